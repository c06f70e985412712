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

:func:`axis_bounds` reads the largest size the capture allows for each named axis, where the model's code bounds
it (a table of 64 position embeddings: ``{"sequence": 64}``, read off the capture's guards). ``export_onnx`` declares it
(``Dim("sequence", max=64)``): torch's exporter, given an unbounded axis, traces the whole model, fails its guard
``sequence <= 64``, and traces it again with the bound it suggests, which doubled the capture of hf DistilBERT and
DeBERTa-v2.
"""

from __future__ import annotations

from collections.abc import Collection

import sympy
import torch

from coreai_opt.graph.shape_guards import shape_env_of

__all__ = ["DynamicAxes", "axis_bounds", "dynamic_axes", "axis_name"]

#: Sizes at or above this count as unbounded (torch's own int32 limit for a symbolic size).
_LARGEST_SIZE = 2**31
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
    return {argument: {dim: name for dim, (name, _) in dims.items()}
            for argument, dims in _named_sizes(program, arguments).items()}


def axis_bounds(program: torch.export.ExportedProgram, arguments: Collection[str]) -> dict[str, int]:
    """The largest size ``program`` allows for each axis :func:`dynamic_axes` names, where it is bounded.

    The capture records a bound as a guard on the size symbol (under ``backed_size_oblivious``, a position table
    of 64 rows guards ``Eq(s, Min(64, s))``, not a range). The bound is the largest size ``n`` at which every guard
    on that symbol alone holds, found from the example size up: doubling until a guard fails, then bisecting, and
    kept only when the guards hold at ``n`` and fail at ``n + 1``. Several symbols under one name (the batch of
    several inputs) get the smallest bound; unbounded axes (none up to 2^31) are left out.
    """
    env = shape_env_of(program)
    if env is None:
        return {}
    guards = [guard.expr.xreplace(env.replacements) for guard in env.guards]
    bounds: dict[str, int] = {}
    for dims in _named_sizes(program, arguments).values():
        for name, size in dims.values():
            symbol = size.node.expr
            example = env.backed_var_to_val.get(symbol)
            if not isinstance(symbol, sympy.Symbol) or example is None:
                continue
            upper = _largest_size([g for g in guards if g.free_symbols == {symbol}], symbol, int(example))
            if upper is not None:
                bounds[name] = min(bounds.get(name, upper), upper)
    return bounds


def _largest_size(guards: list[sympy.Basic], symbol: sympy.Symbol, example: int) -> int | None:
    """The largest ``n >= example`` at which all ``guards`` hold, if they stop holding below 2^31 (see above)."""

    def holds(n: int) -> bool:
        return all(guard.xreplace({symbol: sympy.Integer(n)}) == sympy.true for guard in guards)

    if not guards or example < 1 or not holds(example):
        return None
    low, high = example, 2 * example
    while holds(high):
        if high >= _LARGEST_SIZE:
            return None
        low, high = high, 2 * high
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if holds(middle) else (low, middle)
    return low if low >= 2 and not holds(low + 1) else None


def _named_sizes(program: torch.export.ExportedProgram, arguments: Collection[str]
                 ) -> dict[str, dict[int, tuple[str, torch.SymInt]]]:
    """``{argument: {dimension: (axis name, symbolic size)}}`` (the naming rules of the module docstring)."""
    user_inputs = set(program.graph_signature.user_inputs)
    names_of: dict[str, str] = {}  # size symbol -> axis name
    taken: set[str] = set()
    axes: dict[str, dict[int, tuple[str, torch.SymInt]]] = {}
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
            axes.setdefault(node.name, {})[dim] = (names_of[symbol], size)
    return axes
