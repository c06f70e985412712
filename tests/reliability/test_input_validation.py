"""Inputs that do not fit the prepared model get our error naming the input and the fix, before torch / ORT fail.

Before: ``IndexError: index out of range in self`` (token ids), ``aminmax: Expected reduction dim 1 to have non-zero
size`` (empty batches), exporter internals (wrong shapes / dtypes), the onnx checker (an input and an output with one
name).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from torch import fx, nn

import coreai_opt as co
from coreai_opt.errors import InputValidationError
from coreai_opt.graph.graph_meta import get_graph_meta

from .conftest import Pipeline

VOCAB = 50


class TokenNet(nn.Module):
    """Embedding -> mean over the sequence -> Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(tokens).mean(dim=1))


def _tokens(*shape: int, high: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, high, shape, generator=torch.Generator().manual_seed(seed))


def _assert_one_error(calls: dict[str, Callable[[], object]], message: str) -> None:
    """Each call raises InputValidationError itself (no subclass) with ``"{where}: {message}"``."""
    for where, call in calls.items():
        with pytest.raises(InputValidationError) as info:
            call()
        assert type(info.value) is InputValidationError, where
        assert str(info.value) == f"{where}: {message}"


def _assert_refused_everywhere(bad: torch.Tensor, prepared: fx.GraphModule, converted: fx.GraphModule, path: Path,
                               message: str) -> None:
    """calibrate (batch 0), export_onnx and verify_onnx (batch 0) each refuse ``bad`` with ``message``."""
    _assert_one_error({
        "calibration batch 0": lambda: co.calibrate(copy.deepcopy(prepared), [bad], progress=False),
        "export_onnx example_inputs": lambda: co.export_onnx(converted, (bad,), path.with_name("refused.onnx")),
        "verify_onnx batch 0": lambda: co.verify_onnx(converted, path, [bad]),
    }, message)
    assert not path.with_name("refused.onnx").exists()


@pytest.fixture(scope="module", params=["fx", "export"])
def token_model(request: pytest.FixtureRequest) -> fx.GraphModule:
    torch.manual_seed(0)
    prepared = co.prepare(TokenNet().eval(), co.QuantizerConfig.presets.w8a8(), (_tokens(2, 6),),
                          capture=request.param)
    co.calibrate(prepared, [_tokens(4, 6, seed=s) for s in range(2)], progress=False)
    return prepared


@pytest.mark.parametrize(("bad_id", "shown"), [(VOCAB, VOCAB), (10**6, 10**6), (-1, -1)])
def test_calibrate_names_an_out_of_vocabulary_token_id_the_embedding_and_the_fix(token_model: fx.GraphModule,
                                                                              bad_id: int, shown: int) -> None:
    prepared = copy.deepcopy(token_model)
    before = {k: v.clone() for k, v in prepared.state_dict().items() if torch.is_tensor(v)}
    batch = _tokens(4, 6)
    batch[2, 3] = bad_id
    with pytest.raises(InputValidationError, match=rf"^calibration batch 1: input 'tokens' holds token id {shown}, but "
                                                   rf"embedding '\w+' has {VOCAB} rows \(valid ids 0\.\.{VOCAB - 1}\); "
                                                   r"use the tokenizer that matches"):
        co.calibrate(prepared, [_tokens(4, 6), batch], progress=False)
    assert all(torch.equal(v, prepared.state_dict()[k]) for k, v in before.items())  # rolled back


def test_calibrate_names_a_zero_size_batch_instead_of_aminmax(token_model: fx.GraphModule) -> None:
    with pytest.raises(InputValidationError, match=r"^calibration batch 0: input 'tokens' has shape \(0, 6\), which "
                                                   r"holds no elements \(the example input given to prepare had shape "
                                                   r"\(2, 6\)\); skip empty batches"):
        co.calibrate(copy.deepcopy(token_model), [torch.zeros(0, 6, dtype=torch.long)], progress=False)


