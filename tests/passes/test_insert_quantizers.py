from collections import Counter

import pytest
import torch
from torch import fx, nn

from coreai_opt.config import QuantizerConfig
from coreai_opt.graph.node_meta import Role, get_meta
from coreai_opt.graph.op_kinds import OpKind
from coreai_opt.passes.insert_quantizers import insert_quantizers
from coreai_opt.quantization.spec import BiasFakeQuantize, FakeQuantize, PerChannel, QuantizationSpec
from tests.passes.pipeline import annotated, inserted
from tests.zoo import ZOO, build

W8A8 = QuantizerConfig.presets.w8a8


def _quantizer_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if get_meta(n).quantizer is not None]


@pytest.mark.parametrize("name", list(ZOO))
def test_insert_quantizers_one_quantizer_per_tensor_without_duplicate_buffers(name):
    model, example, _ = build(name)
    gm = inserted(model, example[0], W8A8())
    nodes = _quantizer_nodes(gm)
    # never two quantizers stacked on one tensor, and every tensor is quantized at most once
    assert not any(get_meta(n.args[0]).quantizer is not None for n in nodes)
    assert len({n.args[0] for n in nodes}) == len(nodes)
    modules = [m for m in gm.modules() if isinstance(m, FakeQuantize)]
    assert len({id(m) for m in modules}) == len({str(n.target) for n in nodes if get_meta(n).quantizer.role
                                                  is not Role.BIAS})
    pointers = [m.calculator.scale.data_ptr() for m in modules]
    assert len(set(pointers)) == len(pointers)


