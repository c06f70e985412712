r"""Write every ``aten.view`` of a functional graph as ``aten.reshape``, so the graph does not depend on strides.

``torch.export`` records ``x.reshape(shape)`` as ``aten.view`` whenever the *traced* strides of ``x`` allow a view.
Those strides come from the kernels that ran while tracing: ``scaled_dot_product_attention``'s CPU kernel returns
its ``[B, H, T, D]`` output laid out as ``[B, T, H, D]``, so the usual ``out.transpose(1, 2).reshape(B, T, -1)``
is traced as a view. Once the graph computes the same values with other kernels (``decompose_attention``'s
matmuls, or the ONNX exporter's own decomposition of attention) the input is no longer viewable and the view
raises ``view size is not compatible with input tensor's size and stride`` (eager) or ``Cannot view a tensor with
shape ... and strides ...`` (``torch.onnx.export``).

In a graph without in-place ops (every captured graph: see ``functionalize_inplace``) nothing writes through a
view, so a view and a reshape are the same function:

.. math::

    \mathrm{reshape}(x, s) = \begin{cases} \mathrm{view}(x, s) & x \text{ viewable as } s \\
    \mathrm{view}(\mathrm{contiguous}(x), s) & \text{otherwise} \end{cases}

and the rewrite changes no value, only which memory the result may share.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule

from coreai_opt.graph.op_effects import mutates
from coreai_opt.graph.pass_result import PassResult

__all__ = ["views_to_reshapes"]

_VIEW = torch.ops.aten.view.default
_RESHAPE = torch.ops.aten.reshape.default


def views_to_reshapes(gm: GraphModule) -> PassResult:
    """Retarget every ``aten.view.default`` node of ``gm`` to ``aten.reshape.default``.

    A view that an op writes through (an in-place or ``out=`` op among its users) is kept.

    Args:
        gm: A torch.export capture after ``functionalize_inplace``.

    Returns:
        The same module; ``changes`` is the number of views rewritten.
    """
    changes = 0
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is _VIEW and not any(map(mutates, node.users)):
            node.target = _RESHAPE
            changes += 1
    if changes:
        gm.recompile()
    return PassResult(gm, changes)
