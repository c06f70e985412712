"""IntegerReference: eager QLinearConv / QGemm / QLinearMatMul arithmetic bit-identical to onnxruntime's kernels.

Each test writes one integer kernel by hand (``onnx.helper``) and runs the same layer in eager as the exported
model does (``quantize_dequantize`` of input, weight, int32 bias, then the float op and the output quantizer) under
:class:`~coreai_opt.onnx.verify.integer_reference.IntegerReference`. The multiplier ``x_scale · w_scale / y_scale``
is a power of two, so every odd accumulator lands exactly on a rounding tie (half a step): the test counts them and
requires output codes identical to onnxruntime's at every element, ties included (round half to even on both
sides), and the requantised calls reported in ``replaced``.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from coreai_opt.onnx.verify import integer_reference
from coreai_opt.onnx.verify.integer_reference import IntegerReference

_qdq = torch.ops.coreai_opt.quantize_dequantize.default


def _run_onnx(node: onnx.NodeProto, inputs: dict[str, np.ndarray], initializers: dict[str, np.ndarray],
              out_shape: list[int], domain: str = "") -> np.ndarray:
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
                      for n, v in inputs.items()],
        [helper.make_tensor_value_info("y", TensorProto.UINT8, out_shape)],
        [numpy_helper.from_array(v, n) for n, v in initializers.items()])
    opsets = [helper.make_opsetid("", 13)] + ([helper.make_opsetid(domain, 1)] if domain else [])
    model = helper.make_model(graph, opset_imports=opsets)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(["y"], inputs)[0]


def _eager_codes(forward, calls: set[int], y_scale: float, y_zp: int) -> tuple[np.ndarray, set[int]]:  # noqa: ANN001
    reference = IntegerReference(calls)
    with torch.no_grad(), reference:
        y = forward()
    return (torch.round(y / y_scale) + y_zp).to(torch.int64).numpy(), reference.replaced


def _ties(acc: np.ndarray, multiplier: np.ndarray) -> int:
    scaled = acc.astype(np.float64) * multiplier
    return int((np.abs(scaled - np.floor(scaled)) == 0.5).sum())


def _codes(rng: np.random.Generator, shape: tuple[int, ...], low: int, high: int) -> np.ndarray:
    return rng.integers(low, high + 1, size=shape)


@pytest.mark.parametrize(("per_channel", "groups"), [(False, 1), (True, 1), (True, 6)],
                         ids=["per_tensor", "per_channel", "depthwise_per_channel"])
def test_qlinearconv_codes_identical_to_onnxruntime_at_every_element_including_ties(per_channel: bool,
                                                                                   groups: int) -> None:
    rng = np.random.default_rng(0)
    xs, x_zp, ys, y_zp = np.float32(0.5), 7, np.float32(0.5), 128
    ws = np.array([0.25, 0.125, 0.5, 0.25, 1.0, 0.0625], np.float32) if per_channel else np.full(6, 0.25, np.float32)
    in_channels = 6 if groups > 1 else 3
    xq = _codes(rng, (2, in_channels, 9, 9), 1, 13).astype(np.uint8)
    wq = _codes(rng, (6, in_channels // groups, 3, 3), -6, 6).astype(np.int8)
    bias = _codes(rng, (6,), -200, 200).astype(np.int32)
    w_scale = ws if per_channel else ws[:1].reshape(())
    init = {"xs": np.array(xs), "xz": np.array(x_zp, np.uint8), "w": wq, "ws": w_scale,
            "wz": np.zeros(w_scale.shape, np.int8), "ys": np.array(ys), "yz": np.array(y_zp, np.uint8), "b": bias}
    node = helper.make_node("QLinearConv", ["x", "xs", "xz", "w", "ws", "wz", "ys", "yz", "b"], ["y"],
                            pads=[1, 1, 1, 1], strides=[2, 2], group=groups)
    got = _run_onnx(node, {"x": xq}, init, [2, 6, 5, 5])

    x = torch.tensor((xq.astype(np.float32) - x_zp) * xs)
    w = torch.tensor(wq.astype(np.float32) * ws.reshape(6, 1, 1, 1))
    b_float = torch.tensor(bias.astype(np.float32) * (xs * ws))
    scale_w = torch.tensor(ws) if per_channel else torch.tensor(ws[0])

    def forward() -> torch.Tensor:
        xd = _qdq(x, torch.tensor(xs), torch.tensor(x_zp), 0, 255, 1, 0, "uint8")
        wd = _qdq(w, scale_w, torch.zeros(scale_w.shape, dtype=torch.int32), -127, 127, 0, 0, "int8")
        bd = _qdq(b_float, torch.tensor(xs) * scale_w, torch.zeros(scale_w.shape, dtype=torch.int32),
                  -(2**31), 2**31 - 1, 0, 0, "int32")
        y = torch.nn.functional.conv2d(xd, wd, bd, stride=2, padding=1, groups=groups)
        return _qdq(y, torch.tensor(ys), torch.tensor(y_zp), 0, 255, 1, 0, "uint8")

    eager, replaced = _eager_codes(forward, {3}, float(ys), y_zp)
    acc = torch.nn.functional.conv2d(torch.tensor(xq.astype(np.float64) - x_zp), torch.tensor(wq, dtype=torch.float64),
                                     torch.tensor(bias, dtype=torch.float64), stride=2, padding=1,
                                     groups=groups).numpy()
    ties = _ties(acc, (xs * ws / ys).reshape(1, 6, 1, 1))
    assert replaced == {3}
    assert ties > 20  # about a quarter of the accumulators sit on a tie
    assert np.array_equal(eager, got.astype(np.int64))


def test_qgemm_codes_identical_to_onnxruntime_at_every_element_including_ties() -> None:
    rng = np.random.default_rng(1)
    xs, x_zp, ys, y_zp = np.float32(0.25), 120, np.float32(0.25), 128
    ws = np.array([0.5, 0.25, 0.125, 0.5, 0.25, 1.0, 0.5, 0.25], np.float32)
    xq = _codes(rng, (16, 40), 112, 128).astype(np.uint8)
    wq = _codes(rng, (8, 40), -8, 8).astype(np.int8)
    bias = _codes(rng, (8,), -300, 300).astype(np.int32)
    init = {"xs": np.array(xs), "xz": np.array(x_zp, np.uint8), "w": wq, "ws": ws, "wz": np.zeros(8, np.int8),
            "b": bias, "ys": np.array(ys), "yz": np.array(y_zp, np.uint8)}
    node = helper.make_node("QGemm", ["x", "xs", "xz", "w", "ws", "wz", "b", "ys", "yz"], ["y"], domain="com.microsoft",
                            transB=1)
    got = _run_onnx(node, {"x": xq}, init, [16, 8], "com.microsoft")

    x = torch.tensor((xq.astype(np.float32) - x_zp) * xs)
    w = torch.tensor(wq.astype(np.float32) * ws.reshape(8, 1))
    b_float = torch.tensor(bias.astype(np.float32) * (xs * ws))

    def forward() -> torch.Tensor:
        xd = _qdq(x, torch.tensor(xs), torch.tensor(x_zp), 0, 255, 1, 0, "uint8")
        wd = _qdq(w, torch.tensor(ws), torch.zeros(8, dtype=torch.int32), -127, 127, 0, 0, "int8")
        bd = _qdq(b_float, torch.tensor(xs) * torch.tensor(ws), torch.zeros(8, dtype=torch.int32), -(2**31),
                  2**31 - 1, 0, 0, "int32")
        return _qdq(torch.nn.functional.linear(xd, wd, bd), torch.tensor(ys), torch.tensor(y_zp), 0, 255, 1, 0,
                    "uint8")

    eager, replaced = _eager_codes(forward, {3}, float(ys), y_zp)
    acc = (xq.astype(np.float64) - x_zp) @ wq.astype(np.float64).T + bias
    assert replaced == {3}
    assert _ties(acc, xs * ws / ys) > 20
    assert np.array_equal(eager, got.astype(np.int64))


def test_qlinearmatmul_of_two_activations_codes_identical_to_onnxruntime_including_ties() -> None:
    rng = np.random.default_rng(2)
    as_, a_zp, bs, b_zp, ys, y_zp = np.float32(0.5), 128, np.float32(0.25), 128, np.float32(1.0), 128
    aq = _codes(rng, (2, 4, 6, 24), 120, 136).astype(np.uint8)
    bq = _codes(rng, (2, 4, 24, 6), 120, 136).astype(np.uint8)
    init = {"as": np.array(as_), "az": np.array(a_zp, np.uint8), "bs": np.array(bs), "bz": np.array(b_zp, np.uint8),
            "ys": np.array(ys), "yz": np.array(y_zp, np.uint8)}
    node = helper.make_node("QLinearMatMul", ["a", "as", "az", "b", "bs", "bz", "ys", "yz"], ["y"])
    got = _run_onnx(node, {"a": aq, "b": bq}, init, [2, 4, 6, 6])

    a = torch.tensor((aq.astype(np.float32) - a_zp) * as_)
    b = torch.tensor((bq.astype(np.float32) - b_zp) * bs)

    def forward() -> torch.Tensor:
        ad = _qdq(a, torch.tensor(as_), torch.tensor(a_zp), 0, 255, 1, 0, "uint8")
        bd = _qdq(b, torch.tensor(bs), torch.tensor(b_zp), 0, 255, 1, 0, "uint8")
        return _qdq(ad @ bd, torch.tensor(ys), torch.tensor(y_zp), 0, 255, 1, 0, "uint8")

    eager, replaced = _eager_codes(forward, {2}, float(ys), y_zp)
    acc = (aq.astype(np.float64) - a_zp) @ (bq.astype(np.float64) - b_zp)
    assert replaced == {2}
    assert _ties(acc, as_ * bs / ys) > 15
    assert np.array_equal(eager, got.astype(np.int64))


def test_split_of_a_per_tensor_quantized_activation_keeps_every_piece_exact() -> None:
    """Attention splits one quantized qkv tensor in three (aten.split): each piece still feeds an exact matmul."""
    torch.manual_seed(0)
    qkv = torch.randn(2, 6, 24)

    def forward() -> torch.Tensor:
        x = _qdq(qkv, torch.tensor(0.05), torch.tensor(128), 0, 255, 1, 0, "uint8")
        q, k, _ = x.split(8, dim=-1)
        return _qdq(q @ k.transpose(-1, -2), torch.tensor(0.01), torch.tensor(128), 0, 255, 1, 0, "uint8")

    reference = IntegerReference({1})
    with torch.no_grad(), reference:
        y = forward()
    codes = torch.round(qkv / 0.05).clamp(-128, 127).double()
    q, k = codes[..., :8], codes[..., 8:16]
    expected = ((q @ k.transpose(-1, -2)).float() * (torch.tensor(0.05) * torch.tensor(0.05) / torch.tensor(0.01))
                ).clamp(-128, 127).round()
    assert reference.replaced == {1}
    assert torch.equal(torch.round(y / 0.01), expected)


@pytest.mark.parametrize("per_channel", [False, True])
def test_a_matmul_read_back_in_column_slices_equals_the_whole_weight_read_at_once(per_channel: bool,
                                                                                  monkeypatch) -> None:
    torch.manual_seed(0)
    scale = torch.rand(1, 37) * 0.01 + 0.001 if per_channel else torch.tensor(0.004)
    full = scale.expand(64, 37) if per_channel else scale
    weight = torch.randint(-127, 128, (64, 37)).double() * full.double()
    a = torch.randint(-128, 128, (5, 64)).double()
    tag = integer_reference._Scaled(full.float())
    whole = torch.matmul(a, tag.integers(weight.float()))
    monkeypatch.setattr(integer_reference, "_CHUNK_ELEMENTS", 64 * 4)  # 4 columns per slice: 10 slices
    sliced = integer_reference._exact_matmul(a, weight.float(), tag)
    assert sliced.dtype == torch.float64 and torch.equal(sliced, whole)


@pytest.mark.parametrize(("stride", "padding", "dilation"), [([1], [1], [1]), ([2], [1], [1]), ([1, 2], [1, 0], [2])])
def test_depthwise_tap_sum_takes_aten_one_element_lists_like_aten(stride, padding, dilation) -> None:
    # hf EfficientNet's depthwise convs reach aten.convolution with padding=[1] (ATen broadcasts it): IndexError before
    gen = torch.Generator().manual_seed(0)
    x = torch.randint(-128, 128, (2, 6, 9, 9), generator=gen).double()
    w = torch.randint(-127, 128, (6, 1, 3, 3), generator=gen).double()
    got = integer_reference._exact_convolution(x, w, stride, padding, dilation, 6)
    want = torch.ops.aten.convolution.default(x, w, None, stride, padding, dilation, False, [0, 0], 6)
    assert torch.equal(got, want)
