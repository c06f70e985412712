"""Token flips under teacher forcing: each step compared, each flip's margin against the derived near-tie bound.

The decoders here are arithmetic stand-ins with a known logit table, so every count, margin and bound is exact.
"""

from __future__ import annotations

import numpy as np
import pytest

from coreai_opt.onnx.verify.token_flips import MAX_FLIP_RATE, Flip, FlipReport, compare_streams, forced_logits

VOCAB = 5


def _table_step(offsets: dict[int, np.ndarray], calls: list[tuple[int, int]]):
    """A cache-keeping decoder whose next token is ``(last id + 1) % VOCAB`` by a logit gap of 1.0.

    ``offsets[t]`` is added to the logits when the last fed position is ``t`` (a numerical difference); the
    "cache" is a 1-element array holding the length seen so far. ``calls`` records ``(past, new)`` lengths.
    """
    def step(ids, mask, positions, past):
        calls.append((past[0].shape[2], ids.shape[1]))
        assert mask.shape[1] == past[0].shape[2] + ids.shape[1]
        assert positions.tolist() == [list(range(past[0].shape[2], mask.shape[1]))]
        last = int(ids[0, -1])
        logits = np.zeros((1, ids.shape[1], VOCAB), np.float32)
        logits[0, -1, (last + 1) % VOCAB] = 1.0
        logits[0, -1] += offsets.get(int(positions[0, -1]), 0.0)
        present = [np.zeros((1, 1, mask.shape[1], 1), np.float32)]
        return logits, present
    return step


EMPTY = [np.zeros((1, 1, 0, 1), np.float32)]
PROMPT = np.array([0, 1, 2], np.int64)


def test_forced_logits_feed_the_reference_tokens_with_the_cache_or_regenerate_each_step_from_scratch() -> None:
    cached: list[tuple[int, int]] = []
    forced_logits(_table_step({}, cached), PROMPT, [3, 4, 0], EMPTY, cached=True)
    assert cached == [(0, 3), (3, 1), (4, 1)]  # prefill of the prompt, then one token on the past
    scratch: list[tuple[int, int]] = []
    forced_logits(_table_step({}, scratch), PROMPT, [3, 4, 0], EMPTY, cached=False)
    assert scratch == [(0, 3), (0, 4), (0, 5)]  # prompt + tokens so far, from an empty past each time


def test_a_flip_is_counted_at_its_step_with_the_reference_margin_and_twice_the_bound() -> None:
    reference = _table_step({}, [])
    # fed position 4 (generated step 2: prompt 0 1 2, then 3, 4) the other run lifts token 1 by 1.25 over token 0
    other = _table_step({4: np.array([0.0, 1.25, 0.0, 0.0, 0.0], np.float32)}, [])
    report = compare_streams(reference, other, [PROMPT], EMPTY, 4, lambda logits: 0.7, "test")
    assert report.flips == (Flip(prompt=0, step=2, expected=0, got=1, margin=1.0, bound=1.4),)
    assert report.flips[0].near_tie
    assert report.identical == 2 and report.tokens == 4
    # 1 flip in 4 tokens is over the 1-in-256 rate, even as a near-tie
    assert not report.ok and MAX_FLIP_RATE == 1 / 256


def test_a_flip_whose_margin_exceeds_the_bound_fails_and_one_near_tie_in_256_tokens_passes() -> None:
    far = FlipReport("test", 256, 255, (Flip(0, 3, 1, 2, margin=0.9, bound=0.5),))
    near = FlipReport("test", 256, 255, (Flip(0, 3, 1, 2, margin=0.4, bound=0.5),))
    two = FlipReport("test", 256, 255, (Flip(0, 3, 1, 2, 0.4, 0.5), Flip(1, 3, 1, 2, 0.4, 0.5)))
    assert (far.ok, near.ok, two.ok) == (False, True, False)
    assert str(far).splitlines() == ["test: 255/256 tokens identical (free-running), 1 flip(s) forced, ok=False",
                                     "  prompt 0 step 3: 1 -> 2, margin 0.9 >= bound 0.5"]


@pytest.mark.parametrize("cached", [True, False])
def test_identical_runs_have_no_flip_and_every_token_identical(cached: bool) -> None:
    report = compare_streams(_table_step({}, []), _table_step({}, []), [PROMPT, PROMPT[:2]], EMPTY, 8,
                             lambda logits: 0.0, "same", other_cached=cached)
    assert report.flips == () and report.identical == report.tokens == 16 and report.ok
