import io
import warnings

import pytest
import torch

import coreai_opt as co
from coreai_opt.api.algorithms.auto_quantize.candidates import kernel_kind
from coreai_opt.errors import UnexpectedError
from tests.api.auto_quantize.conftest import LINES, table


@pytest.fixture(scope="module")
def smoothed(tiny):
    """The default path (SmoothQuant first), run once for the module."""
    model, batches = tiny
    return co.auto_quantize(model, batches, (batches[0],), cost_table=table(), progress=False)


def _outputs(model, batches):
    with torch.no_grad():
        return [model(b) for b in batches]


def test_auto_quantize_defaults_meet_max_error_and_report_every_layer(smoothed):
    report = smoothed.report
    assert report.measured_error <= report.max_error == co.api.algorithms.auto_quantize.DEFAULT_MAX_ERROR
    assert [u.layers for u in report.units] == [("q", "k"), ("fc1",), ("fc2",)]
    assert sum(report.counts().values()) == 4
    for unit in report.units:
        assert set(unit.alternatives) == {"static", "dynamic", "int8_compute", "int16", "float"}
        assert unit.alternatives["float"][0] == 0.0 and unit.error == unit.alternatives[unit.choice][0]
    # the LayerNorm's 20x outlier channel is migrated into q / k
    assert report.units[0].smoothing_alpha is not None and smoothed.capture == "export"
    assert report.error_source == "held-out calibration batches (2 of 8)"


def test_auto_quantize_latency_is_the_sum_of_the_cost_table_lines(smoothed):
    macs = {"q": 6 * 16 * 16, "k": 6 * 16 * 16, "fc1": 6 * 16 * 32, "fc2": 6 * 32 * 8}  # 6 tokens a sample
    expected = 0.0
    for unit in smoothed.report.units:
        overhead, throughput = LINES[unit.choice]
        unit_us = sum(overhead + macs[name] / throughput for name in unit.layers)
        assert unit.latency_us == pytest.approx(unit_us, rel=1e-12)
        expected += unit_us
    assert smoothed.report.latency_us == pytest.approx(expected, rel=1e-12)
    assert smoothed.report.reference_latency_us["float"] == pytest.approx(sum(1.0 + m / 100.0 for m in macs.values()))


def test_auto_quantize_config_reproduces_converted_bit_exactly(smoothed, tiny):
    _, batches = tiny
    prepared = co.prepare(smoothed.model, smoothed.config, (batches[0],), capture=smoothed.capture)
    co.calibrate(prepared, batches, progress=False)
    again = co.convert(prepared)
    state, expected = again.state_dict(), smoothed.converted.state_dict()
    assert state.keys() == expected.keys()
    assert all(torch.equal(v, expected[k]) if isinstance(v, torch.Tensor) else v == expected[k]
               for k, v in state.items())
    for a, b in zip(_outputs(again, batches), _outputs(smoothed.converted, batches), strict=True):
        assert torch.equal(a, b)


def test_auto_quantize_config_round_trips_through_yaml(smoothed):
    text = smoothed.config.to_yaml()
    assert co.QuantizerConfig.from_yaml(text) == smoothed.config
    assert text.count("fake_quantize:") >= 2 * sum(1 for u in smoothed.report.units if u.choice != "float")


def test_auto_quantize_report_prints_a_table_and_json(smoothed):
    import json

    text = smoothed.report.table()
    assert "| `q, k` | linear | **" in text and "| round | budget |" in text
    data = json.loads(smoothed.report.to_json())
    assert [u["layers"] for u in data["units"]] == [["q", "k"], ["fc1"], ["fc2"]]
    assert data["counts"] == smoothed.report.counts() and data["measured_error"] == smoothed.report.measured_error


def test_auto_quantize_is_deterministic_same_choices_and_onnx_bytes_and_user_model_untouched(tiny, tmp_path):
    model, batches = tiny
    before = {k: v.clone() for k, v in model.state_dict().items()}
    runs = [co.auto_quantize(model, batches, (batches[0],), cost_table=table(), smooth=False, progress=False)
            for _ in range(2)]
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # the user model is untouched
    assert [u.choice for u in runs[0].report.units] == [u.choice for u in runs[1].report.units]
    files = [co.export_onnx(r.converted, (batches[0],), tmp_path / f"m{i}.onnx") for i, r in enumerate(runs)]
    assert files[0].read_bytes() == files[1].read_bytes()


