"""The coreai-opt command line: help, the demo, quantize (success paths and every bad-input case), inspect."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto
from onnx import helper as oh
from onnx import numpy_helper as nh

from coreai_opt.cli.commands import demo
from coreai_opt.cli.commands.inspect_onnx import summarize_qdq
from coreai_opt.cli.main import main
from coreai_opt.cli.usage_errors import CliError, one_line

MODELS_PY = textwrap.dedent(
    """
    import torch
    from torch import nn


    class SmallCNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, 8, 3, padding=1)
            self.relu = nn.ReLU()
            self.pool = nn.AdaptiveAvgPool2d(1)
            self.fc = nn.Linear(8, 4)

        def forward(self, x):
            return self.fc(torch.flatten(self.pool(self.relu(self.conv(x))), 1))


    def small_cnn():
        torch.manual_seed(0)
        return SmallCNN()


    def linear():
        return nn.Linear(4, 2)


    def not_a_module():
        return 42
    """
)


@pytest.fixture
def models_py(tmp_path: Path) -> Path:
    path = tmp_path / "user_models.py"
    path.write_text(MODELS_PY)
    return path


@pytest.fixture
def images_npz(tmp_path: Path) -> Path:
    path = tmp_path / "images.npz"
    np.savez(path, np.random.default_rng(0).standard_normal((48, 3, 8, 8)).astype(np.float32))
    return path


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def _assert_one_line_error(code: int, err: str, expected: str) -> None:
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1, f"expected one line on stderr, got:\n{err}"
    assert "Traceback" not in err
    assert expected in lines[0], lines[0]


# --- help -------------------------------------------------------------------------------------------------------


def test_main_help_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name in ("demo", "quantize", "inspect"):
        assert re.search(rf"^\s+{name}\s", out, re.MULTILINE), out


@pytest.mark.parametrize(
    ("command", "option"), [("demo", "--train"), ("quantize", "--calib-data"), ("inspect", "--no-fusion")]
)
def test_subcommand_help_describes_its_options(capsys, command, option):
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: coreai-opt {command}")
    assert option in out


def test_main_without_command_prints_usage_and_exits_2(capsys):
    code, _, err = _run(capsys)
    assert code == 2
    assert "usage: coreai-opt" in err


def test_console_script_runs():
    script = Path(sys.executable).with_name("coreai-opt")
    result = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "quantize" in result.stdout


def test_one_line_collapses_newlines_and_names_foreign_errors():
    assert one_line(ValueError("bad\n   value")) == "ValueError: bad value"
    assert one_line(CliError("fix\nthis")) == "fix this"


def test_main_debug_reraises_instead_of_one_line(tmp_path):
    with pytest.raises(CliError, match="ONNX file not found"):
        main(["--debug", "inspect", str(tmp_path / "missing.onnx")])
    with pytest.raises(CliError, match="ONNX file not found"):
        main(["inspect", str(tmp_path / "missing.onnx"), "--debug"])


# --- quantize: bad input ------------------------------------------------------------------------------------------


def test_quantize_missing_model_file_exits_2(capsys, tmp_path, images_npz):
    code, out, err = _run(capsys, "quantize", str(tmp_path / "missing.pt2"), "--calib-data", str(images_npz))
    _assert_one_line_error(code, err, "model file not found")
    assert out == ""


def test_quantize_missing_python_file_exits_2(capsys, tmp_path, images_npz):
    code, _, err = _run(capsys, "quantize", f"{tmp_path / 'missing.py'}:make", "--calib-data", str(images_npz))
    _assert_one_line_error(code, err, "model file not found")


def test_quantize_missing_calibration_data_exits_2(capsys, tmp_path, models_py):
    code, _, err = _run(capsys, "quantize", f"{models_py}:small_cnn", "--calib-data", str(tmp_path / "no.npz"))
    _assert_one_line_error(code, err, "calibration data not found")


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        ("no_such_module_xyz:make", "cannot import module 'no_such_module_xyz'"),
        ("{models_py}:missing_factory", "has no attribute 'missing_factory'"),
        ("{models_py}:not_a_module", "returned int, expected a torch.nn.Module"),
        ("just_some_text", "expected module:factory"),
        ("torch.nn:not-an-identifier", "expected module:factory"),
    ],
)
def test_quantize_bad_module_factory_exits_2(capsys, models_py, images_npz, spec, expected):
    code, _, err = _run(capsys, "quantize", spec.format(models_py=models_py), "--calib-data", str(images_npz))
    _assert_one_line_error(code, err, expected)


def test_quantize_shape_mismatch_in_calibration_data_exits_2(capsys, tmp_path, models_py):
    data = tmp_path / "wrong.npz"
    np.savez(data, np.zeros((10, 5), np.float32))  # nn.Linear(4, 2) needs 4 features
    code, _, err = _run(capsys, "quantize", f"{models_py}:linear", "--calib-data", str(data))
    _assert_one_line_error(code, err, "shape mismatch: the model rejects calibration samples of shape (5,) float32")


def test_quantize_inputs_with_different_sample_counts_exit_2(capsys, tmp_path, models_py):
    data = tmp_path / "ragged.npz"
    np.savez(data, np.zeros((10, 4), np.float32), np.zeros((9, 4), np.float32))
    code, _, err = _run(capsys, "quantize", f"{models_py}:linear", "--calib-data", str(data))
    _assert_one_line_error(code, err, "same number of samples")


def test_quantize_data_contradicting_input_shape_exits_2(capsys, models_py, images_npz):
    code, _, err = _run(
        capsys, "quantize", f"{models_py}:small_cnn", "--calib-data", str(images_npz), "--input-shape", "1,3,16,16"
    )
    _assert_one_line_error(code, err, "shape mismatch")


def test_quantize_unknown_preset_exits_2(capsys, models_py, images_npz):
    code, _, err = _run(capsys, "quantize", f"{models_py}:small_cnn", "--calib-data", str(images_npz), "--preset", "w9")
    _assert_one_line_error(code, err, "unknown preset 'w9'; choose one of: w8, w4, w8a8")


def test_quantize_missing_config_file_exits_2(capsys, tmp_path, models_py, images_npz):
    code, _, err = _run(
        capsys,
        "quantize",
        f"{models_py}:small_cnn",
        "--calib-data",
        str(images_npz),
        "--config",
        str(tmp_path / "nope.yaml"),
    )
    _assert_one_line_error(code, err, "config file not found")


def test_quantize_config_yaml_loads_like_the_preset(tmp_path):
    from coreai_opt.cli.commands.quantize import load_config
    from coreai_opt.config import QuantizerConfig

    path = tmp_path / "my_config.yaml"
    path.write_text(QuantizerConfig.presets.w8().to_yaml())
    config, name = load_config("w8a8", path)
    assert name == "my_config"
    assert config == QuantizerConfig.presets.w8()


def test_quantize_without_data_or_shape_exits_2(capsys, models_py):
    code, _, err = _run(capsys, "quantize", f"{models_py}:small_cnn")
    _assert_one_line_error(code, err, "give --calib-data FILE")


def test_quantize_bad_input_shape_is_an_argparse_error(capsys, models_py):
    with pytest.raises(SystemExit) as exc:
        main(["quantize", f"{models_py}:small_cnn", "--input-shape", "1,three"])
    assert exc.value.code == 2
    assert "expected comma-separated integers" in capsys.readouterr().err


# --- quantize: success paths --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def quantized_small_cnn(tmp_path_factory) -> Path:
    """Run ``coreai-opt quantize file.py:small_cnn --calib-data images.npz`` once; return the ONNX path."""
    root = tmp_path_factory.mktemp("quantize")
    (root / "user_models.py").write_text(MODELS_PY)
    np.savez(root / "images.npz", np.random.default_rng(0).standard_normal((48, 3, 8, 8)).astype(np.float32))
    output = root / "out" / "small.onnx"
    code = main(
        [
            "quantize",
            f"{root / 'user_models.py'}:small_cnn",
            "--calib-data",
            str(root / "images.npz"),
            "--batch-size",
            "16",
            "-o",
            str(output),
            "--no-progress",
        ]
    )
    assert code == 0
    return output


def test_quantize_writes_onnx_and_verification_report(quantized_small_cnn):
    output = quantized_small_cnn
    assert output.is_file()
    onnx.checker.check_model(onnx.load(str(output)))
    report = json.loads(output.with_name("small.report.json").read_text())
    assert report["ok"] is True
    assert report["argmax_agreement"] == 1.0
    assert report["config"] == "w8a8"
    assert report["calibration_inputs"] == [[48, 3, 8, 8]]
    assert report["num_samples"] == 48
    text = output.with_name("small.report.txt").read_text()
    assert "ok=True" in text


def test_quantize_random_data_from_pt2_warns_and_exports(capsys, tmp_path, models_py):
    sys.path.insert(0, str(models_py.parent))
    try:
        import user_models  # the fixture's file, imported to build an ExportedProgram
    finally:
        sys.path.remove(str(models_py.parent))
    program = torch.export.export(user_models.small_cnn().eval(), (torch.randn(4, 3, 8, 8),))
    pt2 = tmp_path / "small.pt2"
    torch.export.save(program, pt2)
    output = tmp_path / "small_random.onnx"
    code, out, err = _run(capsys, "quantize", str(pt2), "--input-shape", "4,3,8,8", "-o", str(output), "--no-progress")
    assert code == 0, err
    assert "warning: no calibration data: calibrating on random normal data" in err
    assert output.is_file()
    # the exported program has a fixed batch of 4: calibration and verification used whole batches of 4
    assert json.loads(output.with_name("small_random.report.json").read_text())["num_samples"] == 32
    assert f"wrote {output}" in out


def test_quantize_torchscript_model(capsys, tmp_path, models_py, images_npz):
    sys.path.insert(0, str(models_py.parent))
    try:
        import user_models
    finally:
        sys.path.remove(str(models_py.parent))
    scripted = torch.jit.trace(user_models.small_cnn().eval(), (torch.randn(16, 3, 8, 8),))
    ts_path = tmp_path / "small_ts.pt"
    torch.jit.save(scripted, str(ts_path))
    output = tmp_path / "small_ts.onnx"
    code, _, err = _run(
        capsys,
        "quantize",
        str(ts_path),
        "--calib-data",
        str(images_npz),
        "--batch-size",
        "16",
        "-o",
        str(output),
        "--no-progress",
    )
    assert code == 0, err
    assert json.loads(output.with_name("small_ts.report.json").read_text())["ok"] is True


# --- inspect ------------------------------------------------------------------------------------------------------


def _hand_made_qdq(path: Path) -> Path:
    """x -> Q/DQ (uint8) -> Gemm with an int8 DQ weight; an int4 DQ initializer feeds a second output."""
    inits = [
        nh.from_array(np.ones((4, 3), np.int8), "w_q"),
        nh.from_array(np.full((4,), 0.1, np.float32), "w_s"),
        nh.from_array(np.zeros((4,), np.int8), "w_z"),
        nh.from_array(np.array(0.05, np.float32), "x_s"),
        nh.from_array(np.array(128, np.uint8), "x_z"),
        nh.from_array(np.zeros((4,), np.float32), "b"),
        oh.make_tensor("v_q", TensorProto.INT4, [4], [1, -2, 3, -4]),
        oh.make_tensor("v_z", TensorProto.INT4, [], [0]),
    ]
    nodes = [
        oh.make_node("QuantizeLinear", ["x", "x_s", "x_z"], ["xq"]),
        oh.make_node("DequantizeLinear", ["xq", "x_s", "x_z"], ["xd"]),
        oh.make_node("DequantizeLinear", ["w_q", "w_s", "w_z"], ["wd"], axis=0),
        oh.make_node("Gemm", ["xd", "wd", "b"], ["y"], transB=1),
        oh.make_node("DequantizeLinear", ["v_q", "x_s", "v_z"], ["v"]),
    ]
    graph = oh.make_graph(
        nodes,
        "g",
        [oh.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])],
        [
            oh.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4]),
            oh.make_tensor_value_info("v", TensorProto.FLOAT, [4]),
        ],
        inits,
    )
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)])
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def test_summarize_qdq_counts_by_zero_point_dtype(tmp_path):
    model = onnx.load(str(_hand_made_qdq(tmp_path / "m.onnx")))
    summary = summarize_qdq(model)
    assert summary.qdq == {
        ("QuantizeLinear", "uint8"): 1,
        ("DequantizeLinear", "uint8"): 1,
        ("DequantizeLinear", "int8"): 1,
        ("DequantizeLinear", "int4"): 1,
    }
    assert summary.quantized_initializers == {"int4": (1, 4), "int8": (1, 12)}
    assert summary.float_initializers == (3, 4 + 1 + 4)  # w_s, x_s, b
    assert summary.ops == {"DequantizeLinear": 3, "QuantizeLinear": 1, "Gemm": 1}
    assert summary.opset == 21


def _gathered_int8_table(path: Path) -> Path:
    """An int8 embedding table whose gathered rows are dequantized by Cast and Mul (no DequantizeLinear)."""
    inits = [
        nh.from_array(np.arange(40, dtype=np.int8).reshape(10, 4), "table_q"),
        nh.from_array(np.full((10, 1), 0.5, np.float32), "row_scale"),
    ]
    nodes = [
        oh.make_node("Gather", ["table_q", "ids"], ["rows_q"]),
        oh.make_node("Gather", ["row_scale", "ids"], ["scale"]),
        oh.make_node("Cast", ["rows_q"], ["rows_f"], to=TensorProto.FLOAT),
        oh.make_node("Mul", ["rows_f", "scale"], ["y"]),
    ]
    graph = oh.make_graph(nodes, "g", [oh.make_tensor_value_info("ids", TensorProto.INT64, ["n"])],
                          [oh.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 4])], inits)
    model = oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)])
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def test_summarize_qdq_counts_embedding_tables_read_through_gather(tmp_path):
    summary = summarize_qdq(onnx.load(str(_gathered_int8_table(tmp_path / "emb.onnx"))))
    assert summary.quantized_initializers == {"int8": (1, 40)}
    assert summary.float_initializers == (1, 10)


def test_inspect_float_model_says_so_and_lists_no_dequantize_feeds(capsys, tmp_path):
    graph = oh.make_graph([oh.make_node("Gemm", ["x", "w"], ["y"])], "g",
                          [oh.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 3])],
                          [oh.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 2])],
                          [nh.from_array(np.ones((3, 2), np.float32), "w")])
    path = tmp_path / "float.onnx"
    onnx.save(oh.make_model(graph, opset_imports=[oh.make_opsetid("", 21)]), str(path))
    code, out, _ = _run(capsys, "inspect", str(path), "--no-fusion")
    assert code == 0
    assert "none: this is a float model" in out
    assert "DequantizeLinear (" not in out and "quantized initializers" not in out
    assert re.search(r"float\s+1\s+6\s+24 B", out)


def test_inspect_prints_qdq_tables_without_fusion(capsys, tmp_path):
    path = _hand_made_qdq(tmp_path / "m.onnx")
    code, out, _ = _run(capsys, "inspect", str(path), "--no-fusion")
    assert code == 0
    assert re.search(r"int4\s+0\s+1", out)  # dtype, QuantizeLinear, DequantizeLinear
    assert re.search(r"uint8\s+1\s+1", out)
    assert re.search(r"int8\s+1\s+12\s+12 B", out)  # quantized initializers: count, elements, size
    assert re.search(r"Gemm\s+1", out)


def test_inspect_exported_model_includes_fusion_report(capsys, quantized_small_cnn):
    import coreai_opt as co

    code, out, _ = _run(capsys, "inspect", str(quantized_small_cnn))
    assert code == 0
    assert "QuantizeLinear" in out
    assert str(co.fusion_report(quantized_small_cnn)) in out


def test_inspect_missing_file_exits_2(capsys, tmp_path):
    code, _, err = _run(capsys, "inspect", str(tmp_path / "missing.onnx"))
    _assert_one_line_error(code, err, "ONNX file not found")


def test_inspect_non_onnx_file_exits_2(capsys, tmp_path):
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"\x00\xffnot a protobuf" * 10)
    code, _, err = _run(capsys, "inspect", str(junk))
    _assert_one_line_error(code, err, "is not a readable ONNX model")


# --- demo ---------------------------------------------------------------------------------------------------------


def _percent(out: str, label: str) -> float:
    match = re.search(rf"\| {re.escape(label)}\s+\| ([0-9.]+)%", out)
    assert match, f"row {label!r} missing from:\n{out}"
    return float(match.group(1))


def test_demo_int8_matches_float_and_onnxruntime_agrees(capsys, tmp_path):
    code, out, _ = _run(capsys, "demo", "--output-dir", str(tmp_path / "demo"))
    assert code == 0
    assert "loaded the shipped weights" in out
    float_acc = _percent(out, "float accuracy (eager)")
    ort_acc = _percent(out, "int8 accuracy (onnxruntime)")
    assert float_acc >= 95.0
    assert abs(float_acc - ort_acc) <= 1.0
    assert _percent(out, "top-1 agreement eager vs onnxruntime") == 100.0
    assert "(450/450)" in out
    sizes = re.search(r"file size fp32 -> int8\s+\| ([0-9.]+) KiB -> ([0-9.]+) KiB", out)
    weights = re.search(r"of which initializers \(weights\)\s+\| ([0-9.]+) KiB -> ([0-9.]+) KiB", out)
    # int8 weights are a quarter of fp32 (plus scales and int32 biases); the graph itself adds a fixed overhead
    assert weights and float(weights.group(2)) < 0.3 * float(weights.group(1))
    assert sizes and float(sizes.group(2)) < 0.6 * float(sizes.group(1))
    assert re.search(r"latency fp32 -> int8 .*\| [0-9.]+ ms -> [0-9.]+ ms", out)
    assert (tmp_path / "demo" / "digits_cnn.int8.onnx").is_file()
    assert (tmp_path / "demo" / "digits_cnn.fp32.onnx").is_file()
    # the README quotes docs/snippets/demo_table.txt: a fresh run prints the same numbers (latency aside)
    snippet = (Path(__file__).resolve().parents[2] / "docs" / "snippets" / "demo_table.txt").read_text()
    rows = [line for line in snippet.splitlines() if line.startswith("| ") and "latency" not in line]
    printed = out.splitlines()
    assert rows and all(row in printed for row in rows), f"stale demo snippet; fresh run:\n{out}"


def test_demo_train_saves_weights_that_load_like_the_trained_network(tmp_path, monkeypatch):
    monkeypatch.setattr(demo, "EPOCHS", 1)
    from coreai_opt.datasets import load_digits_split
    from coreai_opt.reference_models import load_digits_cnn
    from coreai_opt.reference_models.pretrained import sha256_of

    previous_threads = torch.get_num_threads()
    torch.set_num_threads(demo.TORCH_THREADS)  # as run_demo does: one thread trains this tiny CNN fastest
    try:
        model, source = demo._train(load_digits_split(seed=demo.SEED), tmp_path / "w" / "digits_cnn.pt")
    finally:
        torch.set_num_threads(previous_threads)
    digest = sha256_of(tmp_path / "w" / "digits_cnn.pt")
    assert source.startswith("trained 1 epochs") and source.endswith(f"(sha256 {digest})")
    loaded = load_digits_cnn(tmp_path / "w" / "digits_cnn.pt", digest)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in loaded.state_dict().items())


def test_demo_save_weights_without_train_exits_2(capsys, tmp_path):
    code, _, err = _run(capsys, "demo", "--save-weights", str(tmp_path / "w.pt"), "--output-dir", str(tmp_path))
    assert code == 2
    assert "--save-weights needs --train" in err
    assert not (tmp_path / "w.pt").exists()
