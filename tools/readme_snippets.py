"""Regenerate the outputs the README quotes: ``python -m tools.readme_snippets`` (from the repo root).

Each snippet file under ``docs/snippets/`` is the real output of one command, and the README holds a copy of it in
the fenced block right after a ``<!-- snippet: docs/snippets/NAME.txt -->`` marker; this script writes both.
``tests/test_readme_snippets.py`` checks that every README block equals its file, and the demo and CNN tests check
that a fresh run still prints the file's numbers, so a quoted number cannot go stale.

Runs use one thread (``OMP_NUM_THREADS=1``) and fixed seeds, so accuracy, differences and sizes repeat exactly;
latency lines change from run to run (they are quoted as measured, and not compared by the tests).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

__all__ = ["SNIPPETS", "CNN_COMMAND", "MARKER", "readme_blocks", "replace_readme_blocks", "main"]

#: The README's CNN command (run in an empty folder, with the example's absolute path).
CNN_COMMAND = ("quantize", "examples/cnn_factory.py:make_model", "--input-shape", "1,3,64,64")
#: Snippet file -> what produces it.
SNIPPETS = {"docs/snippets/demo_table.txt": "coreai-opt demo (its final table)",
            "docs/snippets/quantize_cnn.txt": "coreai-opt " + " ".join(CNN_COMMAND)}
MARKER = re.compile(r"<!-- snippet: (\S+) -->\n```\n(.*?)```\n", re.DOTALL)


def readme_blocks(readme: str) -> dict[str, str]:
    """Snippet path -> the text of the fenced block after its marker in ``readme``."""
    return {m.group(1): m.group(2) for m in MARKER.finditer(readme)}


def replace_readme_blocks(readme: str, texts: dict[str, str]) -> str:
    """``readme`` with the block after each marker replaced by ``texts[path]`` (markers without text kept)."""

    def block(match: re.Match[str]) -> str:
        text = texts.get(match.group(1), match.group(2))
        return f"<!-- snippet: {match.group(1)} -->\n```\n{text.rstrip()}\n```\n"

    return MARKER.sub(block, readme)


def _one_thread_env() -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1"}


def _demo_table(repo: Path) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        result = subprocess.run([sys.executable, "-m", "coreai_opt.cli.main", "demo", "--output-dir",
                                 str(Path(tmp) / "demo")], capture_output=True, text=True, env=_one_thread_env(),
                                cwd=tmp, check=True)
    lines = result.stdout.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("+-"))
    end = next(i for i, line in enumerate(lines) if line.startswith("(test set:"))
    return "\n".join(lines[start : end + 1]) + "\n"


def _cnn_output(repo: Path) -> str:
    command = list(CNN_COMMAND)
    command[1] = str(repo / command[1])
    with tempfile.TemporaryDirectory() as tmp:
        result = subprocess.run([sys.executable, "-m", "coreai_opt.cli.main", *command], capture_output=True,
                                text=True, env=_one_thread_env(), cwd=tmp, check=True)
    return result.stdout


def main(argv: list[str] | None = None) -> int:
    """Regenerate every snippet file and the README blocks that mirror them."""
    parser = argparse.ArgumentParser(prog="python -m tools.readme_snippets", description=__doc__)
    parser.add_argument("--repo", type=Path, default=Path.cwd(), help="repository root (default: .)")
    args = parser.parse_args(argv)
    repo = args.repo.resolve()
    texts = {"docs/snippets/demo_table.txt": _demo_table(repo), "docs/snippets/quantize_cnn.txt": _cnn_output(repo)}
    for name, text in texts.items():
        path = repo / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        print(f"wrote {name}")
    readme = repo / "README.md"
    readme.write_text(replace_readme_blocks(readme.read_text(), texts))
    print(f"updated {readme.name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
