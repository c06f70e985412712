"""Section 3: what the pipeline costs — stage times and memory, calibration overhead, histogram memory, scaling."""

from __future__ import annotations

import copy
import statistics
import time
import warnings
from collections.abc import Callable, Sequence
from typing import TypeVar

import torch
from torch import Tensor, fx, nn

import coreai_opt as co
from benchmarks.common import ours
from benchmarks.common.onnx_utils import export_float
from benchmarks.common.peak_rss import PeakRSS
from benchmarks.common.results import SectionResult, Table, attempt, fmt_ratio
from benchmarks.common.settings import Settings
from coreai_opt.reference_models import resnet18_style, resnet50_style

T = TypeVar("T")
CHEAP_CALCULATORS = ("minmax", "moving_average")
CALIBRATION_GOAL = 1.3
PREPARE_GOAL_S = 2.0


def _timed(fn: Callable[[], T]) -> tuple[T, float, float]:
    """(result, seconds, peak RSS growth MiB) of ``fn()``."""
    with PeakRSS() as mem:
        start = time.perf_counter()
        result = fn()
        seconds = time.perf_counter() - start
    return result, seconds, mem.peak_mb


def _prepare(model: nn.Module, cfg: object, example: Tensor) -> fx.GraphModule:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return co.prepare(copy.deepcopy(model).eval(), cfg, (example,))


def _calibrate(prepared: fx.GraphModule, batches: Sequence[Tensor]) -> fx.GraphModule:
    with torch.no_grad():
        return co.calibrate(prepared, [(b,) for b in batches], progress=False)


def _float_forward(model: nn.Module, batches: Sequence[Tensor]) -> None:
    with torch.no_grad():
        for b in batches:
            model(b)


def _stage_table(settings: Settings, section: SectionResult) -> Table:
    """prepare / calibrate / convert / export time and peak memory through ResNet-18 → ResNet-50 widths."""
    table = Table(
        "Pipeline stages, w8a8 (minmax); time in s, peak RSS growth in MiB; calibration = 4 batches of 8 at 64²",
        ["model", "params (M)", "graph nodes", "prepare s wall (CPU)", "prepare MiB", "calibrate s", "calibrate MiB",
         "convert s", "convert MiB", "export s", "export MiB", "float export s (same model)"],
    )
    widths = [("ResNet-18-style w64", resnet18_style, 64), ("ResNet-50-style w64", resnet50_style, 64)]
    if settings.tiny:
        widths = [("ResNet-18-style w16", resnet18_style, 16)]
    elif not settings.quick:
        widths = [("ResNet-18-style w32", resnet18_style, 32), widths[0],
                  ("ResNet-50-style w32", resnet50_style, 32), widths[1]]
    gen = torch.Generator().manual_seed(0)
    batches = [torch.rand(8, 3, 64, 64, generator=gen) for _ in range(4)]
    warm = settings.work_dir / "cost" / "warmup.onnx"
    warm.parent.mkdir(parents=True, exist_ok=True)
    export_float(nn.Linear(4, 4), torch.rand(2, 4), warm)  # the first export of a process pays one-off setup
    for name, factory, width in widths:
        model = factory(width=width).eval()
        params = sum(p.numel() for p in model.parameters()) / 1e6

        def stages(model: nn.Module = model, name: str = name) -> list[object]:
            cpu_start = time.process_time()
            prepared, t_prep, m_prep = _timed(lambda: _prepare(model, ours.config("w8a8"), batches[0]))
            cpu_prep = time.process_time() - cpu_start
            _, t_cal, m_cal = _timed(lambda: _calibrate(prepared, batches))
            converted, t_conv, m_conv = _timed(lambda: co.convert(prepared))
            path = settings.work_dir / "cost" / f"{name.replace(' ', '_')}.onnx"
            path.parent.mkdir(parents=True, exist_ok=True)
            t_exp = m_exp = float("nan")
            if not (settings.quick and "ResNet-50" in name):  # --quick times the export on ResNet-18 only
                _, t_exp, m_exp = _timed(lambda: ours.export(converted, batches[0], path))
            if "ResNet-50" in name and cpu_prep > PREPARE_GOAL_S:  # CPU time: a busy machine inflates wall time
                section.losses.append(
                    f"cost: prepare of {name} took {cpu_prep:.2f} s of CPU ({t_prep:.2f} s wall; goal ≤ "
                    f"{PREPARE_GOAL_S:.0f} s)."
                )
            nodes = len(prepared.graph.nodes)
            exported = t_exp == t_exp  # NaN when skipped
            t_float = float("nan")
            if exported:
                _, t_float, _ = _timed(lambda: export_float(model, batches[0], path.with_suffix(".fp32.onnx")))
            if exported and t_exp > 1.5 * t_float:
                section.losses.append(
                    f"cost: co.export_onnx of {name} takes {t_exp:.1f} s, {t_exp / t_float:.1f}× the plain float "
                    f"dynamo export of the same model ({t_float:.1f} s)."
                )
            export_cells = [f"{t_exp:.2f}", f"{m_exp:.0f}", f"{t_float:.2f}"] if exported else ["–"] * 3
            return [nodes, f"{t_prep:.2f} ({cpu_prep:.2f})", f"{m_prep:.0f}", f"{t_cal:.2f}", f"{m_cal:.0f}",
                    f"{t_conv:.2f}", f"{m_conv:.0f}", *export_cells]

        out = attempt(stages, section, f"stages / {name}")
        cells = out.value if out.ok else ["n/a"] * 10
        table.add(name, f"{params:.1f}", *cells)
    return table


