"""What a user sees: stderr of a real demo run is empty; --quiet, --verbose, --version; the noise filters.

The stderr of real quantize runs is checked by tests/test_examples.py, which runs the README's commands (a BERT
directory: no line allowed; the CNN factory on random data: only our random-data warning).
"""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from coreai_opt.cli import demo, third_party_noise
from coreai_opt.cli.main import main

SCRIPT = Path(sys.executable).with_name("coreai-opt")
TIMEOUT = 600


def _cli(*argv: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(SCRIPT), *argv], cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def test_demo_prints_nothing_on_stderr(tmp_path):
    result = _cli("demo", "--output-dir", str(tmp_path / "demo"), cwd=tmp_path,
                  env={"COREAI_OPT_CACHE": str(tmp_path / "cache")})
    assert result.returncode == 0, result.stderr
    assert result.stderr == ""  # allowed lines: none (no FutureWarning, torchvision notice, progress bar, ...)
    assert "| int8 accuracy (onnxruntime)" in result.stdout


def test_known_third_party_warnings_are_filtered_and_others_are_not():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        third_party_noise.install()
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated, use `isinstance(treespec, TreeSpec)`",
                      FutureWarning, stacklevel=1)
        warnings.warn("# The axis name: batch will not be used, since it shares the same shape constraints with "
                      "another axis: batch.", UserWarning, stacklevel=1)
        warnings.warn("# The axis name: seq will not be used, since it shares the same shape constraints with "
                      "another axis: batch.", UserWarning, stacklevel=1)  # a real rename: kept
        warnings.warn("something else is deprecated", FutureWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == [
        "# The axis name: seq will not be used, since it shares the same shape constraints with another axis: batch.",
        "something else is deprecated",
    ]


def test_known_third_party_log_records_are_filtered_and_others_are_not(caplog):
    third_party_noise.install()
    logger = logging.getLogger("onnxscript.optimizer._constant_folding")
    with caplog.at_level(logging.WARNING, logger=logger.name):
        logger.warning("Evaluation failed: %s", "cannot reshape array of size 1 into shape (1,16)")
        logger.warning("Evaluation failed: %s", "division by zero")
    assert [r.getMessage() for r in caplog.records] == ["Evaluation failed: division by zero"]


@pytest.fixture
def small_model(tmp_path):
    (tmp_path / "small.py").write_text("import torch\ndef make():\n    torch.manual_seed(0)\n"
                                       "    return torch.nn.Sequential(torch.nn.Linear(4, 3))\n")
    return f"{tmp_path / 'small.py'}:make"


def test_quiet_prints_nothing_on_stdout_and_still_writes_the_files(capsys, tmp_path, small_model):
    code = main(["--quiet", "quantize", small_model, "--input-shape", "4,4", "--latency-runs", "0",
                 "-o", str(tmp_path / "q.onnx")])
    out, err = capsys.readouterr()
    assert code == 0
    assert out == ""
    assert err.startswith("warning: no calibration data")  # warnings still reach stderr
    assert (tmp_path / "q.onnx").is_file() and (tmp_path / "q.report.json").is_file()


def test_quiet_and_verbose_together_are_refused(capsys, small_model):
    assert main(["quantize", small_model, "-q", "-v"]) == 2
    assert "--quiet and --verbose contradict each other" in capsys.readouterr().err


def test_version_names_coreai_opt_and_its_runtime():
    result = subprocess.run([str(SCRIPT), "--version"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0
    assert re.fullmatch(r"coreai-opt \d+\.\d+\.\d+ \(torch 2\.13\.0\S*, onnx \S+, onnxruntime \S+\)\n", result.stdout)
    assert f"torch {torch.__version__}" in result.stdout


def test_help_states_the_trust_model(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "Model files are trusted code: file.py:factory and module:factory run Python" in out
    with pytest.raises(SystemExit):
        main(["quantize", "--help"])
    assert "Model files are trusted code: only quantize files you trust." in " ".join(capsys.readouterr().out.split())


def test_demo_retrains_on_a_corrupt_cache_with_a_one_line_note(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(demo, "EPOCHS", 1)
    cache = tmp_path / "cache.pt"
    cache.write_bytes(b"")  # a truncated file: torch.load raises EOFError without a message
    from coreai_opt.datasets import load_digits_split

    previous = torch.get_num_threads()
    torch.set_num_threads(demo.TORCH_THREADS)
    try:
        model, source = demo._load_or_train(load_digits_split(seed=demo.SEED), cache)
    finally:
        torch.set_num_threads(previous)
    err = capsys.readouterr().err
    assert err.splitlines() == [f"note: the cached weights {cache} are unreadable (EOFError); training again"]
    assert source.startswith("trained 1 epochs") and source.endswith(f"cached in {cache}")
    reloaded = torch.load(cache, weights_only=True)  # the cache was rewritten with the new weights
    assert all(torch.equal(reloaded[k], v) for k, v in model.state_dict().items())
