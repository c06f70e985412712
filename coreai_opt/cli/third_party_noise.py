"""Narrow filters for the third-party warnings and log records that every run printed and that say nothing.

Each entry names the library that emits it, the exact message and why it is harmless. Nothing else is filtered
(no blanket ``simplefilter("ignore")``): a new or unknown warning still reaches the user. ``--verbose`` skips
:func:`install` so that these messages show again.

=============================================  ==========================================  =========================
message (start)                                emitted by                                  why it is harmless
=============================================  ==========================================  =========================
``isinstance(treespec, LeafSpec)`` is          torch.utils._pytree (FutureWarning,         torch's own deep copy of
deprecated                                     raised inside torch when it copies an       a spec; nothing the user
                                               exported graph)                             can change
``# The axis name: batch will not be used,     torch.onnx dynamo exporter (UserWarning)    two inputs share the one
since it shares the same shape constraints                                                 ``batch`` axis: the name
with another axis: batch``                                                                 is kept
``torchvision is not installed. Skipping ...`` torch.onnx registry (logging, WARNING)      torchvision ops are not
                                                                                           used by the model
``Evaluation failed: cannot reshape array``    onnxscript constant folding (logging)       a fold is skipped; the
                                                                                           node stays as it is
``IProgress not found``                        tqdm.auto in a notebook without ipywidgets  falls back to a text bar
=============================================  ==========================================  =========================
"""

from __future__ import annotations

import logging
import re
import warnings

__all__ = ["KNOWN_WARNINGS", "KNOWN_LOG_RECORDS", "install", "HarmlessRecords"]

#: (category name, module-independent message regex) of harmless third-party warnings.
KNOWN_WARNINGS: tuple[tuple[type[Warning], str], ...] = (
    (FutureWarning, r"`isinstance\(treespec, LeafSpec\)` is deprecated"),
    # Only when the axis would be renamed to the very name it already has.
    (UserWarning, r"# The axis name: (\w+) will not be used, since it shares the same shape constraints with "
                  r"another axis: \1\."),
    (UserWarning, r".*torchvision is not installed"),
)

#: logger name -> message regexes of harmless log records.
KNOWN_LOG_RECORDS: dict[str, tuple[str, ...]] = {
    "torch.onnx._internal.exporter._registration": (r"torchvision is not installed",),
    "onnxscript.optimizer._constant_folding": (r"Evaluation failed: cannot reshape array",),
}


class HarmlessRecords(logging.Filter):
    """Drop log records whose message matches one of ``patterns`` (``re.match``)."""

    def __init__(self, patterns: tuple[str, ...]) -> None:
        super().__init__()
        self.patterns = tuple(re.compile(p) for p in patterns)

    def filter(self, record: logging.LogRecord) -> bool:
        """Keep the record unless it is one of the harmless messages."""
        message = record.getMessage()
        return not any(p.match(message) for p in self.patterns)


def install() -> None:
    """Install the warning and logging filters of this module (idempotent: each filter is added once)."""
    for category, message in KNOWN_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)
    _ignore_tqdm_iprogress()
    for name, patterns in KNOWN_LOG_RECORDS.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, HarmlessRecords) for f in logger.filters):
            logger.addFilter(HarmlessRecords(patterns))


def _ignore_tqdm_iprogress() -> None:
    try:
        from tqdm import TqdmWarning
    except ImportError:  # tqdm is a dependency; keep the CLI usable without it anyway
        return
    warnings.filterwarnings("ignore", message=r"IProgress not found", category=TqdmWarning)
