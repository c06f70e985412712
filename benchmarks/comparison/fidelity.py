"""Section 5: eager fake-quant vs onnxruntime, per reference model, from ``co.verify_onnx``."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

import coreai_opt as co
from benchmarks.common import ours
from benchmarks.common.results import SectionResult, Table, attempt
from benchmarks.common.settings import Settings
from coreai_opt import reference_models as zoo

Maker = Callable[[int, torch.Generator], Tensor]


def _img(ch: int, size: int) -> Maker:
    return lambda b, g: torch.rand(b, ch, size, size, generator=g)


def _zoo(settings: Settings) -> list[tuple[str, Callable[[], nn.Module], Maker]]:
    size = 64 if settings.quick else 224
    models: list[tuple[str, Callable[[], nn.Module], Maker]] = [
        ("DigitsCNN", zoo.DigitsCNN, _img(1, 8)),
        ("ResNet-18-style", zoo.resnet18_style, _img(3, size)),
        ("MobileNetV2-style", zoo.mobilenet_v2_style, _img(3, size)),
        ("Transformer d256 L4", zoo.transformer_encoder, lambda b, g: torch.randint(0, 1000, (b, 128), generator=g)),
        ("ConvTransposeDecoder", zoo.ConvTransposeDecoder, _img(3, 32)),
        ("Conv1dGroupNorm", zoo.Conv1dGroupNorm, lambda b, g: torch.randn(b, 4, 64, generator=g)),
        ("TorchTransformerClassifier", zoo.TorchTransformerClassifier,
         lambda b, g: torch.randn(b, 16, 64, generator=g)),
    ]
    if settings.tiny:
        return models[:1]
    if settings.quick:
        return models[:4]
    models.insert(2, ("ResNet-50-style", zoo.resnet50_style, _img(3, size)))
    return models


def run(settings: Settings) -> SectionResult:
    """Quantize each zoo model (w8a8, random weights), export, and compare eager vs onnxruntime."""
    section = SectionResult("fidelity", "5. Fidelity: eager fake-quant vs onnxruntime (co.verify_onnx)")
    table = Table("w8a8 (minmax), 4 calibration batches, 16 verification inputs not seen in calibration",
                  ["model", "max |diff| in output quantization steps", "max |diff| absolute", "top-1 agreement %",
                   "verify_onnx verdict"])
    missing = ours.api_missing()
    if missing:
        section.errors.append(f"not measured: {missing}")
        return section
    work = settings.work_dir / "fidelity"
    work.mkdir(parents=True, exist_ok=True)
    for name, build, make in _zoo(settings):
        torch.manual_seed(0)
        gen = torch.Generator().manual_seed(0)
        calib = [make(4, gen) for _ in range(4)]
        inputs = make(16, gen)

        def verify(build: Callable[[], nn.Module] = build, calib: list[Tensor] = calib, inputs: Tensor = inputs,
                   name: str = name) -> object:
            converted = ours.quantize(build().eval(), ours.config("w8a8"), calib[0], calib)
            path = ours.export(converted, calib[0], work / f"{name}.onnx")
            return co.verify_onnx(converted, path, inputs)

        out = attempt(verify, section, name)
        if not out.ok:
            table.add(name, "n/a", "n/a", "n/a", f"error: {out.error}")
            continue
        report = out.value
        steps = [o.max_diff_steps for o in report.outputs if o.max_diff_steps is not None]
        max_steps = max(steps) if steps else None
        top1 = report.argmax_agreement
        table.add(name, "float output" if max_steps is None else f"{max_steps:.2f}", f"{report.max_abs_diff:.3g}",
                  "n/a" if top1 is None else f"{100 * top1:.1f}", "ok" if report.ok else "FAILED")
        if top1 is not None and top1 < 1.0:
            section.losses.append(
                f"fidelity: {name} eager vs onnxruntime top-1 agreement is {100 * top1:.1f} % (below 100 %).")
        if not report.ok:
            section.losses.append(
                f"fidelity: {name} fails co.verify_onnx's tolerance (max diff {report.max_abs_diff:.3g}"
                + ("" if max_steps is None else f", {max_steps:.2f} output steps") + ")."
            )
    section.tables.append(table)
    section.notes.append(
        "Whole-network differences of one or two output steps are expected: onnxruntime and torch accumulate float "
        "convolutions in different orders, which flips a few rounding ties that then propagate; co.verify_onnx "
        "derives each output's tolerance from the kernels onnxruntime runs (coreai_opt.onnx.verify.tolerance: "
        "0 steps on "
        "exact paths, one step per quantizer stage after float accumulation or requantisation)."
    )
    return section
