"""Minimal QDQ graphs (onnx.helper) that OpenVINO 2026.4 CPU gets wrong, and the rewrites that fix them.

Both shapes come from our exports: the mean pooling of ``examples/transformer_ptq.py`` and the word + position
embedding add of a DistilBERT-style model (docs/openvino.md).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 20
MEAN_IN = (0.02822317, 139)  # (scale, uint8 zero point) of the LayerNorm output in the example
MEAN_OUT = (0.02452284, 134)


def _scalar_qparams(prefix: str, scale: float, zero_point: int, dtype: type = np.uint8) -> list[onnx.TensorProto]:
    return [numpy_helper.from_array(np.array(scale, np.float32), f"{prefix}_s"),
            numpy_helper.from_array(np.array(zero_point, dtype), f"{prefix}_z")]


def _qdq(x: str, prefix: str, out: str) -> list[onnx.NodeProto]:
    return [helper.make_node("QuantizeLinear", [x, f"{prefix}_s", f"{prefix}_z"], [f"{out}_q"]),
            helper.make_node("DequantizeLinear", [f"{out}_q", f"{prefix}_s", f"{prefix}_z"], [out])]


def sequence_mean(seq: int, as_sum_div: bool) -> onnx.ModelProto:
    """``Q → DQ(uint8, zp 139) → ReduceMean(axes=[1], keepdims=0) → Q → DQ`` on ``x: [batch, seq, 32]``.

    ``as_sum_div`` writes the mean as ``ReduceSum(axes=[1], keepdims=0) → Div(seq)`` (the rewrite).
    """
    inits = _scalar_qparams("in", *MEAN_IN) + _scalar_qparams("out", *MEAN_OUT) + [
        numpy_helper.from_array(np.array([1], np.int64), "axes"),
        numpy_helper.from_array(np.array(seq, np.float32), "n")]
    nodes = _qdq("x", "in", "xd")
    if as_sum_div:
        nodes += [helper.make_node("ReduceSum", ["xd", "axes"], ["sum"], keepdims=0),
                  helper.make_node("Div", ["sum", "n"], ["mean"])]
    else:
        nodes.append(helper.make_node("ReduceMean", ["xd", "axes"], ["mean"], keepdims=0))
    nodes += _qdq("mean", "out", "y")
    graph = helper.make_graph(nodes, "sequence_mean", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                                     ["batch", seq, 32])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 32])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])


def _rows(table: str, indices: str, out: str) -> list[onnx.NodeProto]:
    """Our per-row embedding lookup: ``Cast(Gather(W_q, idx)) * Unsqueeze(Gather(s, idx))``."""
    return [helper.make_node("Gather", [table, indices], [f"{out}_rows_q"]),
            helper.make_node("Cast", [f"{out}_rows_q"], [f"{out}_rows_f"], to=TensorProto.FLOAT),
            helper.make_node("Gather", [f"{table}_scale", indices], [f"{out}_rows_s"]),
            helper.make_node("Unsqueeze", [f"{out}_rows_s", "last_axis"], [f"{out}_rows_sc"]),
            helper.make_node("Mul", [f"{out}_rows_f", f"{out}_rows_sc"], [out])]


def embedding_add(rng: np.random.Generator, vocab: int = 100, seq: int = 16, dim: int = 32,
                  fold_positions: bool = False) -> onnx.ModelProto:
    """Word rows (token indices) + position rows (constant indices ``0..seq-1``), each ``→ Q → DQ``, added.

    ``fold_positions`` replaces the constant position branch up to its ``QuantizeLinear`` by the int8 initializer
    it computes (the rewrite), leaving ``DequantizeLinear(constant) → Add``.
    """
    word = rng.integers(-127, 128, (vocab, dim)).astype(np.int8)
    position = rng.integers(-127, 128, (seq, dim)).astype(np.int8)
    word_scale = (rng.random(vocab) * 0.01 + 0.005).astype(np.float32)
    position_scale = (rng.random(seq) * 0.01 + 0.005).astype(np.float32)
    inits = [numpy_helper.from_array(word, "word"), numpy_helper.from_array(word_scale, "word_scale"),
             numpy_helper.from_array(np.array([-1], np.int64), "last_axis")]
    inits += _scalar_qparams("w", 0.0101, 0, np.int8) + _scalar_qparams("p", 0.0097, 0, np.int8)
    inits += _scalar_qparams("sum", 0.0183, 0, np.int8)
    nodes = _rows("word", "tokens", "word_rows") + _qdq("word_rows", "w", "word_dq")
    if fold_positions:
        rows = position.astype(np.float32) * position_scale[:, None]
        q = np.clip(np.rint(rows / np.float32(0.0097)), -128, 127).astype(np.int8)[None]
        inits.append(numpy_helper.from_array(q, "position_dq_q"))
        nodes.append(helper.make_node("DequantizeLinear", ["position_dq_q", "p_s", "p_z"], ["position_dq"]))
    else:
        inits += [numpy_helper.from_array(position, "position"), numpy_helper.from_array(position_scale,
                                                                                        "position_scale"),
                  numpy_helper.from_array(np.arange(seq, dtype=np.int64)[None], "position_ids")]
        nodes += _rows("position", "position_ids", "position_rows") + _qdq("position_rows", "p", "position_dq")
    nodes.append(helper.make_node("Add", ["word_dq", "position_dq"], ["sum"]))
    nodes += _qdq("sum", "sum", "y")
    graph = helper.make_graph(nodes, "embedding_add",
                              [helper.make_tensor_value_info("tokens", TensorProto.INT64, ["batch", seq])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", seq, dim])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])


def conv_16bit_output(np_dtype: type, zero_point: int, clip: bool) -> onnx.ModelProto:
    """``Conv → QuantizeLinear(16-bit, s=1e-4) → DequantizeLinear`` on ``x: [2, 3, 8, 8]``.

    ``clip`` inserts ``Clip((qmin - zp)·s, (qmax - zp)·s)`` before the ``QuantizeLinear`` (the rewrite).
    """
    scale = np.float32(1e-4)
    info = np.iinfo(np_dtype)
    weight = (np.random.default_rng(0).standard_normal((4, 3, 3, 3)) * 0.1).astype(np.float32)
    inits = [numpy_helper.from_array(np.array(scale), "s"),
             numpy_helper.from_array(np.array(zero_point, np_dtype), "z"),
             numpy_helper.from_array(np.array((info.min - zero_point) * scale, np.float32), "lo"),
             numpy_helper.from_array(np.array((info.max - zero_point) * scale, np.float32), "hi"),
             numpy_helper.from_array(weight, "w")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1])]
    if clip:
        nodes.append(helper.make_node("Clip", ["c", "lo", "hi"], ["clipped"]))
    nodes += [helper.make_node("QuantizeLinear", ["clipped" if clip else "c", "s", "z"], ["q"]),
              helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"])]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 8, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4, 8, 8])
    graph = helper.make_graph(nodes, "conv_16bit", [x], [y], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def conv_16bit_per_channel_output(scale: np.ndarray, zero_point: np.ndarray) -> onnx.ModelProto:
    """``Conv → QuantizeLinear(uint16, per output channel, axis 1) → DequantizeLinear`` on ``x: [2, 3, 8, 8]``."""
    weight = (np.random.default_rng(0).standard_normal((scale.size, 3, 3, 3)) * 0.1).astype(np.float32)
    inits = [numpy_helper.from_array(weight, "w"), numpy_helper.from_array(scale, "s"),
             numpy_helper.from_array(zero_point, "z")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
             helper.make_node("QuantizeLinear", ["c", "s", "z"], ["q"], axis=1),
             helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"], axis=1)]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 8, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, scale.size, 8, 8])
    graph = helper.make_graph(nodes, "conv_16bit_per_channel", [x], [y], inits,
                              value_info=[helper.make_tensor_value_info("c", TensorProto.FLOAT,
                                                                        [2, scale.size, 8, 8])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def lone_16bit_qdq() -> onnx.ModelProto:
    """``x → QuantizeLinear(uint16, s=1e-4, zp 0) → DequantizeLinear`` on ``x: [2, 3, 8, 8]`` (a graph input)."""
    inits = _scalar_qparams("a", 1e-4, 0, np.uint16)
    shape = [2, 3, 8, 8]
    graph = helper.make_graph(_qdq("x", "a", "y"), "lone_16bit",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, shape)], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


RESHAPED_SUM = (0.0028078, 116, 0.0020295, 107)  # (scale, zp) of the shape_unpack w4a8 input and mean quantizers


def reshaped_sum(zero_point: int = RESHAPED_SUM[1], guard: bool = False) -> onnx.ModelProto:
    """``x[batch, 16] → Q → DQ(uint8) → Reshape[-1, 8, 16] → Q → DQ → ReduceSum(axes=[1]) → Div(8) → Q → DQ``.

    The shape of the zoo's ``shape_unpack`` mean pooling (``means_to_sum_and_divide`` writes the mean as a sum and
    a division). ``guard`` puts ``Max(x, lowest float32)`` before the ``ReduceSum`` (the ``guard_quantized_sums``
    rule, applied by hand here).
    """
    scale, _, out_scale, out_zp = RESHAPED_SUM
    inits = _scalar_qparams("a", scale, zero_point) + _scalar_qparams("m", out_scale, out_zp) + [
        numpy_helper.from_array(np.array([-1, 8, 16], np.int64), "shape"),
        numpy_helper.from_array(np.array([1], np.int64), "axes"),
        numpy_helper.from_array(np.array(8, np.float32), "n"),
        numpy_helper.from_array(np.array(np.finfo(np.float32).min, np.float32), "lowest")]
    nodes = _qdq("x", "a", "xd") + [helper.make_node("Reshape", ["xd", "shape"], ["r"])] + _qdq("r", "a", "rd")
    summed = "rd"
    if guard:
        nodes.append(helper.make_node("Max", ["rd", "lowest"], ["rd_guarded"]))
        summed = "rd_guarded"
    nodes += [helper.make_node("ReduceSum", [summed, "axes"], ["sum"], keepdims=0),
              helper.make_node("Div", ["sum", "n"], ["mean"])] + _qdq("mean", "m", "y")
    graph = helper.make_graph(nodes, "reshaped_sum", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                                    ["batch", 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 16])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def float8_qdq(shape: tuple[int, ...], scale: float) -> onnx.ModelProto:
    """``x → QuantizeLinear(float8e4m3fn, s, zero point 0) → DequantizeLinear`` (a graph input, like our fp8 files)."""
    inits = [numpy_helper.from_array(np.array(scale, np.float32), "a_s"),
             helper.make_tensor("a_z", TensorProto.FLOAT8E4M3FN, [], [0.0])]
    graph = helper.make_graph(_qdq("x", "a", "y"), "float8_qdq",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(shape))], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
