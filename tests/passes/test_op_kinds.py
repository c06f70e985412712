import operator

import pytest
import torch
import torch.nn.functional as F
from torch import fx, nn

from coreai_opt.graph.node_meta import get_meta
from coreai_opt.graph.op_kinds import OpKind, lookup_op
from coreai_opt.passes.capture import capture
from coreai_opt.passes.classify_ops import classify_ops


class _ThreeConvs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.w = nn.Parameter(torch.randn(4, 4, 1, 1))

    def forward(self, x):
        y = self.conv(x)
        y = F.conv2d(y, self.w)
        return y.reshape(y.shape[0], -1).softmax(-1) + operator.mul(y.flatten(1), 2)


def _kinds(gm: fx.GraphModule) -> list[str]:
    return [lookup_op(n, gm).kind.value for n in gm.graph.nodes]


def test_op_kinds_module_function_and_aten_conv_map_to_one_kind():
    model, x = _ThreeConvs().eval(), torch.randn(2, 3, 8, 8)
    fx_kinds = _kinds(fx.symbolic_trace(model))
    export_kinds = _kinds(torch.export.export(model, (x,)).module())
    assert fx_kinds.count("conv") == 2  # call_module(nn.Conv2d) and F.conv2d
    assert export_kinds.count("conv") == 2  # aten.conv2d.default twice
    for kinds in (fx_kinds, export_kinds):
        assert "softmax" in kinds and "add" in kinds and "mul" in kinds and "move" in kinds


@pytest.mark.parametrize(
    ("module", "kind"),
    [
        (nn.ConvTranspose2d(2, 2, 2), OpKind.CONV_TRANSPOSE),
        (nn.Conv1d(2, 2, 1), OpKind.CONV),
        (nn.Linear(2, 2), OpKind.LINEAR),
        (nn.LayerNorm(2), OpKind.LAYER_NORM),
        (nn.ReLU6(), OpKind.RELU6),
        (nn.Hardtanh(), OpKind.HARDTANH),
        (nn.MaxPool2d(1), OpKind.MAX_POOL),
        (nn.AdaptiveAvgPool2d(1), OpKind.AVG_POOL),
        (nn.Dropout(), OpKind.DROPOUT),
        (nn.Identity(), OpKind.DROPOUT),
        (nn.PReLU(), OpKind.OTHER),
    ],
)
def test_op_kinds_call_module_types(module, kind):
    graph = fx.Graph()
    graph.output(graph.call_module("m", (graph.placeholder("x"),)))
    gm = fx.GraphModule(nn.ModuleDict({"m": module}), graph)
    node = next(n for n in gm.graph.nodes if n.op == "call_module")
    assert lookup_op(node, gm).kind is kind


def test_op_kinds_embedding_layouts_differ_between_functional_and_aten():
    graph = fx.Graph()
    idx, w = graph.placeholder("idx"), graph.placeholder("w")
    functional = graph.call_function(F.embedding, (idx, w))
    aten = graph.call_function(torch.ops.aten.embedding.default, (w, idx))
    gm = fx.GraphModule(nn.Module(), graph)
    for node in (functional, aten):
        entry = lookup_op(node, gm)
        assert entry.kind is OpKind.EMBEDDING
        assert entry.layout.get(node, entry.layout.weight) is w


def test_classify_ops_counts_changes_and_is_idempotent():
    gm = capture(nn.Sequential(nn.Linear(2, 2), nn.GELU()), (torch.randn(1, 2),))
    assert classify_ops(gm).changes == 4
    before = gm.code
    assert classify_ops(gm).changes == 0
    assert gm.code == before
    assert [get_meta(n).kind for n in gm.graph.nodes] == [OpKind.INPUT, OpKind.LINEAR, OpKind.GELU, OpKind.OUTPUT]
