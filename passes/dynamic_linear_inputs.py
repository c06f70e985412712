"""Restrict dynamic activation quantizers to the inputs of linear layers (dynamic-quantization semantics).

A dynamic quantizer exists to feed an integer matmul (onnxruntime ``DynamicQuantizeMatMul``); anywhere else it
only adds error and a float round trip. After ``insert_quantizers`` a dynamic quantizer sits on a producer's
output and is shared by every consumer (a LayerNorm output feeds the Q/K/V linears *and* the residual add).
This pass makes every consumer that is not a linear layer read the float tensor again and deletes dynamic
quantizer calls (and modules) left without users, e.g. the ones on linear outputs. Static quantizers are
untouched.

A linear reached through value-moving ops only (reshape, transpose, dropout: ``MOVER_KINDS``), such as an
attention output projection fed by ``transpose → reshape``, gets its own call of the quantizer right before it:
per-tensor dynamic quantization commutes with moving values (same values, same min/max, same qparams), so this
is exact, and the exported ``DequantizeLinear`` then feeds the ``MatMul`` directly, which is the pattern
:func:`coreai_opt.onnx.dynamic_matmul.fuse_dynamic_matmuls` rewrites.
"""

from __future__ import annotations

from torch.fx import GraphModule, Node

from coreai_opt.passes.node_meta import META_KEY as _META
from coreai_opt.passes.node_meta import copy_provenance, get_meta
from coreai_opt.passes.op_kinds import MOVER_KINDS, OpKind
from coreai_opt.passes.pass_result import PassResult

__all__ = ["dynamic_linear_inputs"]


def _is_dynamic(gm: GraphModule, target: object) -> bool:
    try:
        module = gm.get_submodule(str(target))
    except AttributeError:
        return False
    return bool(getattr(module, "exports_dynamic", False))


def _linears_through_moves(node: Node) -> list[tuple[Node, Node]]:
    """``(linear, its input)`` for every linear reached from ``node`` through move ops only."""
    found, stack = [], [node]
    while stack:
        current = stack.pop()
        for user in current.users:
            kind = get_meta(user).kind
            if kind is OpKind.LINEAR and user.args and user.args[0] is current:
                found.append((user, current))
            elif kind in MOVER_KINDS and user.args and user.args[0] is current:
                stack.append(user)
    return found


def dynamic_linear_inputs(gm: GraphModule) -> PassResult:
    """Rewire non-linear consumers of dynamic quantizers to the float tensor; drop unused dynamic quantizers.

    Args:
        gm: A GraphModule after ``insert_quantizers``.

    Returns:
        ``PassResult`` counting rewired uses plus removed calls.
    """
    changes = 0
    for node in list(gm.graph.nodes):
        if node.op != "call_module" or not _is_dynamic(gm, node.target):
            continue
        source = node.args[0]
        for user in list(node.users):
            if get_meta(user).kind is OpKind.LINEAR:
                continue
            if get_meta(user).kind in MOVER_KINDS:
                for linear, feeding in _linears_through_moves(user):
                    with gm.graph.inserting_before(linear):
                        call = gm.graph.call_module(str(node.target), (feeding,))
                    copy_provenance(node, call)
                    call.meta[_META] = get_meta(node)
                    linear.replace_input_with(feeding, call)
                    changes += 1
            user.replace_input_with(node, source)
            changes += 1
        if not node.users:
            target = str(node.target)
            gm.graph.erase_node(node)
            if not any(n.op == "call_module" and n.target == target for n in gm.graph.nodes):
                gm.delete_submodule(target)
            changes += 1
    gm.graph.lint()
    gm.recompile()
    return PassResult(gm, changes)
