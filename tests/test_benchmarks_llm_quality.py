"""benchmarks/llm_quality: the perplexity arithmetic, the windows and the corpus split, on tiny known cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from benchmarks.llm_quality.corpus import HELD_OUT_EVERY, Document, split
from benchmarks.llm_quality.perplexity import Score, paired_interval, perplexity, score, window_nll, windows


def test_window_nll_sums_minus_log_of_each_next_token_probability() -> None:
    probabilities = np.array([[0.5, 0.25, 0.25], [0.1, 0.8, 0.1], [0.2, 0.3, 0.5]])
    ids = np.array([2, 0, 1])  # row 0 predicts id 0 (p 0.5), row 1 predicts id 1 (p 0.8); row 2 predicts nothing
    logits = np.log(probabilities) + 7.0  # a shift per row leaves the softmax unchanged
    assert window_nll(logits, ids) == pytest.approx(-math.log(0.5) - math.log(0.8), rel=1e-12)


def test_score_over_windows_is_exp_of_the_mean_nll_per_predicted_token() -> None:
    table = np.log(np.array([[0.5, 0.3, 0.2], [0.25, 0.25, 0.5], [0.9, 0.05, 0.05]]))

    def bigram(ids: np.ndarray) -> np.ndarray:  # p(next | current) = row `current` of the table
        return table[ids]

    batches = windows(torch.tensor([0, 1, 2, 0, 2, 1, 0]), 3)  # [0 1 2] [0 2 1]; the tail [0] is dropped
    result = score(bigram, batches)
    assert result.tokens == 4
    nll = -(math.log(0.3) + math.log(0.5) + math.log(0.2) + math.log(0.05))  # 0->1, 1->2, 0->2, 2->1
    assert result.nll == pytest.approx(nll, rel=1e-12)
    assert result.perplexity == pytest.approx(math.exp(nll / 4), rel=1e-12)
    assert perplexity(4 * math.log(3.0), 4) == pytest.approx(3.0, rel=1e-12)  # uniform over 3: perplexity 3
    assert Score(0.0, 5).perplexity == 1.0


def test_perplexity_and_windows_refuse_empty_cases() -> None:
    with pytest.raises(ValueError, match="at least one predicted token, got 0"):
        perplexity(1.0, 0)
    with pytest.raises(ValueError, match="at least 2 tokens, got length 1"):
        windows(torch.arange(5), 1)


def test_the_split_holds_out_by_name_hash_whatever_the_order() -> None:
    docs = [Document(f"stdlib/m{i}.py", f"text {i}") for i in range(200)]
    training, held = split(docs)
    assert len(training) + len(held) == 200 and 0 < len(held) < 200 / HELD_OUT_EVERY * 2
    assert not {d.name for d in training} & {d.name for d in held}
    assert split(docs[::-1])[1] == held[::-1]


def test_paired_interval_is_the_perplexity_ratio_and_collapses_for_a_constant_difference() -> None:
    reference = np.array([10.0, 20.0, 30.0, 40.0])
    assert paired_interval(reference, reference, 9) == (1.0, 1.0, 1.0)
    ratio, low, high = paired_interval(reference + 0.9, reference, 9)  # +0.1 nats on every predicted token
    assert ratio == pytest.approx(math.exp(0.1), rel=1e-12)
    assert low == pytest.approx(ratio, rel=1e-12) and high == pytest.approx(ratio, rel=1e-12)
    ratio, low, high = paired_interval(reference + np.array([0.0, 0.0, 0.0, 3.6]), reference, 9)
    assert ratio == pytest.approx(math.exp(0.1), rel=1e-12) and low < ratio < high  # one window carries it
