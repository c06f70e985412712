"""The BERT- and DistilBERT-style corpus models in OpenVINO CPU against eager, through verify_onnx(runtime="openvino").

Each (model, preset) cell must compile in OpenVINO, verify ok against the tolerance derived from onnxruntime's
kernels and keep top-1 agreement with eager >= 99.9 % outside near ties (issue 15). Same sizes and seeds as the
corpus runner (benchmarks/corpus/runner.py: 4 calibration batches of 4, 2 evaluation batches of 8). Marker
``corpus`` (each cell builds and exports a transformer: tens of seconds).

Measured (16 inputs; steps / derived bound, top-1): hf-bert w8a8 0 / 31, w8a8_sym 0 / 35, w8a16 5.27 / 29,
w4a8 0 / 30, w8a8_dynamic 3e-8 (float bound 0.0024); hf-distilbert w8a8 2 / 29, w8a8_sym 0 / 33, w8a16 6.76 / 28,
w4a8 1 / 28, w8a8_dynamic 1.9e-8 (0.0023); every cell compiles and agrees 100 %.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import coreai_opt
from benchmarks.corpus.models import CORPUS
from benchmarks.verify.corpus_verify import export_corpus_model

pytest.importorskip("openvino")

MODELS = ("hf-bert", "hf-distilbert")
#: w8a8 is the corpus preset; the others are the presets a BERT is deployed with (static 8/16-bit activations,
#: int4 weights with uint8 activations, dynamic int8 linears).
PRESETS = ("w8a8", "w8a8_sym", "w8a16", "w4a8", "w8a8_dynamic")


@pytest.mark.corpus
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("name", MODELS)
def test_bert_style_corpus_model_agrees_with_eager_in_openvino(name: str, preset: str, tmp_path: Path) -> None:
    export = export_corpus_model(CORPUS[name], preset, tmp_path)
    report = coreai_opt.verify_onnx(export.model, export.path, export.batches, runtime="openvino")
    print(f"\n{report}")
    assert report.runtime == "openvino"
    for output in report.outputs:
        if output.argmax_agreement is not None:
            decided = output.argmax_agreement + output.argmax_flips_within_tolerance / report.num_samples
            assert decided >= 0.999, str(report)
    assert report.ok, str(report)
