"""Section 4: ONNX file size of fp32, ours w8a8 / w8 / w4 (and the onnxruntime quantize_static peer) as ratios."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from torch import nn

from benchmarks.common import ours, peers
from benchmarks.common.onnx_utils import export_float
from benchmarks.common.results import SectionResult, Table, attempt, fmt_ratio
from benchmarks.common.settings import Settings
from coreai_opt.reference_models import resnet18_style, transformer_encoder

OURS_PRESETS = ("w8a8", "w8", "w4")
# Expected ratios if weights are stored at their bit width (plus scales); a file far above this is a loss.
EXPECTED = {"w8a8": 0.30, "w8": 0.30, "w4": 0.20}


def _bytes(path: Path) -> int:
    data = Path(str(path) + ".data")
    return path.stat().st_size + (data.stat().st_size if data.exists() else 0)


def _ours_bytes(model: nn.Module, preset: str, example: torch.Tensor, calib: list[torch.Tensor], path: Path) -> int:
    return _bytes(ours.export(ours.quantize(model, ours.config(preset, model=model), example, calib), example, path))


def _peer_bytes(float_path: Path, pre: Path, calib: list[torch.Tensor], path: Path) -> int:
    return _bytes(peers.ort_static(peers.preprocess(float_path, pre), calib, "MinMax", path))


def _models(settings: Settings) -> list[tuple[str, Callable[[], nn.Module], Callable[[int], torch.Tensor]]]:
    gen = torch.Generator().manual_seed(0)
    size, width = settings.image_size, settings.cnn_width
    images = (f"ResNet-18-style w{width}", lambda: resnet18_style(width=width),
              lambda b: torch.rand(b, 3, size, size, generator=gen))
    tokens = ("Transformer d256 L4", transformer_encoder, lambda b: torch.randint(0, 1000, (b, 128), generator=gen))
    return [images] if settings.quick else [images, tokens]


def run(settings: Settings) -> SectionResult:
    """Export each variant and compare file sizes to the fp32 export."""
    section = SectionResult("size", "4. File size")
    table = Table("ONNX bytes (model + external data), ratio to fp32",
                  ["model", "fp32 bytes", *[f"ours {p}" for p in OURS_PRESETS], "ORT static U8S8"])
    work = settings.work_dir / "size"
    work.mkdir(parents=True, exist_ok=True)
    missing = ours.api_missing()
    for name, build, make in _models(settings):
        stem = name.split()[0].lower()
        torch.manual_seed(0)
        model = build().eval()
        example, calib = make(2), [make(4) for _ in range(2)]
        fp_bytes = _bytes(export_float(model, example, work / f"{stem}.fp32.onnx"))
        cells: list[str] = []
        for preset in OURS_PRESETS:
            if missing:
                cells.append("n/a")
                continue
            path = work / f"{stem}.{preset}.onnx"
            out = attempt(partial(_ours_bytes, model, preset, example, calib, path), section, f"{name} / {preset}")
            if not out.ok:
                cells.append("n/a")
                continue
            ratio = out.value / fp_bytes
            cells.append(f"{out.value:,} ({fmt_ratio(ratio)})")
            if ratio > EXPECTED[preset]:
                section.losses.append(
                    f"size: {name} ours {preset} is {ratio:.2f}× the fp32 file (expected ≤ {EXPECTED[preset]:.2f}× "
                    "if weights were stored at their bit width)."
                )
        pre = work / f"{stem}.pre.onnx"
        peer = attempt(partial(_peer_bytes, work / f"{stem}.fp32.onnx", pre, calib, work / f"{stem}.ort.onnx"), section,
                       f"{name} / ORT")
        cells.append(f"{peer.value:,} ({fmt_ratio(peer.value / fp_bytes)})" if peer.ok else "n/a")
        table.add(name, f"{fp_bytes:,}", *cells)
        if peer.ok and not missing and cells[0] != "n/a":
            ours_w8a8 = _bytes(work / f"{stem}.w8a8.onnx")
            if ours_w8a8 > 1.05 * peer.value:
                section.losses.append(
                    f"size: {name} ours w8a8 file is {ours_w8a8 / peer.value:.2f}× onnxruntime quantize_static's."
                )
    section.tables.append(table)
    section.notes.append(
        f"ours w4 = presets.w4() (int4 per-block, {ours.W4_BLOCK} input channels per block); layers whose input "
        "channels are not a multiple of the block (e.g. the RGB stem) get int4 per-channel weights instead."
    )
    if missing:
        section.errors.append(f"ours not measured: {missing}")
    return section