def _overhead_table(settings: Settings, section: SectionResult) -> Table:
    """Calibration forward time ÷ float eager forward time per range calculator, interleaved, median of repeats."""
    size = 32 if settings.tiny else 64 if settings.quick else 224
    table = Table(
        f"Calibration overhead on ResNet-18-style (width {settings.cnn_width}), 4 batches of 8 at {size}², "
        f"median of {settings.repeats} "
        "interleaved repeats (goal ≤ 1.3× for minmax and moving_average)",
        ["range calculator", "float eager forward s", "co.calibrate s", "calibrate ÷ float",
         "weight elements observed per batch (M)", "activation elements observed per batch (M)"],
    )
    torch.manual_seed(0)
    model = resnet18_style(width=settings.cnn_width).eval()
    gen = torch.Generator().manual_seed(0)
    batches = [torch.rand(8, 3, size, size, generator=gen) for _ in range(4)]
    prepared: dict[str, fx.GraphModule] = {}
    for calc in ours.RANGE_CALCULATORS:
        out = attempt(lambda calc=calc: _prepare(model, ours.config("w8a8", calc), batches[0]), section,
                      f"overhead / prepare {calc}")
        if out.ok:
            prepared[calc] = out.value
    _float_forward(model, batches[:1])  # warm-up
    float_s: list[float] = []
    calib_s: dict[str, list[float]] = {calc: [] for calc in prepared}
    for _ in range(settings.repeats):
        start = time.perf_counter()
        _float_forward(model, batches)
        float_s.append(time.perf_counter() - start)
        for calc, gm in list(prepared.items()):
            start = time.perf_counter()
            out = attempt(lambda gm=gm: _calibrate(gm, batches), section, f"overhead / calibrate {calc}")
            if not out.ok:
                del prepared[calc]
                continue
            calib_s[calc].append(time.perf_counter() - start)
    float_med = statistics.median(float_s)
    weights_m = sum(p.numel() for p in model.parameters() if p.dim() > 1) / 1e6
    for calc in ours.RANGE_CALCULATORS:
        if not calib_s.get(calc):
            table.add(calc, f"{float_med:.3f}", "n/a", "n/a", "n/a", "n/a")
            continue
        med = statistics.median(calib_s[calc])
        ratio = med / float_med
        w_el, a_el = _observed_elements(prepared[calc], batches)
        table.add(calc, f"{float_med:.3f}", f"{med:.3f}", fmt_ratio(ratio), f"{w_el:.1f}", f"{a_el:.1f}")
        if calc in CHEAP_CALCULATORS and ratio > CALIBRATION_GOAL:
            cause = (f" Per-batch work is small at {size}² ({float_med / len(batches) * 1e3:.0f} ms of float "
                     "forward per batch), so the fixed cost of each activation observer (one min/max reduction and "
                     "a few scalar ops, tens of µs in Python) weighs more than at 224².")
            if w_el > 0.5 * weights_m:
                cause = (f" Weight quantizers re-observe the constant weights on every batch ({w_el:.1f} M weight "
                         f"elements scanned per batch next to {a_el:.1f} M activation elements).")
            section.losses.append(
                f"cost: calibration with {calc} costs {ratio:.2f}× a float forward (goal ≤ {CALIBRATION_GOAL}×).{cause}"
            )
    return table


