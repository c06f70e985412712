r"""Remove a shared quantizer's second call where its output only another quantizer reads (one rounding per edge).

A quantizer shared across a value-moving op (split, reshape, slice, max-pool: movers share their input's quantizer)
is called again on the moved tensor, ``A(move(A(x)))``; the second call is the identity, its input already lies on
``A``'s grid. After :func:`~coreai_opt.passes.drop_redundant_activations.drop_redundant_activations` bypasses a
ReLU, that second call can read straight into the ReLU's output quantizer ``B``: MobileViTV2's attention reads
``relu(value)`` of a split of the quantized q / k / v projection. (Under one activation spec the ReLU now shares
``A`` instead, :mod:`~coreai_opt.passes.annotate`; ``B`` remains where the config gives the ReLU, or any reader,
a spec of its own.) Eager computes ``B(A(v)) = B(v)``; the file says ``Q_A → DQ_A → Q_B → DQ_B``.

onnxruntime does not run that file as written. Its ``DoubleQDQPairsRemover`` turns the two pairs into one over
the intersection of their ranges,

.. math::

    lo = \max((q_{min} - z_A) s_A, (q_{min} - z_B) s_B),\quad
    hi = \min((q_{max} - z_A) s_A, (q_{max} - z_B) s_B),\quad
    s = \frac{hi - lo}{q_{max} - q_{min}},\quad z = \mathrm{round}(q_{min} - lo / s),

which is ``B`` only where ``B``'s range lies inside ``A``'s. ``B``'s range is calibrated on float values and can
exceed what ``A`` represents by up to half a step (MobileViTV2: 0.5317 against 0.5300), and onnxruntime then
quantizes at a third scale (0.0020785 for the file's 0.0020851), a step off eager on part of the tensor;
``verify_onnx`` does not see it (its instrumented copy reads every quantizer's output, which keeps pairs apart).

Dropping the identity call makes the file say ``B(v)``, as eager computes, with no pair left to merge. Exact:
only a call whose input reaches, through movers and identities, a call of the same quantizer goes, so ``convert``
still changes no output. Only frozen (export-mode), integer, activation quantizers take part, and only where
nothing else reads the call's values (a reader of its shape alone, as ``y.expand_as(x)``, moves to its input).
"""

from __future__ import annotations

from torch.fx import GraphModule, Node

from coreai_opt.graph.identity_ops import is_identity
from coreai_opt.graph.node_meta import Role, called_quantizer, get_meta
from coreai_opt.graph.op_kinds import MOVER_KINDS
from coreai_opt.graph.pass_result import PassResult
from coreai_opt.graph.shape_queries import reads_only_metadata
from coreai_opt.quantization.fake_quantize.fake_quantize import FakeQuantize

__all__ = ["drop_requantizations"]


def _frozen_activation_quantizer(gm: GraphModule, node: Node) -> FakeQuantize | None:
    fq = called_quantizer(gm, node, Role.ACTIVATION)
    return fq if fq is not None and fq.export_mode and not fq.spec.dtype_info.is_float else None


def _only_value_reader(node: Node, reader: Node) -> bool:
    """True when ``reader`` is the only user of ``node`` that reads its values."""
    return all(user is reader or reads_only_metadata(user, node) for user in node.users)


def _on_own_grid(gm: GraphModule, call: Node) -> bool:
    """True when ``call``'s input is, through movers and identities, the output of a call of the same quantizer."""
    link = call.args[0]
    while isinstance(link, Node) and get_meta(link).quantizer is None and link.args \
            and (get_meta(link).kind in MOVER_KINDS or is_identity(gm, link)):
        link = link.args[0]
    return isinstance(link, Node) and link.op == "call_module" and link.target == call.target \
        and get_meta(link).quantizer is not None


def drop_requantizations(gm: GraphModule) -> PassResult:
    """Bypass every identity call of a shared quantizer whose output only another quantizer reads (module docstring).

    Identities between the two (``nn.Identity``, an eval-mode dropout) are looked through.

    Args:
        gm: A converted GraphModule (quantizers in export mode).

    Returns:
        ``PassResult`` counting the quantizer calls removed.
    """
    changes = 0
    for node in list(gm.graph.nodes):
        if _frozen_activation_quantizer(gm, node) is None or len(node.args) != 1:
            continue
        reader, source = node, node.args[0]
        while isinstance(source, Node) and is_identity(gm, source) and _only_value_reader(source, reader):
            reader, source = source, source.args[0]  # timm's BatchNormAct2d: bn → drop (Identity) → act
        if not isinstance(source, Node) or len(source.args) != 1 or _frozen_activation_quantizer(gm, source) is None \
                or not _on_own_grid(gm, source):
            continue
        if not _only_value_reader(source, reader):
            continue  # another reader takes A's values
        for user in list(source.users):  # shape readers see the same shape on A's input
            user.replace_input_with(source, source.args[0])
        gm.graph.erase_node(source)
        changes += 1
    if changes:
        gm.graph.lint()
        gm.recompile()
    return PassResult(gm, changes)
