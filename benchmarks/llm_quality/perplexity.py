r"""Held-out perplexity of a causal LM, in PyTorch or in onnxruntime, on fixed windows of the held-out tokens.

The held-out token stream is cut into consecutive non-overlapping windows of ``length`` tokens (the tail shorter
than a window is dropped). Each window is scored on its own, from an empty KV cache: the model reads tokens
``0 .. length-2`` and predicts tokens ``1 .. length-1``, so a window contributes ``length - 1`` predictions. Over
all windows, with ``p(t_i | t_<i)`` the model's softmax probability of the actual next token::

    NLL = Σ_windows Σ_{i=1}^{length-1} −log p(t_i | t_<i)          N = windows · (length − 1)
    perplexity = exp(NLL / N)

The log-softmax is taken in float64 from the float32 logits, the same way for every model.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

__all__ = ["Score", "perplexity", "windows", "window_nll", "score", "paired_interval", "onnx_logits", "eager_logits"]


@dataclass(frozen=True)
class Score:
    """Summed negative log-likelihood (nats) over ``tokens`` predicted tokens, and each window's share."""

    nll: float
    tokens: int
    windows: tuple[float, ...] = ()

    @property
    def perplexity(self) -> float:
        """``exp(nll / tokens)``."""
        return perplexity(self.nll, self.tokens)


def perplexity(nll: float, tokens: int) -> float:
    """``exp(nll / tokens)``: the perplexity of ``tokens`` predictions whose negative log-likelihoods sum to ``nll``.

    Raises:
        ValueError: ``tokens`` is not positive.
    """
    if tokens <= 0:
        raise ValueError(f"perplexity needs at least one predicted token, got {tokens}")
    return math.exp(nll / tokens)


def windows(ids: torch.Tensor, length: int) -> list[torch.Tensor]:
    """Consecutive non-overlapping ``length``-token windows of the 1-D ``ids`` (a shorter tail is dropped).

    Raises:
        ValueError: ``length < 2`` (a window must predict at least one token).
    """
    if length < 2:
        raise ValueError(f"a window needs at least 2 tokens, got length {length}")
    count = ids.numel() // length
    return list(ids[: count * length].reshape(count, length))


def window_nll(logits: np.ndarray, ids: np.ndarray) -> float:
    """``Σ_{i≥1} −log softmax(logits[i-1])[ids[i]]`` for one window: logits ``(length, vocab)``, ids ``(length,)``."""
    scores = logits[:-1].astype(np.float64)
    top = scores.max(axis=-1, keepdims=True)
    log_norm = top[:, 0] + np.log(np.exp(scores - top).sum(axis=-1))
    return float((log_norm - scores[np.arange(len(scores)), ids[1:]]).sum())


def score(logits_of: Callable[[np.ndarray], np.ndarray], batches: list[torch.Tensor]) -> Score:
    """Sum :func:`window_nll` over the windows; ``logits_of(ids (1, length)) -> (1, length, vocab)``."""
    per_window, tokens = [], 0
    for window in batches:
        ids = window.numpy().astype(np.int64)
        per_window.append(window_nll(logits_of(ids[None])[0], ids))
        tokens += ids.size - 1
    return Score(sum(per_window), tokens, tuple(per_window))


def paired_interval(nll: np.ndarray, reference: np.ndarray, tokens_per_window: int, rounds: int = 2000,
                    seed: int = 0) -> tuple[float, float, float]:
    r"""Perplexity ratio of two models on the same windows, with a 95 % paired bootstrap interval over windows.

    ``ratio = exp((Σ_w nll_w − Σ_w ref_w) / N)``; the interval resamples the windows with replacement ``rounds``
    times (both models the same windows each time) and takes the 2.5 / 97.5 percentiles of the ratio.
    Returns ``(ratio, low, high)``.
    """
    difference = np.asarray(nll, np.float64) - np.asarray(reference, np.float64)
    count = difference.size
    generator = np.random.default_rng(seed)
    picks = generator.integers(0, count, size=(rounds, count))
    resampled = np.exp(difference[picks].sum(axis=1) / (count * tokens_per_window))
    low, high = np.percentile(resampled, [2.5, 97.5])
    return float(np.exp(difference.sum() / (count * tokens_per_window))), float(low), float(high)


def onnx_logits(path: Path, head_dim: int, threads: int = 1) -> Callable[[np.ndarray], np.ndarray]:
    """Logits of a KV-cache decoder file (ours or onnxruntime-genai's) run as a prefill with an empty cache.

    Feeds ``input_ids``, ``attention_mask`` (ones), ``position_ids`` (``0 .. length-1``, when the file takes them)
    and every ``past_key_values.*`` input as a ``(1, kv_heads, 0, head_dim)`` float32 (int8 cache: int8) tensor;
    returns output 0.
    ``head_dim`` is given because the builder declares that axis symbolic (``kv_cache_dim``).
    """
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    inputs = session.get_inputs()

    def run(ids: np.ndarray) -> np.ndarray:
        batch, length = ids.shape
        feed: dict[str, np.ndarray] = {}
        for arg in inputs:
            if arg.name == "input_ids":
                feed[arg.name] = ids
            elif arg.name == "attention_mask":
                feed[arg.name] = np.ones((batch, length), np.int64)
            elif arg.name == "position_ids":
                feed[arg.name] = np.arange(length, dtype=np.int64)[None].repeat(batch, 0)
            elif arg.name.startswith("past_key_values"):
                codes = arg.type == "tensor(int8)"  # an int8 KV cache (QuantizerConfig.kv_cache)
                feed[arg.name] = np.zeros((batch, int(arg.shape[1]), 0, head_dim), np.int8 if codes else np.float32)
            else:
                raise ValueError(f"{path}: unexpected decoder input {arg.name!r}")
        return session.run([session.get_outputs()[0].name], feed)[0]

    return run


def eager_logits(model: torch.nn.Module) -> Callable[[np.ndarray], np.ndarray]:
    """Logits of a transformers causal LM in PyTorch (float, no cache)."""

    @torch.no_grad()
    def run(ids: np.ndarray) -> np.ndarray:
        return model(input_ids=torch.from_numpy(ids), use_cache=False).logits.float().numpy()

    return run
