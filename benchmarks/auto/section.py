"""Issue 19: ``co.auto_quantize`` with defaults on MiniLM, a transformer encoder and the CNNs, next to the presets.

Every accuracy number is measured in onnxruntime. Latency columns are *timed* (onnxruntime, 1 thread, batch 1)
only when the run is not ``--no-latency``; the ``est. µs`` column is ``auto_quantize``'s own cost-model estimate of
the linears / convolutions (never timed here: it reads the cached cost table of this machine).

Usage: ``python -m benchmarks.run --only auto [--no-latency]``.
"""

from __future__ import annotations

import warnings
from pathlib import Path

import torch
from torch import nn

from benchmarks.common.onnx_utils import ort_predict_fn
from benchmarks.common.results import SectionResult, Table, attempt, fmt_pct
from benchmarks.common.settings import Settings
from benchmarks.minilm import harness as H
from benchmarks.minilm import ours as minilm_ours
from benchmarks.minilm import peers as minilm_peers
from benchmarks.minilm.w8a8 import CALIB_BATCH, w8a8_dynamic_config

__all__ = ["run"]


def _export(converted: nn.Module, example: tuple[torch.Tensor, ...], path: Path, **kwargs: object) -> Path:
    import coreai_opt as co

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return co.export_onnx(converted, example, path, **kwargs)


def _choices(report: object) -> str:
    return ", ".join(f"{k} ×{v}" for k, v in sorted(report.counts().items()))


def _minilm(settings: Settings, section: SectionResult) -> None:
    import coreai_opt as co
    from coreai_opt.api.algorithms.smooth_quant import smooth_quant

    reason = H.minilm_available()
    if reason is not None:
        section.notes.append(f"MiniLM not run: {reason}")
        return
    model, _, cal, ev, reference, example = H.minilm_setup()
    batches = cal.batches(CALIB_BATCH)
    work = settings.work_dir / "auto_minilm"
    work.mkdir(parents=True, exist_ok=True)
    fp32 = minilm_peers.export_float(model, example, work / "fp32.onnx")
    pre = minilm_peers.preprocess(fp32, work / "pre.onnx")
    paths: dict[str, Path] = {"fp32": fp32}
    notes: dict[str, str] = {}

    def ours(name: str, config: object, m: nn.Module = model) -> Path:
        prepared = minilm_ours.prepare_calibrate(m, config, example, batches)
        return minilm_ours.export(prepared, example, work / f"{name}.onnx")[1]

    def auto(name: str, max_error: float | None = None) -> Path:
        result = co.auto_quantize(model, batches, example, max_error=max_error, progress=False)
        report = result.report
        front = "; ".join(f"{p.latency_us / 1e3:.2f} ms → {p.predicted_error:.1e}" for p in report.front)
        notes[name] = (
            f"{_choices(report)}; est. {report.latency_us / 1e3:.2f} ms of linears (all dynamic "
            f"{report.reference_latency_us.get('dynamic', float('nan')) / 1e3:.2f}, all static "
            f"{report.reference_latency_us.get('static', float('nan')) / 1e3:.2f}); measured error "
            f"{report.measured_error:.1e}; predicted front {front}; {report.seconds:.0f} s")
        file = name.split("(")[1].split(")")[0].replace(" ", "_").replace("=", "")
        return _export(result.converted, example, work / f"auto_{file}.onnx", output_names=["sentence_embedding"])

    search = smooth_quant(model, batches, example, alpha="search", insert_mul=True)
    static_sq = co.QuantizerConfig.presets.w8a8().set_op_kind("mul", None)
    builders = {
        "ORT quantize_dynamic (per-tensor)": lambda: minilm_peers.ort_dynamic(pre, work / "ort_dyn.onnx", False),
        "NNCF ModelType.TRANSFORMER": lambda: minilm_peers.nncf_transformer(fp32, batches, work / "nncf.onnx"),
        "ours w8a8_dynamic + smooth_quant(α search, Mul)": lambda: ours("dyn_sq", w8a8_dynamic_config(), search.model),
        "ours w8a8 static": lambda: ours("static", co.QuantizerConfig.presets.w8a8()),
        "ours w8a8 static + smooth_quant": lambda: ours("static_sq", static_sq, search.model),
        "ours co.auto_quantize (defaults)": lambda: auto("ours co.auto_quantize (defaults)"),
        "ours co.auto_quantize (max_error=2e-3)": lambda: auto("ours co.auto_quantize (max_error=2e-3)", 2e-3),
    }
    for name, build in builders.items():
        out = attempt(build, section, f"MiniLM {name}")
        if out.ok:
            paths[name] = out.value
    latency = H.latency_ms(paths, ev, rounds=3 if settings.quick else 6, runs_per_round=5 if settings.quick else 10,
                           threads=1) if settings.latency else {}
    table = Table(f"all-MiniLM-L6-v2, {ev.input_ids.shape[0]} held-out sentences vs fp32 PyTorch (onnxruntime); "
                  "latency **timed** (1 thread, batch 1, 48 tokens) only without --no-latency",
                  ["config", "mean cos", "min cos", "top-5", "latency ms", "vs ORT dynamic", "note"])
    base = latency.get("ORT quantize_dynamic (per-tensor)")
    for name, path in paths.items():
        m = H.compare(reference, H.ort_embed(path, ev))
        lat = latency.get(name)
        ratio = f"{lat / base:.2f}×" if lat and base else "—"
        table.add(name, f"{m.mean_cosine:.4f}", f"{m.min_cosine:.4f}", f"{m.topk_agreement:.3f}",
                  f"{lat:.1f}" if lat else "not timed", ratio, notes.get(name, ""))
    section.tables.append(table)


