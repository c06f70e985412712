import pytest
import torch
from torch import nn

from coreai_opt.config import QuantizerConfig
from coreai_opt.config.quantizer_config import OpConfig
from coreai_opt.graph.node_meta import DerivedSpec, QuantSpec, Role, SharedSpec, get_meta
from coreai_opt.graph.op_kinds import OpKind
from coreai_opt.quantization.fake_quantize.dynamic_fake_quantize import dynamic_activation_spec
from coreai_opt.quantization.spec import DynamicFakeQuantize, PerBlock, PerChannel, QuantizationSpec
from tests.passes.pipeline import annotated, inserted
from tests.zoo import build

W8A8 = QuantizerConfig.presets.w8a8


def _by_kind(gm, kind):
    return [n for n in gm.graph.nodes if get_meta(n).kind is kind]


def test_annotate_conv_relu_puts_output_after_relu_and_derives_bias():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.MaxPool2d(2)).eval()
    gm = annotated(model, torch.randn(1, 3, 8, 8), W8A8())
    conv, = _by_kind(gm, OpKind.CONV)
    relu, = _by_kind(gm, OpKind.RELU)
    pool, = _by_kind(gm, OpKind.MAX_POOL)
    ann = get_meta(conv).annotation
    roles = [(arg.name, type(spec).__name__, getattr(spec, "role", None)) for arg, spec in ann.inputs]
    assert roles == [("input_1", "QuantSpec", Role.ACTIVATION), ("_0_weight", "QuantSpec", Role.WEIGHT),
                     ("_0_bias", "DerivedSpec", None)]
    assert ann.output is None and "fused relu" in get_meta(conv).float_reason
    assert isinstance(get_meta(relu).annotation.output, QuantSpec) and get_meta(relu).annotation.inputs == ()
    assert get_meta(pool).annotation.output == SharedSpec(relu)
    derived = ann.inputs[2][1]
    assert isinstance(derived, DerivedSpec) and derived.derived_from == (ann.inputs[0][0], ann.inputs[1][0])


def test_annotate_conv_transpose_weight_axes_are_swapped():
    cfg = W8A8()
    model = nn.Sequential(nn.ConvTranspose2d(4, 6, 2, stride=2)).eval()
    gm = annotated(model, torch.randn(1, 4, 4, 4), cfg)
    conv, = _by_kind(gm, OpKind.CONV_TRANSPOSE)
    weight_spec = dict((a.name, s) for a, s in get_meta(conv).annotation.inputs)["_0_weight"]
    assert weight_spec.spec.granularity == PerChannel(1)
    w4 = QuantizerConfig.presets.w4(block_size=2)
    gm = annotated(model, torch.randn(1, 4, 4, 4), w4)
    conv, = _by_kind(gm, OpKind.CONV_TRANSPOSE)
    weight_spec = dict((a.name, s) for a, s in get_meta(conv).annotation.inputs)["_0_weight"]
    assert weight_spec.spec.granularity == PerBlock(axis=0, block_size=2)  # input channels of [in, out, kh, kw]


def test_annotate_rejects_block_size_not_dividing_naming_every_node_when_fallback_is_error():
    model = nn.Sequential(nn.Conv2d(3, 8, 1), nn.Conv2d(8, 8, 1), nn.Conv2d(8, 4, 1)).eval()
    config = QuantizerConfig.presets.w4()
    config.per_block_fallback = "error"
    with pytest.raises(ValueError, match=r"0 \(conv2d\) weight \(8, 3, 1, 1\).*block_size=32") as info:
        annotated(model, torch.randn(1, 3, 4, 4), config)
    message = str(info.value)
    assert "1 (conv2d_1)" in message and "2 (conv2d_2)" in message and "set_module_name" in message


def test_annotate_falls_back_to_per_channel_for_undividable_blocks_with_a_warning():
    model = nn.Sequential(nn.Conv2d(3, 8, 1), nn.Conv2d(8, 64, 1), nn.Conv2d(64, 4, 1)).eval()
    with pytest.warns(UserWarning, match=r"use per-channel scales instead: 0 \(conv2d\) weight \(8, 3, 1, 1\), "
                                         r"1 \(conv2d_1\) weight \(64, 8, 1, 1\)$"):
        gm = annotated(model, torch.randn(1, 3, 4, 4), QuantizerConfig.presets.w4())
    granularities = [
        s.spec.granularity for conv in _by_kind(gm, OpKind.CONV) for a, s in get_meta(conv).annotation.inputs
        if a.op == "get_attr"
    ]
    assert granularities == [PerChannel(0), PerChannel(0), PerBlock(axis=1, block_size=32)]


def test_annotate_rejects_per_channel_axis_beyond_rank():
    spec = QuantizationSpec(dtype="int8", granularity=PerChannel(axis=3))
    with pytest.raises(ValueError, match=r"fc \(linear\) weight \(2, 4\).*axis=3 is out of range"):
        annotated(_Fc().eval(), torch.randn(1, 4), QuantizerConfig(weight=spec))


