"""A small Llama-style LM trained here on the text every Python ships, cached as a ``save_pretrained`` folder.

Architecture (:data:`MODEL`): hidden 192, 4 layers, 6 query / 2 key-value heads (GQA, head 32), MLP 512, vocab
2048, untied LM head, 512 positions: 2.4 M parameters, sized so it trains in minutes on a shared 2-core machine.
Training: random windows of :data:`TrainSettings.sequence` tokens from the training documents (each document
followed by ``</s>``), AdamW, linear warm-up then cosine decay, every seed fixed (``torch.manual_seed``, a
``torch.Generator`` for the windows). The folder (weights, config, tokenizer, and ``training.json`` with the
settings and the loss curve) is cached under ``<cache>/<key>`` where the key hashes the settings, so a rerun loads
it instead of training.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from benchmarks.llm_quality.corpus import HELD_OUT_EVERY, VOCAB_SIZE, documents, split, train_tokenizer

__all__ = ["MODEL", "TrainSettings", "TrainedLM", "token_stream", "trained_lm"]

#: ``LlamaConfig`` fields of the trained model.
MODEL: dict[str, Any] = {
    "vocab_size": VOCAB_SIZE, "hidden_size": 192, "intermediate_size": 512, "num_hidden_layers": 4,
    "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": 512,
    "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
}


@dataclass(frozen=True)
class TrainSettings:
    """How the model is trained (all of it goes into the cache key)."""

    steps: int = 400
    batch: int = 8
    sequence: int = 128
    learning_rate: float = 3e-3
    warmup: int = 30
    weight_decay: float = 0.1
    seed: int = 0
    threads: int = 1  # on a loaded 2-core machine one thread trains 3x faster than two

    def key(self) -> str:
        """Cache folder name: the settings, the model and the split rule hashed."""
        blob = json.dumps({"train": asdict(self), "model": MODEL, "held_out_every": HELD_OUT_EVERY}, sort_keys=True)
        return "llama-" + hashlib.sha256(blob.encode()).hexdigest()[:12]


@dataclass(frozen=True)
class TrainedLM:
    """The cached folder and the token ids of both splits (documents joined by ``</s>``)."""

    folder: Path
    training_ids: torch.Tensor
    held_out_ids: torch.Tensor
    record: dict[str, Any]


def token_stream(tokenizer: Any, texts: list[str]) -> torch.Tensor:
    """The texts' token ids, each text followed by ``</s>``, as one 1-D int64 tensor."""
    ids: list[int] = []
    for text in texts:
        ids += tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    return torch.tensor(ids, dtype=torch.int64)


def _train(folder: Path, tokenizer: Any, stream: torch.Tensor, settings: TrainSettings, log: Any) -> dict[str, Any]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(settings.seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(settings.threads)
    model = LlamaForCausalLM(LlamaConfig(**MODEL)).train()
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    rest = [p for n, p in model.named_parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": settings.weight_decay},
                                   {"params": rest, "weight_decay": 0.0}], lr=settings.learning_rate,
                                  betas=(0.9, 0.95))

    def learning_rate(step: int) -> float:
        if step < settings.warmup:
            return (step + 1) / settings.warmup
        progress = (step - settings.warmup) / max(1, settings.steps - settings.warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, learning_rate)
    generator = torch.Generator().manual_seed(settings.seed)
    losses: list[tuple[int, float]] = []
    start = time.perf_counter()
    running = 0.0
    for step in range(settings.steps):
        starts = torch.randint(0, stream.numel() - settings.sequence - 1, (settings.batch,), generator=generator)
        batch = torch.stack([stream[s:s + settings.sequence] for s in starts.tolist()])
        loss = model(input_ids=batch, labels=batch).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        running += loss.item()
        if (step + 1) % 25 == 0:
            losses.append((step + 1, running / 25))
            log(f"  step {step + 1}/{settings.steps}: loss {running / 25:.3f} ({time.perf_counter() - start:.0f} s)")
            running = 0.0
    seconds = time.perf_counter() - start
    torch.set_num_threads(threads)
    model.eval().save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    parameters = sum(p.numel() for p in model.parameters())
    return {"settings": asdict(settings), "model": MODEL, "parameters": parameters, "seconds": round(seconds, 1),
            "training_tokens": int(stream.numel()), "tokens_seen": settings.steps * settings.batch * settings.sequence,
            "loss_curve": losses}


def trained_lm(cache: Path, settings: TrainSettings = TrainSettings(), log: Any = print) -> TrainedLM:
    """The model of ``settings``: loaded from ``cache/<settings.key()>`` when there, else trained and saved there."""
    from transformers import AutoTokenizer

    folder = cache / settings.key()
    training, held_out = split(documents())
    record_path = folder / "training.json"
    if record_path.exists():
        tokenizer = AutoTokenizer.from_pretrained(folder)
        record = json.loads(record_path.read_text())
        log(f"trained model cached: {folder}")
    else:
        tokenizer = train_tokenizer(training)
        stream = token_stream(tokenizer, [d.text for d in training])
        log(f"training {folder.name} on {stream.numel()} tokens ({settings.steps} steps of "
            f"{settings.batch}x{settings.sequence})")
        folder.mkdir(parents=True, exist_ok=True)
        record = _train(folder, tokenizer, stream, settings, log)
        record["documents"] = {"training": len(training), "held_out": len(held_out)}
        record_path.write_text(json.dumps(record, indent=1) + "\n")
    return TrainedLM(folder, token_stream(tokenizer, [d.text for d in training]),
                     token_stream(tokenizer, [d.text for d in held_out]), record)
