"""Ops onnxruntime runs only in float request no quantizers (coreai_opt.graph.float_only_ops), measured in ORT."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch
from torch import fx, nn

import coreai_opt as co
from coreai_opt.config import QuantizerConfig
from coreai_opt.graph.node_meta import get_meta
from coreai_opt.graph.op_kinds import OpKind
from coreai_opt.onnx.verify.fusion_report import optimized_model
from tests.passes.pipeline import annotated, inserted

W8A8 = QuantizerConfig.presets.w8a8


class _RMSNormBlock(nn.Module):
    """linear → RMSNorm (``x · rsqrt(mean(x²) + eps) · w``) → linear, as Llama / Gemma write it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 8)
        self.weight = nn.Parameter(torch.rand(16) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight
        return self.b(h)


class _ScaledBetweenLinears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x) * 0.5)


def _kind_nodes(gm: fx.GraphModule, kind: OpKind) -> list[fx.Node]:
    return [n for n in gm.graph.nodes if get_meta(n).kind is kind]


def _quantized_values(gm: fx.GraphModule) -> list[str]:
    """Names of the nodes whose output an activation quantizer reads, in graph order."""
    return [n.args[0].name for n in gm.graph.nodes
            if get_meta(n).quantizer is not None and get_meta(n).quantizer.role.value == "activation"]


def test_rmsnorm_mean_and_epsilon_add_request_no_quantizers_and_say_why() -> None:
    gm = annotated(_RMSNormBlock().eval(), torch.randn(4, 16), W8A8())
    mean, = _kind_nodes(gm, OpKind.AVG_POOL)
    adds = _kind_nodes(gm, OpKind.ADD)
    assert get_meta(mean).annotation is None
    assert "mean over other axes than the spatial ones of a 4-D tensor" in get_meta(mean).float_reason
    assert [get_meta(a).annotation for a in adds] == [None]
    assert "add with a number operand" in get_meta(adds[0]).float_reason
    # x · rsqrt(...) and · weight still run as QLinearMul: both operands and the output of each mul are quantized
    assert all(len(get_meta(m).annotation.inputs) == 2 for m in _kind_nodes(gm, OpKind.MUL))


