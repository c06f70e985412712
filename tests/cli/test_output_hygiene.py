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

from coreai_opt import third_party_noise
from coreai_opt.cli.main import main

SCRIPT = Path(sys.executable).with_name("coreai-opt")
TIMEOUT = 600


def _cli(*argv: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(SCRIPT), *argv], cwd=cwd, capture_output=True, text=True, timeout=TIMEOUT,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def test_demo_prints_nothing_on_stderr(tmp_path):
    result = _cli("demo", "--output-dir", str(tmp_path / "demo"), cwd=tmp_path)
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


def test_demo_with_damaged_shipped_weights_prints_one_line_naming_the_sha256_and_the_fix(capsys, tmp_path,
                                                                                        monkeypatch):
    from coreai_opt.reference_models import pretrained

    damaged = tmp_path / "digits_cnn.pt"
    damaged.write_bytes(pretrained.DIGITS_CNN_WEIGHTS.read_bytes()[:-1])  # one byte short
    monkeypatch.setattr(pretrained, "DIGITS_CNN_WEIGHTS", damaged)
    monkeypatch.setattr(pretrained.load_digits_cnn, "__defaults__", (damaged, pretrained.DIGITS_CNN_SHA256))
    assert main(["demo", "--output-dir", str(tmp_path / "demo")]) == 2
    err = capsys.readouterr().err.splitlines()
    expected = (f"coreai-opt demo: error: CoreaiOptRuntimeError: the trained digits CNN weights {damaged} have "
                f"sha256 {pretrained.sha256_of(damaged)}, expected {pretrained.DIGITS_CNN_SHA256}: the file is damaged")
    assert len(err) == 1 and err[0].startswith(expected)
    assert err[0].endswith("or train instead (coreai-opt demo --train)")
    assert not (tmp_path / "demo" / "digits_cnn.int8.onnx").exists()
