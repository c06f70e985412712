"""The coreai_opt error hierarchy: every error coreai_opt raises on purpose, and the wrappers of foreign ones.

Every class derives from :class:`CoreaiOptError` *and* from the builtin exception the code raised before the
hierarchy existed, so ``except ValueError`` / ``except RuntimeError`` keep working::

    CoreaiOptError(Exception)
    ├── CoreaiOptValueError(ValueError)          bad values: data, configs, specs, shapes, names
    │   ├── InputValidationError                 an argument of a public function (named, with the fix)
    │   ├── QParamsRangeError                    a range / scale that float32 cannot hold (names the quantizer)
    │   └── ConfigImportError                    a config names a class in a module that is not imported
    ├── CoreaiOptTypeError(TypeError)            wrong kinds of arguments
    ├── CoreaiOptRuntimeError(RuntimeError)      wrong state or order of calls
    │   └── CalibrationInProgressError           a second calibrate on a model that is being calibrated
    ├── CoreaiOptFileNotFoundError(FileNotFoundError)
    └── UnexpectedError                          a foreign exception (torch, onnx, Python, the user's model or
        ├── UnexpectedValueError(ValueError)     data) that escaped a public function: our message in front,
        ├── UnexpectedRuntimeError(RuntimeError) the original as ``__cause__``; one subclass per builtin family
        └── ...                                  (see :data:`UNEXPECTED_BY_FAMILY`)

This module imports nothing from coreai_opt, so every layer (the spec layer included) may raise these.
:mod:`coreai_opt.error_boundary` turns foreign exceptions into ``Unexpected*`` errors at public entry points.
"""

from __future__ import annotations

__all__ = [
    "CoreaiOptError",
    "CoreaiOptValueError",
    "CoreaiOptTypeError",
    "CoreaiOptRuntimeError",
    "CoreaiOptFileNotFoundError",
    "InputValidationError",
    "QParamsRangeError",
    "ConfigImportError",
    "CalibrationInProgressError",
    "UnexpectedError",
    "UNEXPECTED_BY_FAMILY",
]


class CoreaiOptError(Exception):
    """Base of every error coreai_opt raises: ``except coreai_opt.errors.CoreaiOptError`` catches them all."""


class CoreaiOptValueError(CoreaiOptError, ValueError):
    """A value coreai_opt cannot work with (the message names it and the fix)."""


class CoreaiOptTypeError(CoreaiOptError, TypeError):
    """An argument of the wrong kind (the message names it and what to pass)."""


class CoreaiOptRuntimeError(CoreaiOptError, RuntimeError):
    """A call in the wrong state or order (the message says which call to make first)."""


class CoreaiOptFileNotFoundError(CoreaiOptError, FileNotFoundError):
    """A file or directory that must exist does not."""


class InputValidationError(CoreaiOptValueError):
    """An input of a public function does not fit the model (token ids, empty batches, shapes, dtypes, names)."""


class QParamsRangeError(CoreaiOptValueError):
    """A quantizer's range or scale is not finite in float32 (NaN statistics, a scale of inf or 0)."""


class ConfigImportError(CoreaiOptValueError):
    """A config names a class whose module is not imported; coreai_opt never imports it (that runs its code)."""


class CalibrationInProgressError(CoreaiOptRuntimeError):
    """``calibrate`` (or another call that changes quantizer state) is already running on the same model."""


class UnexpectedError(CoreaiOptError):
    """A foreign exception escaped a public function; ``__cause__`` is the original.

    Attributes:
        function: The public function (``"calibrate"``, ``"QuantizerConfig.from_yaml"``).
        stage: What it was doing (``"running calibration batch 3 through the model"``), or None.
        origin: Where the original was raised (``"torch (torch/nn/functional.py:2551)"``), or None.
    """

    function: str = ""
    stage: str | None = None
    origin: str | None = None


class UnexpectedValueError(UnexpectedError, ValueError):
    """A foreign ``ValueError`` (wrapped)."""


class UnexpectedTypeError(UnexpectedError, TypeError):
    """A foreign ``TypeError`` (wrapped)."""


class UnexpectedRuntimeError(UnexpectedError, RuntimeError):
    """A foreign ``RuntimeError`` (wrapped; most torch errors)."""


class UnexpectedNotImplementedError(UnexpectedError, NotImplementedError):
    """A foreign ``NotImplementedError`` (wrapped)."""


class UnexpectedIndexError(UnexpectedError, IndexError):
    """A foreign ``IndexError`` (wrapped)."""


class UnexpectedKeyError(UnexpectedError, KeyError):
    """A foreign ``KeyError`` (wrapped)."""

    def __str__(self) -> str:  # KeyError's own __str__ would quote the whole message
        return str(self.args[0]) if self.args else ""


class UnexpectedAttributeError(UnexpectedError, AttributeError):
    """A foreign ``AttributeError`` (wrapped)."""


class UnexpectedArithmeticError(UnexpectedError, ArithmeticError):
    """A foreign ``ArithmeticError`` (``ZeroDivisionError``, ``OverflowError``; wrapped)."""


class UnexpectedMemoryError(UnexpectedError, MemoryError):
    """A foreign ``MemoryError`` (wrapped)."""


class UnexpectedAssertionError(UnexpectedError, AssertionError):
    """A foreign ``AssertionError`` (wrapped)."""


class UnexpectedFileNotFoundError(UnexpectedError, FileNotFoundError):
    """A foreign ``FileNotFoundError`` (wrapped)."""


class UnexpectedOSError(UnexpectedError, OSError):
    """A foreign ``OSError`` (disk full, permissions, ...; wrapped, ``errno`` / ``filename`` copied)."""


#: Builtin family -> wrapper class, most specific first: a foreign exception becomes the wrapper of the first
#: family it belongs to, so ``except <family>`` still catches it. Anything else becomes :class:`UnexpectedError`.
UNEXPECTED_BY_FAMILY: tuple[tuple[type[BaseException], type[UnexpectedError]], ...] = (
    (FileNotFoundError, UnexpectedFileNotFoundError),
    (OSError, UnexpectedOSError),
    (NotImplementedError, UnexpectedNotImplementedError),
    (IndexError, UnexpectedIndexError),
    (KeyError, UnexpectedKeyError),
    (ValueError, UnexpectedValueError),
    (TypeError, UnexpectedTypeError),
    (RuntimeError, UnexpectedRuntimeError),
    (AttributeError, UnexpectedAttributeError),
    (ArithmeticError, UnexpectedArithmeticError),
    (MemoryError, UnexpectedMemoryError),
    (AssertionError, UnexpectedAssertionError),
)
