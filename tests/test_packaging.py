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


def test_every_library_folder_is_a_package_found_by_setuptools_and_nothing_is_remapped():
    """Tree = import paths: one installed package, ``coreai_opt``, found on disk, with no ``package-dir`` remap."""
    setuptools = _pyproject()["tool"]["setuptools"]
    assert "package-dir" not in setuptools and setuptools["packages"]["find"]["include"] == ["coreai_opt*"]
    folders = {p.parent for p in (ROOT / "coreai_opt").rglob("*.py") if "__pycache__" not in p.parts}
    assert all((folder / "__init__.py").exists() for folder in folders), sorted(folders)
    assert len(_packages_on_disk(ROOT / "coreai_opt", "coreai_opt")) >= 15


def test_a_checkout_imports_its_passes_from_the_root_without_installing(tmp_path):
    """``python -c "import coreai_opt.passes"`` from a copy of the tree that nothing installed."""
    import shutil

    shutil.copytree(ROOT / "coreai_opt", tmp_path / "coreai_opt", ignore=shutil.ignore_patterns("__pycache__"))
    code = (
        "import coreai_opt.passes, coreai_opt.quantization.spec as s; "
        "print(coreai_opt.passes.__file__, s.StatefulQParamsCalculatorBase.__name__)"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": ""})
    assert done.returncode == 0, done.stderr
    path, name = done.stdout.split()
    assert Path(path) == tmp_path / "coreai_opt" / "passes" / "__init__.py" and name == "StatefulQParamsCalculatorBase"


def test_every_module_imports_from_the_path_its_file_has():
    import importlib

    for path in sorted((ROOT / "coreai_opt").rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        parts = path.relative_to(ROOT).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        assert Path(importlib.import_module(name).__file__) == path, name


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
    targets = ("benchmarks/README.md", "benchmarks/comparison/RESULTS.md", "docs/ARCHITECTURE.md",
               "examples/quickstart.py")
    for target in targets:
        assert target in readme
        assert (ROOT / target).exists(), f"README links to {target}, which does not exist"


def _import_alone(name: str) -> str:
    """Import one module in a forked child whose parent imported no coreai_opt module; '' or the error."""
    import importlib
    import traceback

    try:
        importlib.import_module(name)
    except Exception:  # noqa: BLE001 - reported to the parent as text
        return traceback.format_exc(limit=-3)
    return ""


def test_every_tensor_level_module_imports_first_without_a_circle():
    """Import order cannot matter: each module of ``quantization/``, ``graph/``, ``config/`` and ``passes/`` imported
    first, in a fresh fork.

    A package face that eagerly imports a module which imports back into the package fails only for some
    first imports (``ranges.range_calculator`` -> ``spec`` -> ``builtin_qparams_calculators`` -> ``ranges``).
    """
    import multiprocessing

    names = []
    for folder in ("quantization", "graph", "config", "passes"):
        for path in sorted((ROOT / "coreai_opt" / folder).rglob("*.py")):
            parts = path.relative_to(ROOT).with_suffix("").parts
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    code = (
        "import multiprocessing, sys, torch, onnx, onnxscript, pydantic\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "from tests.test_packaging import _import_alone\n"
        "names = sys.argv[2:]\n"
        "with multiprocessing.get_context('fork').Pool(2, maxtasksperchild=1) as pool:\n"
        "    errors = pool.map(_import_alone, names, chunksize=1)\n"
        "bad = [f'{n}: {e}' for n, e in zip(names, errors) if e]\n"
        "print(len(names)); print('\\n'.join(bad))\n"
    )
    assert multiprocessing.get_all_start_methods()[0] == "fork"
    done = subprocess.run([sys.executable, "-c", code, str(ROOT), *names], capture_output=True, text=True,
                          timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    count, *errors = done.stdout.strip().split("\n")
    assert int(count) == len(names) >= 40 and not [e for e in errors if e], "\n".join(errors)
