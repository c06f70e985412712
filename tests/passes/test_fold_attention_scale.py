import math

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from coreai_opt.graph.node_meta import get_meta
from coreai_opt.graph.op_kinds import OpKind
from coreai_opt.passes.capture import capture
from coreai_opt.passes.classify_ops import classify_ops
from coreai_opt.passes.fold_attention_scale import fold_attention_scale
from coreai_opt.passes.fold_batchnorm import fold_batchnorm
from coreai_opt.passes.functionalize_weights import functionalize_weights
from coreai_opt.reference_models import transformer_encoder

METHODS = ["fx", "export"]


def _graph(model: nn.Module, x: torch.Tensor, method: str) -> fx.GraphModule:
    gm = classify_ops(capture(model, (x,), method=method)).graph_module
    return fold_batchnorm(functionalize_weights(gm).graph_module).graph_module


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


def _assert_state_unchanged(model: nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = model.state_dict()
    assert after.keys() == before.keys()
    for name, tensor in before.items():
        assert torch.equal(after[name], tensor), name


def _scale_nodes_on_scores(gm: fx.GraphModule) -> list[fx.Node]:
    """DIV / MUL nodes that read a matmul output."""
    return [u for n in gm.graph.nodes if get_meta(n).kind is OpKind.MATMUL for u in n.users
            if get_meta(u).kind in (OpKind.DIV, OpKind.MUL)]


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max().detach())


def _heads(y: torch.Tensor, heads: int) -> torch.Tensor:
    return y.view(y.shape[0], -1, heads, y.shape[-1] // heads).transpose(1, 2)


class _HFStyleAttention(nn.Module):
    """Attention in the form of HF ``eager_attention_forward``: ``matmul(q, kᵀ) * scaling``."""

    def __init__(self, dim: int = 24, heads: int = 3, depth: int = 2, form: str = "mul") -> None:
        super().__init__()
        self.heads, self.form = heads, form
        self.head_dim = dim // heads
        self.scaling = self.head_dim**-0.5  # 8 ** -0.5 is not a power of two
        self.register_buffer("scale0d", torch.tensor(self.scaling))
        self.register_buffer("divisor1", torch.full((1,), math.sqrt(self.head_dim)))
        self.qs = nn.ModuleList(nn.Linear(dim, dim) for _ in range(depth))
        self.ks = nn.ModuleList(nn.Linear(dim, dim) for _ in range(depth))
        self.vs = nn.ModuleList(nn.Linear(dim, dim) for _ in range(depth))
        self.os = nn.ModuleList(nn.Linear(dim, dim) for _ in range(depth))

    def _scores(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        if self.form == "mul":
            return torch.matmul(q, k.transpose(2, 3)) * self.scaling
        if self.form == "rmul":
            return self.scaling * (q @ k.transpose(-1, -2))
        if self.form == "buffer0d":
            return self.scale0d * torch.matmul(q, k.transpose(2, 3))
        if self.form == "div_buffer":
            return torch.matmul(q, k.transpose(2, 3)) / self.divisor1
        raise ValueError(self.form)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for q_proj, k_proj, v_proj, o_proj in zip(self.qs, self.ks, self.vs, self.os, strict=True):
            q = _heads(q_proj(x), self.heads).contiguous()
            k, v = _heads(k_proj(x), self.heads), _heads(v_proj(x), self.heads)
            attn = F.softmax(self._scores(q, k), dim=-1)
            out = torch.matmul(attn, v).transpose(1, 2).reshape(x.shape)
            x = x + o_proj(out)
        return x


@pytest.mark.parametrize("method", METHODS)
def test_transformer_encoder_folds_one_scale_per_block(method):
    torch.manual_seed(0)
    model = transformer_encoder(dim=64, depth=2, heads=4).eval()
    tokens = torch.randint(0, 1000, (2, 16))
    before = _snapshot(model)
    expected = model(tokens)
    gm = _graph(model, tokens, method)
    assert len(_scale_nodes_on_scores(gm)) == 2
    result = fold_attention_scale(gm)
    assert result.changes == 2 and result.graph_module is gm
    assert _scale_nodes_on_scores(gm) == []
    assert not any(get_meta(n).kind in (OpKind.DIV, OpKind.MUL) for n in gm.graph.nodes)
    err = _max_abs(gm(tokens), expected)
    print(f"transformer_encoder {method}: max abs diff {err:.3e}")
    assert err <= 1e-5
    _assert_state_unchanged(model, before)
    for i, block in enumerate(model.blocks):  # folded into q (operand 0), k untouched, new Parameter objects
        folded = gm.get_parameter(f"blocks.{i}.attn.q.weight")
        assert folded is not block.attn.q.weight
        assert torch.allclose(folded, block.attn.q.weight / 4.0)
        assert torch.allclose(gm.get_parameter(f"blocks.{i}.attn.q.bias"), block.attn.q.bias / 4.0)
        assert torch.equal(gm.get_parameter(f"blocks.{i}.attn.k.weight"), block.attn.k.weight)
    assert fold_attention_scale(gm).changes == 0  # idempotent


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("form", ["mul", "rmul", "buffer0d", "div_buffer"])
def test_hf_style_scaling_is_folded(method, form):
    torch.manual_seed(0)
    model = _HFStyleAttention(form=form).eval()
    x = torch.randn(2, 5, 24)
    before = _snapshot(model)
    expected = model(x)
    gm = _graph(model, x, method)
    assert fold_attention_scale(gm).changes == 2
    assert _scale_nodes_on_scores(gm) == []
    err = _max_abs(gm(x), expected)
    print(f"hf-style {form} {method}: max abs diff {err:.3e}")
    assert err <= 1e-5
    _assert_state_unchanged(model, before)
    assert torch.allclose(gm.get_parameter("qs.0.weight"), model.qs[0].weight * model.scaling)


class _Probe(nn.Module):
    """q/k attention scores with knobs that break one rule at a time."""

    def __init__(self, q_reused: bool = False, k_linear: bool = True, shared_weight: bool = False,
                 scale: object = 2.0, learnable_scale: bool = False) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)
        self.k = nn.Linear(8, 8)
        self.q_reused, self.k_linear, self.shared_weight = q_reused, k_linear, shared_weight
        self.scale = scale
        if learnable_scale:
            self.logit_scale = nn.Parameter(torch.tensor(0.5))

    def _c(self, x: torch.Tensor) -> object:
        if self.scale == "runtime":
            return x.abs().mean() + 1.0  # computed from the input
        if self.scale == "learnable":
            return self.logit_scale
        return self.scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q_lin = self.q(x)
        q = _heads(q_lin, 2)
        k = _heads(self.k(x) if self.k_linear else x, 2)
        scores = torch.matmul(q, k.transpose(-2, -1)) * self._c(x)
        out = scores.softmax(-1).sum()
        if self.q_reused:
            out = out + q_lin.sum()
        if self.shared_weight:
            out = out + F.linear(x, self.q.weight).sum()
        return out


def _assert_not_folded(model: nn.Module, method: str) -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 4, 8)
    before = _snapshot(model)
    gm = _graph(model, x, method)
    code = gm.code
    assert fold_attention_scale(gm).changes == 0
    assert gm.code == code
    assert len(_scale_nodes_on_scores(gm)) == 1
    torch.testing.assert_close(gm(x), model(x), rtol=0, atol=0, equal_nan=True)  # bit-identical (NaN for nan)
    _assert_state_unchanged(model, before)


