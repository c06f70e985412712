"""Derived int32 bias scales computed once for the export, not traced as arithmetic between two quantizers.

A converted graph calls each ``BiasFakeQuantize`` with the bias and the layer's input and weight quantizers
(``get_attr`` nodes), and its forward computes ``s_b = s_in · s_w`` from their scales. Traced as is, every bias
adds the two quantizers' qparams to the program and a reshape / two casts / a multiply / a zeros to fold away: on a
ResNet-18 that is 168 of the 631 nodes the exporter (capture, decompositions, translation, optimizer) walks.
:func:`bias_scales_frozen` resolves those ``get_attr`` arguments and freezes each bias quantizer's ``(s_b, 0)``
(:meth:`~coreai_opt.quantization.fake_quantize.bias_fake_quantize.BiasFakeQuantize.scale_frozen`) for the ``with``
block; the file's values are the same (the product is the one the forward computes). A bias quantizer whose
arguments are not constants of the graph (computed at run time) is left to compute its scale as before.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from torch import Tensor, fx, nn

from coreai_opt.quantization.fake_quantize.bias_fake_quantize import BiasFakeQuantize
from coreai_opt.quantization.fake_quantize.fake_quantize import FakeQuantize

__all__ = ["bias_scales_frozen"]


def _graph_constant(owner: fx.GraphModule, arg: object) -> Tensor | FakeQuantize | None:
    """The tensor or export-mode quantizer a ``get_attr`` argument names (None: anything else)."""
    if not isinstance(arg, fx.Node) or arg.op != "get_attr":
        return None
    try:
        value = functools.reduce(getattr, str(arg.target).split("."), owner)
    except AttributeError:
        return None
    if isinstance(value, FakeQuantize):
        return value if value.export_mode and value.stateful else None
    return value if isinstance(value, Tensor) else None


@contextmanager
def bias_scales_frozen(model: nn.Module) -> Iterator[int]:
    """Freeze the scale of every bias quantizer whose three arguments are graph constants; yields how many."""
    with ExitStack() as stack:
        frozen: set[int] = set()
        for owner in model.modules():
            if not isinstance(owner, fx.GraphModule):
                continue
            for node in owner.graph.nodes:
                if node.op != "call_module" or len(node.args) != 3:
                    continue
                module = owner.get_submodule(str(node.target))
                if not isinstance(module, BiasFakeQuantize) or id(module) in frozen or not module.fake_quant_enabled:
                    continue
                bias, input_scale, weight_scale = (_graph_constant(owner, a) for a in node.args)
                if not isinstance(bias, Tensor) or input_scale is None or weight_scale is None:
                    continue
                stack.enter_context(module.scale_frozen(bias, input_scale, weight_scale))
                frozen.add(id(module))
        yield len(frozen)