def _cnn(settings: Settings, dataset: str, section: SectionResult, table: Table) -> None:
    import coreai_opt as co
    from coreai_opt.datasets import accuracy, load_digits_split, load_mnist_split, train_classifier
    from coreai_opt.reference_models import DigitsCNN

    split = {"digits": load_digits_split, "mnist": load_mnist_split}[dataset](seed=0)
    torch.manual_seed(0)
    model = train_classifier(DigitsCNN(), split, epochs=settings.epochs[dataset], lr=1e-2)
    batches = [split.x_train[i : i + 32] for i in range(0, settings.calib_images, 32)]
    example = (batches[0],)
    work = settings.work_dir / f"auto_{dataset}"
    work.mkdir(parents=True, exist_ok=True)

    def ort_acc(converted: nn.Module, name: str) -> float:
        return accuracy(ort_predict_fn(_export(converted, example, work / f"{name}.onnx"), threads=1),
                        split.x_test, split.y_test)

    float_acc = accuracy(model, split.x_test, split.y_test)
    prepared = co.prepare(model, co.QuantizerConfig.presets.w8a8(), example)
    co.calibrate(prepared, batches, progress=False)
    static_acc = ort_acc(co.convert(prepared), "w8a8")
    result = co.auto_quantize(model, batches, example, progress=False)
    auto_acc = ort_acc(result.converted, "auto")
    convs = [u for u in result.report.units if u.kind == "conv"]
    table.add(f"DigitsCNN on {dataset} ({len(split.y_test)} test images, {settings.epochs[dataset]} epochs)",
              fmt_pct(float_acc), fmt_pct(static_acc), fmt_pct(auto_acc), f"{100 * (auto_acc - float_acc):+.2f}",
              f"{sum(u.choice == 'static' for u in convs)}/{len(convs)}", _choices(result.report),
              f"{result.report.latency_us:.0f}")


def _encoder(settings: Settings, section: SectionResult, table: Table) -> None:
    import coreai_opt as co
    from coreai_opt.reference_models import transformer_encoder

    dim, depth = settings.transformer_dim_depth
    torch.manual_seed(0)
    model = transformer_encoder(dim=dim, depth=depth, heads=4, vocab_size=1000, num_classes=10, max_len=64).eval()
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 1000, (8, 48), generator=gen) for _ in range(8)]
    test = torch.randint(0, 1000, (256, 48), generator=gen)
    result = co.auto_quantize(model, batches, (batches[0],), progress=False)
    predict = ort_predict_fn(_export(result.converted, (batches[0],), settings.work_dir / "auto_encoder.onnx"),
                             threads=1)
    with torch.no_grad():
        ref = model(test)
    out = torch.as_tensor(predict(test))
    rse = float(((out - ref) ** 2).sum() / (ref**2).sum())
    agree = float((out.argmax(-1) == ref.argmax(-1)).float().mean())
    table.add(f"transformer_encoder dim {dim} depth {depth} (untrained, random tokens: argmax agreement with float "
              f"{fmt_pct(agree)}, output error {rse:.1e})", "—", "—", "—", "—", "—", _choices(result.report),
              f"{result.report.latency_us:.0f}")


def run(settings: Settings) -> SectionResult:
    """The auto_quantize section (module docstring)."""
    from coreai_opt.api.algorithms.auto_quantize.cost_measurement import load_or_measure

    section = SectionResult("auto", "co.auto_quantize (issue 19)")
    key = attempt(lambda: load_or_measure(threads=1).key, section, "cost table")
    section.notes.append(f"cost table: {key.value if key.ok else 'unavailable'} (cached per machine; the `est. µs` "
                         "column is its estimate, not a timing)")
    if not settings.tiny:
        attempt(lambda: _minilm(settings, section), section, "MiniLM")
    table = Table("CNNs and a transformer encoder: onnxruntime accuracy of the float model, plain w8a8 static and "
                  "auto_quantize with defaults",
                  ["model", "float", "w8a8 static", "auto", "Δ pt", "convs static", "choices", "est. µs"])
    for dataset in settings.datasets:
        attempt(lambda dataset=dataset: _cnn(settings, dataset, section, table), section, f"auto {dataset}")
    attempt(lambda: _encoder(settings, section, table), section, "auto transformer_encoder")
    section.tables.append(table)
    return section
