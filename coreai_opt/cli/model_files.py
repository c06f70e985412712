"""Turn the ``MODEL`` argument of ``coreai-opt quantize`` into a float ``nn.Module``.

Accepted forms and how each loads (the trust model: a model file is code or is loaded by torch's own loaders):

* ``package.module:factory`` - imported like ``python -m`` would: the working directory is put first on
  ``sys.path``, so ``mymodel:make`` works from the folder holding ``mymodel.py``. The factory is called with no
  arguments and must return an ``nn.Module``. This runs the module's Python code.
* ``path/to/file.py:factory`` - the file is imported with its own folder on ``sys.path`` (its sibling modules
  import). Also Python code.
* a directory written by ``save_pretrained`` (holds ``config.json``) - :mod:`coreai_opt.huggingface`.
* TorchScript (``.pt``, ``.pth``, ``.ts``, ``.jit``) - ``torch.jit.load``, then converted to a ``torch.export``
  graph. A ``torch.save`` pickle or a ``state_dict`` under those suffixes is recognised (with the restricted
  ``weights_only`` loader) and refused with how to pass it instead; it is never unpickled unrestricted.
* ``torch.export`` (``.pt2``) - ``torch.export.load`` after :func:`coreai_opt.cli.pt2_archive.check_pt2_archive`.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coreai_opt.cli.pt2_archive import check_pt2_archive
from coreai_opt.cli.usage_errors import CliError, one_line

if TYPE_CHECKING:
    import torch
    from torch import nn

    from coreai_opt.huggingface import PretrainedModel

__all__ = ["TORCHSCRIPT_SUFFIXES", "EXPORT_SUFFIX", "LoadedModel", "load_model", "forward_inputs"]

TORCHSCRIPT_SUFFIXES = (".pt", ".pth", ".ts", ".jit")
EXPORT_SUFFIX = ".pt2"
_FACTORY_HINT = "pass a Python file with a factory instead: coreai-opt quantize file.py:make_model"


@dataclass
class LoadedModel:
    """A loaded model before calibration.

    Attributes:
        module: The float model (for TorchScript: the ``ScriptModule``; call :meth:`ready` to convert it).
        name: Short name for default output files.
        kind: ``"factory"``, ``"torchscript"``, ``"export"`` or ``"huggingface"``.
        pretrained: The Hugging Face bundle (tokenizer, input builders) for ``kind == "huggingface"``.
    """

    module: Any
    name: str
    kind: str
    pretrained: PretrainedModel | None = None

    def ready(self, example_inputs: tuple[torch.Tensor, ...]) -> nn.Module:
        """The ``nn.Module`` to quantize; TorchScript is converted to a ``torch.export`` graph (batch size fixed)."""
        if self.kind != "torchscript":
            return self.module
        from torch._export.converter import TS2EPConverter

        try:
            return _mark_eval(TS2EPConverter(self.module, example_inputs).convert().module())
        except Exception as exc:  # noqa: BLE001 - the converter raises many types
            raise CliError(f"cannot convert the TorchScript model {self.name} to a torch.export graph: "
                           f"{one_line(exc)[:300]}; {_FACTORY_HINT}") from None


def forward_inputs(module: Any) -> tuple[tuple[str, ...], int] | None:
    """``(input names in order, number of required ones)`` of a model's forward, or None if it takes ``*args``.

    TorchScript modules are read from their schema (``self`` dropped).
    """
    schema = getattr(getattr(module, "forward", None), "schema", None)
    if schema is not None:  # torch.jit.ScriptModule
        args = list(schema.arguments)[1:]
        return tuple(a.name for a in args), sum(1 for a in args if a.default_value is None)
    try:
        parameters = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    if any(p.kind is p.VAR_POSITIONAL for p in parameters):
        return None
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return tuple(p.name for p in positional), sum(1 for p in positional if p.default is p.empty)


def load_model(spec: str, *, seq_len: int = 128) -> LoadedModel:
    """Load the model named by ``spec`` (module docstring).

    Args:
        spec: The command line's ``MODEL`` argument.
        seq_len: Sequence length of a Hugging Face text model.

    Raises:
        CliError: Missing file or module, a factory that fails or returns no ``nn.Module``, a pickle instead of
            TorchScript, a ``.pt2`` that needs an unrestricted unpickle, or a Hugging Face directory that cannot
            be loaded.
    """
    path = Path(spec)
    if path.is_dir():
        return _load_pretrained(path, seq_len)
    if path.suffix in (*TORCHSCRIPT_SUFFIXES, EXPORT_SUFFIX):
        if not path.is_file():
            raise CliError(f"model file not found: {spec}")
        if path.suffix == EXPORT_SUFFIX:
            return LoadedModel(_load_exported(path), path.stem, "export")
        return LoadedModel(_load_torchscript(path), path.stem, "torchscript")
    module_part, sep, factory_name = spec.rpartition(":")
    if not sep or not module_part or not factory_name.isidentifier():
        raise CliError(
            f"cannot read model {spec!r}: expected module:factory, path/to/file.py:factory, a save_pretrained "
            f"directory, a TorchScript file ({', '.join(TORCHSCRIPT_SUFFIXES)}) or a torch.export file (.pt2)"
        )
    return LoadedModel(_call_factory(spec, module_part, factory_name), factory_name, "factory")


def _call_factory(spec: str, module_part: str, factory_name: str) -> nn.Module:
    from torch import nn

    module = _import_module(module_part)
    factory = getattr(module, factory_name, None)
    if factory is None:
        raise CliError(f"{module_part!r} has no attribute {factory_name!r}")
    if not callable(factory):
        raise CliError(f"{spec!r} is not callable")
    model = factory()
    if not isinstance(model, nn.Module):
        raise CliError(f"{spec}() returned {type(model).__name__}, expected a torch.nn.Module")
    return model.eval()


def _load_pretrained(path: Path, seq_len: int) -> LoadedModel:
    from coreai_opt import huggingface

    if not huggingface.is_pretrained_directory(path):
        raise CliError(f"{path} is a directory without config.json; pass a save_pretrained directory, "
                       "module:factory, file.py:factory, a TorchScript file or a .pt2 file")
    try:
        pretrained = huggingface.from_pretrained(path, seq_len=seq_len)
    except (huggingface.MissingExtraError, ValueError, OSError) as exc:
        raise CliError(one_line(exc) if not isinstance(exc, OSError) else
                       f"cannot load the Hugging Face directory {path}: {one_line(exc)[:300]}") from None
    return LoadedModel(pretrained.model, path.resolve().name, "huggingface", pretrained)


def _prepend_sys_path(folder: str) -> None:
    if folder not in sys.path:
        sys.path.insert(0, folder)


def _import_module(name: str) -> Any:
    """Import a dotted module name (working directory on ``sys.path``) or a ``.py`` file path."""
    if name.endswith(".py") or "/" in name or "\\" in name:
        path = Path(name)
        if not path.is_file():
            raise CliError(f"model file not found: {name}")
        spec = importlib.util.spec_from_file_location(f"_coreai_opt_user_{path.stem}", path)
        if spec is None or spec.loader is None:
            raise CliError(f"cannot import {name}: not a Python source file")
        _prepend_sys_path(str(path.resolve().parent))
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
        return module
    _prepend_sys_path(os.getcwd())
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        raise CliError(f"cannot import module {name!r} (looked in the working directory {os.getcwd()} and "
                       f"sys.path): {exc}; or pass path/to/file.py:factory") from None


def _load_exported(path: Path) -> nn.Module:
    import torch

    check_pt2_archive(path)
    try:
        return _mark_eval(torch.export.load(path).module())
    except Exception as exc:  # noqa: BLE001 - a corrupt archive raises many types
        raise CliError(f"cannot load {path} with torch.export.load: {one_line(exc)[:300]}") from None


def _mark_eval(module: nn.Module) -> nn.Module:
    """Set ``training = False`` on a ``torch.export`` module, whose ``eval()`` raises NotImplementedError.

    Its graph is fixed when it is exported, so the flag changes no computation; it only keeps ``prepare`` and the
    ONNX exporter from warning that the model is in train mode.
    """
    for sub in module.modules():
        sub.training = False
    return module


def _load_torchscript(path: Path) -> Any:
    import torch

    try:
        return torch.jit.load(str(path), map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - a corrupt archive raises many types
        what = _describe_torch_save_file(path)
        if what is not None:
            raise CliError(f"{path} is not TorchScript: it is {what}; {_FACTORY_HINT} (or save the model with "
                           "torch.jit.save(torch.jit.trace(model, example)) or torch.export.save)") from None
        raise CliError(f"cannot load {path} with torch.jit.load (is it TorchScript?): {one_line(exc)[:300]}") from None


def _describe_torch_save_file(path: Path) -> str | None:
    """What a ``torch.save`` file holds, read with the restricted loader; None when it is no torch.save file."""
    import pickle

    import torch

    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        found = re.search(r"GLOBAL ([\w.]+)", str(exc))
        cls = f" ({found.group(1)})" if found else ""
        return (f"a pickled Python object{cls} written by torch.save(model); coreai-opt does not unpickle it, "
                "since unpickling runs arbitrary code")
    except Exception:  # noqa: BLE001 - not a torch.save file at all
        return None
    state = obj.get("state_dict", obj) if isinstance(obj, dict) else obj
    if isinstance(state, dict) and state and all(isinstance(v, torch.Tensor) for v in state.values()):
        first = next(iter(state))
        return (f"a state_dict ({len(state)} tensors, e.g. {first!r}): weights without the architecture. Build "
                "the model in a factory that loads them, e.g. def make_model(): m = MyNet(); "
                f"m.load_state_dict(torch.load({str(path)!r})); return m")
    return f"a torch.save file holding {type(obj).__name__}, not a model"
