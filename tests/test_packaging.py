"""Packaging and documentation contracts: what a fresh clone needs to install, run and test the project."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
DEMO_COMMAND = 'python3 -m venv .venv && .venv/bin/pip install -e ".[examples]" && .venv/bin/coreai-opt demo'
TEST_COMMAND = 'python3 -m venv .venv && .venv/bin/pip install -e ".[test]" && .venv/bin/python -m pytest'


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def _packages_on_disk(source: Path, package: str) -> set[str]:
    found = set()
    for init in source.rglob("__init__.py"):
        if "__pycache__" in init.parts:
            continue
        relative = init.parent.relative_to(source).parts
        found.add(".".join((package, *relative)))
    return found


def _readme() -> str:
    return (ROOT / "README.md").read_text()


def test_pyproject_packages_match_every_package_directory():
    setuptools = _pyproject()["tool"]["setuptools"]
    on_disk = _packages_on_disk(ROOT / "coreai_opt", "coreai_opt") | _packages_on_disk(
        ROOT / "passes", "coreai_opt.passes"
    )
    listed = set(setuptools["packages"])
    assert listed == on_disk, f"missing from pyproject: {on_disk - listed}; listed but absent: {listed - on_disk}"


def test_pyproject_package_dir_maps_passes_into_coreai_opt():
    assert _pyproject()["tool"]["setuptools"]["package-dir"]["coreai_opt.passes"] == "passes"


def test_pyproject_console_script_points_at_cli_main():
    assert _pyproject()["project"]["scripts"]["coreai-opt"] == "coreai_opt.cli.main:main"


def test_readme_contains_both_setup_commands_verbatim():
    lines = [line.strip() for line in _readme().splitlines()]
    assert DEMO_COMMAND in lines
    assert TEST_COMMAND in lines


def test_ci_run_runs_exactly_the_readme_test_command():
    script = ROOT / ".ci" / "run"
    assert os.access(script, os.X_OK), ".ci/run must be executable"
    commands = [
        line.strip()
        for line in script.read_text().splitlines()
        if line.strip() and not line.lstrip().startswith("#") and not line.startswith("#!")
    ]
    assert commands[0] == "set -euo pipefail"
    # The README command is the last line, so its status (pytest's, including 5 for "no tests") is the script's.
    assert commands[-1] == TEST_COMMAND
    assert sum(TEST_COMMAND in line for line in commands) == 1
    assert all("pip install" not in line for line in commands[:-1]), "nothing may be installed outside the command"
    subprocess.run(["bash", "-n", str(script)], check=True)


def _presets_markdown() -> str:
    from coreai_opt.config import QuantizerConfig

    rows = QuantizerConfig.presets.describe()
    lines = ["| preset | weights | activations |", "|---|---|---|"]
    lines += [f"| `{row.name}` | {row.weight} | {row.activation} |" for row in rows]
    return "\n".join(lines)


def test_readme_presets_table_matches_describe():
    table = _presets_markdown()
    assert table.count("\n") >= 3, "presets.describe() returned too few rows"
    assert table in _readme(), "README presets table is stale; replace it with:\n" + table


def test_readme_links_exist():
    readme = _readme()
    for target in ("benchmarks/RESULTS.md", "docs/ARCHITECTURE.md", "examples/quickstart.py"):
        assert target in readme
        assert (ROOT / target).exists(), f"README links to {target}, which does not exist"