@pytest.mark.parametrize("method", METHODS)
def test_q_projection_with_second_user_is_not_folded(method):
    _assert_not_folded(_Probe(q_reused=True, k_linear=False).eval(), method)


@pytest.mark.parametrize("method", METHODS)
def test_q_projection_with_second_user_falls_back_to_k(method):
    torch.manual_seed(0)
    model, x = _Probe(q_reused=True).eval(), torch.randn(2, 4, 8)
    gm = _graph(model, x, method)
    assert fold_attention_scale(gm).changes == 1
    assert torch.equal(gm.get_parameter("q.weight"), model.q.weight)
    assert torch.allclose(gm.get_parameter("k.weight"), model.k.weight * 2.0)
    err = _max_abs(gm(x), model(x))
    print(f"fallback to k {method}: max abs diff {err:.3e}")
    assert err <= 1e-5


@pytest.mark.parametrize("method", METHODS)
def test_weight_shared_with_another_op_is_not_folded(method):
    _assert_not_folded(_Probe(shared_weight=True, k_linear=False).eval(), method)


@pytest.mark.parametrize("method", METHODS)
def test_tied_weight_is_not_folded(method):
    model = _Probe().eval()
    model.k.weight = model.q.weight  # one Parameter under two names: q and k projections
    _assert_not_folded(model, method)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("scale", ["runtime", 0.0, 0, float("inf"), float("nan")])
def test_non_constant_zero_or_non_finite_scale_is_not_folded(method, scale):
    _assert_not_folded(_Probe(scale=scale).eval(), method)


@pytest.mark.parametrize("method", METHODS)
def test_trainable_scale_parameter_is_not_folded(method):
    _assert_not_folded(_Probe(scale="learnable", learnable_scale=True).eval(), method)


class _ScaleInNumerator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.q = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return 4.0 / torch.matmul(self.q(x), x.transpose(-2, -1))


@pytest.mark.parametrize("method", METHODS)
def test_constant_divided_by_scores_is_not_folded(method):
    model, x = _ScaleInNumerator().eval(), torch.randn(2, 4, 8)
    gm = _graph(model, x, method)
    assert fold_attention_scale(gm).changes == 0
    assert torch.equal(gm(x), model(x))


def test_zero_scale_buffer_is_not_folded():
    model = _HFStyleAttention(form="buffer0d", depth=1).eval()
    model.scale0d.zero_()
    x = torch.randn(2, 5, 24)
    gm = _graph(model, x, "fx")
    assert fold_attention_scale(gm).changes == 0
    assert torch.equal(gm(x), model(x))


def test_requires_classified_graph():
    gm = fx.symbolic_trace(_Probe())
    with pytest.raises(ValueError, match="run classify_ops first"):
        fold_attention_scale(gm)
