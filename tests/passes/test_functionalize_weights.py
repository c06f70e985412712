import torch
import torch.nn.functional as F
from torch import nn

from coreai_opt.graph.node_meta import get_meta
from coreai_opt.graph.op_kinds import OpKind
from coreai_opt.passes.capture import capture
from coreai_opt.passes.classify_ops import classify_ops
from coreai_opt.passes.functionalize_weights import functionalize_weights


class _Mixed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(10, 8)
        self.conv = nn.Conv1d(8, 8, 3, padding=1, bias=False)
        self.up = nn.ConvTranspose1d(8, 4, 2, stride=2)
        self.fc = nn.Linear(4, 3)
        self.circ = nn.Conv1d(8, 8, 3, padding=1, padding_mode="circular")

    def forward(self, tokens):
        x = self.emb(tokens).transpose(1, 2)
        x = self.up(self.conv(self.circ(x)))
        return self.fc(x.transpose(1, 2))


def _prepared(model, x):
    return classify_ops(capture(model, (x,), method="fx")).graph_module


def test_functionalize_weights_rewrites_modules_to_functions_with_same_output():
    torch.manual_seed(0)
    model, x = _Mixed().eval(), torch.randint(0, 10, (2, 5))
    gm = _prepared(model, x)
    result = functionalize_weights(gm)
    assert result.changes == 4  # emb, conv, up, fc; circular padding stays a module call
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function" and get_meta(n).kind in
               (OpKind.EMBEDDING, OpKind.CONV, OpKind.CONV_TRANSPOSE, OpKind.LINEAR)]
    assert targets == [F.embedding, F.conv1d, F.conv_transpose1d, F.linear]
    assert [n.target for n in gm.graph.nodes if n.op == "call_module"] == ["circ"]
    assert "padding_mode='circular'" in get_meta(next(n for n in gm.graph.nodes if n.target == "circ")).float_reason
    assert [n.target for n in gm.graph.nodes if n.op == "get_attr"] == [
        "emb.weight", "conv.weight", "up.weight", "up.bias", "fc.weight", "fc.bias"]
    conv = next(n for n in gm.graph.nodes if n.target is F.conv1d)
    assert conv.args[2] is None and get_meta(conv).module_name == "conv"
    assert torch.equal(gm(x), model(x))
    assert set(gm.state_dict()) == set(model.state_dict())


def test_functionalize_weights_is_a_no_op_without_weighted_modules():
    gm = _prepared(nn.Sequential(nn.ReLU(), nn.Flatten()), torch.randn(2, 3))
    before = gm.code
    assert functionalize_weights(gm).changes == 0
    assert gm.code == before
