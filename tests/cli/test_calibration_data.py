"""Calibration data binds to forward() by name (.npz keys, .pt dict keys, --input), never silently by position."""

from __future__ import annotations

import argparse
import json
import textwrap

import numpy as np
import pytest
import torch

from coreai_opt.cli.calibration_data import bind_to_forward
from coreai_opt.cli.input_specs import InputSpec, parse_input_spec, random_inputs
from coreai_opt.cli.main import main
from coreai_opt.cli.usage_errors import CliError
from tests.cli.conftest import one_line_error

TOKEN_MODEL = textwrap.dedent(
    """
    import torch
    from torch import nn


    class Tokens(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(50, 8)
            self.fc = nn.Linear(8, 3)

        def forward(self, input_ids, attention_mask, token_type_ids=None):
            x = self.embed(input_ids) * attention_mask.unsqueeze(-1).float()
            return self.fc(x.mean(dim=1))


    def make():
        torch.manual_seed(0)
        return Tokens()
    """
)


@pytest.fixture
def token_model(tmp_path):
    path = tmp_path / "tokens.py"
    path.write_text(TOKEN_MODEL)
    return f"{path}:make"


def test_npz_keys_bind_by_forward_name_whatever_the_stored_order(capsys, tmp_path, token_model):
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 50, (16, 6)).astype(np.int64)
    mask = (rng.random((16, 6)) > 0.3).astype(np.int64)
    np.savez(tmp_path / "swapped.npz", attention_mask=mask, input_ids=ids)  # mask stored first
    output = tmp_path / "tokens.onnx"
    code = main(["quantize", token_model, "--calib-data", str(tmp_path / "swapped.npz"), "--latency-runs", "0",
                 "-o", str(output)])
    assert code == 0, capsys.readouterr().err
    report = json.loads(output.with_name("tokens.report.json").read_text())
    assert [i["name"] for i in report["inputs"]] == ["input_ids", "attention_mask"]
    assert report["ok"] is True
    import onnxruntime as ort

    session = ort.InferenceSession(str(output), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == ["input_ids", "attention_mask"]
    # the file computes model(input_ids, attention_mask), close to the float model called by name ...
    namespace: dict[str, object] = {}
    exec(TOKEN_MODEL, namespace)  # noqa: S102 - the test's own model source
    with torch.no_grad():
        expected = namespace["make"]()(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask))
    got = session.run(None, {"input_ids": ids, "attention_mask": mask})[0]
    np.testing.assert_allclose(got, expected.numpy(), atol=0.05)
    # ... while the two inputs swapped would give other logits
    swapped = session.run(None, {"input_ids": mask, "attention_mask": ids % 2})[0]
    assert np.abs(swapped - got).max() > 0.05


def test_npz_with_unknown_names_lists_them_and_the_forward_arguments(capsys, tmp_path, token_model):
    np.savez(tmp_path / "abcd.npz", **{k: np.zeros((4, 6), np.int64) for k in "abcd"})
    line = one_line_error(capsys, "quantize", token_model, "--calib-data", str(tmp_path / "abcd.npz"))
    assert ("has inputs a, b, c, d that are not forward() arguments; the model takes input_ids, attention_mask, "
            "token_type_ids; rename them") in line


def test_npz_missing_a_required_argument_is_refused(capsys, tmp_path, token_model):
    np.savez(tmp_path / "ids.npz", input_ids=np.zeros((4, 6), np.int64))
    line = one_line_error(capsys, "quantize", token_model, "--calib-data", str(tmp_path / "ids.npz"))
    assert "lacks the required forward() argument(s) attention_mask" in line


def test_npz_skipping_an_argument_before_a_given_one_is_refused(capsys, tmp_path, token_model):
    np.savez(tmp_path / "gap.npz", input_ids=np.zeros((4, 6), np.int64), token_type_ids=np.zeros((4, 6), np.int64))
    line = one_line_error(capsys, "quantize", token_model, "--calib-data", str(tmp_path / "gap.npz"))
    assert "gives token_type_ids but not attention_mask, which forward() takes before it" in line


