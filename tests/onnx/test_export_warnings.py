"""The Python API's export is as quiet as the CLI's: the exporter's known harmless warnings are filtered for that
call only, and the caller's own warning filters are left as they were."""

from __future__ import annotations

import logging
import warnings

import torch
from torch import nn

import coreai_opt as co
from coreai_opt import third_party_noise


class _TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return self.fc(a + b)


def _converted() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    torch.manual_seed(0)
    inputs = (torch.randn(2, 4), torch.randn(2, 4))
    prepared = co.prepare(_TwoInputs().eval(), co.QuantizerConfig.presets.w8a8(), inputs)
    co.calibrate(prepared, [inputs])
    return co.convert(prepared), inputs


def _is_known(message: str) -> bool:
    import re

    return any(re.match(pattern, message) for _, pattern in third_party_noise.KNOWN_WARNINGS)


def test_export_onnx_emits_none_of_the_known_exporter_warnings_and_restores_filters(tmp_path):
    converted, inputs = _converted()
    filters_before = list(warnings.filters)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        co.export_onnx(converted, inputs, tmp_path / "two.onnx")  # two inputs share the dynamic batch axis
        warnings.warn("`isinstance(treespec, LeafSpec)` is deprecated", FutureWarning, stacklevel=1)
    messages = [str(w.message) for w in caught]
    assert messages[-1] == "`isinstance(treespec, LeafSpec)` is deprecated"  # outside the export: not filtered
    assert not any(_is_known(m) for m in messages[:-1]), messages
    assert warnings.filters == filters_before


def test_scoped_filters_log_records_inside_the_block_only(caplog, monkeypatch):
    logger = logging.getLogger("onnxscript.optimizer._constant_folding")
    # a CLI test run earlier in this process may have installed the process-wide filter: start without it
    kept = [f for f in logger.filters if not isinstance(f, third_party_noise.HarmlessRecords)]
    monkeypatch.setattr(logger, "filters", kept)
    with caplog.at_level(logging.WARNING, logger=logger.name):
        with third_party_noise.scoped():
            logger.warning("Evaluation failed: cannot reshape array of size 1 into shape (1,16)")
        logger.warning("Evaluation failed: cannot reshape array of size 1 into shape (1,16)")
    assert [r.getMessage() for r in caplog.records] == [
        "Evaluation failed: cannot reshape array of size 1 into shape (1,16)"]
    assert not any(isinstance(f, third_party_noise.HarmlessRecords) for f in logger.filters)
