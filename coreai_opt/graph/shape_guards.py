"""Refuse an exported graph that is only valid for some sizes of a dimension we asked to be dynamic.

``torch.export`` traces one path through ``forward``. When the code branches on a dynamic size
(``if x.shape[0] == 1:``) the exporter records a *guard* (``x.size(0) != 1`` for an example of batch 8) and the
graph holds only the branch the example took; when it forces a size (``if x.shape[0] == 8:``, a reshape to a
literal batch) the dimension becomes a constant. The guards live in a ``_guards_fn`` call that capture removes
(other passes must not see it, it cannot be pickled, and ONNX cannot express ``!= 1``), so such a graph would
silently run the wrong branch. Capture therefore exports with ``backed_size_oblivious`` (a size-1 comparison
becomes a guard instead of the exporter's silent assumption that dynamic sizes are never 0 or 1) and this module
refuses, with a :class:`~coreai_opt.graph.capture_error.ShapeGuardError` naming the input, the dimension, the
condition, the source line and the fixes:

* every dynamic dimension that came out constant;
* every guard on a dynamic dimension raised by code outside the ``torch`` package (the model's own branches).

Guards raised inside torch's own operators (e.g. ``nn.MultiheadAttention`` choosing a kernel for batch 1) are
accepted: those operators compute the same function for every size.
"""

from __future__ import annotations

import linecache
import os
import re
import traceback
from typing import Any

import sympy
import torch

from coreai_opt.graph.capture_error import ShapeGuardError

__all__ = ["check_shape_guards", "shape_env_of"]

_TORCH_DIR = os.path.dirname(torch.__file__)
_SOURCE = re.compile(r"^L\['(?P<name>[^']+)'\](?P<path>.*)\.size\(\)\[(?P<dim>\d+)\]$")
_RELATIONS = {sympy.Eq: "==", sympy.Ne: "!=", sympy.Lt: "<", sympy.Le: "<=", sympy.Gt: ">", sympy.Ge: ">="}


def shape_env_of(program: torch.export.ExportedProgram) -> Any:
    """The ``ShapeEnv`` ``program`` was traced under (its sizes, their ranges and guards); None without one."""
    for node in program.graph.nodes:
        value = node.meta.get("val")
        fake_mode = getattr(value, "fake_mode", None)
        if fake_mode is not None and fake_mode.shape_env is not None:
            return fake_mode.shape_env
    return None


def _dimension(sources: list[Any]) -> tuple[str, str]:
    """``("dimension 0 of input 'x'", "x.size(0)")`` from the exporter's source of a size symbol."""
    name = sources[0].name if sources else "?"
    name = name() if callable(name) else str(name)
    match = _SOURCE.match(name)
    if match is None:
        return f"the size {name}", name
    where = f"{match['name']}{match['path']}"
    return f"dimension {match['dim']} of input '{where}'", f"{where}.size({match['dim']})"


def _frame(sloc: Any) -> tuple[str, int] | None:
    """``(file, line)`` of a guard's source location (the user frame when the exporter found one)."""
    for loc in (getattr(sloc, "maybe_user_loc", None), getattr(sloc, "framework_loc", None)):
        if isinstance(loc, traceback.FrameSummary) and loc.lineno is not None:
            return loc.filename, loc.lineno
        if isinstance(loc, str):
            match = re.search(r"(\S+):(\d+)", loc)
            if match:
                return match[1], int(match[2])
    return None


def _is_user_code(frame: tuple[str, int] | None) -> bool:
    return frame is not None and not os.path.abspath(frame[0]).startswith(_TORCH_DIR + os.sep)


def _where(frame: tuple[str, int] | None) -> str:
    if frame is None:
        return ""
    code = linecache.getline(frame[0], frame[1]).strip()
    return f" at {frame[0]}:{frame[1]}" + (f" ({code})" if code else "")


def _condition(expr: Any, names: dict[Any, str]) -> str:
    rendered = expr.subs({sym: sympy.Symbol(text) for sym, text in names.items()})
    relation = _RELATIONS.get(type(rendered))
    return f"{rendered.lhs} {relation} {rendered.rhs}" if relation else str(rendered)


def _fixes(where: str, data_dependent: bool) -> str:
    static = (f"if only one size is ever used, capture it fixed: prepare(..., dynamic_shapes={{'{where}': None}}) "
              "and export_onnx(..., dynamic_batch=False)")
    if data_dependent:
        return f"make forward independent of that size (e.g. torch.where instead of an if), or {static}"
    return f"remove the size-dependent code (e.g. reshape with -1 instead of a literal size), or {static}"


def _holds_from_two(expr: Any, sym: Any) -> bool:
    """Whether guard ``expr`` holds for every size ``sym >= 2`` (e.g. ``s > 1``, ``s != 1``: a size-1 fast path).

    ``torch.export`` itself assumes every dynamic size is at least 2; an optional dimension keeps that assumption
    instead of being captured static for a branch that only size 0 or 1 would take.
    """
    above = sympy.Symbol("_k", integer=True, nonnegative=True)
    return bool(expr.subs(sym, above + 2) == sympy.true)


def check_shape_guards(
    program: torch.export.ExportedProgram, model_name: str, optional: frozenset[str] = frozenset()
) -> frozenset[str]:
    """Raise when ``program`` specialises or guards a dimension that was exported as dynamic.

    Args:
        program: The exported program (before ``.module()``).
        model_name: The model's class name, for the message.
        optional: Dimensions (``"x.size(1)"``) that are dynamic only where the model allows it: one the model fixes
            is accepted as a constant, one it guards is returned instead of raised (capture them static), except
            for guards that hold for every size >= 2 (see :func:`_holds_from_two`), which are accepted.

    Returns:
        The optional dimensions the model's own code guards.

    Raises:
        ShapeGuardError: names the input and dimension, the condition, the source line and the fixes.
    """
    env = shape_env_of(program)
    if env is None:
        return frozenset()
    names = {sym: _dimension(sources)[1] for sym, sources in env.var_to_sources.items()}
    user_guards = [guard for guard in env.guards if _is_user_code(_frame(guard.sloc))]
    guarded = frozenset(text for sym, sources in env.var_to_sources.items()
                        if (text := _dimension(sources)[1]) in optional
                        and any(sym in guard.expr.free_symbols and not _holds_from_two(guard.expr, sym)
                                for guard in user_guards))
    if guarded:  # a guard may involve a required dimension too: judge those once the optional ones are static
        return guarded
    for sym, sources in env.var_to_sources.items():
        dimension, text = _dimension(sources)
        if text in optional:
            continue
        top = text.split(".")[0].split("[")[0]
        value = env.replacements.get(sym)
        if value is not None and getattr(value, "is_number", False):
            frame = _frame(env.replacements_slocs.get(sym))
            raise ShapeGuardError(
                f"{dimension} was exported as dynamic, but {model_name}.forward fixes it to {value}"
                f"{_where(frame)}; the graph would be wrong for any other size. Fix: {_fixes(top, False)}"
            )
        for guard in env.guards:
            frame = _frame(guard.sloc)
            if sym in guard.expr.free_symbols and _is_user_code(frame):
                raise ShapeGuardError(
                    f"{model_name}.forward branches on {dimension}{_where(frame)}: the graph torch.export captured "
                    f"holds only the branch taken when {_condition(guard.expr, names)} (the example has "
                    f"{text} = {env.backed_var_to_val.get(sym)}) and would silently take it for every other size too. "
                    f"Fix: {_fixes(top, True)}"
                )
    return frozenset()
