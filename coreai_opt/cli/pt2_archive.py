"""Refuse ``.pt2`` archives that ``torch.export.load`` would unpickle without restrictions.

``torch.export.load`` unpickles several members of the archive, and some with ``weights_only=False``: the sample
inputs (retried unrestricted when the restricted load fails), weights and tensor constants stored as pickles, and
"opaque" Python objects (plain ``pickle.loads``). An unrestricted unpickle runs whatever the file says, so
``coreai-opt quantize evil.pt2`` could run code. Before loading, every pickled member is loaded here with
``torch.load(weights_only=True)`` (torch's restricted unpickler, which only builds tensors and plain containers);
the archive is refused when one fails, or when it holds pickled Python objects or TorchBind objects at all.
A member that loads in the restricted mode builds the same allow-listed objects in torch's own loader.
"""

from __future__ import annotations

import io
import json
import re
import zipfile
from pathlib import Path, PurePosixPath

from coreai_opt.cli.usage_errors import CliError, one_line

__all__ = ["check_pt2_archive"]

_REFUSED_PREFIXES = ("custom_obj_", "opaque_obj_")  # TorchBind / pickled Python objects among the constants
_FIX = "re-save it with torch.export.save from a program whose inputs and constants are plain tensors"


def _relative(name: str) -> PurePosixPath:
    """``'lin/data/weights/weight_0'`` -> ``data/weights/weight_0`` (members sit under one root folder)."""
    parts = PurePosixPath(name).parts
    return PurePosixPath(*parts[1:]) if len(parts) > 1 else PurePosixPath(name)


def _payload_members(archive: zipfile.ZipFile, names: dict[PurePosixPath, str], path: Path) -> tuple[set[str],
                                                                                                       set[str]]:
    """(members stored as raw tensor bytes, members stored as pickles) from the weight / constant configs."""
    raw: set[str] = set()
    pickled: set[str] = set()
    for rel, member in names.items():
        if rel.parent.name not in ("weights", "constants") or not rel.name.endswith("_config.json"):
            continue
        try:
            config = json.loads(archive.read(member))["config"]
        except (KeyError, ValueError) as exc:
            raise CliError(f"{path} is not a readable torch.export archive ({member}: {one_line(exc)})") from None
        for payload in config.values():
            target = str(PurePosixPath(member).parent / payload["path_name"])
            if payload["path_name"].startswith(_REFUSED_PREFIXES):
                raise CliError(f"refusing {path}: it holds pickled Python or TorchBind objects ({target}), which "
                               f"torch.export.load would unpickle without restrictions; {_FIX}")
            (pickled if payload.get("use_pickle") else raw).add(target)
    return raw, pickled


def check_pt2_archive(path: Path) -> None:
    """Raise unless every pickle ``torch.export.load`` would read from ``path`` loads in restricted mode.

    Raises:
        CliError: Not a zip archive, an old archive format (loaded through a legacy unpickling path), pickled
            Python objects, or a member that torch's restricted unpickler rejects (named in the message).
    """
    if not zipfile.is_zipfile(path):
        raise CliError(f"{path} is not a torch.export archive (not a zip file); write it with torch.export.save")
    with zipfile.ZipFile(path) as archive:
        names = {_relative(n): n for n in archive.namelist() if not n.endswith("/")}
        if PurePosixPath("archive_format") not in names:
            raise CliError(f"refusing {path}: it uses the pre-2.7 torch.export format, whose loader unpickles "
                           f"without restrictions; {_FIX}")
        raw, pickled = _payload_members(archive, names, path)
        for rel, member in names.items():
            under_data = rel.parts[:1] == ("data",)
            if under_data and rel.suffix == ".pt":  # sample inputs and the legacy weight / constant files
                pickled.add(member)
        for member in sorted(pickled - raw):
            _restricted_load(archive.read(member), member, path)


def _restricted_load(data: bytes, member: str, path: Path) -> None:
    import pickle

    import torch

    try:
        torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        found = re.search(r"GLOBAL ([\w.]+)", str(exc))
        detail = f" (it calls {found.group(1)})" if found else ""
        raise CliError(
            f"refusing {path}: {_relative(member)} needs an unrestricted unpickle, which could run code{detail}; "
            f"{_FIX}"
        ) from None
    except Exception as exc:  # noqa: BLE001 - a damaged member raises many types
        raise CliError(f"{path} is not a readable torch.export archive ({member}: {one_line(exc)[:200]})") from None
