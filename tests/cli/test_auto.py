"""``coreai-opt quantize --auto [--max-error X]``: co.auto_quantize from the command line, files beside the ONNX."""

from __future__ import annotations

import json

import pytest

from coreai_opt.api.algorithms.auto_quantize import cost_measurement
from coreai_opt.cli.main import main
from coreai_opt.config import QuantizerConfig
from tests.api.auto_quantize.conftest import plant_cost_table
from tests.cli.conftest import one_line_error
from tests.cli.test_report import TRANSFORMER as REPORT_TRANSFORMER

#: The report test's encoder, widened to 256 so that int8 kernels beat float on the measured cost table (at width
#: 32 every layer is float's: the integer kernels' fixed cost is larger than the whole float matmul).
TRANSFORMER = REPORT_TRANSFORMER.replace("dim=32", "dim=256").replace("max_len=16", "max_len=32")


@pytest.fixture(scope="module")
def auto_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("auto")
    (root / "tf.py").write_text(TRANSFORMER)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("COREAI_OPT_CACHE_DIR", str(plant_cost_table(root / "cache").parent))
        code = main(["quantize", f"{root / 'tf.py'}:make", "--input", "tokens:int64:4,32:0-49", "-o",
                     str(root / "tf.onnx"), "--auto", "--max-error", "0.01", "--latency-runs", "0", "--quiet"])
    assert code == 0
    return root


def test_quantize_auto_writes_table_json_and_config_beside_the_onnx_file(auto_run):
    text = (auto_run / "tf.auto.txt").read_text()
    data = json.loads((auto_run / "tf.auto.json").read_text())
    assert text.startswith("auto_quantize: measured error ") and "| layers | kind | choice |" in text
    assert data["max_error"] == 0.01 and data["measured_error"] <= 0.01
    layers = [name for unit in data["units"] for name in unit["layers"]]
    assert sum(data["counts"].values()) == len(layers) >= 4  # q/k/v/o, fc1, fc2, head of the one-block encoder
    config = QuantizerConfig.from_yaml((auto_run / "tf.auto.yaml").read_text())
    assert sorted(config.module_name) == sorted(name.replace(".", r"\.") for name in layers)
    assert data["cost_table"] == cost_measurement.machine_key(1)  # the planted cache file was read, not re-measured
    assert [p.name for p in (auto_run / "cache").iterdir()] == [cost_measurement.cache_path(1, auto_run).name]


def test_quantize_auto_report_records_the_choices(auto_run):
    report = json.loads((auto_run / "tf.report.json").read_text())
    data = json.loads((auto_run / "tf.auto.json").read_text())
    assert report["ok"] is True and report["config"] == "auto"
    assert report["tuning"]["auto (layers per format)"] == data["counts"]


def test_quantize_auto_refuses_to_write_a_float_model(capsys, tmp_path):
    (tmp_path / "tiny.py").write_text("import torch\n\ndef make():\n    return torch.nn.Sequential("
                                      "torch.nn.Linear(4, 2)).eval()\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("COREAI_OPT_CACHE_DIR", str(plant_cost_table(tmp_path / "cache").parent))
        code = main(["quantize", f"{tmp_path / 'tiny.py'}:make", "--input-shape", "2,4", "--auto", "-o",
                     str(tmp_path / "tiny.onnx")])
    lines = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and lines[0].startswith("warning: no calibration data")  # random data: the expected warning
    assert lines[1].startswith("coreai-opt quantize: error: --auto kept every layer float (")
    assert "float is the fastest kernel at their size: 0" in lines[1] and "use --preset" in lines[1]
    assert not (tmp_path / "tiny.onnx").exists()


@pytest.mark.parametrize("flag", [["--max-error", "0.01"], ["--max-latency", "dynamic"]])
def test_quantize_auto_bounds_need_auto(capsys, flag):
    line = one_line_error(capsys, "quantize", "m.py:make", "--input-shape", "1,4", *flag)
    assert line == f"coreai-opt quantize: error: {flag[0]} only applies with --auto; add --auto or drop {flag[0]}"


def test_quantize_auto_max_latency_bounds_the_search_and_the_json_records_it(tmp_path):
    (tmp_path / "tf.py").write_text(TRANSFORMER)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("COREAI_OPT_CACHE_DIR", str(plant_cost_table(tmp_path / "cache").parent))
        code = main(["quantize", f"{tmp_path / 'tf.py'}:make", "--input", "tokens:int64:4,32:0-49", "-o",
                     str(tmp_path / "tf.onnx"), "--auto", "--max-error", "1e-9", "--max-latency", "dynamic",
                     "--latency-runs", "0", "--quiet"])
    data = json.loads((tmp_path / "tf.auto.json").read_text())
    assert code == 0 and data["latency_bound_us"] == pytest.approx(data["reference_latency_us"]["dynamic"])
    assert data["latency_us"] <= data["latency_bound_us"] and data["measured_error"] > 1e-9
    assert "was not reached within the latency bound" in (tmp_path / "tf.auto.txt").read_text()


@pytest.mark.parametrize("value", ["0", "-5", "fastest"])
def test_quantize_max_latency_must_be_microseconds_or_a_format(capsys, value):
    with pytest.raises(SystemExit) as exc:
        main(["quantize", "m.py:make", "--input-shape", "1,4", "--auto", "--max-latency", value])
    assert exc.value.code == 2
    assert "expected positive microseconds such as 1500 or a format name from static" in capsys.readouterr().err


@pytest.mark.parametrize("flag", [["--smoothquant"], ["--search-calibration"], ["--keep-float-top", "1"]])
def test_quantize_auto_refuses_the_tuning_flags_it_replaces(capsys, flag):
    line = one_line_error(capsys, "quantize", "m.py:make", "--input-shape", "1,4", "--auto", *flag)
    assert line.startswith("coreai-opt quantize: error: --auto chooses the format per layer itself")
    assert line.endswith(f"drop {flag[0]}")


@pytest.mark.parametrize("value", ["0", "-1", "inf", "x"])
def test_quantize_max_error_must_be_positive(capsys, value):
    from coreai_opt.cli.main import main as run

    with pytest.raises(SystemExit) as exc:
        run(["quantize", "m.py:make", "--input-shape", "1,4", "--auto", "--max-error", value])
    assert exc.value.code == 2
    assert "expected a positive relative squared error such as 0.003" in capsys.readouterr().err
