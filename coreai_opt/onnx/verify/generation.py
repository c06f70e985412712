"""Generation-level check of a KV-cache decoder file: greedy tokens in onnxruntime vs the eager converted model.

Both run the same loop: prefill the prompt with an empty cache (past length 0), take the arg-max of the last
position's logits, then feed that one token with the previous step's ``present`` tensors as the past, ``count``
times. :func:`compare_greedy` reports, per prompt, the first step where the two token streams part (None when
identical) and the top-2 logit margin of the eager model there (a small margin marks a near-tie).

Memory (issue 32, Scale): the eager steps run the
:func:`~coreai_opt.passes.sink_weight_quantizers.eager_order` view of the converted model, which fake-quantizes
each weight right before its layer (a ``torch.export`` graph quantizes every weight at its top: one extra float
copy of the weights alive at once), and all of them run before the onnxruntime session opens, so the eager
temporaries and the session's weights are never resident together.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort
import torch
from torch import nn

from coreai_opt.passes.sink_weight_quantizers import eager_order

__all__ = ["GenerationReport", "greedy_tokens", "compare_greedy", "eager_step", "ort_step", "Step"]

#: One decoder call: ``(input_ids, attention_mask, position_ids, past) -> (logits, present)``, numpy arrays.
Step = Callable[[np.ndarray, np.ndarray, np.ndarray, list[np.ndarray]], tuple[np.ndarray, list[np.ndarray]]]


@dataclass(frozen=True)
class GenerationReport:
    """Token streams of onnxruntime and eager, and where they first differ.

    Attributes:
        onnxruntime: The generated ids per prompt (onnxruntime).
        eager: The generated ids per prompt (the eager converted model).
        first_difference: Per prompt, the first differing step, or None.
        margins: Per prompt, the eager top-2 logit margin at that step (None where identical).
    """

    onnxruntime: list[list[int]]
    eager: list[list[int]]
    first_difference: list[int | None]
    margins: list[float | None]

    @property
    def identical(self) -> int:
        """Positions where both streams hold the same token (counted up to the first difference)."""
        return sum(len(a) if d is None else d for a, d in zip(self.onnxruntime, self.first_difference, strict=True))

    @property
    def total(self) -> int:
        """Generated positions in all."""
        return sum(len(a) for a in self.onnxruntime)

    @property
    def ok(self) -> bool:
        """Every prompt's tokens identical."""
        return all(d is None for d in self.first_difference)

    def __str__(self) -> str:
        lines = [f"greedy generation, onnxruntime vs eager (KV cache): {len(self.eager)} prompt(s), "
                 f"{self.identical}/{self.total} tokens identical, ok={self.ok}"]
        for i, (step, margin) in enumerate(zip(self.first_difference, self.margins, strict=True)):
            if step is not None:
                lines.append(f"  prompt {i}: first difference at step {step} (eager top-2 margin {margin:.4g})")
        return "\n".join(lines)


def greedy_tokens(step: Step, prompt: np.ndarray, empty_past: list[np.ndarray], count: int
                  ) -> tuple[list[int], list[np.ndarray]]:
    """``count`` greedy tokens after ``prompt`` (1-D ids) and the last-position logits of each step."""
    ids, past, tokens, logits_seen = prompt.reshape(1, -1).astype(np.int64), empty_past, [], []
    for _ in range(count):
        start = past[0].shape[2]
        mask = np.ones((1, start + ids.shape[1]), np.int64)
        positions = np.arange(start, start + ids.shape[1], dtype=np.int64).reshape(1, -1)
        logits, past = step(ids, mask, positions, past)
        logits_seen.append(logits[0, -1])
        tokens.append(int(np.argmax(logits[0, -1])))
        ids = np.array([[tokens[-1]]], np.int64)
    return tokens, logits_seen


def eager_step(model: nn.Module) -> Step:
    """One call of the eager KV-cache decoder ``model`` as a :data:`Step` (no gradients)."""

    @torch.no_grad()
    def step(ids: np.ndarray, mask: np.ndarray, positions: np.ndarray, past: list[np.ndarray]
             ) -> tuple[np.ndarray, list[np.ndarray]]:
        out = model(*(torch.from_numpy(np.ascontiguousarray(t)) for t in (ids, mask, positions, *past)))
        return out[0].numpy(), [t.numpy() for t in out[1:]]
    return step


def ort_step(session: ort.InferenceSession) -> Step:
    """One run of the decoder file's onnxruntime ``session`` as a :data:`Step` (inputs fed in graph order)."""
    names = [i.name for i in session.get_inputs()]

    def step(ids: np.ndarray, mask: np.ndarray, positions: np.ndarray, past: list[np.ndarray]
             ) -> tuple[np.ndarray, list[np.ndarray]]:
        out = session.run(None, dict(zip(names, (ids, mask, positions, *past), strict=True)))
        return out[0], list(out[1:])
    return step


def compare_greedy(model: nn.Module, path: str | os.PathLike[str], prompts: Sequence[torch.Tensor],
                   empty_past: Sequence[torch.Tensor], count: int) -> GenerationReport:
    """Greedy-decode ``count`` tokens after each prompt in onnxruntime (file ``path``) and with ``model``.

    Args:
        model: The converted KV-cache decoder (``coreai_opt.graph.kv_cache_decoder.DecoderWithCache``, prepared,
            calibrated and converted).
        path: Its ONNX file (``export_onnx(..., task="text-generation")``).
        prompts: 1-D token id tensors.
        empty_past: The past of a prefill, ``DecoderWithCache.empty_cache(1)``.
        count: Tokens to generate per prompt.
    """
    past = [t.numpy() for t in empty_past]
    step = eager_step(eager_order(model))
    eager = [greedy_tokens(step, p.numpy(), past, count) for p in prompts]
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    # an int8 KV cache (QuantizerConfig.kv_cache) takes its empty past as int8 codes
    file_past = [p.astype(np.int8) if i.type == "tensor(int8)" else p for p, i in zip(past, session.get_inputs()[3:],
                                                                                       strict=True)]
    runs = [(greedy_tokens(ort_step(session), p.numpy(), file_past, count), e)
            for p, e in zip(prompts, eager, strict=True)]
    firsts: list[int | None] = []
    margins: list[float | None] = []
    for (ours, _), (theirs, logits) in runs:
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None)
        firsts.append(first)
        top2 = np.sort(logits[first])[-2:] if first is not None else None
        margins.append(float(top2[1] - top2[0]) if top2 is not None else None)
    return GenerationReport([o for (o, _), _ in runs], [e for _, (e, _) in runs], firsts, margins)
