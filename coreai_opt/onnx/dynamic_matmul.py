"""ONNX post-pass: run dynamically quantized linears on onnxruntime's integer kernels.

The spec layer exports a dynamic activation quantizer as ``DynamicQuantizeLinear → DequantizeLinear`` and a
static int8 weight as an int8 initializer ``→ DequantizeLinear (→ Transpose)``. onnxruntime does not fuse that
QDQ pattern around ``MatMul`` into an integer kernel (it turns the weight into a float ``MatMulNBits`` and keeps
the activation round trip, slower than fp32). This pass rewrites every::

    q, s, z = DynamicQuantizeLinear(x)
    MatMul(DequantizeLinear(q, s, z), [Transpose](DequantizeLinear(W_q, s_w, 0)))

(and the same with ``Gemm(transB=1)`` plus its bias) into the integer form ``quantize_dynamic`` produces,
which onnxruntime fuses into ``DynamicQuantizeMatMul``::

    Mul(Cast(MatMulInteger(q, W_q', z, 0), FLOAT), Mul(s, s_w))

with ``W_q'`` the ``[K, N]`` int8 weight (transposed once, offline) and ``s_w`` a scalar or a per-column ``[N]``
scale. Mathematically ``Σ_k (q_k − z)·s · W_kn·s_wn = s·s_wn · Σ_k (q_k − z)·W_kn``: the result differs from the
QDQ graph only by float32 summation order (the integer sum is exact). Other consumers of the
``DequantizeLinear`` output (e.g. a residual ``Add``) keep reading it. Weights with a non-zero zero point or a
per-row scale are left alone.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from coreai_opt.onnx.graph_index import attributes_of, producers_of, remove_dead

__all__ = ["fuse_dynamic_matmuls"]


def _weight_from(name: str, producers: dict[str, onnx.NodeProto], inits: dict[str, np.ndarray],
                 transposed: bool = False) -> tuple[np.ndarray, np.ndarray] | None:
    """``(W_q as [K, N] int8, s_w of shape () or (N,))`` when ``name`` is a constant int8 symmetric weight."""
    node = producers.get(name)
    if node is not None and node.op_type == "Transpose":
        if list(attributes_of(node).get("perm", [1, 0])) != [1, 0]:
            return None
        transposed, node = not transposed, producers.get(node.input[0])
    if node is None or node.op_type != "DequantizeLinear" or node.input[0] not in inits or node.input[1] not in inits:
        return None
    w, scale = inits[node.input[0]], inits[node.input[1]]
    zero = inits.get(node.input[2]) if len(node.input) > 2 and node.input[2] else np.zeros((), np.int8)
    if w.dtype != np.int8 or w.ndim != 2 or zero is None or np.any(zero != 0) or scale.dtype != np.float32:
        return None
    axis = int(attributes_of(node).get("axis", 1)) % 2
    if scale.size > 1 and attributes_of(node).get("block_size", 0):
        return None
    if transposed:
        w = w.T
        axis = 1 - axis
    if scale.size > 1 and axis != 1:  # per-row (input channel) scales cannot be factored out of the sum
        return None
    return np.ascontiguousarray(w), scale.reshape(()) if scale.size == 1 else scale.reshape(-1)


def fuse_dynamic_matmuls(model: onnx.ModelProto) -> int:
    """Rewrite dynamic-activation × int8-weight MatMuls in place (module docstring); return how many.

    Dead weight ``DequantizeLinear`` / ``Transpose`` nodes and unused initializers are removed afterwards.
    """
    graph = model.graph
    inits = {i.name: numpy_helper.to_array(i) for i in graph.initializer}
    producers = producers_of(graph)
    taken = {o for n in graph.node for o in n.output} | set(inits) | {i.name for i in graph.input}
    rewritten = 0
    new_nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        attrs = attributes_of(node)
        gemm_ok = node.op_type == "Gemm" and attrs.get("transA", 0) == 0 and attrs.get("alpha", 1.0) == 1.0 \
            and attrs.get("beta", 1.0) == 1.0
        if node.op_type != "MatMul" and not gemm_ok:
            new_nodes.append(node)
            continue
        dq = producers.get(node.input[0])
        dql = producers.get(dq.input[0]) if dq is not None and dq.op_type == "DequantizeLinear" else None
        weight = _weight_from(node.input[1], producers, inits, transposed=node.op_type == "Gemm" and
                              bool(attrs.get("transB", 0)))
        if dql is None or dql.op_type != "DynamicQuantizeLinear" or weight is None or \
                list(dq.input[1:3]) != list(dql.output[1:3]):
            new_nodes.append(node)
            continue
        w, w_scale = weight
        stem = node.name or node.output[0]
        names = {}
        for key in ("w", "w_zero", "w_scale", "acc", "acc_f", "scale"):
            base, i = f"{stem}_dyn_{key}", 0
            while f"{base}{i or ''}" in taken:
                i += 1
            names[key] = f"{base}{i or ''}"
            taken.add(names[key])
        graph.initializer.extend([
            numpy_helper.from_array(w, names["w"]),
            numpy_helper.from_array(np.zeros(w_scale.shape, np.int8), names["w_zero"]),
            numpy_helper.from_array(w_scale.astype(np.float32), names["w_scale"]),
        ])
        q, s, z = dql.output
        new_nodes += [
            helper.make_node("MatMulInteger", [q, names["w"], z, names["w_zero"]], [names["acc"]],
                             name=f"{stem}_MatMulInteger"),
            helper.make_node("Cast", [names["acc"]], [names["acc_f"]], to=TensorProto.FLOAT, name=f"{stem}_Cast"),
            helper.make_node("Mul", [s, names["w_scale"]], [names["scale"]], name=f"{stem}_ScaleMul"),
        ]
        if node.op_type == "Gemm" and len(node.input) > 2 and node.input[2]:
            mm = f"{names['scale']}_mm"
            taken.add(mm)
            new_nodes += [helper.make_node("Mul", [names["acc_f"], names["scale"]], [mm], name=f"{stem}_Mul"),
                          helper.make_node("Add", [mm, node.input[2]], list(node.output), name=f"{stem}_Bias")]
        else:
            new_nodes.append(helper.make_node("Mul", [names["acc_f"], names["scale"]], list(node.output),
                                              name=f"{stem}_Mul"))
        rewritten += 1
    if rewritten:
        del graph.node[:]
        graph.node.extend(new_nodes)
        remove_dead(graph)
    return rewritten