def _observed_elements(prepared: fx.GraphModule, batches: Sequence[Tensor]) -> tuple[float, float]:
    """Elements observed per calibration batch by weight quantizers and by activation quantizers (millions)."""
    from coreai_opt.quantization.spec import FakeQuantize

    seen = {"weight": 0, "activation": 0}

    def hook(module: nn.Module, args: tuple[Tensor, ...], kind: str) -> None:
        if bool(module.observer_enabled):  # weight quantizers pass their weight through unobserved while calibrating
            seen[kind] += args[0].numel()

    kinds = {
        name: "weight" if "weight" in name or "bias" in name else "activation"
        for name, m in prepared.named_modules() if isinstance(m, FakeQuantize)
    }
    modules = dict(prepared.named_modules())
    handles = [
        modules[name].register_forward_pre_hook(lambda mod, args, kind=kind: hook(mod, args, kind))
        for name, kind in kinds.items()
    ]
    try:
        _calibrate(prepared, batches)
    finally:
        for h in handles:
            h.remove()
    return seen["weight"] / len(batches) / 1e6, seen["activation"] / len(batches) / 1e6


def _state_bytes(module: nn.Module) -> int:
    return sum(b.numel() * b.element_size() for b in module.buffers())


def _histogram_table(settings: Settings, section: SectionResult) -> Table:
    """Histogram-calculator memory as the number of calibration batches grows: must stay flat."""
    counts = (1, 4) if settings.tiny else (1, 4, 16) if settings.quick else (1, 4, 16, 64)
    table = Table(
        "Histogram range calculators: memory vs number of calibration batches (ResNet-18-style, batches of 8 at 64²)",
        ["range calculator", *[f"{n} batch(es): state KiB / peak RSS MiB" for n in counts]],
    )
    torch.manual_seed(0)
    model = resnet18_style(width=settings.cnn_width).eval()
    gen = torch.Generator().manual_seed(0)
    batches = [torch.rand(8, 3, 64, 64, generator=gen) for _ in range(max(counts))]
    for calc in ("percentile", "mse", "entropy"):
        cells: list[str] = []
        states: list[int] = []
        for n in counts:

            def one(calc: str = calc, n: int = n) -> tuple[int, float]:
                prepared = _prepare(model, ours.config("w8a8", calc), batches[0])
                _, _, peak = _timed(lambda: _calibrate(prepared, batches[:n]))
                return _state_bytes(prepared), peak

            out = attempt(one, section, f"histogram memory / {calc} / {n} batches")
            if out.ok:
                state, peak = out.value
                states.append(state)
                cells.append(f"{state / 1024:.0f} / {peak:.0f}")
            else:
                cells.append("n/a")
        table.add(calc, *cells)
        if len(states) >= 2 and max(states) > 1.05 * min(states):
            section.losses.append(
                f"cost: {calc} calculator state grows with the number of batches "
                f"({min(states) / 1024:.0f} → {max(states) / 1024:.0f} KiB)."
            )
    return table


def run(settings: Settings) -> SectionResult:
    """Measure the cost of prepare / calibrate / convert / export."""
    section = SectionResult("cost", "3. Cost of the pipeline")
    missing = ours.api_missing()
    if missing:
        section.errors.append(f"not measured: {missing}")
        return section
    section.tables.append(_overhead_table(settings, section))
    section.tables.append(_histogram_table(settings, section))
    section.tables.append(_stage_table(settings, section))
    section.notes += [
        "Peak RSS growth is sampled every 2 ms with psutil during each call (process RSS minus RSS at entry); "
        "memory freed and reused from earlier calls is not counted again, so treat it as a lower bound.",
        "Calibration state = bytes of every buffer of the prepared model after calibration "
        "(constant across batch counts when memory is bounded).",
    ]
    return section
