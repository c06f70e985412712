"""Run settings: the full run, ``--quick`` (≤ 10 min on 2 cores) and ``--tiny`` (one case, for the smoke test)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Settings:
    """Sizes and repeat counts for one run; every section reads its knobs from here."""

    quick: bool
    tiny: bool
    work_dir: Path
    torch_threads: int = 2
    latency: bool = True  # False (--no-latency): sections that time onnxruntime on the side (corpus) skip it

    @property
    def datasets(self) -> tuple[str, ...]:
        """Datasets of the accuracy section."""
        return ("digits",) if (self.tiny or self.quick) else ("digits", "mnist")

    @property
    def epochs(self) -> dict[str, int]:
        """Float training epochs per dataset."""
        return {"digits": 1 if self.tiny else 10, "mnist": 6}

    @property
    def calib_images(self) -> int:
        """Calibration images (batches of 32) shared by ours and every peer."""
        return 64 if self.tiny else 256

    @property
    def qat_epochs(self) -> int:
        """Fine-tuning epochs of the QAT row."""
        return 1 if (self.tiny or self.quick) else 2

    @property
    def latency_rounds(self) -> int:
        """Interleaved rounds per latency measurement."""
        return 5 if self.quick else 15

    @property
    def latency_runs_per_round(self) -> int:
        """Consecutive runs of one variant per round."""
        return 2 if self.quick else 4

    @property
    def latency_batches(self) -> tuple[int, ...]:
        """Batch sizes timed in the speed section."""
        return (1,) if self.quick else (1, 8)

    @property
    def latency_threads(self) -> tuple[int, ...]:
        """onnxruntime intra-op thread counts timed in the speed section."""
        return (1, 2)

    @property
    def image_size(self) -> int:
        """Image side of the CNNs in the speed section."""
        return 64 if self.tiny else 224

    @property
    def cnn_width(self) -> int:
        """Base width of the ResNet-style models (64 = standard) in speed, cost and fidelity."""
        return 16 if self.tiny else 64

    @property
    def transformer_dim_depth(self) -> tuple[int, int]:
        """(dim, depth) of the transformer encoder in the speed section."""
        return (64, 1) if self.tiny else (256, 4)

    @property
    def repeats(self) -> int:
        """Repeats of the pipeline-cost timings (median taken)."""
        return 3 if self.quick else 7
