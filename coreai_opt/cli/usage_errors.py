"""User-facing CLI errors and their one-line rendering.

A :class:`CliError` is a mistake the user can fix (a missing file, a bad ``module:factory``, calibration data
that does not fit the model). ``coreai-opt`` prints any error as ONE line on stderr and exits with code 2;
``--debug`` re-raises instead so the traceback is shown.
"""

from __future__ import annotations

EXIT_OK = 0
EXIT_VERIFICATION_FAILED = 1
EXIT_USAGE = 2


class CliError(Exception):
    """An error caused by the command line or its input files; its message says what to change."""


def one_line(exc: BaseException) -> str:
    """Render an exception as a single line: whitespace (including newlines) collapsed to single spaces.

    Args:
        exc: The exception to render.

    Returns:
        ``"message"`` for a :class:`CliError`, ``"TypeName: message"`` for anything else.

    Example:
        >>> one_line(ValueError("bad   value"))
        'ValueError: bad value'
    """
    message = " ".join(str(exc).split())
    if isinstance(exc, CliError):
        return message
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__
