"""The eight decoder families of the matrix as tiny ``save_pretrained`` folders, built offline (random weights).

Each folder holds a small random model (hidden 64, 2 layers, 4 heads; 2 KV heads where the family has grouped-query
attention) and a byte-level BPE tokenizer (trained here on the prompt words, :data:`VOCAB` entries) with BOS / EOS /
UNK and no pad token, as most decoder tokenizers have. Byte-level BPE, because some families' tokenizer classes
rebuild the tokenizer from its vocabulary and merges (transformers 5 loads a Qwen2 folder with ``Qwen2Tokenizer``
whatever ``tokenizer_config.json`` says), which turns a word-level vocabulary into empty prompts. The
configs keep each family's own features switched on, so the export meets them: sliding windows shorter than a
prompt plus its 32 generated tokens (Mistral, Gemma2's local layers), Gemma2's logit soft-capping, GPT-2's
``Conv1D`` linears, GPT-NeoX's partial rotary embedding (a quarter of each head) and fused q/k/v, Phi-3's fused
q/k/v and gate/up. ``use_cache`` stays as each config class sets it (true for all eight).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

__all__ = ["FAMILIES", "WORDS", "VOCAB", "PROMPTS", "CALIBRATION", "save_family", "tokenizer"]

SPECIAL = ["<unk>", "<s>", "</s>"]
WORDS = [*"the a cat dog sat on mat is good bad movie film very not".split(), *(f"w{i}" for i in range(80))]
#: Tokenizer vocabulary: the 3 special tokens, 256 bytes, and merges up to this size.
VOCAB = 400
#: Prompts of the generation check (8), and the calibration text (8 other lines).
PROMPTS = ["the cat sat on the mat", "a very good movie", "the dog is bad w1 w2", "not a good film w7",
           "w3 w4 w5 w6 w9", "the film is very bad w11", "a dog sat on a cat w20", "good good good w33 w40"]
CALIBRATION = ["the dog sat on the mat", "a very bad film", "the cat is good w5", "not a bad movie w8",
               "w10 w11 w12 w13", "the movie is very good w15", "a cat sat on a dog w25", "bad bad w30 w31"]

_SIZES = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
          "max_position_embeddings": 256}
_GQA = {**_SIZES, "num_key_value_heads": 2}
_TOKENS = {"vocab_size": VOCAB, "bos_token_id": 1, "eos_token_id": 2}
#: Shorter than a prompt plus 32 new tokens, so the window is exercised.
SLIDING_WINDOW = 16


def _llama(t: Any) -> Any:
    return t.LlamaForCausalLM(t.LlamaConfig(**_GQA, **_TOKENS))


def _qwen2(t: Any) -> Any:
    return t.Qwen2ForCausalLM(t.Qwen2Config(**_GQA, **_TOKENS))


def _qwen3(t: Any) -> Any:
    return t.Qwen3ForCausalLM(t.Qwen3Config(**_GQA, head_dim=16, **_TOKENS))


def _mistral(t: Any) -> Any:
    return t.MistralForCausalLM(t.MistralConfig(**_GQA, sliding_window=SLIDING_WINDOW, **_TOKENS))


def _phi3(t: Any) -> Any:
    return t.Phi3ForCausalLM(t.Phi3Config(**_GQA, pad_token_id=0, **_TOKENS))


def _gemma2(t: Any) -> Any:
    """Layers alternate sliding (window 16) / full. Attention soft-cap 0.3 and weights of std 0.1: at the default
    cap of 50 random weights' attention logits (about 0.01) pass unchanged and the cap would go untested."""
    return t.Gemma2ForCausalLM(t.Gemma2Config(**_GQA, head_dim=16, sliding_window=SLIDING_WINDOW, pad_token_id=0,
                                              attn_logit_softcapping=0.3, initializer_range=0.1, **_TOKENS))


def _gpt2(t: Any) -> Any:
    return t.GPT2LMHeadModel(t.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=256, **_TOKENS))


def _gpt_neox(t: Any) -> Any:
    return t.GPTNeoXForCausalLM(t.GPTNeoXConfig(**_SIZES, rotary_pct=0.25, **_TOKENS))


#: Family name -> builder of its random model (``transformers`` module in, ``PreTrainedModel`` out).
FAMILIES: dict[str, Callable[[Any], Any]] = {
    "llama": _llama, "qwen2": _qwen2, "qwen3": _qwen3, "mistral": _mistral, "phi3": _phi3, "gemma2": _gemma2,
    "gpt2": _gpt2, "gpt_neox": _gpt_neox}


def tokenizer() -> Any:
    """The byte-level BPE of every folder: ``<unk>`` / ``<s>`` / ``</s>`` = 0 / 1 / 2, merges learned on the words."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    bpe.train_from_iterator([" ".join(WORDS), *PROMPTS, *CALIBRATION] * 4, trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=bpe, unk_token="<unk>", bos_token="<s>",
                                                eos_token="</s>")


def save_family(name: str, directory: Path) -> Path:
    """Write family ``name``'s random model (seed 0) and :func:`tokenizer` to ``directory``."""
    import transformers

    if name not in FAMILIES:
        raise ValueError(f"unknown family {name!r}; the families are {list(FAMILIES)}")
    tokenizer().save_pretrained(directory)
    torch.manual_seed(0)
    transformers.utils.logging.disable_progress_bar()
    FAMILIES[name](transformers).eval().save_pretrained(directory)
    return directory
