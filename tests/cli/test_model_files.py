"""Model arguments that used to fail with someone else's error: torch.save pickles, state_dicts, module:factory
from the working directory, and .pt2 archives that torch would unpickle without restrictions."""

from __future__ import annotations

import io
import os
import sys
import zipfile
from pathlib import Path

import numpy as np
import torch
from torch import nn

from coreai_opt.cli.main import main
from tests.cli.conftest import one_line_error


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x)


def test_state_dict_file_says_what_it_is_and_how_to_pass_the_model(capsys, tmp_path):
    path = tmp_path / "cnn_state.pt"
    torch.save(_Net().state_dict(), path)
    line = one_line_error(capsys, "quantize", str(path), "--input-shape", "2,4")
    assert f"{path} is not TorchScript: it is a state_dict (2 tensors, e.g. 'fc.weight')" in line
    assert "m.load_state_dict(torch.load(" in line and "coreai-opt quantize file.py:make_model" in line
    assert "constants.pkl" not in line and "corrupted" not in line


def test_pickled_model_file_is_named_and_never_unpickled(capsys, tmp_path):
    path = tmp_path / "cnn_model.pt"
    torch.save(_Net(), path)
    line = one_line_error(capsys, "quantize", str(path), "--input-shape", "2,4")
    assert f"{path} is not TorchScript: it is a pickled Python object (tests.cli.test_model_files._Net)" in line
    assert "does not unpickle it, since unpickling runs arbitrary code" in line
    assert "file.py:make_model" in line


def test_module_factory_imports_from_the_working_directory(capsys, tmp_path, monkeypatch):
    (tmp_path / "mymodel.py").write_text("import torch\n\ndef make():\n    torch.manual_seed(0)\n"
                                         "    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    monkeypatch.delitem(sys.modules, "mymodel", raising=False)
    code = main(["quantize", "mymodel:make", "--input-shape", "4,4", "--latency-runs", "0", "-o", "m.onnx"])
    assert code == 0, capsys.readouterr().err
    assert (tmp_path / "m.onnx").is_file()
    monkeypatch.delitem(sys.modules, "mymodel", raising=False)


def test_missing_module_names_the_working_directory(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = one_line_error(capsys, "quantize", "no_such_model_module:make", "--input-shape", "2,4")
    assert f"cannot import module 'no_such_model_module' (looked in the working directory {tmp_path}" in line


def _pt2_with_sample_inputs(path: Path, payload: object) -> Path:
    """A real torch.export archive of a Linear whose sample-inputs member is replaced by ``payload``."""
    good = path.with_name("good.pt2")
    torch.export.save(torch.export.export(nn.Linear(4, 2).eval(), (torch.randn(3, 4),)), good)
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(path, "w") as dst:
        for item in src.infolist():
            data = buffer.getvalue() if item.filename.endswith("data/sample_inputs/model.pt") else src.read(item)
            dst.writestr(item, data)
    return path


class _MakesADirectory:
    """Unpickling this calls os.makedirs(marker): a stand-in for any code an archive could run."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # noqa: ANN204
        return (os.makedirs, (str(self.marker),))


def test_pt2_that_needs_an_unrestricted_unpickle_is_refused_before_any_code_runs(capsys, tmp_path):
    marker = tmp_path / "code_ran"
    evil = _pt2_with_sample_inputs(tmp_path / "evil.pt2", ((_MakesADirectory(marker),), {}))
    line = one_line_error(capsys, "quantize", str(evil), "--input-shape", "3,4")
    assert (f"refusing {evil}: data/sample_inputs/model.pt needs an unrestricted unpickle, which could run code "
            "(it calls os.makedirs)") in line
    assert not marker.exists()
    # the archive really is hostile: torch's own loader runs its code
    try:
        torch.export.load(evil)
    except Exception:  # noqa: BLE001, S110 - whatever happens after the payload ran is irrelevant here
        pass
    assert marker.is_dir()


def test_pt2_with_plain_tensor_sample_inputs_still_loads(capsys, tmp_path):
    archive = _pt2_with_sample_inputs(tmp_path / "plain.pt2", ((torch.randn(3, 4),), {}))
    np.savez(tmp_path / "x.npz", np.random.default_rng(0).standard_normal((6, 4)).astype(np.float32))
    code = main(["quantize", str(archive), "--calib-data", str(tmp_path / "x.npz"), "--latency-runs", "0",
                 "-o", str(tmp_path / "plain.onnx")])
    assert code == 0, capsys.readouterr().err


def test_non_zip_pt2_is_refused(capsys, tmp_path):
    path = tmp_path / "junk.pt2"
    path.write_bytes(b"not a zip")
    line = one_line_error(capsys, "quantize", str(path), "--input-shape", "3,4")
    assert "is not a torch.export archive (not a zip file)" in line
