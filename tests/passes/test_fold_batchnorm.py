import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from coreai_opt.graph.node_meta import get_meta
from coreai_opt.graph.op_kinds import OpKind
from coreai_opt.passes.capture import capture
from coreai_opt.passes.classify_ops import classify_ops
from coreai_opt.passes.fold_batchnorm import fold_batchnorm
from coreai_opt.passes.functionalize_weights import functionalize_weights
from tests.zoo import randomize_batchnorm


class _ConvBN(nn.Module):
    def __init__(self, transpose: bool = False, bias: bool = True, groups: int = 1) -> None:
        super().__init__()
        conv = nn.ConvTranspose2d if transpose else nn.Conv2d
        self.conv = conv(4, 6, 3, padding=1, bias=bias, groups=groups)
        self.bn = nn.BatchNorm2d(6)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


class _FunctionalBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(4, 6, 3)
        self.bn = nn.BatchNorm2d(6)

    def forward(self, x):
        bn = self.bn
        return F.batch_norm(self.conv(x), bn.running_mean, bn.running_var, bn.weight, bn.bias, False, 0.1, bn.eps)


def _graph(model: nn.Module, x: torch.Tensor, how: str) -> fx.GraphModule:
    if how == "decomposed":  # aten._native_batch_norm_legit_no_training + aten.convolution
        exported = torch.export.export(model, (x,)).run_decompositions().module()
        gm = fx.GraphModule(exported, exported.graph)
    else:
        gm = capture(model, (x,), method=how)
    gm = classify_ops(gm).graph_module
    return functionalize_weights(gm).graph_module


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max().detach() / b.abs().max().detach())


@pytest.mark.parametrize("how", ["fx", "export", "decomposed"])
@pytest.mark.parametrize(("transpose", "bias", "groups"), [(False, True, 1), (False, False, 2), (True, True, 1),
                                                            (True, False, 2)])
def test_fold_batchnorm_matches_eager_within_1e5(how, transpose, bias, groups):
    torch.manual_seed(0)
    model = randomize_batchnorm(_ConvBN(transpose, bias, groups)).eval()
    x = torch.randn(2, 4, 8, 8)
    gm = _graph(model, x, how)
    result = fold_batchnorm(gm)
    assert result.changes == 1
    kinds = [get_meta(n).kind for n in gm.graph.nodes]
    assert OpKind.BATCH_NORM not in kinds
    assert not any("running_mean" in str(n.target) for n in gm.graph.nodes)
    err = _rel_err(gm(x), model(x))
    print(f"fold {how} transpose={transpose} bias={bias} groups={groups}: max rel err {err:.2e}")
    assert err < 1e-5


def test_fold_batchnorm_handles_functional_batch_norm_in_user_code():
    torch.manual_seed(0)
    model = randomize_batchnorm(_FunctionalBN()).eval()
    x = torch.randn(2, 4, 8, 8)
    gm = _graph(model, x, "fx")
    assert fold_batchnorm(gm).changes == 1
    assert _rel_err(gm(x), model(x)) < 1e-5


class _SharedConvOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 1)
        self.bn = nn.BatchNorm2d(4)

    def forward(self, x):
        y = self.conv(x)
        return self.bn(y) + y


def test_fold_batchnorm_keeps_conv_when_output_has_two_users():
    model, x = _SharedConvOutput().eval(), torch.randn(2, 3, 4, 4)
    gm = _graph(model, x, "fx")
    before = gm.code
    assert fold_batchnorm(gm).changes == 0
    assert gm.code == before
    bn = next(n for n in gm.graph.nodes if get_meta(n).kind is OpKind.BATCH_NORM)
    assert get_meta(bn).float_reason == "batch norm 'bn' not folded: conv 'conv2d' output has 2 users"
    assert torch.equal(gm(x), model(x))


def test_fold_batchnorm_is_a_no_op_without_batch_norm():
    gm = _graph(nn.Sequential(nn.Conv2d(3, 3, 1), nn.ReLU()), torch.randn(1, 3, 4, 4), "fx")
    before = gm.code
    assert fold_batchnorm(gm).changes == 0
    assert gm.code == before


def test_fold_batchnorm_requires_classified_graph():
    gm = fx.symbolic_trace(nn.Sequential(nn.Conv2d(3, 3, 1), nn.BatchNorm2d(3)))
    with pytest.raises(ValueError, match="run classify_ops first"):
        fold_batchnorm(gm)


def test_fold_batchnorm_adds_the_bias_argument_an_exported_bias_free_conv_left_out():
    # torch.export writes a bias-free conv with default stride/padding as aten.conv2d.default(x, w): no bias slot.
    torch.manual_seed(0)
    model = randomize_batchnorm(nn.Sequential(nn.Conv2d(3, 8, 3, bias=False), nn.BatchNorm2d(8))).eval()
    x = torch.randn(2, 3, 8, 8)
    gm = _graph(model, x, "export")
    conv = next(n for n in gm.graph.nodes if get_meta(n).kind is OpKind.CONV)
    assert len(conv.args) == 2 and not conv.kwargs
    assert fold_batchnorm(gm).changes == 1
    assert conv.args[2].op == "get_attr"
    assert _rel_err(gm(x), model(x)) < 1e-5


class _BatchNormAct2d(nn.BatchNorm2d):
    """timm's BatchNormAct2d: a rank assert on the input, a functional batch norm, then the activation."""

    def __init__(self, channels: int) -> None:
        super().__init__(channels)
        self.act = nn.ReLU()

    def forward(self, x):
        torch._assert(x.ndim == 4, f"expected 4D input (got {x.ndim}D input)")
        x = F.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False, 0.0, self.eps)
        return self.act(x)


class _ConvBNAct(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn = _BatchNormAct2d(8)
        self.head = nn.Conv2d(8, 4, 1)

    def forward(self, x):
        y = self.bn(self.conv(x))
        return self.head(y.reshape(y.shape[0], y.shape[1], y.shape[2], -1))  # more shape readers, after the BN


@pytest.mark.parametrize("how", ["fx", "export"])
def test_fold_batchnorm_ignores_users_that_only_read_the_conv_output_shape(how):
    torch.manual_seed(0)
    model = randomize_batchnorm(_ConvBNAct()).eval()
    x = torch.randn(2, 3, 8, 8)
    gm = _graph(model, x, how)
    conv = next(n for n in gm.graph.nodes if get_meta(n).kind is OpKind.CONV)
    if how == "fx":  # the assert (and its message) read conv.ndim: two more users of the conv output
        assert sorted(str(u.target) for u in conv.users if u.target is getattr) == ["<built-in function getattr>"] * 2
    assert fold_batchnorm(gm).changes == 1
    assert OpKind.BATCH_NORM not in [get_meta(n).kind for n in gm.graph.nodes]
    err = _rel_err(gm(x), model(x))
    print(f"BatchNormAct2d fold ({how}): max rel err {err:.2e}")
    assert err < 1e-5
    assert gm(torch.randn(5, 3, 8, 8)).shape == (5, 4, 8, 8)  # the shape readers still follow the batch
