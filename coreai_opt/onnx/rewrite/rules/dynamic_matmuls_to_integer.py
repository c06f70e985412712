"""Rule: run dynamically quantized linears on onnxruntime's integer kernels.

The spec layer exports a dynamic activation quantizer as ``DynamicQuantizeLinear → DequantizeLinear`` and a
static int8 weight as an int8 initializer ``→ DequantizeLinear (→ Transpose)``. onnxruntime does not fuse that
QDQ pattern around ``MatMul`` into an integer kernel (it turns the weight into a float ``MatMulNBits`` and keeps
the activation round trip, slower than fp32). This rule rewrites every::

    q, s, z = DynamicQuantizeLinear(x)
    MatMul(DequantizeLinear(q, s, z), [Transpose](DequantizeLinear(W_q, s_w, 0)))

(and the same with ``Gemm(transB=1)`` plus its bias) into the integer form ``quantize_dynamic`` produces,
which onnxruntime fuses into ``DynamicQuantizeMatMul``::

    Mul(Cast(MatMulInteger(q, W_q', z, 0), FLOAT), Mul(s, s_w))

A per-token dynamic activation (``PerToken()``: ``q = QuantizeLinear(x, s, z, axis=-1, block_size=K)`` with the
run-time per-row ``s``, ``z`` of shape ``x.shape[:-1] + (1,)``, read by the same blocked ``DequantizeLinear``) has a
zero point per row, which onnxruntime's ``MatMulInteger`` does not take (its ``a_zero_point`` must be a scalar), so
its correction is written out in int32, exactly::

    Σ_k (q_mk − z_m)·W_kn = Σ_k q_mk·W_kn − z_m · Σ_k W_kn
    Mul(Cast(Sub(MatMulInteger(q, W_q'), Mul(Cast(z, INT32), colsum(W_q'))), FLOAT), Mul(s, s_w))

(measured at 256 x 256, 1 thread: 1.8-2x the time of the per-tensor ``DynamicQuantizeMatMul``, which has no
per-row form).

with ``W_q'`` the ``[K, N]`` int8 weight (transposed once, offline) and ``s_w`` a scalar or a per-column ``[N]``
scale. Mathematically ``Σ_k (q_k − z)·s · W_kn·s_wn = s·s_wn · Σ_k (q_k − z)·W_kn``: the result differs from the
QDQ graph only by float32 summation order (the integer sum is exact). Other readers of the ``DequantizeLinear``
output (e.g. a residual ``Add``) keep reading it. Weights with a non-zero zero point or a per-row scale are left
alone (near misses in the report).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

from coreai_opt.onnx.rewrite.graph import OnnxGraph, attributes_of
from coreai_opt.onnx.rewrite.qdq import QdqView, axis_and_block
from coreai_opt.onnx.rewrite.rule import Fail, Match, Rule

__all__ = ["DynamicMatmulsToInteger"]


@dataclass(frozen=True)
class _Site(Match):
    activation: tuple[str, str, str]  # (q, s, z) of the dynamic quantizer
    per_token: bool  # s, z per row of the last axis (else scalars)
    weight: np.ndarray  # [K, N] int8
    weight_scale: np.ndarray  # () or (N,)


def _per_token_activation(dq: onnx.NodeProto, graph: OnnxGraph) -> tuple[str, str, str] | None:
    """``(q, s, z)`` when ``dq`` dequantizes a per-token dynamic ``QuantizeLinear``, else None.

    Per token: blocked on the last axis, with a run-time (non-constant) scale and zero point.
    """
    ql = graph.producer(dq.input[0])
    if ql is None or ql.op_type != "QuantizeLinear" or list(ql.input[1:3]) != list(dq.input[1:3]):
        return None
    view = QdqView.of(ql, graph)
    if (view is None or view.block_size <= 0 or view.scale is not None or view.zero_point is not None
            or axis_and_block(dq) != axis_and_block(ql)):
        return None
    shape = graph.shape(dq.input[0])
    rank = len(shape) if shape is not None else None
    if view.axis != -1 and (rank is None or view.axis != rank - 1):
        return None
    return ql.output[0], ql.input[1], ql.input[2]


def _weight(name: str, graph: OnnxGraph, transposed: bool) -> tuple[np.ndarray, np.ndarray] | str:
    """``(W_q as [K, N] int8, s_w of shape () or (N,))``, or why ``name`` is not a constant int8 symmetric weight."""
    node = graph.producer(name)
    if node is not None and node.op_type == "Transpose":
        if list(attributes_of(node).get("perm", [1, 0])) != [1, 0]:
            return "weight Transpose is not perm=[1, 0]"
        transposed, node = not transposed, graph.producer(node.input[0])
    view = QdqView.of(node, graph)
    if view is None or not view.is_dequantize or not view.data_is_constant or view.scale is None:
        return "weight is not a constant DequantizeLinear"
    w = graph.constant(view.data)
    if w.dtype != np.int8 or w.ndim != 2:
        return f"weight is {view.type_name} of rank {w.ndim} (MatMulInteger here takes a 2-D int8 weight)"
    if not view.zero_point_is_zero:
        return "weight zero point is not 0"
    if view.scale.dtype != np.float32:
        return f"weight scale is {view.scale.dtype}, not float32"
    if view.scale.size > 1 and view.block_size:
        return "weight is per-block"
    axis = view.axis % 2
    if transposed:
        w, axis = w.T, 1 - axis
    if view.scale.size > 1 and axis != 1:
        return "weight scale is per input channel (it cannot be factored out of the sum)"
    scale = view.scale.reshape(()) if view.scale.size == 1 else view.scale.reshape(-1)
    return np.ascontiguousarray(w), scale


class DynamicMatmulsToInteger(Rule):
    """Rewrite dynamic-activation × int8-weight ``MatMul`` / ``Gemm`` into ``MatMulInteger`` (module docstring)."""

    name = "dynamic_matmuls_to_integer"
    anchors = frozenset({"MatMul", "Gemm"})

    def match(self, node: onnx.NodeProto, graph: OnnxGraph) -> _Site | Fail | None:
        """A ``MatMul`` (or plain ``Gemm``) whose input 0 is a dynamically quantized activation."""
        attrs = attributes_of(node)
        if node.op_type == "Gemm" and (attrs.get("transA", 0) != 0 or attrs.get("alpha", 1.0) != 1.0
                                       or attrs.get("beta", 1.0) != 1.0):
            return None
        dq = graph.producer(node.input[0])
        if dq is None or dq.op_type != "DequantizeLinear":
            return None
        dql = graph.producer(dq.input[0])
        per_token = _per_token_activation(dq, graph)
        if per_token is None and (dql is None or dql.op_type != "DynamicQuantizeLinear"
                                  or list(dq.input[1:3]) != list(dql.output[1:3])):
            return None
        weight = _weight(node.input[1], graph, node.op_type == "Gemm" and bool(attrs.get("transB", 0)))
        if isinstance(weight, str):
            return Fail(weight)
        if per_token is not None and axis_and_block(dq)[1] != weight[0].shape[0]:
            return Fail(f"per-token block size {axis_and_block(dq)[1]} is not the product's K = {weight[0].shape[0]}")
        activation = per_token if per_token is not None else tuple(dql.output)
        return _Site(node, activation, per_token is not None, *weight)

    def rewrite(self, match: _Site, graph: OnnxGraph) -> None:
        """Replace the product by ``MatMulInteger -> Cast -> Mul(s · s_w) [-> Add(bias)]``."""
        node = match.node
        stem = node.name or node.output[0]
        w = graph.add_initializer(graph.unique_name(f"{stem}_dyn_w"), match.weight)
        w_zero = graph.add_initializer(graph.unique_name(f"{stem}_dyn_w_zero"),
                                       np.zeros(match.weight_scale.shape, np.int8))
        w_scale = graph.add_initializer(graph.unique_name(f"{stem}_dyn_w_scale"),
                                        match.weight_scale.astype(np.float32))
        acc, acc_f, scale = (graph.unique_name(f"{stem}_dyn_{key}") for key in ("acc", "acc_f", "scale"))
        q, s, z = match.activation
        name = graph.unique_node_name
        if match.per_token:  # per-row zero points: MatMulInteger with none, then − z_m · colsum_n in int32
            product, z32, correction = (graph.unique_name(f"{stem}_dyn_{key}") for key in ("qw", "z32", "zw"))
            colsum = graph.add_initializer(graph.unique_name(f"{stem}_dyn_w_colsum"),
                                           match.weight.astype(np.int32).sum(axis=0, dtype=np.int32))
            nodes = [
                helper.make_node("MatMulInteger", [q, w], [product], name=name(f"{stem}_MatMulInteger")),
                helper.make_node("Cast", [z], [z32], to=TensorProto.INT32, name=name(f"{stem}_ZeroPointCast")),
                helper.make_node("Mul", [z32, colsum], [correction], name=name(f"{stem}_ZeroPointMul")),
                helper.make_node("Sub", [product, correction], [acc], name=name(f"{stem}_ZeroPointSub")),
            ]
        else:
            nodes = [helper.make_node("MatMulInteger", [q, w, z, w_zero], [acc], name=name(f"{stem}_MatMulInteger"))]
        nodes += [
            helper.make_node("Cast", [acc], [acc_f], to=TensorProto.FLOAT, name=name(f"{stem}_Cast")),
            helper.make_node("Mul", [s, w_scale], [scale], name=name(f"{stem}_ScaleMul")),
        ]
        if node.op_type == "Gemm" and len(node.input) > 2 and node.input[2]:
            product = graph.unique_name(f"{scale}_mm")
            nodes += [helper.make_node("Mul", [acc_f, scale], [product], name=name(f"{stem}_Mul")),
                      helper.make_node("Add", [product, node.input[2]], list(node.output), name=name(f"{stem}_Bias"))]
        else:
            nodes.append(helper.make_node("Mul", [acc_f, scale], list(node.output), name=name(f"{stem}_Mul")))
        graph.replace(node, nodes)
