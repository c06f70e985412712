"""Every axis a torch.export capture kept symbolic stays symbolic in the ONNX file (issue 13 cause 6).

The model below is the shape pattern of HF encoders: a learned position table sliced to the sequence length
(``pos[:, :T]``), which a capture at the example shapes would bake in. It is calibrated at ``[2, 16]`` and run in
onnxruntime at other batches and sequence lengths.
"""

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

import coreai_opt as co
from coreai_opt.graph.graph_meta import get_graph_meta
from coreai_opt.onnx.export.dynamic_axes import captured_bounds, check_axes_are_dynamic, input_axes, requested_axes

VOCAB, D, MAX_T = 50, 32, 64


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.pos = nn.Parameter(torch.randn(1, MAX_T, D) * 0.1)
        self.fc1, self.fc2 = nn.Linear(D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, ids):
        h = self.embed(ids) + self.pos[:, : ids.shape[1]]
        return self.fc2(torch.relu(self.fc1(h)))


class _BranchesOnLength(_Encoder):
    def forward(self, ids):
        h = super().forward(ids)
        return h * 2 if ids.shape[1] > 8 else h


def _ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def converted() -> torch.fx.GraphModule:
    torch.manual_seed(0)
    prepared = co.prepare(_Encoder().eval(), co.QuantizerConfig.presets.w8a8(), (_ids(2, 16),), capture="export")
    co.calibrate(prepared, [(_ids(2, 16, s),) for s in range(4)], progress=False)
    return co.convert(prepared)


@pytest.fixture(scope="module")
def exported(converted, tmp_path_factory) -> object:
    return co.export_onnx(converted, (_ids(2, 16),), tmp_path_factory.mktemp("dynamic_axes") / "m.onnx")


def _input_shapes(path) -> list[list[object]]:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return [i.shape for i in session.get_inputs()]


def test_capture_records_batch_and_sequence_as_symbolic(converted):
    assert converted.meta["coreai_opt"]["dynamic_axes"] == {"ids": {0: "batch", 1: "sequence"}}


@pytest.mark.parametrize("batch, length", [(3, 32), (1, 5), (2, 64)])
def test_file_calibrated_at_2x16_runs_other_batches_and_lengths_within_tolerance(converted, exported, batch, length):
    path = exported
    assert _input_shapes(path) == [["batch", "sequence"]]
    ids = _ids(batch, length, seed=9)
    report = co.verify_onnx(converted, path, [(ids,)])
    assert report.ok, report
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {"ids": ids.numpy()})
    assert out.shape == (batch, length, D)
    eager = converted(ids).detach().numpy()
    steps = np.abs(out - eager).max() / report.outputs[0].tolerance
    assert steps <= 1.0


def test_dynamic_shapes_override_fixes_or_renames_axes(converted, tmp_path):
    fixed = co.export_onnx(converted, (_ids(2, 16),), tmp_path / "fixed.onnx", dynamic_shapes={"ids": None})
    assert _input_shapes(fixed) == [[2, 16]]
    renamed = co.export_onnx(converted, (_ids(2, 16),), tmp_path / "renamed.onnx",
                             dynamic_shapes={"ids": {0: "n", -1: "tokens"}})
    assert _input_shapes(renamed) == [["n", "tokens"]]


def test_dynamic_batch_false_keeps_the_sequence_axis(converted, tmp_path):
    path = co.export_onnx(converted, (_ids(2, 16),), tmp_path / "m.onnx", dynamic_batch=False)
    assert _input_shapes(path) == [[2, "sequence"]]


@pytest.mark.parametrize("override, message", [
    ({"tokens": None}, r"dynamic_shapes names \['tokens'\], which are not inputs of the graph"),
    ({"ids": {2: "x"}}, r"names dimension 2, but that input has rank 2"),
    ({"ids": {1: "my axis"}}, r"an axis name must be a Python identifier"),
])
def test_bad_dynamic_shapes_are_refused_with_the_reason(converted, tmp_path, override, message):
    with pytest.raises(ValueError, match=message):
        co.export_onnx(converted, (_ids(2, 16),), tmp_path / "m.onnx", dynamic_shapes=override)
    assert not (tmp_path / "m.onnx").exists()


def test_torch_exports_positional_dynamic_shapes_are_refused_naming_the_form_to_use(converted, tmp_path):
    with pytest.raises(TypeError, match=r"dynamic_shapes must be a dict keyed by graph input name, .* got a tuple "
                                        r"\(torch.export's positional form is not accepted here\); e.g. "
                                        r"\{'ids': \{0: 'batch'\}\}"):
        co.export_onnx(converted, (_ids(2, 16),), tmp_path / "m.onnx", dynamic_shapes=({0: "batch"},))
    assert not (tmp_path / "m.onnx").exists()


def test_a_length_the_model_branches_on_is_captured_static_and_the_batch_stays_dynamic(tmp_path):
    torch.manual_seed(0)
    model = _BranchesOnLength().eval()
    prepared = co.prepare(model, co.QuantizerConfig.presets.w8a8(), (_ids(2, 16),), capture="export")
    assert prepared.meta["coreai_opt"]["dynamic_axes"] == {"ids": {0: "batch"}}
    co.calibrate(prepared, [(_ids(2, 16, s),) for s in range(2)], progress=False)
    converted = co.convert(prepared)
    path = co.export_onnx(converted, (_ids(2, 16),), tmp_path / "m.onnx")
    assert _input_shapes(path) == [["batch", 16]]
    assert co.verify_onnx(converted, path, [(_ids(5, 16, 3),)]).ok