class _TwoConsumers(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        y = self.a(x)
        return self.b(y) + self.c(y)


def test_insert_quantizers_tensor_consumed_twice_is_observed_once():
    gm = inserted(_TwoConsumers().eval(), torch.randn(2, 4), W8A8())
    a_out = next(n for n in gm.graph.nodes if get_meta(n).module_name == "a" and n.op == "call_function")
    users = list(a_out.users)
    assert len(users) == 1 and get_meta(users[0]).quantizer.serves == "a.output"
    consumers = {get_meta(u).module_name for u in users[0].users if u.op == "call_function"}
    assert consumers == {"b", "c"}
    counts = Counter(get_meta(n).quantizer.role.value for n in _quantizer_nodes(gm))
    assert counts == {"activation": 5, "weight": 3, "bias": 3}  # x, a, b, c, add outputs


def test_insert_quantizers_cat_inputs_keep_their_producers_quantizers_and_the_output_gets_its_own():
    model, example, _ = build("conv_transpose_decoder")
    gm = inserted(model, example[0], W8A8())
    cat = next(n for n in gm.graph.nodes if n.target is torch.cat)
    inputs = [get_meta(a).quantizer for a in cat.args[0]]
    assert [q.serves for q in inputs] == ["relu.output", "enc1.1.output"]  # each branch's own quantizer
    (user,) = cat.users
    output = get_meta(user).quantizer
    assert output.serves.endswith(".output") and str(user.target) not in {str(a.target) for a in cat.args[0]}


def test_insert_quantizers_bias_reads_the_input_and_weight_quantizers_it_derives_from():
    torch.manual_seed(0)
    gm = inserted(_TwoConsumers().eval(), torch.randn(2, 4), W8A8())
    for fq in (m for m in gm.modules() if isinstance(m, FakeQuantize)):
        fq.enable_fake_quant(True)
        fq.enable_observer(True)
    gm(torch.randn(16, 4))
    bias_node = next(n for n in _quantizer_nodes(gm) if get_meta(n).quantizer.role is Role.BIAS)
    bq = gm.get_submodule(str(bias_node.target))
    assert isinstance(bq, BiasFakeQuantize)
    bias, in_node, w_node = bias_node.args
    # the graph passes the two quantizer modules (get_attr), not their calculators' buffers
    assert (in_node.op, in_node.target, w_node.op, w_node.target) == ("get_attr", "x_input_fq", "get_attr",
                                                                      "a_weight_fq")
    s = gm.get_submodule("x_input_fq").get_qparams().scale * gm.get_submodule("a_weight_fq").get_qparams().scale
    b = gm.get_submodule("a").bias
    expected = torch.round(b / s) * s
    assert torch.equal(bq(b, gm.get_submodule("x_input_fq"), gm.get_submodule("a_weight_fq")), expected)
    # a new input scale (a QAT step) is read at the next call: s_b = s_in · s_w is never stale
    before = s.clone()
    gm(torch.randn(16, 4) * 3)
    s = gm.get_submodule("x_input_fq").get_qparams().scale * gm.get_submodule("a_weight_fq").get_qparams().scale
    assert not torch.equal(s, before)
    assert torch.equal(bq(b, gm.get_submodule("x_input_fq"), gm.get_submodule("a_weight_fq")), torch.round(b / s) * s)


def test_insert_quantizers_is_a_no_op_for_a_float_config():
    gm = annotated(_TwoConsumers().eval(), torch.randn(2, 4), QuantizerConfig())
    before = gm.code
    assert insert_quantizers(gm).changes == 0
    assert gm.code == before


def test_insert_quantizers_requires_classified_graph():
    with pytest.raises(ValueError, match="run classify_ops and annotate first"):
        insert_quantizers(fx.symbolic_trace(nn.Linear(2, 2)))


def test_insert_quantizers_rejects_activation_axis_beyond_rank_naming_the_node():
    cfg = QuantizerConfig(activation=QuantizationSpec(dtype="uint8", qscheme="asymmetric",
                                                      granularity=PerChannel(axis=4)))
    with pytest.raises(ValueError, match=r"quantizer for a.output \(%linear : .*per-channel axis=4 is out of range "
                                         r"for a tensor of rank 2"):
        inserted(_TwoConsumers().eval(), torch.randn(2, 4), cfg)


def _is_quantizer(node) -> bool:
    """A quantizer call, also read through an identity (an eval dropout: the export emits no op for it)."""
    while isinstance(node, fx.Node) and get_meta(node).kind is OpKind.DROPOUT:
        node = node.args[0]
    return isinstance(node, fx.Node) and get_meta(node).quantizer is not None


@pytest.mark.parametrize("name", list(ZOO))
def test_insert_quantizers_wraps_every_conv_linear_matmul_add_in_dq_op_q(name):
    """The onnxruntime fusion rule: DQ on every input and weight, Q on the output (after a fused relu).

    A linear whose readers are all float writes float (QGemm / MatMulIntegerToFloat, graph.unread_outputs): no Q.
    """
    model, example, _ = build(name)
    gm = inserted(model, example[0], W8A8())
    checked = 0
    for node in gm.graph.nodes:
        kind = get_meta(node).kind
        if kind not in (OpKind.CONV, OpKind.CONV_TRANSPOSE, OpKind.LINEAR, OpKind.MATMUL, OpKind.ADD):
            continue
        operands = [a for a in node.args[:2] if isinstance(a, fx.Node)]
        assert operands and all(_is_quantizer(a) for a in operands), node.format_node()
        checked += 1
        users = list(node.users)
        if len(users) == 1 and get_meta(users[0]).kind in (OpKind.RELU, OpKind.RELU6, OpKind.HARDTANH):
            users = list(users[0].users)
        if kind is OpKind.LINEAR and not any(_is_quantizer(u) for u in users):
            # a float-writing linear: only float ops read it, none of them through a quantizer of its own
            assert all(get_meta(u).annotation is None or all(a is not node for a, _ in get_meta(u).annotation.inputs)
                       for u in users), node.format_node()
            continue
        assert len(users) == 1 and _is_quantizer(users[0]), node.format_node()
    print(f"{name}: {checked} conv/linear/matmul/add ops wrapped in DQ -> op -> Q")
    assert checked > 0
