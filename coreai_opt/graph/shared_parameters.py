"""Copies of a module that share parameter storage with it instead of duplicating every weight.

Post-training quantization only reads the float weights, so the prepared model (and the converted one) can use the
user's weight storage: a copy of a 10 GB model costs its buffers, not another 10 GB. The rules that keep the user's
model untouched:

* :func:`copy_sharing_parameters` gives every parameter of the copy a *new* ``nn.Parameter`` object viewing the same
  storage (tied weights stay tied); buffers and every other attribute are deep-copied as usual. The new parameters
  are recorded in a registry of shared tensors.
* Code that changes a parameter's *value* binds a new tensor (``setattr(module, name, nn.Parameter(new))``, as the
  folding passes do) or calls :func:`unshare_parameters` first; it never writes into a shared tensor in place.
* ``shared_buffers``: buffers that are never written in place either (a weight rounding's integers and qparams:
  ``commit`` binds new tensors) may be shared the same way, as the *same* tensor object; ``load_state_dict`` gives
  them their own copy first, like the parameters (``convert``: the rounded integers of a GPTQ decoder are 0.25x of
  its fp32 weights, held once for the prepared and the converted model instead of twice).
* :func:`protect_shared_parameters` makes a module's shared parameters read-only for training
  (``requires_grad=False``, so no optimizer step can write through them) and un-shares them before any
  ``load_state_dict``, which copies into parameters in place.

``Tensor._version`` is shared by every view of a storage, so an in-place write through any of them stays visible to
checks that compare versions.
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

import torch
from torch import nn

__all__ = ["copy_sharing_parameters", "is_shared", "protect_shared_parameters", "unshare_parameters"]

M = TypeVar("M", bound=nn.Module)

#: id -> parameter, for the parameters whose storage another model holds too (tensors compare elementwise, so a
#: WeakSet cannot hold them; an entry disappears with its tensor).
_SHARED: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


def _mark_shared(tensor: torch.Tensor) -> None:
    _SHARED[id(tensor)] = tensor


def is_shared(tensor: torch.Tensor) -> bool:
    """True when ``tensor`` is a parameter whose storage another model also holds."""
    return _SHARED.get(id(tensor)) is tensor


def _shared_view(parameter: nn.Parameter) -> nn.Parameter:
    view = nn.Parameter(parameter.detach(), requires_grad=parameter.requires_grad)
    _mark_shared(view)
    return view


def copy_sharing_parameters(module: M, *, only_shared: bool = False,
                            shared_buffers: Iterable[torch.Tensor] = ()) -> M:
    """``copy.deepcopy(module)``, except that parameters share storage with ``module``'s.

    Args:
        module: The module to copy (not modified).
        only_shared: Share only the parameters that are already shared (:func:`is_shared`) and deep-copy the
            rest (e.g. the trainable weights of a QAT model, which must not change under a converted copy).
        shared_buffers: Buffers of ``module`` that no code writes in place; the copy holds the same tensors
            (module docstring).

    Returns:
        The copy.
    """
    memo: dict[int, Any] = {}
    for parameter in module.parameters():
        if not only_shared or is_shared(parameter):
            memo[id(parameter)] = _shared_view(parameter)
    for buffer in shared_buffers:
        _mark_shared(buffer)
        memo[id(buffer)] = buffer
    return copy.deepcopy(module, memo)


def unshare_parameters(module: nn.Module) -> int:
    """Give every shared parameter and buffer of ``module`` its own storage (a copy); returns how many were copied."""
    copies: dict[int, nn.Parameter] = {}
    count = 0
    for owner in module.modules():
        for name, parameter in list(owner.named_parameters(recurse=False)):
            if not is_shared(parameter):
                continue
            if id(parameter) not in copies:
                copies[id(parameter)] = nn.Parameter(parameter.detach().clone(), requires_grad=parameter.requires_grad)
                count += 1
            setattr(owner, name, copies[id(parameter)])
        for name, buffer in list(owner.named_buffers(recurse=False)):
            if buffer is not None and is_shared(buffer):
                owner.register_buffer(name, buffer.clone(), persistent=name not in owner._non_persistent_buffers_set)
                count += 1
    return count


def _unshare_before_loading(module: nn.Module, state_dict: Mapping[str, Any], prefix: str, *args: Any) -> None:
    """``load_state_dict`` pre-hook: loading copies into parameters in place, so give them their own storage."""
    if prefix == "":
        unshare_parameters(module)


def protect_shared_parameters(module: nn.Module, *, share_all: bool = False) -> None:
    """Make ``module``'s shared parameters read-only for training and un-share them before ``load_state_dict``.

    Args:
        module: A module from :func:`copy_sharing_parameters`.
        share_all: Also treat its other parameters (e.g. weights a pass computed) as shared, so that later copies
            share them too.
    """
    for parameter in module.parameters():
        if share_all:
            _mark_shared(parameter)
        if is_shared(parameter):
            parameter.requires_grad_(False)
    module.register_load_state_dict_pre_hook(_unshare_before_loading)