@pytest.mark.parametrize("cheapest", ["static", "dynamic", "int8_compute"])
def test_auto_quantize_cost_table_decides_the_format_under_a_loose_bound(tiny, cheapest):
    model, batches = tiny
    lines = {k: (1.0, 10.0) for k in LINES} | {cheapest: (0.0, 1e6)}
    result = co.auto_quantize(model, batches, (batches[0],), cost_table=table(lines), max_error=1.0, smooth=False,
                              progress=False)
    assert result.report.counts() == {cheapest: 4}


def test_auto_quantize_tight_bound_keeps_layers_float(tiny):
    model, batches = tiny
    result = co.auto_quantize(model, batches, (batches[0],), cost_table=table(), max_error=1e-12, smooth=False,
                              progress=False)
    assert result.report.counts() == {"float": 4} and result.report.measured_error == 0.0
    assert "kept float" in result.report.table()


def test_auto_quantize_uses_eval_data_and_a_custom_metric(tiny):
    model, batches = tiny

    def max_abs(outputs, references):
        return max(float((o - r).abs().max()) for o, r in zip(outputs, references, strict=True))

    result = co.auto_quantize(model, batches[:4], (batches[0],), eval_data=batches[4:], metric=max_abs,
                              max_error=0.05, candidates=("static", "float"), cost_table=table(), smooth=False,
                              progress=False)
    report = result.report
    assert report.error_source == "eval_data" and report.metric == "max_abs"
    assert set(report.counts()) <= {"static", "float"} and report.measured_error <= 0.05
    assert max_abs(_outputs(result.converted, batches[4:]), _outputs(model, batches[4:])) <= 0.05


@pytest.mark.parametrize("kwargs, message", [
    ({"max_error": 0.0}, "max_error must be a positive finite number"),
    ({"max_error": float("nan")}, "max_error must be a positive finite number"),
    ({"candidates": ("static", "int4")}, "must be a subset of"),
    ({"candidates": ("float",)}, "at least one quantized format"),
    ({"eval_data": []}, "eval_data is empty"),
    ({"latency": -1.0}, "latency must be None, a positive number of microseconds or a format name"),
    ({"latency": "fastest"}, r"latency must be .*\(e\.g\. 'dynamic'"),
    ({"latency": True}, "latency must be None"),
])
def test_auto_quantize_rejects_bad_arguments_with_the_fix(tiny, kwargs, message):
    model, batches = tiny
    with pytest.raises(ValueError, match=message):
        co.auto_quantize(model, batches, (batches[0],), cost_table=table(), progress=False, **kwargs)


def test_auto_quantize_refuses_when_no_candidate_can_beat_float(tiny):
    model, batches = tiny
    slow = {"float": (0.0, 1e9), "static": (1.0, 10.0), "dynamic": (1.0, 10.0), "int16": (1.0, 10.0),
            "int8_compute": (1.0, 10.0)}
    with pytest.raises(ValueError, match="no quantized candidate .* is faster than float .* cost table 'test'"):
        co.auto_quantize(model, batches, (batches[0],), cost_table=table(slow), progress=False)


def test_auto_quantize_names_the_fix_for_a_model_that_is_one_layer():
    x = torch.randn(2, 4)
    with pytest.raises(ValueError, match=r"Linear has no linear or convolution inside a named submodule.*"
                                         r"wrap it, e.g. nn.Sequential\(model\)"):
        co.auto_quantize(torch.nn.Linear(4, 2).eval(), [x, x], (x,), cost_table=table(), smooth=False, progress=False)


def test_auto_quantize_rejects_empty_calibration_data(tiny):
    model, batches = tiny
    with pytest.raises(ValueError, match="at least one calibration batch"):
        co.auto_quantize(model, [], (batches[0],), cost_table=table(), progress=False)


def test_auto_quantize_progress_bar_counts_every_measurement(tiny, monkeypatch):
    model, batches = tiny
    stream = io.StringIO()
    import coreai_opt.api.algorithms.auto_quantize.recipe as recipe

    real = recipe.tqdm
    monkeypatch.setattr(recipe, "tqdm", lambda **kw: real(file=stream, mininterval=0, **kw))
    co.auto_quantize(model, batches, (batches[0],), cost_table=table(), smooth=False, candidates=("static", "float"))
    assert "auto_quantize" in stream.getvalue() and "3/7" in stream.getvalue()  # 3 units x 1 candidate + 4 rounds


