"""The error boundary of the public API: no foreign exception leaves coreai_opt without our message in front.

Every public function is decorated with :func:`public_api`. An exception that escapes it is

* passed through unchanged when it is **ours**: a :class:`~coreai_opt.errors.CoreaiOptError`, a pydantic
  ``ValidationError`` of our models (its text is our validators' messages), or a ``ValueError`` /
  ``TypeError`` / ``RuntimeError`` / ``OSError`` raised by a ``raise`` statement in coreai_opt's own code
  (those messages name the problem and the fix, see ``docs/errors.md``);
* passed through unchanged when it is not an ``Exception`` (``KeyboardInterrupt``, ``SystemExit``) or is a
  warning turned into an error by a warnings filter (``-W error``);
* otherwise **foreign** (raised inside torch, onnx, onnxruntime, Python itself, or the user's model or data
  iterator; or an internal slip such as a ``KeyError`` in our code): it is re-raised as the
  :class:`~coreai_opt.errors.UnexpectedError` subclass of its builtin family (``except IndexError`` still
  catches it), with the function, the stage and where it was raised in front of the original message, and the
  original as ``__cause__``.

Stages: ``with error_stage("running calibration batch 3 through the model"):`` inside a public function
labels foreign exceptions that pass through the block (the innermost stage wins).
"""

from __future__ import annotations

import dis
import functools
from collections.abc import Callable
from types import TracebackType
from typing import Any, TypeVar

from pydantic import ValidationError

from coreai_opt.errors import UNEXPECTED_BY_FAMILY, CoreaiOptError, UnexpectedError

__all__ = ["PUBLIC_API_ATTRIBUTE", "public_api", "error_stage", "is_own_error", "wrap_foreign"]

F = TypeVar("F", bound=Callable[..., Any])

#: Attribute :func:`public_api` sets on the functions it wraps (value: the public name).
PUBLIC_API_ATTRIBUTE = "__coreai_opt_public__"

_STAGE_ATTRIBUTE = "__coreai_opt_stage__"
_RAISE_OPCODE = dis.opmap["RAISE_VARARGS"]
#: Builtin families coreai_opt raises deliberately, with its own message.
_DELIBERATE_FAMILIES = (ValueError, TypeError, RuntimeError, OSError)


def _innermost(tb: TracebackType | None) -> TracebackType | None:
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    return tb


def _is_coreai_opt_module(name: str) -> bool:
    return name == "coreai_opt" or name.startswith("coreai_opt.")


def _raised_by_our_raise_statement(exc: BaseException) -> bool:
    """True when the innermost frame of ``exc`` is coreai_opt code executing a ``raise`` statement.

    A ``ValueError`` that a builtin (``int("x")``) or a C extension raised while our code called it has its
    innermost Python frame in our code too, but that frame is executing a call, not ``RAISE_VARARGS``.
    """
    tb = _innermost(exc.__traceback__)
    if tb is None or not _is_coreai_opt_module(str(tb.tb_frame.f_globals.get("__name__", ""))):
        return False
    code = tb.tb_frame.f_code.co_code
    return 0 <= tb.tb_lasti < len(code) and code[tb.tb_lasti] == _RAISE_OPCODE


def is_own_error(exc: BaseException) -> bool:
    """True when ``exc`` carries a coreai_opt message already (see the module docstring)."""
    if isinstance(exc, (CoreaiOptError, ValidationError, Warning)) or not isinstance(exc, Exception):
        return True
    return isinstance(exc, _DELIBERATE_FAMILIES) and _raised_by_our_raise_statement(exc)


def _origin(exc: BaseException) -> str | None:
    tb = _innermost(exc.__traceback__)
    if tb is None:
        return None
    module = str(tb.tb_frame.f_globals.get("__name__", "?"))
    return f"{module}, line {tb.tb_lineno}"


def _hint(origin: str | None) -> str:
    if origin is not None and _is_coreai_opt_module(origin):
        return "this is a coreai_opt bug: please report it with the traceback"
    return ("check the argument or data named above; if they are valid, please report it with the traceback "
            "(the original exception is chained as __cause__)")


def wrap_foreign(exc: Exception, function: str) -> UnexpectedError:
    """Build the :class:`UnexpectedError` that replaces the foreign ``exc`` escaping ``function``."""
    stage = getattr(exc, _STAGE_ATTRIBUTE, None)
    origin = _origin(exc)
    cls = next((wrapper for family, wrapper in UNEXPECTED_BY_FAMILY if isinstance(exc, family)), UnexpectedError)
    kind = f"{type(exc).__module__}.{type(exc).__qualname__}".removeprefix("builtins.")
    where = f" while {stage}" if stage else ""
    raised = f" (raised in {origin})" if origin else ""
    wrapped = cls(f"coreai_opt {function} failed{where}: {kind}: {exc}{raised}; {_hint(origin)}")
    wrapped.function, wrapped.stage, wrapped.origin = function, stage, origin
    if isinstance(exc, OSError) and isinstance(wrapped, OSError):
        wrapped.errno, wrapped.strerror, wrapped.filename = exc.errno, exc.strerror, exc.filename
    return wrapped


def _is_call_error(exc: Exception) -> bool:
    """True for the caller's own mistake binding the arguments (``prepare() missing 1 required argument``).

    Such a ``TypeError`` is raised before the public function's first line runs, so its traceback ends in the
    wrapper's frame. Python's message names the argument; it is re-raised unchanged.
    """
    return isinstance(exc, TypeError) and exc.__traceback__ is not None and exc.__traceback__.tb_next is None


def public_api(function: F) -> F:
    """Decorate a public function so that foreign exceptions leave it as :class:`UnexpectedError`.

    The wrapper carries :data:`PUBLIC_API_ATTRIBUTE` (the public name, ``function.__qualname__``). Apply it
    below ``@classmethod`` / ``@staticmethod``.
    """
    name = function.__qualname__

    @functools.wraps(function)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return function(*args, **kwargs)
        except Exception as exc:
            if is_own_error(exc) or _is_call_error(exc):
                raise
            raise wrap_foreign(exc, name) from exc

    setattr(wrapper, PUBLIC_API_ATTRIBUTE, name)
    return wrapper  # type: ignore[return-value]


class error_stage:  # noqa: N801 - used like a function: ``with error_stage("..."):``
    """Label foreign exceptions passing through the block with ``description`` (the innermost label wins).

    Args:
        description: What the public function is doing, e.g. ``"running calibration batch 3 through the model"``.
    """

    def __init__(self, description: str) -> None:
        self.description = description

    def __enter__(self) -> error_stage:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if exc is not None and not is_own_error(exc) and not hasattr(exc, _STAGE_ATTRIBUTE):
            try:
                setattr(exc, _STAGE_ATTRIBUTE, self.description)
            except (AttributeError, TypeError):  # an exception type without an instance dict
                pass
