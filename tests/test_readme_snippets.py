"""The README's quoted outputs equal the generated snippet files, and its tuning-tools example runs as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.api.auto_quantize.conftest import plant_cost_table
from tools.readme_snippets import SNIPPETS, readme_blocks, replace_readme_blocks

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_every_snippet_is_quoted_in_the_readme_exactly_as_generated():
    blocks = readme_blocks(README)
    assert sorted(blocks) == sorted(SNIPPETS)
    for name, text in blocks.items():
        generated = (ROOT / name).read_text()
        assert generated.strip(), f"{name} is empty: run python -m tools.readme_snippets"
        assert text == generated, f"README block for {name} differs from the file; rerun the generator"


def test_replace_readme_blocks_rewrites_only_marked_blocks():
    text = "a\n<!-- snippet: x.txt -->\n```\nold\n```\nb\n```\nuntouched\n```\n"
    assert replace_readme_blocks(text, {"x.txt": "new\n"}) == (
        "a\n<!-- snippet: x.txt -->\n```\nnew\n```\nb\n```\nuntouched\n```\n")


def test_readme_tuning_tools_example_runs(tmp_path):
    section = README[README.index("## Tuning tools"):]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                            timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "| rank | layer | rel. squared error |" in out and "all layers quantized" in out
    assert re.search(r"\{'(minmax|percentile|mse|entropy)': \d+", out)
    assert "| input of | kind | foldable |" in out


def test_readme_auto_quantize_example_runs(tmp_path):
    plant_cost_table(tmp_path / "cache")  # the development machine's table: a measurement under load is noise
    section = README[README.index("### auto_quantize"):]
    code = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True,
                            timeout=600, env={**os.environ, "OMP_NUM_THREADS": "1",
                                              "COREAI_OPT_CACHE_DIR": str(tmp_path / "cache")})
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.startswith("auto_quantize: measured error ") and "| `features.0` | conv |" in result.stdout
    assert "module_name:" in result.stdout and (tmp_path / "digits.auto.onnx").stat().st_size > 0
