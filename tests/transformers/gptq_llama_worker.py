"""Run GPTQ w4 on a ~100 M-parameter random-init Llama decoder in this process; print a JSON report.

Run as ``python tests/transformers/gptq_llama_worker.py`` (a fresh process, so ``ru_maxrss`` is this run's peak).
Report: fp32 weight bytes, Σ Hessian bytes (one ``d × d`` float32 per linear), RSS after building the model,
peak RSS, seconds, and a SHA-256 digest of every GPTQ integer weight (determinism across runs).
"""

from __future__ import annotations

import hashlib
import json
import resource
import time
import warnings

import psutil
import torch

import coreai_opt as co
from coreai_opt.config import QuantizerConfig
from coreai_opt.quantization.spec import FakeQuantize


class _Logits(torch.nn.Module):
    """``input_ids -> logits`` without the KV cache (a plain tensor output for torch.export)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


def main() -> None:
    import transformers

    warnings.filterwarnings("ignore")
    torch.manual_seed(0)
    torch.set_num_threads(2)
    config = transformers.LlamaConfig(vocab_size=8000, hidden_size=768, intermediate_size=2048,
                                      num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=12,
                                      max_position_embeddings=128, attn_implementation="sdpa")
    model = _Logits(transformers.LlamaForCausalLM(config)).eval()
    params = sum(p.numel() for p in model.parameters())
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, 8000, (2, 64), generator=gen) for _ in range(4)]
    rss_model = psutil.Process().memory_info().rss
    start = time.perf_counter()
    cfg = QuantizerConfig.presets.w4(block_size=32, algorithm="gptq").set_op_kind("embedding", None)
    # transformers' masking branches on the batch size (a shape guard prepare refuses): captured at the fixed shape
    prepared = co.prepare(model, cfg, (batches[0],), capture="export", dynamic_shapes={"input_ids": None})
    hessian_bytes = sum(m.weight.shape[1] ** 2 * 4 for m in model.modules() if isinstance(m, torch.nn.Linear))
    co.calibrate(prepared, batches, progress=False)
    seconds = time.perf_counter() - start
    digest = hashlib.sha256()
    for name, fq in sorted(prepared.named_modules(), key=lambda item: item[0]):
        if isinstance(fq, FakeQuantize) and fq.rounding is not None:
            digest.update(name.encode())
            digest.update(fq.rounding.qweight.numpy().tobytes())
            digest.update(fq.rounding.scale.numpy().tobytes())
    print(json.dumps({
        "params": params, "fp32_weight_bytes": params * 4, "hessian_bytes": hessian_bytes,
        "rss_after_model": rss_model, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "seconds": seconds, "digest": digest.hexdigest(),
        "awaiting": sum(bool(fq.rounding.awaiting_data) for _, fq in prepared.named_modules()
                        if isinstance(fq, FakeQuantize) and fq.rounding is not None),
    }))


if __name__ == "__main__":
    main()
