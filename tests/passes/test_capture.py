import copy
import importlib
import inspect
import operator

import pytest
import torch
from torch import nn

from coreai_opt.graph.graph_meta import InputSpec, OutputLeaf, get_graph_meta
from coreai_opt.graph.node_meta import get_meta
from coreai_opt.passes.capture import CaptureError, capture
from tests.zoo import ZOO, build


@pytest.mark.parametrize("name", list(ZOO))
def test_capture_auto_picks_expected_method_and_matches_eager(name):
    model, example, _ = build(name)
    reference = copy.deepcopy(model.state_dict())
    gm = capture(model, example)
    assert get_graph_meta(gm).capture == ZOO[name].capture
    assert get_graph_meta(gm).input_names == tuple(inspect.signature(model.forward).parameters)
    gm.eval()
    assert torch.equal(gm(*example), model(*example))
    assert all(torch.equal(v, reference[k]) for k, v in model.state_dict().items())


def test_capture_fx_traces_through_composite_torch_modules():
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Linear(4, 2))
    gm = capture(model, (torch.randn(2, 4),), method="fx")
    targets = [n.target for n in gm.graph.nodes if n.op == "call_module"]
    assert targets == ["0.0", "0.1", "1"]
    assert get_meta(next(n for n in gm.graph.nodes if n.target == "0.0")).module_type is nn.Linear


def test_capture_fx_respects_user_leaf_modules():
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Linear(4, 2))
    gm = capture(model, (torch.randn(2, 4),), method="fx", leaf_modules=("0",))
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["0", "1"]


def test_capture_export_removes_guards_fn_and_has_dynamic_batch():
    model, example, batches = build("torch_transformer")
    gm = capture(model, example, method="export")
    assert not any("_guards_fn" in str(n.target) for n in gm.graph.nodes)
    gm.eval()
    assert torch.equal(gm(batches[0]), model(batches[0]))  # batch 8 vs example batch 2


def test_capture_fx_error_names_module_and_line_when_tracing_fails():
    model, example, _ = build("torch_transformer")
    pattern = r"module 'encoder' \(TransformerEncoder\).*transformer.py:\d+.*leaf_modules"
    with pytest.raises(CaptureError, match=pattern):
        capture(model, example, method="fx")


class _DataDependent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        if x.sum() > 0:
            return self.fc(x)
        return x


def test_capture_raises_naming_source_line_when_both_methods_fail():
    with pytest.raises(CaptureError, match=r"test_capture.py:\d+: if x.sum\(\) > 0.*concrete_args"):
        capture(_DataDependent(), (torch.randn(2, 4),))


def test_capture_rejects_non_tuple_example_inputs():
    with pytest.raises(TypeError, match=r"tuple.*\(x,\)"):
        capture(nn.Linear(2, 2), torch.randn(1, 2))


def test_capture_fx_uses_concrete_args_to_specialise_flags():
    class Flagged(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x, double: bool = False):
            y = self.fc(x)
            return y * 2 if double else y

    gm = capture(Flagged(), (torch.randn(2, 4),), method="fx", concrete_args={"double": True})
    assert get_graph_meta(gm).input_names == ("x",)
    assert sum(n.target is operator.mul for n in gm.graph.nodes) == 1


class _Keyword(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x, scale=None):
        b, t, _ = x.shape
        return self.fc(x).reshape(b * t, 3) * scale


def test_capture_export_accepts_keyword_inputs_with_dynamic_batch():
    model = _Keyword().eval()
    x, scale = torch.randn(2, 5, 4), torch.randn(1, 3)
    gm = capture(model, (x,), {"scale": scale}, method="export")
    assert get_graph_meta(gm).input_names == ("x", "scale")
    gm.eval()
    y = torch.randn(7, 5, 4)
    assert torch.equal(gm(y, scale=scale), model(y, scale=scale))


class _DictOutputs(nn.Module):
    """Keyword input with a default, a nested return value holding a None."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, scale: float = 2.0) -> dict:
        h = self.fc(x) * scale
        return {"logits": h, "pair": (h * mask.unsqueeze(-1), None)}


@pytest.mark.parametrize("method", ["fx", "export"])
def test_capture_records_the_bound_example_inputs_and_the_output_leaves_in_graph_meta(method: str) -> None:
    x, mask = torch.randn(2, 4), torch.ones(2, dtype=torch.int64)
    gm = capture(_DictOutputs().eval(), (x,), {"mask": mask}, method=method)
    meta = get_graph_meta(gm)
    assert meta.capture == method
    assert meta.input_names == ("x", "mask", "scale")
    assert meta.input_specs == (InputSpec("x", "float32", (2, 4)), InputSpec("mask", "int64", (2,)))
    assert meta.outputs == (OutputLeaf("['logits']", "Tensor"), OutputLeaf("['pair'][0]", "Tensor"),
                            OutputLeaf("['pair'][1]", "NoneType", "None"))


class _Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lstm = nn.LSTM(4, 5, batch_first=True)

    def forward(self, x: torch.Tensor) -> tuple:
        return self.lstm(x)  # one FX node whose value is (output, (h, c))


def test_fx_capture_records_the_leaves_of_a_leaf_module_that_returns_a_tuple() -> None:
    gm = capture(_Recurrent().eval(), (torch.randn(2, 3, 4),), method="fx")
    assert [n.op for n in gm.graph.nodes] == ["placeholder", "call_module", "output"]
    assert get_graph_meta(gm).outputs == (OutputLeaf("[0]", "Tensor"), OutputLeaf("[1][0]", "Tensor"),
                                          OutputLeaf("[1][1]", "Tensor"))


def test_capture_binds_the_example_inputs_to_forward_once(monkeypatch: pytest.MonkeyPatch) -> None:
    capture_module = importlib.import_module("coreai_opt.passes.capture")  # the package exports the function
    calls = []
    bind = capture_module.ExampleCall.bind.__func__
    monkeypatch.setattr(capture_module.ExampleCall, "bind",
                        classmethod(lambda cls, *a: calls.append(a[0]) or bind(cls, *a)))
    model = _DictOutputs().eval()
    capture(model, (torch.randn(2, 4),), {"mask": torch.ones(2)}, method="auto")
    assert calls == [model]