def test_kernel_kind_names_the_cost_table_line():
    assert kernel_kind("static", "conv") == "conv_static" and kernel_kind("dynamic", "linear") == "linear_dynamic"
    assert kernel_kind("int8_compute", "linear") == "linear_int8_compute"


@pytest.mark.parametrize("max_error", [1e-12, 1.0])  # every layer float / every layer quantized
def test_auto_quantize_shows_no_warning_about_its_own_internal_configs(tiny, max_error):
    model, batches = tiny
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        co.auto_quantize(model, batches, (batches[0],), cost_table=table(), max_error=max_error, smooth=False,
                         progress=False)
    assert [str(w.message) for w in caught] == []


def test_auto_quantize_wraps_a_foreign_error_from_the_data_naming_itself(tiny):
    model, batches = tiny
    bad = [torch.randn(4, 6, 15)] * 4  # 15 features for a 16-wide LayerNorm: torch raises inside the model
    with pytest.raises(UnexpectedError, match=r"^coreai_opt auto_quantize failed") as info:
        co.auto_quantize(model, bad, (batches[0],), cost_table=table(), smooth=False, progress=False)
    assert isinstance(info.value, RuntimeError) and isinstance(info.value.__cause__, RuntimeError)


def test_auto_quantize_takes_data_and_still_accepts_calibration_data_with_a_deprecation_warning(tiny):
    model, batches = tiny
    options = {"example_inputs": (batches[0],), "cost_table": table(), "smooth": False, "progress": False}
    new = co.auto_quantize(model, data=batches, **options)
    with pytest.warns(DeprecationWarning, match=r"^auto_quantize\(calibration_data=\.\.\.\) is deprecated; pass "
                                                r"data=\.\.\. \(same meaning\)$") as record:
        old = co.auto_quantize(model, calibration_data=batches, **options)
    assert [w.filename for w in record if w.category is DeprecationWarning] == [__file__]  # the caller's line
    assert [u.choice for u in old.report.units] == [u.choice for u in new.report.units]
    assert old.report.measured_error == new.report.measured_error
    with pytest.raises(TypeError, match=r"^auto_quantize\(\) got both data= and calibration_data= \(its deprecated "
                                        r"name\); pass data= only$"):
        co.auto_quantize(model, batches, calibration_data=batches, **options)


def test_auto_quantize_default_latency_bound_is_every_linear_dynamic(smoothed):
    report = smoothed.report
    assert report.latency_bound_us == pytest.approx(report.reference_latency_us["dynamic"], rel=1e-12)
    assert report.latency_us <= report.latency_bound_us
    assert report.front[0].latency_us <= report.latency_us <= report.front[-1].latency_us


def test_auto_quantize_latency_bound_wins_over_max_error_and_the_report_says_so(tiny):
    model, batches = tiny
    # all static is the fastest assignment of LINES: the bound leaves no room for anything more accurate
    result = co.auto_quantize(model, batches, (batches[0],), cost_table=table(), max_error=1e-12, latency="static",
                              smooth=False, progress=False)
    report = result.report
    assert report.counts() == {"static": 4} and report.measured_error > 1e-12
    assert report.latency_us == pytest.approx(report.reference_latency_us["static"], rel=1e-12)
    assert "was not reached within the latency bound" in report.table()
    # a bound in microseconds with room for the cheapest more accurate option of one unit: it is taken
    extra = min(lat - u.latency_us for u in report.units for err, lat in u.alternatives.values()
                if err < u.error and lat > u.latency_us)
    loose = co.auto_quantize(model, batches, (batches[0],), cost_table=table(), max_error=1e-12,
                             latency=report.latency_us + extra, smooth=False, progress=False)
    assert report.latency_us < loose.report.latency_us <= report.latency_us + extra
    assert sum(u.error for u in loose.report.units) < sum(u.error for u in report.units)


def test_auto_quantize_front_is_in_the_json_report(smoothed):
    import json

    data = json.loads(smoothed.report.to_json())
    assert [p["choices"] for p in data["front"]] == [list(p.choices) for p in smoothed.report.front]
    assert "| front: latency µs | predicted error | choices |" in smoothed.report.table()