def test_a_spatial_mean_of_a_4d_tensor_keeps_its_quantizers() -> None:
    class Pool(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Conv2d(3, 4, 3)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.conv(x).mean((2, 3))

    gm = annotated(Pool().eval(), torch.randn(1, 3, 8, 8), W8A8())
    mean, = _kind_nodes(gm, OpKind.AVG_POOL)
    annotation = get_meta(mean).annotation
    assert annotation is not None and len(annotation.inputs) == 1 and annotation.output is not None


def test_a_number_multiply_between_two_linears_keeps_the_consumers_input_quantized() -> None:
    gm = inserted(_ScaledBetweenLinears().eval(), torch.randn(2, 8), W8A8())
    mul, = _kind_nodes(gm, OpKind.MUL)
    assert get_meta(mul).annotation is None
    # the consumer's input is quantized; the producer's output is read by the float mul only, so it stays float
    # (onnxruntime's QGemm writes float: graph.unread_outputs)
    assert _quantized_values(gm) == ["x", "mul", "linear_1"]


def test_rmsnorm_block_runs_without_quantize_dequantize_round_trips_and_onnxruntime_matches_eager(
        tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = _RMSNormBlock().eval()
    batches = [(torch.randn(4, 16),) for _ in range(3)]
    prepared = co.prepare(model, W8A8(), batches[0])
    co.calibrate(prepared, batches, progress=False)
    converted = co.convert(prepared)
    path = co.export_onnx(converted, batches[0], tmp_path / "rms.onnx")
    ops = Counter(n.op_type for n in optimized_model(path, level="all").graph.node)
    # Q: the input and rsqrt's output (read by QLinearMul); DQ: a's output (read by pow) and the graph output.
    # Before float_only_ops the mean's input / output and the epsilon add's output were three more Q -> DQ pairs.
    assert {op: ops[op] for op in ("QuantizeLinear", "DequantizeLinear", "QLinearMul", "QGemm", "ReduceMean")} == {
        "QuantizeLinear": 2, "DequantizeLinear": 2, "QLinearMul": 2, "QGemm": 2, "ReduceMean": 1}
    assert co.verify_onnx(converted, path, batches).ok


class _CosineAttention(nn.Module):
    """Swin-V2's cosine attention: ``normalize(q) @ normalize(k)ᵀ``, ``normalize(x) = x / max(‖x‖, ε)``."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k = self.q(x), self.k(x)
        q = q / q.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        k = k / k.norm(dim=-1, keepdim=True).clamp_min(1e-12)
        return q @ k.transpose(-1, -2)


def test_a_division_by_a_tensor_requests_no_quantizers_so_no_divisor_rounds_to_zero() -> None:
    torch.manual_seed(0)
    model = _CosineAttention().eval()
    x = torch.randn(2, 6, 16)
    x[:, 0] *= 1e-4  # token 0: tiny queries next to the others, its norm near 0 on a grid shared with them
    gm = annotated(model, x, W8A8())
    divs = _kind_nodes(gm, OpKind.DIV)
    assert len(divs) == 2
    assert all(get_meta(d).annotation is None for d in divs)
    assert all("division by a tensor" in get_meta(d).float_reason for d in divs)
    prepared = co.prepare(model, W8A8(), (x,))
    co.calibrate(prepared, [(x,)])
    with torch.no_grad():
        out, ref = co.convert(prepared)(x), model(x)
    assert torch.isfinite(out).all()
    assert float((out - ref).abs().max()) < 0.05  # cosines in [-1, 1]: a few 8-bit steps at most


class _TanhGeluBlock(nn.Module):
    """linear → GPT-Neo's GELU ``0.5 h (1 + tanh(c (h + 0.044715 h³)))`` → linear, as transformers writes it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 32), nn.Linear(32, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h = 0.5 * h * (1.0 + torch.tanh(0.7978845608 * (h + 0.044715 * torch.pow(h, 3.0))))
        return self.b(h)


class _NormBetweenLinears(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(8, 8), nn.LayerNorm(8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(nn.functional.gelu(self.norm(self.a(x))))


def test_a_tanh_between_float_arithmetic_requests_no_quantizers_unless_the_config_names_it() -> None:
    gm = annotated(_TanhGeluBlock().eval(), torch.randn(4, 16), W8A8())
    tanh, = _kind_nodes(gm, OpKind.TANH)
    assert get_meta(tanh).annotation is None
    assert get_meta(tanh).float_reason.endswith("tanh has no onnxruntime integer kernel (its edges are quantized "
                                                "only where a neighbour's kernel reads them)")
    # an op_kind entry naming tanh is the user asking for its quantizers: they stay
    named = annotated(_TanhGeluBlock().eval(), torch.randn(4, 16),
                      W8A8().set_op_kind("tanh", {"activation": W8A8().activation}))
    tanh, = _kind_nodes(named, OpKind.TANH)
    annotation = get_meta(tanh).annotation
    assert annotation is not None and len(annotation.inputs) == 1 and annotation.output is not None


def test_a_norm_and_gelu_between_linears_keep_every_edge_the_linears_ask_for() -> None:
    gm = inserted(_NormBetweenLinears().eval(), torch.randn(2, 8), W8A8())
    assert [get_meta(n).annotation for n in _kind_nodes(gm, OpKind.LAYER_NORM) + _kind_nodes(gm, OpKind.GELU)] \
        == [None, None]
    # b's input (the gelu's output); a's output is read by the float norm only, so it stays float (QGemm writes
    # float: graph.unread_outputs), and the norm's output has no reader that asks
    assert _quantized_values(gm) == ["x", "gelu", "linear_1"]


def test_tanh_gelu_written_as_arithmetic_runs_as_one_gelu_and_onnxruntime_matches_eager(tmp_path: Path) -> None:
    """GPT-Neo's arithmetic GELU becomes one ``Gelu`` (passes/recompose_gelu.py) read from a float-writing QGemm; a
    config naming ``op_kind:tanh`` keeps the chain as written, each op asking for its own quantizers."""
    torch.manual_seed(0)
    batches = [(torch.randn(4, 16),) for _ in range(3)]
    counts = {}
    for label, config in (("default", W8A8()),
                          ("tanh named", W8A8().set_op_kind("tanh", {"activation": W8A8().activation}))):
        prepared = co.prepare(_TanhGeluBlock().eval(), config, batches[0])
        co.calibrate(prepared, batches, progress=False)
        converted = co.convert(prepared)
        path = co.export_onnx(converted, batches[0], tmp_path / f"{label}.onnx")
        ops = Counter(n.op_type for n in optimized_model(path, level="all").graph.node)
        counts[label] = {op: ops[op] for op in ("QuantizeLinear", "DequantizeLinear", "Tanh", "Gelu", "QGemm", "Mul")}
        assert co.verify_onnx(converted, path, batches).ok
    # x and the GELU's output are quantized (b's input), the model output dequantized: a's QGemm writes float
    assert counts["default"] == {"QuantizeLinear": 2, "DequantizeLinear": 1, "Tanh": 0, "Gelu": 1, "QGemm": 2,
                                 "Mul": 0}
    # as written: tanh's input and output, the addition's operands and output, three float multiplies
    assert counts["tanh named"] == {"QuantizeLinear": 6, "DequantizeLinear": 6, "Tanh": 1, "Gelu": 0, "QGemm": 2,
                                    "Mul": 3}
