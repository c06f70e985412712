import json

import pytest

from coreai_opt.api.algorithms.auto_quantize import KERNEL_KINDS
from coreai_opt.api.algorithms.auto_quantize import cost_measurement as cm
from coreai_opt.api.algorithms.auto_quantize.cost_table import KernelCost

SMALL = {"linear_shapes": ((8, 32, 32), (8, 64, 128)), "conv_shapes": ((4, 4, 8), (8, 8, 8))}


def test_fit_recovers_overhead_and_throughput_of_exact_lines():
    cost = cm._fit([1000.0, 5000.0, 9000.0], [12.0, 20.0, 28.0])  # 10 µs + MACs / 500
    assert cost.overhead_us == pytest.approx(10.0) and cost.macs_per_us == pytest.approx(500.0)


def test_fit_goes_through_the_origin_when_the_overhead_comes_out_negative():
    cost = cm._fit([1000.0, 2000.0], [1.0, 3.0])  # the line would have overhead -1
    assert cost.overhead_us == 0.0 and cost.macs_per_us == pytest.approx(5e6 / 7000)  # slope = Σ m·t / Σ m²


def test_every_kernel_graph_runs_in_onnxruntime_and_computes_its_macs():
    import numpy as np
    import onnxruntime as ort

    rng = np.random.default_rng(0)
    for kind in KERNEL_KINDS:
        shape = (8, 32, 16) if kind.startswith("linear") else (4, 8, 6)
        model, x, macs = cm._graph(kind, shape, rng)
        options = ort.SessionOptions()
        options.log_severity_level = 3
        sess = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
        (y,) = sess.run(None, {"x": x})
        assert macs == (8 * 32 * 16 if kind.startswith("linear") else 6 * 6 * 8 * 4 * 9), kind
        assert y.shape == ((8, 16) if kind.startswith("linear") else (1, 8, 6, 6)) and np.isfinite(y).all(), kind


def test_measure_cost_table_prices_every_kind_with_positive_lines():
    t = cm.measure_cost_table(runs=3, **SMALL)
    assert set(t.kernels) == set(KERNEL_KINDS)
    assert all(c.overhead_us >= 0 and c.macs_per_us > 0 for c in t.kernels.values())
    for family in ("linear", "conv"):  # 16-bit runs the float kernel plus Q/DQ: never cheaper than float
        int16, fp = t.kernels[f"{family}_int16"], t.kernels[f"{family}_float"]
        assert int16.overhead_us >= fp.overhead_us and int16.macs_per_us <= fp.macs_per_us
    assert t.key == cm.machine_key(1) and "ort" in t.key


def test_load_or_measure_measures_once_then_reads_the_cache(tmp_path, monkeypatch):
    calls = []
    fake = cm.CostTable({k: KernelCost(1.0, float(i + 1)) for i, k in enumerate(KERNEL_KINDS)}, cm.machine_key(1))
    monkeypatch.setattr(cm, "measure_cost_table", lambda threads: calls.append(threads) or fake)
    first = cm.load_or_measure(directory=tmp_path)
    second = cm.load_or_measure(directory=tmp_path)
    assert first == second == fake and calls == [1]
    files = list(tmp_path.iterdir())
    assert [f.name for f in files] == [f"cost_table-v{cm.FORMAT_VERSION}-{cm.machine_key(1)}.json"]
    assert files == [cm.cache_path(1, tmp_path)]
    assert json.loads(files[0].read_text())["kernels"]["linear_float"]["macs_per_us"] == 1.0


def test_load_or_measure_remeasures_a_corrupt_cache_file(tmp_path, monkeypatch):
    fake = cm.CostTable({k: KernelCost(2.0, 3.0) for k in KERNEL_KINDS}, cm.machine_key(1))
    (tmp_path / f"cost_table-v{cm.FORMAT_VERSION}-{cm.machine_key(1)}.json").write_text("{not json")
    monkeypatch.setattr(cm, "measure_cost_table", lambda threads: fake)
    assert cm.load_or_measure(directory=tmp_path) == fake
    cached = tmp_path / f"cost_table-v{cm.FORMAT_VERSION}-{cm.machine_key(1)}.json"
    assert json.loads(cached.read_text())["key"] == fake.key


def test_cache_dir_follows_the_environment_variable(tmp_path, monkeypatch):
    monkeypatch.setenv("COREAI_OPT_CACHE_DIR", str(tmp_path / "c"))
    assert cm.cache_dir() == tmp_path / "c"