@pytest.fixture(scope="module")
def exported_tokens(token_model: fx.GraphModule, tmp_path_factory: pytest.TempPathFactory
                    ) -> tuple[fx.GraphModule, Path]:
    converted = co.convert(token_model)
    return converted, co.export_onnx(converted, (_tokens(2, 6),), tmp_path_factory.mktemp("tok") / "tokens.onnx")


def test_verify_onnx_names_an_out_of_vocabulary_token_before_onnxruntime_runs(
        exported_tokens: tuple[fx.GraphModule, Path]) -> None:
    converted, path = exported_tokens
    good, bad = _tokens(3, 6), _tokens(3, 6)
    bad[0, 0] = VOCAB + 7
    assert co.verify_onnx(converted, path, [good]).ok
    with pytest.raises(InputValidationError, match=rf"^verify_onnx batch 1: input 'tokens' holds token id {VOCAB + 7}"):
        co.verify_onnx(converted, path, [good, bad])


def test_verify_and_export_name_an_empty_input(exported_tokens: tuple[fx.GraphModule, Path], tmp_path: Path) -> None:
    converted, path = exported_tokens
    empty = torch.zeros(0, 6, dtype=torch.long)
    with pytest.raises(InputValidationError, match=r"^verify_onnx batch 0: input 'tokens' has shape \(0, 6\)"):
        co.verify_onnx(converted, path, [empty])
    with pytest.raises(InputValidationError, match=r"^export_onnx example_inputs: input 'tokens' has shape \(0, 6\)"):
        co.export_onnx(converted, (empty,), tmp_path / "empty.onnx")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(("example", "message"), [
    (torch.zeros(4, 3, 8, 8, dtype=torch.float64),
     r"input 'x' is float64 of shape \(4, 3, 8, 8\) but the example input given to prepare was float32 of shape "
     r"\(4, 3, 8, 8\); pass inputs of that dtype and rank"),
    (torch.zeros(3, 8, 8), r"input 'x' is float32 of shape \(3, 8, 8\) but the example input given to prepare was "
                           r"float32 of shape \(4, 3, 8, 8\)"),
    (torch.zeros(4, 3, 9, 9), r"the model fails on input 'x' of shape \(4, 3, 9, 9\) \(prepare had \(4, 3, 8, 8\)\): "
                              r".*pass example inputs of shape \(4, 3, 8, 8\) \(only the batch dimension may change\)"),
    (torch.zeros(4, 3, 8, 8, dtype=torch.long), r"input 'x' is int64"),
], ids=["float64", "rank_3", "spatial_9x9", "int64"])
def test_export_onnx_checks_example_inputs_against_what_prepare_recorded(cnn_pipeline: Pipeline, tmp_path: Path,
                                                                        example: torch.Tensor, message: str) -> None:
    with pytest.raises(InputValidationError, match=rf"^export_onnx example_inputs: {message}"):
        co.export_onnx(cnn_pipeline.converted, (example,), tmp_path / "m.onnx")
    assert list(tmp_path.iterdir()) == []


def test_a_torch_export_capture_refuses_other_static_sizes_alike_in_calibrate_export_onnx_and_verify_onnx(
        tmp_path: Path) -> None:
    """torch.export specialises the graph to the example's static sizes; FX graphs are run to see (above)."""
    prepared = co.prepare(TokenNet().eval(), co.QuantizerConfig.presets.w8a8(), (_tokens(2, 6),), capture="export",
                          dynamic_shapes={"tokens": {0: torch.export.Dim("batch")}})  # the sequence stays static
    co.calibrate(prepared, [_tokens(4, 6)], progress=False)
    converted = co.convert(prepared)
    path = co.export_onnx(converted, (_tokens(2, 6),), tmp_path / "m.onnx")
    longer = _tokens(2, 9)
    message = ("input 'tokens' has shape (2, 9) but the model was captured with torch.export for (2, 6); pass inputs "
               "of shape (2, 6) (only the batch dimension may change), or prepare with dynamic_shapes naming the "
               "dimensions that vary")
    _assert_refused_everywhere(longer, prepared, converted, path, message)


