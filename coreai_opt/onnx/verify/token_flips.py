r"""Token flips between two runs of a KV-cache decoder, each checked against the derived logits bound.

Free-running greedy streams part at their first difference and say nothing after it. Here the *other* run is forced
along the *reference* run's greedy tokens (teacher forcing), so every one of the ``count`` steps of every prompt is
compared: a flip is a step where the other run's arg-max is not the reference's token. Two comparisons serve the
decoder export (issue 32):

* eager converted model (with its cache) vs onnxruntime (with the cache);
* onnxruntime with the cache vs onnxruntime regenerating from scratch (a full forward over prompt + tokens so far
  from an empty past at every step).

Near-tie rule. Let :math:`r` and :math:`o` be the two runs' logits at a step, :math:`a` the reference token and
:math:`b` the other run's choice. The other run prefers :math:`b` only if
:math:`r_a - r_b \le (o_b - r_b) - (o_a - r_a) \le 2\tau`, with :math:`\tau` the largest difference one logit may
show between the runs. So a flip is explained by the runtimes' allowed numerical difference iff the reference's
margin :math:`r_a - r_b < 2\tau`: a near-tie. :math:`\tau` is the tolerance verify_onnx derives for the file's
``logits`` output (:mod:`coreai_opt.onnx.verify.tolerance`) evaluated at that step: ``steps × step`` for the
quantizer-steps rule, ``relative × (max r − min r)`` for the float and underived rules (and for an int8-compute
path, whose per-element unit is not computed here: :data:`~coreai_opt.onnx.verify.tolerance.UNDERIVED_RELATIVE`),
0 for an exact output. Acceptance: every flip a near-tie and at most one flip in :data:`MAX_FLIP_RATE`\ :sup:`-1`
generated tokens.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from coreai_opt.onnx.verify.generation import Step, greedy_tokens

__all__ = ["MAX_FLIP_RATE", "Flip", "FlipReport", "forced_logits", "logits_bound", "compare_streams"]

#: At most this fraction of the generated tokens may flip (1 in 256), each a near-tie.
MAX_FLIP_RATE = 1 / 256

#: ``bound(reference_logits) -> τ``: the allowed difference of one logit at a step (module docstring).
Bound = Callable[[np.ndarray], float]


@dataclass(frozen=True)
class Flip:
    r"""One step where the other run's arg-max is not the reference's greedy token.

    Attributes:
        prompt: Index of the prompt.
        step: Generated position (0 = the token after the prompt).
        expected: The reference's token :math:`a`.
        got: The other run's arg-max :math:`b`.
        margin: The reference's :math:`r_a - r_b` (at least its top-2 margin).
        bound: :math:`2\tau` at that step.
    """

    prompt: int
    step: int
    expected: int
    got: int
    margin: float
    bound: float

    @property
    def near_tie(self) -> bool:
        """The margin lies below the bound: the allowed numerical difference explains the flip."""
        return self.margin < self.bound


@dataclass(frozen=True)
class FlipReport:
    """Flips of one comparison over all prompts.

    Attributes:
        comparison: What was compared (``"eager vs onnxruntime"``).
        tokens: Generated positions compared (prompts × count).
        identical: Positions where the two free-running greedy streams agree, up to each prompt's first difference.
        flips: Every flip of the forced comparison.
    """

    comparison: str
    tokens: int
    identical: int
    flips: tuple[Flip, ...]

    @property
    def ok(self) -> bool:
        """Every flip is a near-tie and flips are at most :data:`MAX_FLIP_RATE` of the tokens."""
        return all(f.near_tie for f in self.flips) and len(self.flips) <= MAX_FLIP_RATE * self.tokens

    def __str__(self) -> str:
        head = (f"{self.comparison}: {self.identical}/{self.tokens} tokens identical (free-running), "
                f"{len(self.flips)} flip(s) forced, ok={self.ok}")
        return "\n".join([head, *(f"  prompt {f.prompt} step {f.step}: {f.expected} -> {f.got}, margin "
                                  f"{f.margin:.4g} {'<' if f.near_tie else '>='} bound {f.bound:.4g}"
                                  for f in self.flips)])


def forced_logits(step: Step, prompt: np.ndarray, tokens: Sequence[int], empty_past: list[np.ndarray],
                  cached: bool) -> list[np.ndarray]:
    """The last-position logits at each of ``len(tokens)`` steps along ``prompt + tokens``.

    ``cached``: prefill ``prompt``, then one token per call with the previous call's presents. Else every step is
    a full forward over ``prompt + tokens[:t]`` from ``empty_past`` (regenerating without the cache).
    """
    ids = np.concatenate([prompt.reshape(-1), np.asarray(tokens, np.int64)]).astype(np.int64)
    start = prompt.size
    seen: list[np.ndarray] = []
    if not cached:
        for t in range(len(tokens)):
            n = start + t
            logits, _ = step(ids[None, :n], np.ones((1, n), np.int64), np.arange(n, dtype=np.int64)[None], empty_past)
            seen.append(logits[0, -1])
        return seen
    past, chunk, offset = empty_past, ids[None, :start], 0
    for t in range(len(tokens)):
        end = offset + chunk.shape[1]
        logits, past = step(chunk, np.ones((1, end), np.int64), np.arange(offset, end, dtype=np.int64)[None], past)
        seen.append(logits[0, -1])
        chunk, offset = ids[None, start + t:start + t + 1], end
    return seen


def _greedy_uncached(step: Step, prompt: np.ndarray, empty_past: list[np.ndarray], count: int) -> list[int]:
    ids = [int(i) for i in prompt.reshape(-1)]
    for _ in range(count):
        n = len(ids)
        logits, _ = step(np.asarray(ids, np.int64)[None], np.ones((1, n), np.int64), np.arange(n, dtype=np.int64)[None],
                         empty_past)
        ids.append(int(np.argmax(logits[0, -1])))
    return ids[prompt.size:]


def logits_bound(path: str | os.PathLike[str], output: str = "logits") -> tuple[Bound, str]:
    r""":math:`\tau` of the decoder file's ``output`` (module docstring) and the tolerance's reason line."""
    from coreai_opt.onnx.verify.fusion_report import optimized_model
    from coreai_opt.onnx.verify.tolerance import UNDERIVED_RELATIVE, derive_tolerances

    tolerance = derive_tolerances(optimized_model(path, "all"), set())[output]
    if tolerance.rule == "exact":
        return (lambda _: 0.0), tolerance.reason
    if tolerance.steps is not None and tolerance.source_step is not None and tolerance.rule == "quantizer steps":
        absolute = tolerance.steps * tolerance.source_step
        return (lambda _: absolute), tolerance.reason
    relative = tolerance.relative if tolerance.relative is not None else UNDERIVED_RELATIVE
    return (lambda logits: relative * float(np.max(logits) - np.min(logits))), tolerance.reason


def compare_streams(reference: Step, other: Step, prompts: Sequence[np.ndarray], empty_past: list[np.ndarray],
                    count: int, bound: Bound, comparison: str, other_cached: bool = True) -> FlipReport:
    r"""Greedy ``count`` tokens after each prompt with ``reference`` (cached); force ``other`` along them.

    Args:
        reference: The run whose greedy tokens are the stream (with its KV cache).
        other: The run compared with it, cached or (``other_cached=False``) regenerating from scratch.
        prompts: 1-D int64 token ids.
        empty_past: The past of a prefill (length 0).
        count: Tokens per prompt.
        bound: :math:`\tau` at a step, from the reference's logits (:func:`logits_bound`).
        comparison: The report's title.
        other_cached: How ``other`` runs (see :func:`forced_logits`).
    """
    flips: list[Flip] = []
    identical = 0
    for p, prompt in enumerate(prompts):
        tokens, ref_logits = greedy_tokens(reference, prompt, empty_past, count)
        free = (greedy_tokens(other, prompt, empty_past, count)[0] if other_cached
                else _greedy_uncached(other, prompt, empty_past, count))
        identical += next((i for i, (a, b) in enumerate(zip(tokens, free, strict=True)) if a != b), count)
        for t, logits in enumerate(forced_logits(other, prompt, tokens, empty_past, other_cached)):
            got = int(np.argmax(logits))
            if got != tokens[t]:
                ref = ref_logits[t]
                flips.append(Flip(p, t, tokens[t], got, float(ref[tokens[t]] - ref[got]), 2 * bound(ref)))
    return FlipReport(comparison, len(prompts) * count, identical, tuple(flips))
