"""``verify_onnx`` on the real-architecture corpus (issue 28): single defects, clean files, token agreement.

Every model is built, calibrated and exported exactly as the corpus runner does (:mod:`benchmarks.corpus.runner`:
seed 0, 4 calibration batches of 4, evaluation batches of 8 not seen in calibration, the named preset with default
capture). Two parts:

* ``mutations``: on :data:`MUTATION_MODELS` (CNNs, encoders, decoders, ViTs), each defect of
  :data:`benchmarks.verify.mutations.MUTATIONS` written into the w8a8 file, one at a time, and judged by
  :func:`benchmarks.verify.mutations.judge_defect` on 2 evaluation batches. A defect that changes onnxruntime's
  output must be flagged with the first failing quantizer named.
* ``clean``: every corpus model's clean export (w8a8, and weight-only w4 with ``--presets w8a8 w4``) verified on 8
  evaluation batches; ``verify_onnx`` must say ok. For ``[B, T, V]`` logits the row reports token top-1 agreement
  eager vs onnxruntime and how many flips are near ties (eager top-2 margin within twice the output tolerance).
"""

from __future__ import annotations

import dataclasses
import json
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

import coreai_opt as co
from benchmarks.corpus.models import CORPUS, CorpusModel
from benchmarks.corpus.runner import RunOptions
from benchmarks.verify.mutations import MUTATIONS, DefectOutcome, judge_defect, run_file

__all__ = ["MUTATION_MODELS", "CleanRow", "CorpusExport", "clean_row", "export_corpus_model", "mutation_outcomes"]

#: Corpus models of the mutation part: 4 CNNs, 3 encoders, 3 decoders, 2 ViTs.
MUTATION_MODELS: tuple[str, ...] = (
    "hf-resnet", "hf-mobilenet-v2", "timm-resnet18", "hf-convnext",
    "hf-bert", "hf-distilbert", "hf-roberta",
    "hf-gpt2", "hf-llama", "hf-opt",
    "hf-deit", "hf-vit",
)

Batch = tuple[Tensor, ...]

#: The corpus runner's sizes and seeds.
CORPUS_OPTIONS = RunOptions()


@dataclass(frozen=True)
class CorpusExport:
    """A converted corpus model, its exported file and its evaluation batches."""

    name: str
    preset: str
    model: nn.Module
    path: Path
    batches: list[Batch]


def export_corpus_model(entry: CorpusModel, preset: str, work_dir: Path, options: RunOptions = CORPUS_OPTIONS
                        ) -> CorpusExport:
    """prepare -> calibrate -> convert -> export_onnx of ``entry`` under ``preset``, seeded as the corpus runner."""
    work_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(options.seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = entry.build().eval()
        gen = torch.Generator().manual_seed(options.seed + 1)
        calib = [entry.inputs(gen, options.calib_batch) for _ in range(options.calib_batches)]
        evals = [entry.inputs(gen, options.eval_batch) for _ in range(options.eval_batches)]
        prepared = co.prepare(model, getattr(co.QuantizerConfig.presets, preset)(), calib[0])
        co.calibrate(prepared, calib, progress=False)
        converted = co.convert(prepared)
        path = co.export_onnx(converted, calib[0], work_dir / f"{entry.name}.{preset}.onnx",
                              input_names=list(entry.input_names))
    return CorpusExport(entry.name, preset, converted, Path(path), evals)


def mutation_outcomes(export: CorpusExport, work_dir: Path, defects: Sequence[str] = tuple(MUTATIONS)
                      ) -> list[DefectOutcome]:
    """Each defect written into ``export``'s file alone, judged on its batches (one clean onnxruntime run shared)."""
    clean = run_file(export.path, export.batches)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return [judge_defect(export.model, export.path, export.batches, d, work_dir, clean) for d in defects]


@dataclass
class CleanRow:
    """``verify_onnx`` on one clean corpus export."""

    name: str
    family: str
    preset: str
    error: str | None = None  # the pipeline stage that raised, with its message
    ok: bool | None = None
    rule: str | None = None  # the first output's tolerance rule
    steps: float | None = None  # its max difference in output steps (None for float outputs)
    allowed: str | None = None
    quantizers: int = 0
    failing_quantizer: str | None = None
    top1: float | None = None  # argmax agreement over rows (classes) or tokens ([B, T, V])
    positions: int = 0  # rows or tokens compared
    near_tie_flips: int = 0
    flips: str = ""  # the flips explained (OutputComparison.argmax_flips): largest eager margin vs the near-tie bound
    export_seconds: float = 0.0
    verify_seconds: float = 0.0


def clean_row(entry: CorpusModel, preset: str, work_dir: Path, options: RunOptions = CORPUS_OPTIONS) -> CleanRow:
    """Export ``entry`` under ``preset`` and verify the clean file; never raises, the row records a failure."""
    row = CleanRow(entry.name, entry.family, preset)
    start = time.perf_counter()
    try:
        export = export_corpus_model(entry, preset, work_dir, options)
    except Exception as exc:  # noqa: BLE001 - a failing export is a measurement of its own (the corpus study's)
        row.error = f"export: {type(exc).__name__}: {str(exc)[:300]}"
        return row
    row.export_seconds = time.perf_counter() - start
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = co.verify_onnx(export.model, export.path, export.batches)
    row.verify_seconds = time.perf_counter() - start
    output = report.outputs[0]
    row.ok, row.rule, row.steps = report.ok, output.rule, output.max_diff_steps
    row.allowed = f"{output.tolerance_steps} steps" if output.tolerance_steps is not None else f"{output.tolerance:.3g}"
    row.quantizers = len(report.quantizers)
    first = report.first_failing_quantizer
    row.failing_quantizer = None if first is None else str(first)
    if not report.ok:
        print(report, flush=True)
    if output.argmax_agreement is not None:
        row.top1 = output.argmax_agreement
        row.positions = report.num_samples * (output.shape[1] if len(output.shape) == 3 else 1)
        row.near_tie_flips = output.argmax_flips_within_tolerance
        row.flips = output.argmax_flips
    for f in work_dir.glob(f"{entry.name}.*"):
        f.unlink()
    return row


def append_jsonl(path: Path, record: object) -> None:
    """One measurement per line, written as it is made (a run cut short keeps what it measured)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as log:
        log.write(json.dumps(dataclasses.asdict(record) if dataclasses.is_dataclass(record) else record) + "\n")


def models_of(names: Sequence[str] | None) -> list[CorpusModel]:
    """The corpus entries named (all 40 when ``names`` is empty)."""
    return [CORPUS[n] for n in (names or list(CORPUS))]
