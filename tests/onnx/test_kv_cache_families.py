"""The KV-cache wrapper across decoder families: the float model's own math, sliding windows and soft-capping included.

Each family of the decoder matrix (benchmarks/llm/families.py: tiny random Llama, Qwen2, Qwen3, Mistral, Phi-3,
Gemma2, GPT-2, GPT-NeoX) is run through ``DecoderWithCache``: a prefill, then one token at a time past the sliding
window (16), must give the logits of transformers' own full forward without a cache.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.llm.families import FAMILIES, SLIDING_WINDOW, save_family
from coreai_opt.errors import CoreaiOptValueError
from coreai_opt.graph.kv_cache_decoder import ATTENTION, DecoderWithCache
from coreai_opt.huggingface import from_pretrained, is_causal_lm

TOKENS = 30  # past the sliding window of 16


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("families")
    return {name: save_family(name, root / name) for name in FAMILIES}


def _decode_one_at_a_time(decoder: DecoderWithCache, ids: torch.Tensor, prefill: int) -> torch.Tensor:
    logits, *present = decoder(ids[:, :prefill], torch.ones(1, prefill, dtype=torch.int64),
                               torch.arange(prefill)[None], *decoder.empty_cache(1))
    steps = [logits]
    for k in range(prefill, ids.shape[1]):
        logits, *present = decoder(ids[:, k:k + 1], torch.ones(1, k + 1, dtype=torch.int64), torch.tensor([[k]]),
                                   *present)
        steps.append(logits)
    assert [tuple(p.shape[:3]) for p in present] == [(1, decoder.kv_heads, ids.shape[1])] * len(present)
    return torch.cat(steps, 1)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_prefill_then_decode_past_the_window_equals_the_float_full_forward(family: str, folders) -> None:
    model = from_pretrained(folders[family], seq_len=16).model
    ids = torch.randint(3, int(model.config.vocab_size), (1, TOKENS), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids).logits
        cached = _decode_one_at_a_time(DecoderWithCache(model), ids, prefill=20)
    torch.testing.assert_close(cached, full, rtol=1e-5, atol=1e-5)


def _gemma2_logits(ids: torch.Tensor, **change: object) -> torch.Tensor:
    """Logits of transformers' own full forward of the matrix's Gemma2 weights, config fields ``change``d."""
    import transformers

    config = FAMILIES["gemma2"](transformers).config
    for key, value in change.items():
        setattr(config, key, value)
    torch.manual_seed(0)  # the seed of save_family: the same weights (the changed fields hold no parameters)
    return type(FAMILIES["gemma2"](transformers))(config).eval()(ids).logits


@torch.no_grad()
def test_gemma2s_window_and_soft_cap_change_its_logits_so_the_parity_above_covers_them() -> None:
    ids = torch.randint(3, 90, (1, TOKENS), generator=torch.Generator().manual_seed(1))
    reference = _gemma2_logits(ids)
    assert (_gemma2_logits(ids, sliding_window=4096) - reference)[:, SLIDING_WINDOW:].abs().max() > 1e-4
    assert (_gemma2_logits(ids, sliding_window=4096) - reference)[:, :SLIDING_WINDOW].abs().max() == 0
    assert (_gemma2_logits(ids, attn_logit_softcapping=None) - reference).abs().max() > 0.1


def test_an_attention_option_the_wrapper_does_not_implement_is_refused_by_name(folders) -> None:
    from transformers import AttentionInterface

    DecoderWithCache(from_pretrained(folders["llama"], seq_len=16).model)  # registers the attention function
    q = k = v = torch.zeros(1, 2, 3, 4)
    with pytest.raises(CoreaiOptValueError, match=r"^Module passes s_aux to its attention function, which the "
                                                  r"KV-cache decoder export does not implement"):
        AttentionInterface()[ATTENTION](torch.nn.Module(), q, k, v, None, s_aux=torch.zeros(2))


def test_gpt2_lm_head_model_counts_as_a_causal_lm_and_a_classifier_does_not() -> None:
    assert is_causal_lm("GPT2LMHeadModel") and is_causal_lm("LlamaForCausalLM") and is_causal_lm("GPTNeoXForCausalLM")
    assert not is_causal_lm("BertForSequenceClassification")
