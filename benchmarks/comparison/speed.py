"""Section 2: onnxruntime CPU latency of fp32, ours (w8a8) and the peers, plus what onnxruntime fused.

All variants of one model are timed interleaved in the same process (see ``latency.measure``), so the ratios
ours / best peer and fp32 / ours are side by side even on a noisy machine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from benchmarks.common import ours, peers
from benchmarks.common.latency import Timing, measure
from benchmarks.common.onnx_utils import export_float, session
from benchmarks.common.results import SectionResult, Table, attempt, fmt_ms, fmt_ratio
from benchmarks.common.settings import Settings
from benchmarks.comparison import fusion
from coreai_opt.reference_models import mobilenet_v2_style, resnet18_style, transformer_encoder

OURS = "ours w8a8"
OURS_DYNAMIC = "ours w8a8 dynamic"
OURS_VARIANTS = (OURS, OURS_DYNAMIC)
FP32 = "fp32"
ORT_STATIC = "ORT static U8S8"
ORT_DYNAMIC = "ORT dynamic"
NNCF = "NNCF"
PEERS = (ORT_STATIC, ORT_DYNAMIC, NNCF)
ISSUE4_MODELS = ("ResNet-18-style", "Transformer")


@dataclass(frozen=True)
class SpeedModel:
    """A model of the speed section and how to make its inputs."""

    name: str
    build: Callable[[], nn.Module]
    make_input: Callable[[int, torch.Generator], Tensor]
    dynamic_peer: bool = False


def _images(size: int) -> Callable[[int, torch.Generator], Tensor]:
    return lambda batch, gen: torch.rand(batch, 3, size, size, generator=gen)


def _tokens(batch: int, gen: torch.Generator) -> Tensor:
    return torch.randint(0, 1000, (batch, 128), generator=gen)


def speed_models(settings: Settings) -> list[SpeedModel]:
    """ResNet-18-style and MobileNetV2-style at 224², the d256 4-layer transformer encoder at seq 128."""
    size, width = settings.image_size, settings.cnn_width
    dim, depth = settings.transformer_dim_depth
    return [
        SpeedModel("ResNet-18-style", lambda: resnet18_style(width=width), _images(size)),
        SpeedModel("MobileNetV2-style", lambda: mobilenet_v2_style(width_mult=width / 64), _images(size)),
        SpeedModel(f"Transformer d{dim} L{depth}", lambda: transformer_encoder(dim=dim, depth=depth, heads=4),
                   _tokens, True),
    ]


def _runs(path: Path, feed: np.ndarray) -> Path:
    sess = session(path, threads=1)
    sess.run(None, {sess.get_inputs()[0].name: feed})
    return path


def _variants(spec: SpeedModel, settings: Settings, section: SectionResult) -> dict[str, Path]:
    """Build every ONNX variant of one model; variants that fail to build or to run are reported and dropped."""
    work = settings.work_dir / "speed"
    work.mkdir(parents=True, exist_ok=True)
    stem = spec.name.split()[0].lower()
    if settings.tiny:
        stem += "-tiny"
    torch.manual_seed(0)
    model = spec.build().eval()
    gen = torch.Generator().manual_seed(0)
    calib = [spec.make_input(4, gen) for _ in range(4 if settings.quick else 8)]
    example = spec.make_input(2, gen)
    feed = spec.make_input(1, gen).numpy()
    fp = export_float(model, example, work / f"{stem}.fp32.onnx")
    builders: dict[str, Callable[[], Path]] = {FP32: lambda: fp}
    missing = ours.api_missing()
    if missing is None:
        builders[OURS] = lambda: ours.export(ours.quantize(model, ours.config("w8a8"), example, calib), example,
                                             work / f"{stem}.ours.onnx")
        if spec.dynamic_peer:  # like for like with onnxruntime's quantize_dynamic
            builders[OURS_DYNAMIC] = lambda: ours.export(
                ours.quantize(model, ours.config("w8a8_dynamic"), example, calib), example,
                work / f"{stem}.ours_dynamic.onnx")
    else:
        section.errors.append(f"{spec.name} / {OURS}: {missing}")
    pre = work / f"{stem}.pre.onnx"
    builders[ORT_STATIC] = lambda: peers.ort_static(peers.preprocess(fp, pre), calib, "MinMax",
                                                    work / f"{stem}.ort.onnx")
    if spec.dynamic_peer:
        builders[ORT_DYNAMIC] = lambda: peers.ort_dynamic(peers.preprocess(fp, pre), work / f"{stem}.dyn.onnx")
    builders[NNCF] = lambda: peers.nncf_quantize(fp, calib, work / f"{stem}.nncf.onnx")
    variants: dict[str, Path] = {}
    for label, build in builders.items():
        out = attempt(lambda build=build: _runs(build(), feed), section, f"{spec.name} / {label}")
        if out.ok:
            variants[label] = out.value
    return variants


def _best_peer(timings: dict[str, Timing], among: tuple[str, ...] = PEERS) -> tuple[str | None, float | None]:
    candidates = [(timings[p].median_ms, p) for p in among if p in timings]
    if not candidates:
        return None, None
    ms, label = min(candidates)
    return label, ms


def _fusion_difference(ours_c: fusion.FusionCounts | None, peer_c: fusion.FusionCounts | None, peer: str | None) -> str:
    """One sentence naming what onnxruntime fused differently for ours and the peer (empty if identical)."""
    if ours_c is None or peer_c is None:
        return ""
    parts = []
    for what, a, b in (
        ("integer conv/matmul", ours_c.integer_compute, peer_c.integer_compute),
        ("float conv/matmul", ours_c.float_compute, peer_c.float_compute),
        ("other integer ops", ours_c.other_integer, peer_c.other_integer),
    ):
        if a != b:
            parts.append(f"{what}: ours {fusion.FusionCounts._fmt(a)} vs {fusion.FusionCounts._fmt(b)}")
    if (ours_c.quantize_linear, ours_c.dequantize_linear) != (peer_c.quantize_linear, peer_c.dequantize_linear):
        parts.append(f"Q/DQ left: ours {ours_c.quantize_linear}/{ours_c.dequantize_linear} vs "
                     f"{peer_c.quantize_linear}/{peer_c.dequantize_linear}")
    if not parts:
        return " onnxruntime fused both graphs identically (difference is timing noise or kernel choice)."
    return f" Fusion differs from {peer}: " + "; ".join(parts) + "."


def run(settings: Settings) -> SectionResult:
    """Measure latency of every variant at each thread count and batch size, and count fused kernels."""
    section = SectionResult("speed", "2. Speed in onnxruntime (CPU)")
    latency = Table(
        "Latency, median ms (interleaved); ratio = ours / best peer (goal ≤ 1.0); speedup = fp32 / ours",
        ["model", "batch", "threads", FP32, OURS, OURS_DYNAMIC, ORT_STATIC, ORT_DYNAMIC, NNCF, "best peer",
         "ours / best peer", "ours speedup vs fp32", "best-peer speedup vs fp32"],
    )
    issue4 = Table(
        "Issue 4: single-thread latency, batch 1 (ms), ours vs onnxruntime quantize_static and NNCF",
        ["model", OURS, ORT_STATIC, NNCF, "faster peer", "ours / faster peer"],
    )
    fused = Table(
        "What onnxruntime runs (its optimized graph): integer conv/matmul kernels vs float conv/matmul left",
        ["model", "variant", "integer conv/matmul", "float conv/matmul left", "other integer ops", "Q / DQ left"],
    )
    fusion_source = "n/a"
    for spec in speed_models(settings):
        variants = _variants(spec, settings, section)
        counts_by_variant: dict[str, fusion.FusionCounts] = {}
        for label, path in variants.items():
            counts = attempt(lambda path=path: fusion.count_fused(path, settings.work_dir / "speed"), section,
                             f"{spec.name} / {label} fusion count")
            if counts.ok:
                c = counts_by_variant[label] = counts.value
                fused.add(spec.name, label, c.integer_summary, c.float_summary, c.other_summary,
                          f"{c.quantize_linear} / {c.dequantize_linear}")
                fusion_source = c.source
        gen = torch.Generator().manual_seed(1)
        for batch in settings.latency_batches:
            feed = spec.make_input(batch, gen).numpy()
            for threads in settings.latency_threads:
                t = measure(variants, feed, threads=threads, rounds=settings.latency_rounds,
                            runs_per_round=settings.latency_runs_per_round)
                med = {k: v.median_ms for k, v in t.items()}
                peer, peer_ms = _best_peer(t)
                best_ours, ours_ms = _best_peer(t, OURS_VARIANTS)
                fp_ms = med.get(FP32)
                ratio = ours_ms / peer_ms if ours_ms and peer_ms else None
                latency.add(spec.name, batch, threads,
                            *(fmt_ms(med.get(k)) for k in (FP32, *OURS_VARIANTS, *PEERS)),
                            peer or "n/a", fmt_ratio(ratio),
                            fmt_ratio(fp_ms / ours_ms if fp_ms and ours_ms else None),
                            fmt_ratio(fp_ms / peer_ms if fp_ms and peer_ms else None))
                if ratio is not None and ratio > 1.0:
                    section.losses.append(
                        f"speed: {spec.name} batch {batch}, {threads} thread(s): {best_ours} {fmt_ms(ours_ms)} ms vs "
                        f"{peer} {fmt_ms(peer_ms)} ms — ours is {ratio:.2f}× the best peer's latency."
                        + _fusion_difference(counts_by_variant.get(best_ours or ""), counts_by_variant.get(peer or ""),
                                             peer)
                    )
                if threads == 1 and batch == 1 and spec.name.startswith(ISSUE4_MODELS):
                    static_ms = med.get(OURS)
                    fpeer, fpeer_ms = _best_peer(t, (ORT_STATIC, NNCF))
                    issue4.add(spec.name, fmt_ms(static_ms), fmt_ms(med.get(ORT_STATIC)), fmt_ms(med.get(NNCF)),
                               fpeer or "n/a", fmt_ratio(static_ms / fpeer_ms if static_ms and fpeer_ms else None))
    section.tables += [issue4, latency, fused]
    section.notes += [
        f"Each cell: median of {settings.latency_rounds} interleaved rounds × {settings.latency_runs_per_round} runs "
        "per variant, spread over 3 fresh CPUExecutionProvider sessions per variant (3 warm-up runs each; one "
        "session's memory placement can shift a whole run by a few percent), intra_op_num_threads as shown, "
        "sequential execution, all graph optimisations. Weights random (seeded); calibration on the same random "
        "batches for ours and every peer.",
        "Ours = co.QuantizerConfig.presets.w8a8() → prepare → calibrate → convert → co.export_onnx; ours dynamic "
        "(transformer only, like for like with quantize_dynamic) = presets.w8a8_dynamic(). \"ours / best peer\" "
        "takes the faster of our variants. "
        "ORT static = quantize_static QDQ, per-channel, uint8 activations, int8 weights, MinMax, after "
        "quant_pre_process. ORT dynamic = quantize_dynamic int8 weights (transformer only). NNCF = nncf.quantize on "
        "the float ONNX.",
        f"Fused ops are counted by {fusion_source} in the optimized graph onnxruntime dumps.",
    ]
    return section
