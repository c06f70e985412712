"""The user-facing flow: ``prepare`` → ``calibrate`` (or QAT) → ``convert``, plus ``summary``."""

from __future__ import annotations

from coreai_opt.api.calibrate import calibrate
from coreai_opt.api.convert import convert
from coreai_opt.api.load_state import load_state_dict
from coreai_opt.api.prepare import prepare
from coreai_opt.api.qat import enable_fake_quant, enable_observers
from coreai_opt.api.summary import QuantizationSummary, summary

__all__ = ["prepare", "calibrate", "convert", "summary", "QuantizationSummary", "enable_observers",
           "enable_fake_quant", "load_state_dict"]
