"""Emulate int8-compute ``MatMulNBits`` in eager: an ``Int8ComputeActivation`` on the input of those linears.

A linear whose weight quantizer's spec says ``matmul_compute="int8"`` and whose input is not an 8-bit (static or
dynamic) activation quantizer runs in onnxruntime as ``MatMulNBits(accuracy_level=4)``, which quantizes its input
to int8 per row and per K block. This pass inserts, right before each such linear, on its own input edge::

    x ──► call_module <linear>_int8_compute (Int8ComputeActivation(block_size)) ──► linear(·, W_q, b)

with the block size of :func:`~coreai_opt.quantization.spec.matmul_compute.matmul_nbits_block_size` (the
weight's
own block, or one block per row capped at 256), the one the ONNX rule writes. Other readers of ``x`` are untouched.
A linear with an 8-bit activation quantizer runs on onnxruntime's integer kernels (QLinearMatMul / QGemm /
DynamicQuantizeMatMul), not MatMulNBits, so it gets nothing. Run after ``insert_quantizers`` (and before
``insert_weight_statistics``, so data-aware rounding sees the int8 input the linear computes with).
"""

from __future__ import annotations

import re

from torch.fx import GraphModule, Node

from coreai_opt.graph.node_meta import NodeMeta, Role, copy_provenance, get_meta, set_meta
from coreai_opt.graph.op_kinds import ArgLayout, OpKind, lookup_op
from coreai_opt.graph.pass_result import PassResult
from coreai_opt.quantization.matmul_nbits.int8_compute_op import Int8ComputeActivation
from coreai_opt.quantization.spec import PerBlock
from coreai_opt.quantization.spec.matmul_compute import get_matmul_compute, matmul_nbits_block_size

__all__ = ["int8_compute_inputs"]


def _module(gm: GraphModule, node: object) -> object | None:
    if not isinstance(node, Node) or node.op != "call_module":
        return None
    return gm.get_submodule(str(node.target))


def _int8_weight(gm: GraphModule, node: object) -> object | None:
    """The weight FakeQuantize called by ``node`` when its spec asks for int8 compute."""
    info = get_meta(node).quantizer if isinstance(node, Node) else None
    fq = _module(gm, node) if info is not None and info.role is Role.WEIGHT else None
    spec = getattr(fq, "spec", None)
    return fq if spec is not None and get_matmul_compute(spec.matmul_compute).quantizes_activation else None


def _input_is_8_bit(gm: GraphModule, x: Node) -> bool:
    info = get_meta(x).quantizer
    fq = _module(gm, x) if info is not None and info.role is Role.ACTIVATION else None
    if fq is None:
        return False
    dtype = fq.spec.dtype_info
    return fq.exports_dynamic or (not dtype.is_float and dtype.bits == 8)


def _block_size(gm: GraphModule, linear: Node, weight_call: Node, fq: object, layout: ArgLayout) -> int:
    weight = weight_call.args[0]
    shape = tuple(gm.get_parameter(str(weight.target)).shape) if weight.op == "get_attr" else None
    if shape is None or len(shape) != 2:
        raise ValueError(f"{get_meta(linear).module_name or linear.name}: matmul_compute='int8' needs a 2-D "
                         "weight stored in the model; use matmul_compute='float' for this layer")
    k_axis = dict(layout.weight_axes or ()).get(1, 1)
    granularity = fq.spec.granularity
    if isinstance(granularity, PerBlock) and granularity.axis % 2 != k_axis:
        raise ValueError(f"{get_meta(linear).module_name or linear.name}: matmul_compute='int8' needs weight blocks "
                         f"along the input features (axis {k_axis}), got {granularity}")
    return matmul_nbits_block_size(granularity, shape[k_axis])


def int8_compute_inputs(gm: GraphModule) -> PassResult:
    """Insert the ``Int8ComputeActivation`` calls described in the module docstring.

    Args:
        gm: A GraphModule after ``insert_quantizers``.

    Returns:
        ``PassResult`` counting inserted calls.

    Raises:
        ValueError: an int8-compute weight that ``MatMulNBits`` cannot hold (names the layer and the fix).
    """
    changes = 0
    for linear in list(gm.graph.nodes):
        if get_meta(linear).kind is not OpKind.LINEAR:
            continue
        layout = lookup_op(linear, gm).layout
        weight_call = ArgLayout.get(linear, layout.weight)
        x = ArgLayout.get(linear, layout.data[0]) if layout.data else None
        fq = _int8_weight(gm, weight_call)
        if fq is None or not isinstance(x, Node) or _input_is_8_bit(gm, x):
            continue
        block_size = _block_size(gm, linear, weight_call, fq, layout)
        module_name = get_meta(linear).module_name or linear.name
        target, i = re.sub(r"\W+", "_", module_name).strip("_") + "_int8_compute", 1
        base = target
        while hasattr(gm, target):
            target, i = f"{base}_{i}", i + 1
        module = Int8ComputeActivation(block_size)
        module.set_name(f"{module_name}.int8_compute")
        gm.add_submodule(target, module)
        with gm.graph.inserting_before(linear):
            call = gm.graph.call_module(target, (x,))
        copy_provenance(x, call)
        set_meta(call, NodeMeta(kind=OpKind.OTHER, module_name=get_meta(linear).module_name,
                                module_type=get_meta(linear).module_type))
        linear.replace_input_with(x, call)
        changes += 1
    return PassResult.after_edits(gm, changes)
