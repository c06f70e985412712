"""Old keyword names of public functions that still work for a while, with a ``DeprecationWarning``."""

from __future__ import annotations

import functools
import inspect
import warnings
from collections.abc import Callable
from typing import Any, TypeVar

from coreai_opt.errors import CoreaiOptTypeError

__all__ = ["renamed_keyword"]

F = TypeVar("F", bound=Callable[..., Any])


def renamed_keyword(old: str, new: str) -> Callable[[F], F]:
    """Accept ``old=`` as the deprecated name of the keyword ``new=`` (outermost decorator of a public function).

    The call gets ``new=value`` and a ``DeprecationWarning`` that points at the caller's line; passing both names
    raises :class:`~coreai_opt.errors.CoreaiOptTypeError`. The function's signature (``inspect.signature``) shows
    only ``new``.
    """

    def decorate(function: F) -> F:
        position = list(inspect.signature(function).parameters).index(new)

        @functools.wraps(function)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if old in kwargs:
                if new in kwargs or len(args) > position:
                    raise CoreaiOptTypeError(
                        f"{function.__name__}() got both {new}= and {old}= (its deprecated name); pass {new}= only"
                    )
                warnings.warn(f"{function.__name__}({old}=...) is deprecated; pass {new}=... (same meaning)",
                              DeprecationWarning, stacklevel=2)
                kwargs[new] = kwargs.pop(old)
            return function(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate
