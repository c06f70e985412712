"""A per-model guard: calls that change quantizer state never run concurrently on one model.

``calibrate``, ``search_calibration`` and ``sensitivity`` switch observers and fake quantization and (calibrate)
rewrite statistics; two of them interleaving on one model would mix statistics silently. The second caller,
from any thread (or re-entering from a data iterator), gets :class:`~coreai_opt.errors.CalibrationInProgressError`
at once instead of waiting: a caller that waits would still calibrate on top of the other call's result.
``convert`` refuses to copy a model in the middle of such a call.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

from torch import nn

from coreai_opt.errors import CalibrationInProgressError

__all__ = ["exclusive_model", "check_model_idle"]

_LOCK = threading.Lock()
#: Model -> who is changing it ("calibrate in thread 'MainThread'").
_BUSY: weakref.WeakKeyDictionary[nn.Module, str] = weakref.WeakKeyDictionary()


def _busy_error(model: nn.Module, caller: str, holder: str) -> CalibrationInProgressError:
    return CalibrationInProgressError(
        f"{caller}: {holder} is already changing the quantizers of this {type(model).__name__}; calls that change "
        "quantizer state (calibrate, search_calibration, sensitivity) cannot run concurrently on one model. Wait "
        "for it to finish, or give each thread its own model (copy.deepcopy(prepared) or another prepare)"
    )


@contextmanager
def exclusive_model(model: nn.Module, caller: str) -> Iterator[None]:
    """Hold ``model`` for ``caller`` for the duration of the block.

    Raises:
        CalibrationInProgressError: another call (any thread, or this one re-entering) holds ``model``.
    """
    holder = f"{caller} in thread {threading.current_thread().name!r}"
    with _LOCK:
        current = _BUSY.get(model)
        if current is not None:
            raise _busy_error(model, caller, current)
        _BUSY[model] = holder
    try:
        yield
    finally:
        with _LOCK:
            _BUSY.pop(model, None)


def check_model_idle(model: nn.Module, caller: str) -> None:
    """Raise when a state-changing call holds ``model`` (e.g. ``convert`` during another thread's calibrate).

    Raises:
        CalibrationInProgressError: ``model`` is held.
    """
    with _LOCK:
        current = _BUSY.get(model)
    if current is not None:
        raise _busy_error(model, caller, current)
