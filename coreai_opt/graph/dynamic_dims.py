"""Which input dimensions a ``torch.export`` capture kept symbolic, under readable axis names.

The capture asks for every dimension of every tensor argument to be dynamic where the model allows it
(``Dim.AUTO``); the model's weights and code then fix some (channels, a feature width) and leave the others
symbolic. This module reads the result off the exported program's input placeholders and names each distinct size
symbol once, so that two inputs sharing a size (``input_ids`` and ``attention_mask``: batch and sequence) share
an axis name:

* dimension 0: ``batch`` (one axis for every input, even when the model never relates their batch sizes);
* dimension 1 of a rank-2 or rank-3 input: ``sequence``;
* dimensions 2 and 3 of a rank-4 input: ``height`` and ``width``;
* anything else, and a second, different symbol that would get a name already taken: ``<input>_dim<i>``.

The result, ``{argument name: {dimension: axis name}}``, is what ``export_onnx`` keeps dynamic by default.
"""

from __future__ import annotations

from collections.abc import Collection

import torch

__all__ = ["DynamicAxes", "dynamic_axes", "axis_name"]

#: ``{argument name: {dimension: axis name}}``.
DynamicAxes = dict[str, dict[int, str]]


def axis_name(argument: str, dim: int, rank: int) -> str:
    """The conventional name of dimension ``dim`` of a rank-``rank`` input (see the module docstring)."""
    if dim == 0:
        return "batch"
    if dim == 1 and rank in (2, 3):
        return "sequence"
    if rank == 4 and dim in (2, 3):
        return ("height", "width")[dim - 2]
    return f"{argument}_dim{dim}"


def dynamic_axes(program: torch.export.ExportedProgram, arguments: Collection[str]) -> DynamicAxes:
    """The symbolic dimensions of the top-level tensor ``arguments`` of ``program``, named.

    Args:
        program: The exported program.
        arguments: The forward argument names (nested inputs are not named after an argument and are skipped).

    Returns:
        ``{argument: {dimension: axis name}}`` for every argument with at least one symbolic dimension.
    """
    user_inputs = set(program.graph_signature.user_inputs)
    names_of: dict[str, str] = {}  # size symbol -> axis name
    taken: set[str] = set()
    axes: DynamicAxes = {}
    for node in program.graph.nodes:
        value = node.meta.get("val")
        if node.op != "placeholder" or node.name not in user_inputs or node.name not in arguments:
            continue
        if not isinstance(value, torch.Tensor):
            continue
        for dim, size in enumerate(value.shape):
            if not isinstance(size, torch.SymInt) or not size.node.expr.free_symbols:
                continue
            symbol = "batch" if dim == 0 else str(size.node.expr)  # inputs of one call share their batch
            if symbol not in names_of:
                name = axis_name(node.name, dim, value.dim())
                names_of[symbol] = name if name not in taken else f"{node.name}_dim{dim}"
                taken.add(names_of[symbol])
            axes.setdefault(node.name, {})[dim] = names_of[symbol]
    return axes
