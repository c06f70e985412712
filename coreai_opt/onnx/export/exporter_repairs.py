"""Repairs of what torch's dynamo exporter writes, applied to its ``onnx_ir`` model before anything reads it.

**Unregistered constants.** When two ``Clip`` nodes (``torch.clamp(x, lo, hi)`` with tensor bounds) read the same
input with bounds of their own, torch 2.13's export names the second pair of bound constants ``<input>_min_1`` /
``<input>_max_1`` but registers only the first pair as initializers: the second ``Clip`` reads values that nothing
produces, and the file does not load ("Node input 'mul_min_1' is not a graph input, initializer, or output of a
previous node"; timm's Gemma 4 vision tower, whose q / k / v ``ClippableLinear`` each clamp the same hidden state,
in torch's own float export too). The values still carry their constant: :func:`register_dangling_constants`
registers each as the initializer it was meant to be.
"""

from __future__ import annotations

import onnx_ir as ir

__all__ = ["register_dangling_constants"]


def register_dangling_constants(model: ir.Model) -> list[str]:
    """Register every node input that has a constant value but no producer, graph input or initializer entry.

    Args:
        model: The exporter's model (``ONNXProgram.model``), edited in place.

    Returns:
        The names registered (empty for a well-formed model).
    """
    graph = model.graph
    registered = []
    for node in graph:
        for value in node.inputs:
            if (value is None or value.producer() is not None or value.is_graph_input()
                    or value.const_value is None or graph.initializers.get(value.name) is value):
                continue
            if value.name in graph.initializers:  # a different value of that name: keep both, rename this one
                value.name = f"{value.name}_constant"
            graph.register_initializer(value)
            registered.append(value.name)
    return registered
