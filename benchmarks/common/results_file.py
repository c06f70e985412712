"""Writing a study's one results file, ``benchmarks/<study>/RESULTS.md``, whole or one part at a time.

A study with several parts (``minilm``: ``w8a8``, ``int4-eager``, ``int4-peers``, ``int4-onnx``) keeps each part's
latest output between two marker lines, ``<!-- part NAME -->`` and ``<!-- /part NAME -->``; :func:`write_part`
replaces that block and leaves every other line of the file as it was (a part run for the first time is appended).

A study that measures model by model appends one JSON row per model to its ``rows.jsonl`` (:func:`append_row`) and
rebuilds its page from all of them (:func:`read_rows`), so a run can stop and resume.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["append_row", "read_rows", "write_page", "write_part"]


def append_row(path: Path, row: dict[str, Any]) -> None:
    """Append ``row`` as one JSON line to ``path`` (creating its folder)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a", encoding="utf-8") as out:
        out.write(json.dumps(row) + "\n")


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The JSON rows of ``path`` in file order (none when it does not exist yet)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def write_page(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` (creating its folder)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def write_part(path: Path, part: str, text: str) -> None:
    """Put ``text`` between the markers of ``part`` in ``path``, replacing what was there (module docstring).

    Raises:
        ValueError: the file holds the begin marker of ``part`` without its end marker (edited by hand): fix or
            delete the block, then run again.
    """
    begin, end = f"<!-- part {part} -->", f"<!-- /part {part} -->"
    block = f"{begin}\n{text.rstrip()}\n{end}\n"
    old = path.read_text(encoding="utf-8") if path.exists() else ""
    if begin not in old:
        write_page(path, (old.rstrip() + "\n\n" if old.strip() else "") + block)
        return
    head, _, rest = old.partition(begin)
    if end not in rest:
        raise ValueError(f"{path} has {begin!r} but no {end!r}: restore the end marker or delete the block")
    tail = rest.partition(end)[2].removeprefix("\n")
    write_page(path, head + block + tail)
