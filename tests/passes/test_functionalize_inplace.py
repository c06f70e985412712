"""In-place ops become out of place right after capture, with every later reader rewired (both captures)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from coreai_opt.graph.capture_error import InplaceAliasError
from coreai_opt.graph.inplace_ops import inplace_write
from coreai_opt.passes.capture import CaptureError, capture

CAPTURES = ("fx", "export")


class _Forms(nn.Module):
    """One of each in-place form, each result read later through the *old* name."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 3, padding=1)
        self.act = nn.ReLU(inplace=True)
        self.tanh = nn.Hardtanh(-0.5, 0.5, inplace=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        keep = y                      # a second name of the same tensor
        y.add_(x)                     # call_method
        y.mul_(0.5)
        y.clamp_(min=-1.0)
        y += x                        # operator.iadd (recorded by the capture tracer)
        F.relu(y, inplace=True)       # keyword inplace
        F.hardtanh(y, -2.0, 2.0, True)  # positional inplace
        self.act(y)                   # nn.ReLU(inplace=True)
        z = y * 3.0
        self.tanh(z)                  # nn.Hardtanh(inplace=True)
        z.unsqueeze_(0)               # metadata only
        return keep + z.squeeze(0)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return _Forms().eval()


@pytest.mark.parametrize("method", CAPTURES)
def test_every_in_place_form_is_rewritten_and_the_graph_matches_eager_exactly(method: str) -> None:
    model = _model()
    x = torch.randn(2, 3, 6, 6)
    gm = capture(model, (x,), method=method)
    assert [n.format_node() for n in gm.graph.nodes if inplace_write(gm, n) is not None] == []
    assert not any(getattr(m, "inplace", False) for m in gm.modules())
    with torch.no_grad():
        assert torch.equal(gm(x.clone()), copy.deepcopy(model)(x.clone()))


@pytest.mark.parametrize("method", CAPTURES)
def test_the_user_model_and_example_inputs_are_not_changed(method: str) -> None:
    model = _model()
    state = copy.deepcopy(model.state_dict())
    x = torch.randn(2, 3, 6, 6)
    original = x.clone()
    capture(model, (x,), method=method)
    assert torch.equal(x, original)
    assert model.act.inplace and model.tanh.inplace  # the flags were switched on the copy only
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())


class _OutArgument(nn.Module):
    """``out=`` (parameter-free: with a parameter that requires grad, eager PyTorch itself refuses ``out=``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        buf = torch.empty_like(x, dtype=torch.float64)
        torch.mul(x, 3.0, out=buf)    # out= also casts to the dtype of buf
        keep = buf
        buf.add_(1.0)
        return keep


@pytest.mark.parametrize("method", CAPTURES)
def test_an_out_argument_becomes_a_result_cast_to_its_dtype(method: str) -> None:
    x = torch.randn(2, 5)
    gm = capture(_OutArgument(), (x,), method=method)
    assert [n for n in gm.graph.nodes if inplace_write(gm, n) is not None] == []
    out = gm(x)
    assert out.dtype == torch.float64 and torch.equal(out, _OutArgument()(x))


class _InputWrite(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.sub_(0.5).div_(2.0)         # normalisation written into the input
        return self.fc(x)


@pytest.mark.parametrize("method", CAPTURES)
def test_a_write_into_the_input_becomes_out_of_place_and_the_callers_tensor_is_left_alone(method: str) -> None:
    torch.manual_seed(0)
    model = _InputWrite().eval()
    x = torch.randn(3, 4)
    gm = capture(model, (x,), method=method)
    mine = x.clone()
    with torch.no_grad():
        out = gm(mine)
        expected = model(x.clone())
    assert torch.equal(out, expected)
    assert torch.equal(mine, x)


class _Counter(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return self.fc(x) + self.calls


@pytest.mark.parametrize("method", CAPTURES)
def test_a_write_into_module_state_is_kept_and_advances_once_per_call(method: str) -> None:
    torch.manual_seed(0)
    model = _Counter().eval()
    x = torch.randn(3, 4)
    gm = capture(model, (x,), method=method)
    assert float(gm.get_buffer("calls")) == 0.0  # capture itself ran no forward on the real buffer
    with torch.no_grad():
        outputs = [gm(x) for _ in range(3)]
        expected = [model(x) for _ in range(3)]
    assert all(torch.equal(a, b) for a, b in zip(outputs, expected, strict=True))
    assert float(gm.get_buffer("calls")) == 3.0


class _ViewWrite(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 3, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv(x)
        y[:, 0].add_(1.0)             # writes through a view of y
        y.view(-1).mul_(3.0)          # and through another
        return torch.relu(y)


def test_a_write_through_a_view_under_fx_names_the_node_line_and_fix() -> None:
    with pytest.raises(InplaceAliasError) as info:
        capture(_ViewWrite().eval(), (torch.randn(2, 3, 4, 4),), method="fx")
    message = str(info.value)
    assert "in-place op 'add_' (node add_, at " in message and "test_functionalize_inplace.py" in message
    assert "y[:, 0].add_(1.0)" in message
    assert "reads 'conv' after the write" in message and "capture='auto' or capture='export'" in message


@pytest.mark.parametrize("method", ("auto", "export"))
def test_a_write_through_a_view_is_functionalized_by_the_export_capture(method: str) -> None:
    torch.manual_seed(0)
    model = _ViewWrite().eval()
    x = torch.randn(2, 3, 4, 4)
    gm = capture(model, (x,), method=method)
    assert gm.meta["coreai_opt"]["capture"] == "export"
    assert [n for n in gm.graph.nodes if inplace_write(gm, n) is not None] == []
    with torch.no_grad():
        for batch in (x, torch.randn(5, 3, 4, 4)):
            assert torch.equal(gm(batch), model(batch.clone()))


class _IaddAlias(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x * 2.0
        z = y
        y += 1.0                      # eager: z sees it too
        return z * 10.0


def test_iadd_through_a_second_name_is_seen_by_that_name() -> None:
    x = torch.randn(3)
    gm = capture(_IaddAlias(), (x,), method="fx")
    assert torch.equal(gm(x), _IaddAlias()(x))  # plain FX tracing records y = y + 1 and returns 20 * x here
    assert torch.equal(gm(x), x * 20.0 + 10.0)


def test_an_in_place_op_without_an_out_of_place_form_is_refused_naming_it() -> None:
    class Noise(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = x * 1.0
            y.uniform_()
            return y

    with pytest.raises(CaptureError, match=r"in-place op 'uniform_' \(node uniform_\) has no out-of-place form.*"
                                           r"y\.uniform_\(\).*leaf_modules"):
        capture(Noise(), (torch.randn(2, 2),), method="fx")


def test_integers_updated_with_plus_equals_keep_python_semantics() -> None:
    class Sizes(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            n = x.size(0)
            m = n
            n += 1                    # ints are immutable: m keeps the old value
            return x.reshape(m, -1) * n

    x = torch.randn(3, 4)
    gm = capture(Sizes(), (x,), method="fx")
    assert torch.equal(gm(x), Sizes()(x))


def test_the_tracer_records_plus_equals_as_operator_iadd() -> None:
    gm = capture(_IaddAlias(), (torch.randn(3),), method="fx")
    plain = fx.symbolic_trace(_IaddAlias())
    assert not torch.equal(plain(torch.ones(3)), _IaddAlias()(torch.ones(3)))  # why the tracer records it
    assert "iadd" not in gm.code and "add" in gm.code