def test_fx_captured_models_keep_only_the_batch_axis(tmp_path):
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU()).eval()
    prepared = co.prepare(model, co.QuantizerConfig.presets.w8a8(), (torch.randn(2, 4, 8),), capture="fx")
    assert get_graph_meta(prepared).dynamic_axes is None
    axes = input_axes(prepared, (torch.randn(2, 4, 8),), ["x"], True, None)
    assert axes == [{0: "batch"}]


def _graph_with_input_dims(dims: list[object]) -> onnx.ModelProto:
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, dims)
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, dims)
    return onnx.helper.make_model(onnx.helper.make_graph([onnx.helper.make_node("Relu", ["x"], ["y"])], "g", [x], [y]))


def test_a_default_axis_the_exporter_fixed_warns_and_an_asked_for_one_raises():
    """samvit: the capture keeps height symbolic (Dim.AUTO accepts its window-padding guards), the ONNX export's
    free Dim does not, and torch fixes it at 64. Only a dimension the caller named is an error."""
    proto = _graph_with_input_dims(["batch", 3, 64, "width"])
    axes = [{0: "batch", 2: "height", 3: "width"}]
    assert requested_axes(["x"], True, None) == [{0}]
    with pytest.warns(UserWarning, match=r"dimension 2 \('height'\) of input 'x' is fixed at 64 in the ONNX file"):
        check_axes_are_dynamic(proto, axes, requested_axes(["x"], True, None))
    asked = requested_axes(["x"], True, {"x": {0: "batch", 2: "height"}})
    assert asked == [{0, 2}]
    with pytest.raises(ValueError, match=r"dimension 2 \('height'\) of input 'x' was exported as the constant 64"):
        check_axes_are_dynamic(proto, axes, asked)
    batch_fixed = _graph_with_input_dims([4, 3, 64, 64])
    with pytest.raises(ValueError, match="export with dynamic_batch=False"):  # the batch stays an error
        check_axes_are_dynamic(batch_fixed, [{0: "batch"}], requested_axes(["x"], True, None))


def test_capture_reads_the_position_tables_bound_on_the_sequence(converted):
    assert get_graph_meta(converted).axis_bounds == {"sequence": MAX_T}


def test_export_declares_the_bound_and_traces_distilbert_once(tmp_path, monkeypatch):
    """Unbounded, torch's exporter traces DistilBERT, fails its guard ``sequence <= 64`` (64 positions) and traces
    it again with the bound it suggests: a second capture, half of the export's capture time."""
    import coreai_opt.onnx.export.export_onnx as export_module
    from benchmarks.corpus.models import corpus_entry

    entry = corpus_entry("hf-distilbert")
    torch.manual_seed(0)
    batches = [entry.inputs(torch.Generator().manual_seed(s), 2) for s in range(2)]
    prepared = co.prepare(entry.build().eval(), co.QuantizerConfig.presets.w8a8(), batches[0])
    co.calibrate(prepared, batches, progress=False)
    converted = co.convert(prepared)
    assert get_graph_meta(converted).axis_bounds == {"sequence": 64}
    calls = []
    real_export = torch.export.export

    def counted(*args, **kwargs):
        calls.append(kwargs.get("dynamic_shapes"))
        return real_export(*args, **kwargs)

    monkeypatch.setattr(torch.export, "export", counted)
    co.export_onnx(converted, batches[0], tmp_path / "bounded.onnx", input_names=list(entry.input_names))
    assert len(calls) == 1
    assert calls[0][0][1].max == 64
    calls.clear()
    monkeypatch.setattr(export_module, "captured_bounds", lambda model, axes: {})
    co.export_onnx(converted, batches[0], tmp_path / "unbounded.onnx", input_names=list(entry.input_names))
    assert len(calls) == 2  # the second trace the bound saves
    files = [onnx.load(tmp_path / name) for name in ("bounded.onnx", "unbounded.onnx")]
    assert files[0].graph == files[1].graph


def test_a_bound_is_declared_only_for_the_axis_the_capture_named_so(converted):
    assert captured_bounds(converted, [{0: "batch", 1: "sequence"}]) == {"sequence": MAX_T}
    assert captured_bounds(converted, [{0: "batch", 1: "length"}]) == {}
    assert captured_bounds(converted, [{0: "sequence"}]) == {}


@pytest.mark.parametrize(("guards", "bound"), [
    (["s <= 100"], 100), (["s < 100"], 99), (["Eq(s, Min(64, s))"], 64), (["s > 1", "s <= 40"], 40),
    (["Ne(s, 5)"], None), (["s > 1"], None), ([], None),
])
def test_largest_size_is_where_the_guards_stop_holding(guards, bound):
    import sympy

    from coreai_opt.graph.dynamic_dims import _largest_size

    s = sympy.Symbol("s", integer=True, positive=True)
    parsed = [sympy.sympify(g, locals={"s": s}) for g in guards]
    assert _largest_size(parsed, s, 16) == bound
