"""Every option is checked before calibration starts, and the messages speak command-line, not Python API."""

from __future__ import annotations

import numpy as np
import pytest

import coreai_opt
from coreai_opt.cli.commands.quantize import PRESET_NAMES
from coreai_opt.cli.main import main
from coreai_opt.config import QuantizerConfig
from tests.cli.conftest import one_line_error

GELU_MODEL = """
import torch
from torch import nn


def make():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))
"""


@pytest.fixture
def gelu_model(tmp_path):
    (tmp_path / "gelu.py").write_text(GELU_MODEL)
    return f"{tmp_path / 'gelu.py'}:make"


@pytest.fixture
def no_calibration(monkeypatch):
    """Fail the test if calibration starts: these errors must come first."""

    def refuse(*args, **kwargs):
        raise AssertionError("calibrate ran before the option check")

    monkeypatch.setattr(coreai_opt, "calibrate", refuse)


def test_opset_out_of_range_names_the_models_real_need(capsys, gelu_model, no_calibration):
    line = one_line_error(capsys, "quantize", gelu_model, "--input-shape", "2,64", "--opset", "17")
    assert line == ("coreai-opt quantize: error: --opset 17 is not supported: coreai-opt writes opsets 18 to 23, and "
                    "this model exports best with 20 (its GELU exports as one Gelu op from 20); pass --opset 20 or "
                    "leave --opset out")
    assert "opset=None" not in line


def test_opset_too_low_for_int4_blocks_names_the_quantizer_and_the_fix(capsys, gelu_model, no_calibration):
    line = one_line_error(capsys, "quantize", gelu_model, "--input-shape", "2,64", "--preset", "w4a8", "--opset", "20")
    assert "--opset 20 is too low for this model: its int4 per-block quantizer" in line
    assert "needs opset 21; pass --opset 21 or leave --opset out (then 21 is used)" in line


def test_opset_below_the_gelu_opset_warns_and_exports(capsys, gelu_model, tmp_path):
    output = tmp_path / "g18.onnx"
    code = main(["quantize", gelu_model, "--input-shape", "4,64", "--opset", "18", "--latency-runs", "0",
                 "-o", str(output)])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "warning: --opset 18 writes this model's GELU as Erf/Div/Add/Mul" in err
    import onnx

    assert next(o.version for o in onnx.load(str(output)).opset_import if o.domain == "") == 18


def test_output_path_that_is_a_directory_fails_before_the_model_loads(capsys, tmp_path, no_calibration):
    (tmp_path / "out.onnx").mkdir()
    line = one_line_error(capsys, "quantize", "no_such_module_at_all:make", "--input-shape", "2,4",
                  "-o", str(tmp_path / "out.onnx"))
    assert f"output path {tmp_path / 'out.onnx'} is a directory" in line


def test_output_under_a_file_fails_before_the_model_loads(capsys, tmp_path, no_calibration):
    (tmp_path / "file").write_text("x")
    line = one_line_error(capsys, "quantize", "no_such_module_at_all:make", "--input-shape", "2,4",
                  "-o", str(tmp_path / "file" / "sub" / "m.onnx"))
    assert f"{tmp_path / 'file'} is a file, not a directory" in line


@pytest.mark.parametrize(("flag", "value"), [("--batch-size", "0"), ("--max-batches", "0"),
                                             ("--keep-float-top", "0"), ("--latency-runs", "-1")])
def test_numeric_options_are_checked_first(capsys, flag, value, no_calibration):
    line = one_line_error(capsys, "quantize", "no_such_module_at_all:make", "--input-shape", "2,4", flag, value)
    assert f"{flag} must be >=" in line


def test_two_calibration_sources_are_refused(capsys, tmp_path, no_calibration):
    np.savez(tmp_path / "x.npz", np.zeros((4, 4), np.float32))
    line = one_line_error(capsys, "quantize", "m:make", "--calib-data", str(tmp_path / "x.npz"),
                          "--input", "x:float32:2,4")
    assert "give one calibration source, got --calib-data and --input" in line


def test_preset_help_lists_every_preset(capsys):
    assert list(PRESET_NAMES) == list(QuantizerConfig.presets.all_names())
    assert "w8a8_dynamic" in PRESET_NAMES
    with pytest.raises(SystemExit):
        main(["quantize", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert f"QuantizerConfig preset: {', '.join(PRESET_NAMES)} (default: w8a8)" in out
