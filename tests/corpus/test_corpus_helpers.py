"""The corpus harness itself: its metrics on hand-computed numbers and the torchvision op declaration."""

from __future__ import annotations

import math

import numpy as np
import torch

from benchmarks.common.torchvision_ops import declare_torchvision_ops
from benchmarks.corpus.models import CORPUS, tokens
from benchmarks.corpus.runner import CorpusRow, decisive_flips, output_verdict, sqnr_db, top1_agreement
from benchmarks.corpus.section import export_ratio
from coreai_opt.onnx.verify.output_comparison import OutputComparison


def test_sqnr_db_is_signal_over_noise_power_over_all_batches():
    reference = [np.array([1.0, -1.0]), np.array([2.0])]
    approx = [np.array([1.1, -0.9]), np.array([2.0])]
    assert math.isclose(sqnr_db(reference, approx), 10 * math.log10(6.0 / 0.02), rel_tol=1e-12)
    assert sqnr_db(reference, reference) == math.inf


def test_top1_agreement_counts_every_position_of_lm_logits():
    reference = [np.array([[[0.0, 1.0], [1.0, 0.0]], [[0.0, 1.0], [0.0, 1.0]]])]  # [N=2, T=2, V=2]
    other = [np.array([[[0.0, 1.0], [0.0, 1.0]], [[0.0, 1.0], [0.0, 1.0]]])]
    assert top1_agreement(reference, other) == 0.75


def test_decisive_flips_forgive_only_near_ties():
    reference = [np.array([[0.0, 1.0], [0.0, 0.1]])]  # margins 1.0 and 0.1
    other = [np.array([[1.0, 0.0], [0.1, 0.0]])]  # both rows flip
    assert decisive_flips(reference, other, tolerance=0.1) == 1  # 0.1 <= 2 * 0.1: a near tie
    assert decisive_flips(reference, other, tolerance=0.01) == 2


def test_export_ratio_is_export_onnx_seconds_over_the_float_export_seconds():
    row = CorpusRow("m", "cnn", seconds={"export": 6.0, "ort_float_export": 4.0})
    assert export_ratio(row) == 1.5
    assert export_ratio(CorpusRow("m", "cnn", seconds={"export": 6.0})) is None  # the float export did not run
    assert export_ratio(CorpusRow("m", "cnn", seconds={"ort_float_export": 4.0})) is None  # ours failed earlier


def test_token_inputs_stay_in_the_vocabulary_with_a_right_padded_mask():
    ids, mask = tokens(torch.Generator().manual_seed(0), 64)
    assert ids.dtype == torch.int64 and 0 <= int(ids.min()) and int(ids.max()) < 1000
    assert mask[0].all() and not mask.all() and (mask.sum(1) >= 8).all()
    assert torch.equal(mask, mask.sort(dim=1, descending=True).values)  # ones first: right padding


def test_declare_torchvision_ops_lets_timm_and_transformers_import():
    declare_torchvision_ops()
    assert declare_torchvision_ops() is False  # idempotent
    torch._C._get_schema("torchvision::nms", "")
    torch._C._get_schema("torchvision::qnms", "")
    import timm
    import transformers

    model = timm.create_model("resnet18", pretrained=False, num_classes=3).eval()
    assert model(torch.randn(1, 3, 32, 32)).shape == (1, 3)
    assert transformers.BertConfig is not None


def test_corpus_has_forty_architectures_from_both_libraries():
    names = list(CORPUS)
    assert len(names) == 40 and sum(n.startswith("hf-") for n in names) == 28 and sum(n.startswith("timm-") for n in
                                                                                         names) == 12
    assert {m.family for m in CORPUS.values()} == {"cnn", "encoder", "decoder", "vit", "speech"}


def test_a_failing_output_row_says_the_difference_the_argmax_verdict_and_the_bound():
    """hf-ergo's row said only why its bound was 47 steps; it failed on the argmax agreement floor."""
    failing = OutputComparison("output", (8, 16, 512), 0.0157, 0.0039, 4.0, 1.0, 0.9648, 9, False, "steps", 47,
                               0.18, "1 per quantizer stage", 0.00786, 0.369, 256)
    assert output_verdict(failing) == (
        "output: 4 of 47 steps; argmax: 9 near-tie flip(s); largest eager top-2 margin of a flip 0.00786 <= bound "
        "0.369; agreement 96.48% of 256 rows is below 99.5%: too many flips at once for rounding (a shift) "
        "(1 per quantizer stage)")
    floating = OutputComparison("logits", (2, 3), 0.5, None, None, 1.0, None, 0, False, "float", None, 0.02, "why")
    assert output_verdict(floating) == "logits: |diff| 0.5 of 0.02 (why)"