class _Fc(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(x)


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Parameter(torch.randn(8, 6))

    def forward(self, x):
        return torch.sigmoid(torch.tanh(torch.softmax(x @ self.table, -1)))


def test_annotate_matmul_constant_operand_is_a_weight_and_fixed_ranges_apply():
    gm = annotated(_Attention().eval(), torch.randn(2, 8), W8A8())
    matmul, = _by_kind(gm, OpKind.MATMUL)
    specs = {a.name: s for a, s in get_meta(matmul).annotation.inputs}
    assert specs["table"].role is Role.WEIGHT and specs["table"].spec.granularity == PerChannel(1)  # [K, N]: N
    assert specs["x"].role is Role.ACTIVATION
    ranges = {k: get_meta(_by_kind(gm, k)[0]).annotation.output.spec.float_range
              for k in (OpKind.SOFTMAX, OpKind.SIGMOID)}
    # softmax (uint8 here): [0, 255/256], a step of exactly 2^-8, which onnxruntime's QLinearSoftmax reproduces;
    # sigmoid / tanh are calibrated (their calibrated range lies inside [0, 1] / [-1, 1])
    assert ranges == {OpKind.SOFTMAX: (0.0, 255 / 256), OpKind.SIGMOID: None}
    # tanh has no onnxruntime integer kernel: no request of its own; its output is quantized by the sigmoid that
    # reads it (QLinearSigmoid), calibrated, and its input by the softmax that writes it
    tanh, = _by_kind(gm, OpKind.TANH)
    sigmoid, = _by_kind(gm, OpKind.SIGMOID)
    assert get_meta(tanh).annotation is None and "tanh has no onnxruntime integer kernel" in get_meta(tanh).float_reason
    (edge, spec), = get_meta(sigmoid).annotation.inputs
    assert edge is tanh and spec.spec.float_range is None
    cfg = W8A8()
    cfg.fixed_range_outputs = False
    gm = annotated(_Attention().eval(), torch.randn(2, 8), cfg)
    assert get_meta(_by_kind(gm, OpKind.SOFTMAX)[0]).annotation.output.spec.float_range is None


def test_annotate_records_reason_when_config_leaves_op_float():
    cfg = W8A8().set_op_kind("softmax", None)
    gm = annotated(_Attention().eval(), torch.randn(2, 8), cfg)
    softmax, = _by_kind(gm, OpKind.SOFTMAX)
    assert get_meta(softmax).annotation is None
    assert get_meta(softmax).float_reason == "softmax output left float: no activation spec (op_kind:softmax)"


def test_annotate_weight_only_config_leaves_bias_and_activations_float():
    gm = annotated(_Fc().eval(), torch.randn(1, 4), QuantizerConfig.presets.w8())
    fc, = _by_kind(gm, OpKind.LINEAR)
    assert [s.role for _, s in get_meta(fc).annotation.inputs] == [Role.WEIGHT]
    assert get_meta(fc).float_reason == ("fc (linear) output left float: no activation spec (global); fc (linear) "
                                         "bias left float: needs both the input and the weight quantized")


def test_annotate_module_name_override_applies_to_one_layer():
    cfg = W8A8().set_module_name(r"stem\.0", OpConfig(weight=None))
    model, example, _ = build("resnet18")
    gm = annotated(model, example[0], cfg)
    stem = next(n for n in _by_kind(gm, OpKind.CONV) if get_meta(n).module_name == "stem.0")
    assert [s.role for _, s in get_meta(stem).annotation.inputs] == [Role.ACTIVATION]
    assert get_meta(stem).float_reason == ("stem.0 (conv2d) weight left float: no weight spec "
                                           "(weight from module_name:'stem\\.0'; activation from global)")


def _dynamic_config() -> QuantizerConfig:
    return QuantizerConfig(weight=QuantizerConfig.presets.w8().weight, activation=dynamic_activation_spec())


def test_annotate_dynamic_spec_is_requested_only_on_linear_input_edges():
    model, example, _ = build("transformer_encoder")
    gm = annotated(model, example[0], _dynamic_config())
    dynamic = [(arg, node, spec) for node in gm.graph.nodes if get_meta(node).annotation is not None
               for arg, spec in get_meta(node).annotation.inputs
               if isinstance(spec, QuantSpec) and spec.spec == dynamic_activation_spec()]
    assert len(dynamic) == 13  # q, k, v, out_proj, fc1, fc2 per block and the head
    assert all(get_meta(node).kind is OpKind.LINEAR and spec.edge_only for _, node, spec in dynamic)
    outputs = [get_meta(n).annotation.output for n in gm.graph.nodes if get_meta(n).annotation is not None]
    assert not any(isinstance(o, QuantSpec) for o in outputs)  # only value-moving ops' SharedSpec remain
    softmax = next(n for n in gm.graph.nodes if get_meta(n).kind is OpKind.SOFTMAX)
    assert get_meta(softmax).float_reason.endswith("output left float: dynamic activation quantization applies to "
                                                   "linear-layer inputs only")
    linear = next(n for _, n, _ in dynamic)
    assert "bias left float: a dynamic (stateless) quantizer has no scale buffer" in get_meta(linear).float_reason


def test_inserted_dynamic_quantizers_feed_linear_layers_only():
    model, example, _ = build("transformer_encoder")
    gm = inserted(model, example[0], _dynamic_config())
    dynamic = [n for n in gm.graph.nodes
               if n.op == "call_module" and isinstance(gm.get_submodule(str(n.target)), DynamicFakeQuantize)]
    assert len(dynamic) == 9  # per block: ln1 (shared by q/k/v), attention output, ln2, gelu; plus the head input
    assert all(get_meta(u).kind is OpKind.LINEAR for n in dynamic for u in n.users)
    # the attention output reaches out_proj through transpose -> reshape: quantized right before it, on the
    # reshape output (exact: per-tensor dynamic quantization commutes with moving values)
    out_proj = next(n for n in gm.graph.nodes if get_meta(n).module_name == "blocks.0.attn.o"
                    and get_meta(n).kind is OpKind.LINEAR)
    call = out_proj.args[0]
    assert call in dynamic and get_meta(call.args[0]).kind is OpKind.MOVE
    assert get_meta(call.args[0].args[0]).kind is OpKind.MOVE  # transpose, read as float


def test_tensors_computed_from_integer_positions_stay_float_so_longer_inputs_are_not_clipped():
    """A Llama decoder's rotary angles (``position_ids · inv_freq``) and their cos / sin get no quantizer: a range
    calibrated on prompts of length T would clamp every later position to T (benchmarks/llm_quality: w8a8 held-out
    perplexity +16.7 % of fp32 with those quantizers, +0.03 % without)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import coreai_opt as co
    from coreai_opt.graph.integer_inputs import integer_input_derived
    from coreai_opt.graph.kv_cache_decoder import DecoderWithCache

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    decoder = DecoderWithCache(LlamaForCausalLM(config).eval()).eval()
    prepared = co.prepare(decoder, W8A8(), decoder.example_inputs(), capture="export",
                          dynamic_shapes=decoder.capture_dynamic_shapes())
    derived = integer_input_derived(prepared)
    float_ops = {n.target for n in derived if n.op == "call_function"}
    assert {torch.ops.aten.cos.default, torch.ops.aten.sin.default, torch.ops.aten.cat.default} <= float_ops
    reasons = [get_meta(n).float_reason for n in derived if get_meta(n).float_reason]
    assert len(reasons) >= 3 and all("computed from integer inputs (positions, masks)" in r for r in reasons)
    assert [n.args[0].name for n in prepared.graph.nodes if n.op == "call_module" and n.args[0] in derived] == []
    embedding_quantizers = [n for n in prepared.graph.nodes if n.op == "call_module" and "embed_tokens" in n.target]
    assert embedding_quantizers  # the token embedding (a lookup by integer ids) is data, still quantized


class _FusedQkvAttention(nn.Module):
    """GPT-2's layout: one linear makes q, k and v (``split``), the scores are masked by ``attention_mask``."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).split(x.shape[-1], dim=-1)
        scores = q @ k.transpose(-1, -2)
        scores = torch.where(attention_mask[:, None, :].bool(), scores, torch.finfo(scores.dtype).min)
        return self.out(scores.softmax(-1) @ v)


def test_outputs_of_a_split_linear_are_data_so_masked_attention_and_its_output_linear_stay_quantized():
    """The getitems of ``split`` inherit the linear's data: before, they were neutral, the masked scores counted
    as derived from the mask alone and GPT-2's ``c_proj`` ran weight-only (11 integer kernels against
    quantize_static's 13)."""
    import coreai_opt as co
    from coreai_opt.graph.integer_inputs import integer_input_derived

    torch.manual_seed(0)
    x, mask = torch.randn(2, 5, 16), torch.ones(2, 5, dtype=torch.int64)
    prepared = co.prepare(_FusedQkvAttention().eval(), W8A8(), (x, mask), capture="export")
    derived = integer_input_derived(prepared)
    assert {n.target for n in derived if n.op == "call_function"} <= {
        torch.ops.aten.slice.Tensor, torch.ops.aten.unsqueeze.default, torch.ops.aten.to.dtype,
        torch.ops.aten._to_copy.default}  # the mask's own moves and cast only
    out = next(n for n in prepared.graph.nodes
               if get_meta(n).module_name == "out" and get_meta(n).kind is OpKind.LINEAR)
    assert all(a.op == "call_module" for a in out.args[:1]), out.args  # its input is a quantizer's output
    assert not [get_meta(n).float_reason for n in prepared.graph.nodes
                if "integer inputs" in (get_meta(n).float_reason or "")]