def test_export_onnx_still_accepts_float32_inputs_for_a_bfloat16_prepare_converted_back_to_float(
        tmp_path: Path) -> None:
    """The documented bfloat16 path (model.float() before export) stays valid: the check allows the params' dtype."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2)).eval().to(torch.bfloat16)
    x = torch.randn(8, 4)
    prepared = co.prepare(model, co.QuantizerConfig.presets.w8a8(), (x.bfloat16(),))
    co.calibrate(prepared, [x.bfloat16()], progress=False)
    converted = co.convert(prepared).float()
    path = co.export_onnx(converted, (x,), tmp_path / "bf16_as_f32.onnx")
    assert co.verify_onnx(converted, path, [x]).ok


class _Bfloat16Buffers(nn.Module):
    """A float32 model with a bfloat16 scalar buffer (hf RecurrentGemma's embedding normalizer), used two ways."""

    def __init__(self, compute_in_bfloat16: bool) -> None:
        super().__init__()
        self.linear, self.compute_in_bfloat16 = nn.Linear(4, 8), compute_in_bfloat16
        self.normalizer = nn.Buffer(torch.tensor(2.0, dtype=torch.bfloat16), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.linear(x)
        if self.compute_in_bfloat16:
            return (h.to(torch.bfloat16) * self.normalizer).float()
        return h * self.normalizer.type(h.dtype)


def _bfloat16_buffer_export(compute_in_bfloat16: bool, path: Path) -> tuple[nn.Module, Path, torch.Tensor]:
    torch.manual_seed(0)
    x = torch.randn(8, 4)
    prepared = co.prepare(_Bfloat16Buffers(compute_in_bfloat16).eval(), co.QuantizerConfig.presets.w8a8(), (x,))
    co.calibrate(prepared, [x], progress=False)
    converted = co.convert(prepared)
    return converted, co.export_onnx(converted, (x,), path), x


def test_a_bfloat16_constant_cast_to_float32_exports_and_verifies(tmp_path: Path) -> None:
    converted, path, x = _bfloat16_buffer_export(False, tmp_path / "normalizer.onnx")
    assert co.verify_onnx(converted, path, [x]).ok


def test_bfloat16_compute_is_refused_naming_the_node_and_the_fix(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"^the exported graph computes in bfloat16 \(node .*casts to bfloat16: a "
                                         r"bfloat16 buffer of the model used as it is\), and onnxruntime's CPU "
                                         r"provider has no bfloat16 .*model.float\(\)"):
        _bfloat16_buffer_export(True, tmp_path / "bf16.onnx")
    assert not (tmp_path / "bf16.onnx").exists()
    converted, _, x = _bfloat16_buffer_export(False, tmp_path / "normalizer.onnx")
    with pytest.raises(ValueError, match=r"^the model's parameters or its example inputs are bfloat16"):
        co.export_onnx(converted.to(torch.bfloat16), (x.bfloat16(),), tmp_path / "params.onnx")


class _NamedOutput(nn.Module):
    def forward(self, output: torch.Tensor) -> torch.Tensor:
        return torch.relu(output) + 1.0


def test_an_input_and_an_output_with_one_name_are_refused_naming_them(cnn_pipeline: Pipeline, tmp_path: Path) -> None:
    with pytest.raises(InputValidationError, match=r"^export_onnx: \['x'\] would name both a graph input and a graph "
                                                   r"output .*pass output_names \(or input_names\) with different"):
        co.export_onnx(cnn_pipeline.converted, (cnn_pipeline.example,), tmp_path / "m.onnx", output_names=["x"])
    prepared = co.prepare(_NamedOutput().eval(), co.QuantizerConfig.presets.w8a8(), (torch.randn(2, 4),))
    co.calibrate(prepared, [torch.randn(2, 4)], progress=False)
    with pytest.raises(InputValidationError, match=r"\['output'\] would name both"):  # the default output name
        co.export_onnx(co.convert(prepared), (torch.randn(2, 4),), tmp_path / "m.onnx")
    assert list(tmp_path.iterdir()) == []


_EXAMPLE = (4, 3, 8, 8)
SAME_BAD_INPUT = [
    ("float64", lambda x: (x.double(),),
     "input 'x' is float64 of shape (4, 3, 8, 8) but the example input given to prepare was float32 of shape "
     "(4, 3, 8, 8); pass inputs of that dtype and rank (only the batch dimension is free)"),
    ("int64", lambda x: (x.long(),),
     "input 'x' is int64 of shape (4, 3, 8, 8) but the example input given to prepare was float32 of shape "
     "(4, 3, 8, 8); pass inputs of that dtype and rank (only the batch dimension is free)"),
    ("rank_3", lambda x: (x[0],),
     "input 'x' is float32 of shape (3, 8, 8) but the example input given to prepare was float32 of shape "
     "(4, 3, 8, 8); pass inputs of that dtype and rank (only the batch dimension is free)"),
    ("empty", lambda x: (x[:0],),
     "input 'x' has shape (0, 3, 8, 8), which holds no elements (the example input given to prepare had shape "
     "(4, 3, 8, 8)); skip empty batches (e.g. a DataLoader over an empty shard, or a filtered batch with no samples "
     "left)"),
    ("two_positional", lambda x: (x, x),
     "2 positional inputs given but the model takes 1 (x); pass one tensor per model input, in order, like the "
     "example inputs given to prepare"),
]


@pytest.mark.parametrize(("make", "message"), [c[1:] for c in SAME_BAD_INPUT], ids=[c[0] for c in SAME_BAD_INPUT])
def test_the_same_bad_input_gets_one_error_type_and_message_from_calibrate_export_onnx_and_verify_onnx(
        cnn_pipeline: Pipeline, tmp_path: Path, make, message: str) -> None:  # noqa: ANN001
    assert tuple(cnn_pipeline.example.shape) == _EXAMPLE
    bad = make(cnn_pipeline.example)
    calls = {
        "calibration batch 1": lambda: co.calibrate(copy.deepcopy(cnn_pipeline.prepared), [cnn_pipeline.example, bad],
                                                    progress=False),
        "export_onnx example_inputs": lambda: co.export_onnx(cnn_pipeline.converted, bad, tmp_path / "m.onnx"),
        "verify_onnx batch 1": lambda: co.verify_onnx(cnn_pipeline.converted, cnn_pipeline.onnx_path,
                                                      [(cnn_pipeline.example,), bad]),
    }
    _assert_one_error(calls, message)
    assert list(tmp_path.iterdir()) == []


def test_a_torch_export_capture_accepts_its_symbolic_sequence_length_and_refuses_other_sizes_everywhere(
        tmp_path: Path) -> None:
    prepared = co.prepare(TokenNet().eval(), co.QuantizerConfig.presets.w8a8(), (_tokens(2, 6),), capture="export")
    assert get_graph_meta(prepared).dynamic_axes == {"tokens": {0: "batch", 1: "sequence"}}
    co.calibrate(prepared, [_tokens(4, 6), _tokens(3, 11, seed=1)], progress=False)  # sequence 11 is symbolic
    converted = co.convert(prepared)
    path = co.export_onnx(converted, (_tokens(2, 9),), tmp_path / "m.onnx")
    assert co.verify_onnx(converted, path, [_tokens(5, 13)]).ok
    float_tokens = _tokens(2, 6).float()
    message = ("input 'tokens' is float32 of shape (2, 6) but the example input given to prepare was int64 of shape "
               "(2, 6); pass inputs of that dtype and rank (only the batch dimension is free)")
    _assert_refused_everywhere(float_tokens, prepared, converted, path, message)
