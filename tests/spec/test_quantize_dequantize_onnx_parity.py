"""Per-op parity table: FakeQuantize (export mode) → dynamo ONNX export → onnxruntime, bit-exact against eager.

One row per (opset, dtype, granularity, scheme). All quantizers of one opset live in one module with one input
and one output each, so each opset costs a single export. Inputs contain exact ties ``(k + 0.5)·s`` and values
far outside the quantized range.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import numpy as np
import onnx
import pytest
import torch
from torch import Tensor, nn

from coreai_opt.quantization.spec import (
    SUPPORTED_DTYPES,
    BiasFakeQuantize,
    FakeQuantize,
    PerBlock,
    PerChannel,
    PerTensor,
    QuantizationSpec,
    get_dtype_info,
    quantize_dequantize_translation_table,
)

SHAPE = (16, 8)
GRANULARITIES = {"per_tensor": PerTensor(), "per_channel": PerChannel(1), "per_block": PerBlock(axis=1, block_size=4)}
SCHEMES = ("symmetric", "symmetric_with_clipping", "asymmetric")
OPSETS = (18, 19, 20, 21, 23)


def _valid_cells(opset: int) -> list[tuple[str, str, str]]:
    cells = []
    for dtype in SUPPORTED_DTYPES:
        info = get_dtype_info(dtype)
        for granularity in GRANULARITIES:
            for scheme in SCHEMES:
                if info.is_float and scheme == "asymmetric":
                    continue  # float8 has no zero point
                if opset < info.min_opset or (granularity == "per_block" and opset < 21):
                    continue  # not expressible; see test_translation_raises_naming_minimum_opset
                if opset == 23 and scheme != _HARDEST_SCHEME[dtype]:
                    continue  # opset 23 repeats 21's translation: one scheme per dtype keeps the export small
                if opset == 20 and granularity != "per_channel":
                    continue  # likewise for opset 20 versus 19
                cells.append((dtype, granularity, scheme))
    return cells


# The scheme exercising most of the translation: narrow range for signed ints, a zero point for unsigned ones.
_HARDEST_SCHEME = {d: "symmetric" if get_dtype_info(d).is_float else
                   ("symmetric_with_clipping" if get_dtype_info(d).is_signed else "asymmetric")
                   for d in SUPPORTED_DTYPES}


CELLS = [(opset, *cell) for opset in OPSETS for cell in _valid_cells(opset)]


def _is_narrow(dtype: str, scheme: str) -> bool:
    info = get_dtype_info(dtype)
    return not info.is_float and info.is_signed and scheme == "symmetric_with_clipping"


class _Quantizers(nn.Module):
    def __init__(self, quantizers: list[FakeQuantize]) -> None:
        super().__init__()
        self.quantizers = nn.ModuleList(quantizers)

    def forward(self, *xs: Tensor) -> tuple[Tensor, ...]:
        return tuple(fq(x) for fq, x in zip(self.quantizers, xs, strict=True))


def _calibrated_quantizer(cell: tuple[str, str, str], seed: int) -> FakeQuantize:
    dtype, granularity, scheme = cell
    gen = torch.Generator().manual_seed(seed)
    fq = FakeQuantize(QuantizationSpec(dtype=dtype, qscheme=scheme, granularity=GRANULARITIES[granularity]))
    fq.enable_fake_quant(False)
    offset = torch.linspace(-1.0, 2.0, SHAPE[1])
    fq(torch.randn(SHAPE, generator=gen) * 2 + offset)
    fq.set_export_mode(True)
    return fq


def _test_input(fq: FakeQuantize, seed: int) -> Tensor:
    """Rows: 4 in-range, 6 ties / fp8 midpoints, 2 far out of range, 4 wide Gaussian."""
    gen = torch.Generator().manual_seed(seed + 1000)
    info = fq.spec.dtype_info
    x_like = torch.empty(SHAPE)
    s = torch.broadcast_to(fq.spec.granularity.expand(fq.calculator.scale, x_like), SHAPE)
    if info.is_float:
        codes = torch.randint(0, 255, (6, SHAPE[1]), generator=gen, dtype=torch.uint8)
        lo = codes.view(info.storage_dtype).float()
        hi = (codes + 1).view(info.storage_dtype).float()
        mid = torch.where(torch.isfinite(lo) & torch.isfinite(hi), (lo + hi) / 2, lo.nan_to_num(0.0))
        ties = mid * s[4:10]
        span = float(info.quant_max) * s
    else:
        z = torch.broadcast_to(fq.spec.granularity.expand(fq.calculator.zero_point, x_like), SHAPE)
        qmin, qmax = fq.spec.quant_min, fq.spec.quant_max
        k = torch.randint(-1 << 20, 1 << 20, (6, SHAPE[1]), generator=gen)
        k = qmin - 2 + k.remainder(qmax - qmin + 4) - z[4:10]  # q = k + zp spans [qmin - 2, qmax + 1]
        ties = (k.float() + 0.5) * s[4:10]
        span = (qmax - qmin) * s
    in_range = (torch.rand(4, SHAPE[1], generator=gen) - 0.5) * span[:4]
    out_of_range = torch.cat([3 * span[10:11], -3 * span[11:12]])
    wide = torch.randn(4, SHAPE[1], generator=gen) * 4
    return torch.cat([in_range, ties, out_of_range, wide])


class _Result(NamedTuple):
    eager: np.ndarray
    onnx: np.ndarray
    chain: list[str]
    attrs: list[dict[str, Any]]
    zero_point_type: int | None
    exact_ties: int


def _chain(graph: onnx.GraphProto, output: str) -> tuple[list[onnx.NodeProto], str]:
    producers = {o: n for n in graph.node for o in n.output}
    nodes, name = [], output
    while name in producers:
        node = producers[name]
        nodes.append(node)
        name = node.input[0]
    return nodes[::-1], name


@functools.cache
def _run_opset(opset: int) -> tuple[dict[tuple[str, str, str], _Result], int]:
    from conftest import _export_onnx_model, _ort_session

    cells = _valid_cells(opset)
    quantizers = [_calibrated_quantizer(cell, i) for i, cell in enumerate(cells)]
    inputs = [_test_input(fq, i) for i, fq in enumerate(quantizers)]
    module = _Quantizers(quantizers).eval()
    with torch.no_grad():
        eager = module(*inputs)
    model = _export_onnx_model(module, tuple(inputs), opset)
    session = _ort_session(model)
    outputs = session.run(None, {i.name: x.numpy() for i, x in zip(session.get_inputs(), inputs, strict=True)})
    graph = model.graph
    initializers = {t.name: t for t in graph.initializer}
    graph_inputs = [i.name for i in graph.input]
    results = {}
    for idx, cell in enumerate(cells):
        nodes, source = _chain(graph, graph.output[idx].name)
        assert source == graph_inputs[idx], f"{cell}: chain starts at {source}"
        dq = [n for n in nodes if n.op_type == "DequantizeLinear"]
        zp_type = initializers[dq[0].input[2]].data_type if dq and len(dq[0].input) > 2 else None
        fq = quantizers[idx]
        ratio = inputs[idx] / torch.broadcast_to(fq.spec.granularity.expand(fq.calculator.scale, inputs[idx]), SHAPE)
        results[cell] = _Result(
            eager=eager[idx].numpy(),
            onnx=outputs[idx],
            chain=[n.op_type for n in nodes],
            attrs=[{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute} for n in nodes[:2]],
            zero_point_type=zp_type,
            exact_ties=int((ratio - ratio.floor() == 0.5).sum()),
        )
    return results, len(graph.node)


@pytest.mark.parametrize(("opset", "dtype", "granularity", "scheme"), CELLS, ids=["-".join(map(str, c)) for c in CELLS])
def test_quantize_dequantize_matches_onnxruntime_bit_exactly(opset: int, dtype: str, granularity: str,
                                                            scheme: str) -> None:
    result = _run_opset(opset)[0][dtype, granularity, scheme]
    np.testing.assert_array_equal(result.onnx, result.eager)
    # Graph: exactly QuantizeLinear -> DequantizeLinear, plus the narrow-range clamp when the range is narrowed.
    narrow = _is_narrow(dtype, scheme)
    assert result.chain[:2] == ["QuantizeLinear", "DequantizeLinear"]
    assert result.chain[2:] in ((["Max", "Min"], ["Clip"]) if narrow else ([],))
    # (ONNX ignores axis for a 0-d scale; the exporter may spell out the default axis=1.)
    expected_attrs = {"per_tensor": {}, "per_channel": {"axis": 1}, "per_block": {"axis": 1, "block_size": 4}}
    keys = ("block_size",) if granularity == "per_tensor" else ("axis", "block_size")
    for attrs in result.attrs:
        assert {k: v for k, v in attrs.items() if k in keys and v != 0} == expected_attrs[granularity]
    assert result.zero_point_type == get_dtype_info(dtype).onnx_type
    if not get_dtype_info(dtype).is_float:
        assert result.exact_ties > 0


@pytest.mark.parametrize("opset", OPSETS)
def test_exported_graph_has_no_nodes_beyond_the_quantizer_chains(opset: int) -> None:
    results, node_count = _run_opset(opset)
    assert node_count == sum(len(r.chain) for r in results.values())


def test_parity_table_covers_every_valid_combination() -> None:
    """8 dtypes × 3 granularities × valid schemes = 6·3·3 + 2·3·2 = 66 cells at opset 21."""
    assert len(_valid_cells(21)) == 66
    assert len(_valid_cells(23)) == 24  # 8 dtypes × 3 granularities, one scheme each
    assert len(_valid_cells(19)) == 20  # int8/uint8 (3 schemes) + float8 (2 schemes), per-tensor/per-channel
    assert len(_valid_cells(20)) == 10  # the per-channel half of opset 19's cells
    assert len(_valid_cells(18)) == 12  # int8/uint8 per-tensor/per-channel
    assert len(CELLS) == 132


@pytest.mark.parametrize(
    ("opset", "dtype", "granularity", "message"),
    [
        (19, "int4", PerTensor(), r"dtype 'int4' needs ONNX opset >= 21"),
        (20, "uint16", PerChannel(1), r"dtype 'uint16' needs ONNX opset >= 21"),
        (18, "float8_e4m3fn", PerTensor(), r"dtype 'float8_e4m3fn' needs ONNX opset >= 19"),
        (20, "int8", PerBlock(1, 4), r"per-block quantization \(block_size=4\) needs ONNX opset >= 21"),
    ],
)
def test_translation_raises_naming_minimum_opset(opset: int, dtype: str, granularity: Any, message: str) -> None:
    from conftest import _export_onnx_model

    fq = FakeQuantize(QuantizationSpec(dtype=dtype, granularity=granularity))
    fq(torch.randn(SHAPE))
    fq.set_export_mode(True)
    with pytest.raises(Exception, match=message):
        _export_onnx_model(fq, (torch.randn(SHAPE),), opset)


class _Bias(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.quantizer = BiasFakeQuantize()
        self.register_buffer("input_scale", torch.tensor(0.02))
        self.register_buffer("weight_scale", torch.rand(6) / 10 + 0.01)
        self.bias = nn.Parameter(torch.randn(6))

    def forward(self, bias: Tensor) -> tuple[Tensor, Tensor]:
        return (self.quantizer(bias, self.input_scale, self.weight_scale),
                self.quantizer(self.bias, self.input_scale, self.weight_scale))


def test_bias_int32_translation_matches_onnxruntime_and_folds_constant_bias() -> None:
    from conftest import _export_onnx_model, _ort_session

    module = _Bias().eval()
    scale = module.input_scale * module.weight_scale
    bias = (torch.tensor([-3.0, 7.0, 0.0, 0.0, 0.0, 2.0]) + 0.5) * scale  # ties
    bias[3], bias[4] = 1e12, -1e12  # far beyond int32·s: clamped to the float32-exact int32 bounds
    model = _export_onnx_model(module, (bias,), 21)
    session = _ort_session(model)
    outputs = session.run(None, {session.get_inputs()[0].name: bias.numpy()})
    with torch.no_grad():
        expected = module(bias)
    for got, want in zip(outputs, expected, strict=True):
        np.testing.assert_array_equal(got, want.numpy())
    chain, _ = _chain(model.graph, model.graph.output[0].name)
    assert [n.op_type for n in chain] == ["Div", "Round", "Clip", "Cast", "DequantizeLinear"]
    # The constant bias folds into an INT32 initializer feeding DequantizeLinear (axis 0, per output channel).
    const_chain, source = _chain(model.graph, model.graph.output[1].name)
    assert [n.op_type for n in const_chain] == ["DequantizeLinear"]
    initializers = {t.name: t for t in model.graph.initializer}
    assert initializers[source].data_type == onnx.TensorProto.INT32
    assert {a.name: onnx.helper.get_attribute_value(a) for a in const_chain[0].attribute}.get("axis") == 0


def test_translation_table_rejects_unsupported_opset() -> None:
    with pytest.raises(ValueError, match=r"opset 17 is not supported.*\(18, 19, 20, 21, 22, 23\)"):
        quantize_dequantize_translation_table(17)
    table = quantize_dequantize_translation_table(21)
    assert list(table) == [torch.ops.coreai_opt.quantize_dequantize.default]