def test_pt_dict_binds_by_name_like_npz(tmp_path):
    ids, mask = torch.zeros(2, 3, dtype=torch.int64), torch.ones(2, 3, dtype=torch.int64)
    tensors, names = bind_to_forward(["attention_mask", "input_ids"], (mask, ids),
                                     (("input_ids", "attention_mask", "token_type_ids"), 2), "data.pt")
    assert names == ("input_ids", "attention_mask")
    assert tensors[0] is ids and tensors[1] is mask


def test_unnamed_npz_arrays_bind_by_position_and_too_many_are_refused():
    a, b = torch.zeros(2, 3), torch.ones(2, 3)
    assert bind_to_forward(None, (a, b), (("x", "y"), 2), "f.npz")[1] == ("x", "y")
    with pytest.raises(CliError, match=r"f.npz has 2 inputs but forward\(\) takes 1 \(x\)"):
        bind_to_forward(None, (a, b), (("x",), 1), "f.npz")


def test_float_data_for_token_ids_is_a_dtype_error_naming_the_int64_fix(capsys, token_model):
    line = one_line_error(capsys, "quantize", token_model, "--input", "input_ids:float32:2,6", "--input",
                  "attention_mask:int64:2,6:1-1")
    assert line.startswith("coreai-opt quantize: error: dtype mismatch: the model rejects the calibration inputs "
                           "(input_ids float32, attention_mask int64)")
    assert "must be int64: --input NAME:int64:SHAPE:LOW-HIGH" in line


def test_random_token_inputs_quantize_and_verify(capsys, tmp_path, token_model):
    output = tmp_path / "random.onnx"
    code = main(["quantize", token_model, "--input", "input_ids:int64:4,6:0-49", "--input",
                 "attention_mask:int64:4,6:1-1", "--latency-runs", "0", "-o", str(output)])
    err = capsys.readouterr().err
    assert code == 0, err
    assert err.startswith("warning: no calibration data: calibrating on random data from --input (8 batches)")
    report = json.loads(output.with_name("random.report.json").read_text())
    assert report["ok"] is True
    assert [(i["name"], i["dtype"], i["samples_shape"]) for i in report["inputs"]] == [
        ("input_ids", "int64", [32, 6]), ("attention_mask", "int64", [32, 6])]


# --- --input parsing and generation --------------------------------------------------------------------------------


def test_parse_input_spec_reads_name_dtype_shape_and_range():
    assert parse_input_spec("input_ids:int64:1,128:0-30521") == InputSpec("input_ids", "int64", (1, 128), 0, 30521)
    assert parse_input_spec("x:float32:8,3") == InputSpec("x", "float32", (8, 3))
    assert parse_input_spec("x:float32:2,2:-1.5-2") == InputSpec("x", "float32", (2, 2), -1.5, 2.0)


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("input_ids:int64", "expected NAME:DTYPE:SHAPE[:LOW-HIGH]"),
        ("input_ids:long:1,8:0-9", "unknown dtype 'long'"),
        ("input_ids:int64:1,x:0-9", "must be comma-separated integers"),
        ("input_ids:int64:1,8", "needs a value range, e.g. input_ids:int64:1,8:0-30521"),
        ("input_ids:int64:1,8:9-0", "has LOW > HIGH"),
        ("input_ids:int64:1,8:0-9.5", "must be integers"),
        ("1x:float32:1,8", "is not a forward() argument name"),
    ],
)
def test_parse_input_spec_rejects_malformed_specs(text, message):
    with pytest.raises(argparse.ArgumentTypeError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[").replace("]", r"\]")):
        parse_input_spec(text)


def test_random_inputs_respect_dtype_and_inclusive_range():
    ids, mask, x = random_inputs([parse_input_spec("ids:int64:4,50:0-3"), parse_input_spec("m:int64:4,50:1-1"),
                                  parse_input_spec("x:float32:4,50:-1-1")], batches=3, seed=0)
    assert ids.dtype == torch.int64 and ids.shape == (12, 50)
    assert set(ids.unique().tolist()) == {0, 1, 2, 3}  # both ends drawn
    assert mask.unique().tolist() == [1]
    assert x.dtype == torch.float32 and float(x.min()) >= -1.0 and float(x.max()) < 1.0


def test_random_inputs_need_one_batch_size():
    with pytest.raises(ValueError, match="same batch size"):
        random_inputs([parse_input_spec("a:float32:2,3"), parse_input_spec("b:float32:4,3")], batches=1)
