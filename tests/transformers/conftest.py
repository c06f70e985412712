"""The real all-MiniLM-L6-v2 with its calibration and held-out sentences, loaded once for the slow MiniLM tests."""

from __future__ import annotations

import warnings

import pytest

from benchmarks.minilm import harness as H


@pytest.fixture(scope="session")
def setup():  # noqa: ANN201
    """(model, calibration encodings, held-out encodings, float reference embeddings of the held-out ones)."""
    reason = H.minilm_available()
    if reason is not None:
        pytest.fail(f"the MiniLM test needs the bench extra: {reason}")
    warnings.filterwarnings("ignore")
    model, _, cal, ev, reference, _ = H.minilm_setup()
    return model, cal, ev, reference
