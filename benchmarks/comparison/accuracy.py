"""Section 1: test accuracy on real data, every row executed in onnxruntime.

DigitsCNN is trained (seeded, seconds) on digits and MNIST-5k, exported once to a float ONNX model, and quantized
by ours (several presets and range calculators, plus a short QAT) and by the peers from the same float ONNX model
with the same calibration images.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, fx, nn

from benchmarks.common import ours, peers
from benchmarks.common.onnx_utils import export_float, ort_predict_fn
from benchmarks.common.results import SectionResult, Table, attempt, fmt_pct
from benchmarks.common.settings import Settings
from coreai_opt.datasets import (
    DIGITS_TEST_SIZE,
    MNIST_TEST_SIZE,
    DatasetSplit,
    accuracy,
    load_digits_split,
    load_mnist_split,
    train_classifier,
)
from coreai_opt.reference_models import DigitsCNN

LOADERS: dict[str, Callable[[], DatasetSplit]] = {"digits": load_digits_split, "mnist": load_mnist_split}
TEST_SIZES = {"digits": DIGITS_TEST_SIZE, "mnist": MNIST_TEST_SIZE}
CALIB_BATCH = 32


@dataclass
class Row:
    """One accuracy row: who produced the model, its onnxruntime accuracy and (ours only) the eager accuracy."""

    label: str
    kind: str  # "float", "ours-w8a8", "ours-other", "ours-qat", "peer"
    ort_acc: float | None = None
    eager_acc: float | None = None
    error: str | None = None
    path: Path | None = None
    seconds: float | None = None
    basic_acc: float | None = None  # onnxruntime with only basic graph optimisations (diagnosis of mismatches)


def _ours_rows(settings: Settings) -> list[tuple[str, str, str, str | None]]:
    """(label, kind, preset, activation range calculator) of our rows."""
    calcs = ("minmax",) if settings.tiny else ("minmax", "percentile") if settings.quick else ours.RANGE_CALCULATORS
    rows = [(f"ours w8a8 ({c})", "ours-w8a8", "w8a8", c) for c in calcs]
    if not settings.tiny:
        others = ("w4", "fp8") if settings.quick else ("w8", "w4", "fp8")
        rows += [(f"ours {p}", "ours-other", p, None) for p in others]
        rows.append(("ours w8a8 (moving_average) + QAT", "ours-qat", "w8a8", "moving_average"))
    return rows


def _qat_step(split: DatasetSplit, epochs: int) -> Callable[[fx.GraphModule], None]:
    """Fine-tune a prepared model with fake quantization: observers on for the first epoch, then frozen."""
    import coreai_opt as co

    def step(prepared: fx.GraphModule) -> None:
        optimizer = torch.optim.Adam(prepared.parameters(), lr=1e-4)
        loss_fn = nn.CrossEntropyLoss()
        generator = torch.Generator().manual_seed(0)
        prepared.train()
        for epoch in range(epochs):
            co.enable_observers(prepared, epoch == 0)
            order = torch.randperm(len(split.y_train), generator=generator)
            for start in range(0, len(order), 32):
                idx = order[start : start + 32]
                optimizer.zero_grad(set_to_none=True)
                loss_fn(prepared(split.x_train[idx]), split.y_train[idx]).backward()
                optimizer.step()
        co.enable_observers(prepared, False)
        prepared.eval()

    return step


def _evaluate_ours(
    row: Row, model: nn.Module, cfg_fn: Callable[[], object], calib: list[Tensor], split: DatasetSplit, path: Path,
    qat_step: Callable[[fx.GraphModule], None] | None = None,
) -> None:
    start = time.perf_counter()
    converted = ours.quantize(model, cfg_fn(), calib[0], calib, qat_step=qat_step)
    ours.export(converted, calib[0], path)
    row.seconds, row.path = time.perf_counter() - start, path
    row.eager_acc = accuracy(converted, split.x_test, split.y_test)
    row.ort_acc = accuracy(ort_predict_fn(path), split.x_test, split.y_test)
    if row.ort_acc != row.eager_acc:
        row.basic_acc = accuracy(ort_predict_fn(path, level="ORT_ENABLE_BASIC"), split.x_test, split.y_test)


def _peer_row(
    label: str, build: Callable[[], Path], split: DatasetSplit, section: SectionResult, dataset: str
) -> Row:
    """Quantize with a peer (``build`` returns the ONNX path) and measure its onnxruntime accuracy."""
    row = Row(label, "peer")
    start = time.perf_counter()
    out = attempt(build, section, f"{dataset} / {label}")
    row.seconds, row.error = time.perf_counter() - start, out.error
    if out.ok:
        row.path = out.value
        row.ort_acc = accuracy(ort_predict_fn(out.value), split.x_test, split.y_test)
    return row


def _dataset_rows(name: str, settings: Settings, section: SectionResult) -> list[Row]:
    work = settings.work_dir / "accuracy"
    work.mkdir(parents=True, exist_ok=True)
    split = LOADERS[name]()
    model = train_classifier(DigitsCNN(), split, epochs=settings.epochs[name], lr=1e-2)
    calib = [split.x_train[i : i + CALIB_BATCH] for i in range(0, settings.calib_images, CALIB_BATCH)]
    float_path = export_float(model, calib[0], work / f"{name}.fp32.onnx")

    rows = [Row("float (fp32 ONNX)", "float", eager_acc=accuracy(model, split.x_test, split.y_test))]
    rows[0].ort_acc = accuracy(ort_predict_fn(float_path), split.x_test, split.y_test)

    missing = ours.api_missing()
    plan = _ours_rows(settings)
    for label, kind, preset, calc in plan:
        row = Row(label, kind, error=missing)
        rows.append(row)
        if missing:
            continue
        stem = label.replace(" ", "_").replace("(", "").replace(")", "").replace("+", "")
        qat = _qat_step(split, settings.qat_epochs) if kind == "ours-qat" else None
        out = attempt(
            lambda row=row, preset=preset, calc=calc, stem=stem, qat=qat: _evaluate_ours(
                row, model, lambda: ours.config(preset, calc, model), calib, split, work / f"{name}.{stem}.onnx", qat
            ),
            section,
            f"{name} / {label}",
        )
        row.error = out.error

    pre = attempt(lambda: peers.preprocess(float_path, work / f"{name}.pre.onnx"), section,
                  f"{name} / quant_pre_process")
    methods = ("MinMax",) if settings.tiny else ("MinMax", "Percentile") if settings.quick else peers.ORT_STATIC_METHODS
    for method in methods:
        rows.append(_peer_row(
            f"ORT quantize_static ({method})",
            lambda method=method: peers.ort_static(pre.value, calib, method, work / f"{name}.ort_{method}.onnx"),
            split, section, name,
        ))
    if not settings.tiny:
        rows.append(_peer_row(
            "NNCF quantize (ONNX)", lambda: peers.nncf_quantize(float_path, calib, work / f"{name}.nncf.onnx"),
            split, section, name,
        ))
    return rows


def _losses(name: str, rows: list[Row], n_test: int) -> list[str]:
    """Plain statements of every ours row that is below the best peer (int8 rows) or far below float."""
    losses: list[str] = []
    float_acc = rows[0].ort_acc or 0.0
    peer_rows = [r for r in rows if r.kind == "peer" and r.ort_acc is not None]
    best_peer = max(peer_rows, key=lambda r: r.ort_acc or 0.0, default=None)
    for r in rows:
        if not r.kind.startswith("ours"):
            continue
        if r.ort_acc is None:
            losses.append(f"accuracy/{name}: {r.label} produced no onnxruntime result ({r.error}).")
            continue
        if r.kind in ("ours-w8a8", "ours-qat") and best_peer is not None and r.ort_acc < (best_peer.ort_acc or 0.0):
            gap = 100 * ((best_peer.ort_acc or 0.0) - r.ort_acc)
            losses.append(
                f"accuracy/{name}: {r.label} {fmt_pct(r.ort_acc)} % is below {best_peer.label} "
                f"{fmt_pct(best_peer.ort_acc)} % (−{gap:.2f} pt = {round(gap * n_test / 100)} of {n_test} test images)."
            )
        if r.kind == "ours-other" and float_acc - r.ort_acc > 0.01:
            losses.append(
                f"accuracy/{name}: {r.label} loses {100 * (float_acc - r.ort_acc):.2f} pt against float "
                f"({fmt_pct(r.ort_acc)} % vs {fmt_pct(float_acc)} %)."
            )
        if r.eager_acc is not None and r.eager_acc != r.ort_acc:
            diagnosis = ""
            if r.basic_acc is not None:
                diagnosis = (
                    " With only basic graph optimisations (ORT_ENABLE_BASIC) onnxruntime gives "
                    f"{fmt_pct(r.basic_acc)} %"
                    + (", so the gap comes from onnxruntime's extended (QDQ) graph rewrites of our export."
                       if r.basic_acc == r.eager_acc else ".")
                )
            losses.append(
                f"accuracy/{name}: {r.label} eager fake-quant {fmt_pct(r.eager_acc)} % ≠ onnxruntime "
                f"{fmt_pct(r.ort_acc)} % (eager/ONNX mismatch).{diagnosis}"
            )
    return losses


def run(settings: Settings) -> SectionResult:
    """Train, quantize with ours and the peers, and measure onnxruntime test accuracy on each dataset."""
    section = SectionResult("accuracy", "1. Accuracy on real data (every row executed in onnxruntime)")
    for name in settings.datasets:
        rows = _dataset_rows(name, settings, section)
        float_acc = rows[0].ort_acc
        split_desc = "1347 train / 450 test, 8×8" if name == "digits" else "3750 train / 1250 test, 28×28"
        table = Table(
            f"{name} ({split_desc}); DigitsCNN trained {settings.epochs[name]} epochs; "
            f"{settings.calib_images} calibration images shared by every quantizer",
            ["model", "onnxruntime top-1 %", "Δ vs float (pt)", "eager top-1 %", "quantize + export s", "note"],
        )
        for r in rows:
            delta = "" if r.ort_acc is None or float_acc is None else f"{100 * (r.ort_acc - float_acc):+.2f}"
            note = f"not measured: {r.error}" if r.error else ""
            if r.basic_acc is not None:
                note = f"onnxruntime at ORT_ENABLE_BASIC: {fmt_pct(r.basic_acc)} %"
            table.add(r.label, fmt_pct(r.ort_acc), delta, fmt_pct(r.eager_acc) if r.eager_acc is not None else "",
                      "" if r.seconds is None else f"{r.seconds:.1f}", note)
        section.tables.append(table)
        section.losses += _losses(name, rows, TEST_SIZES[name])
    section.notes.append(
        "ORT quantize_static: QDQ, per_channel=True, uint8 activations / int8 weights, after quant_pre_process "
        "(Percentile at 99.999). NNCF: nncf.quantize on the same float ONNX with subset_size = number of calibration "
        "batches. Ours: exported with co.export_onnx and run in the same onnxruntime session settings "
        "(ORT_ENABLE_ALL). QAT: prepare(qat=True), calibrate, then fine-tune with fake quantization "
        f"({settings.qat_epochs} epoch(s), Adam 1e-4, observers frozen after the first epoch). "
        f"ours w4 = presets.w4() with int4 per-channel weights for layers whose input channels are not a multiple "
        f"of {ours.W4_BLOCK}."
    )
    return section
