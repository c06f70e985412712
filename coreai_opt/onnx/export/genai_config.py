"""``genai_config.json`` and the tokenizer beside a KV-cache decoder, so ``onnxruntime_genai.Model(folder)`` runs it.

Checked by hand with onnxruntime-genai 0.18.0 (installed in a separate venv, not a test dependency): on the tiny
Llama of tests/onnx/test_kv_cache_export.py (w4), its greedy generation of 32 tokens from 4 prompts (ids fed
directly: its tokenizer cannot read a WordLevel tokenizer.json) equals the eager converted model token for token.

The fields are those onnxruntime-genai's model builder writes for a decoder (``model.decoder``: file name, head
size, hidden size, heads, KV heads, layers and the input / output names of
:mod:`coreai_opt.onnx.export.kv_cache`; ``model``: BOS / EOS / pad ids, context length, type, vocabulary size;
``search``: greedy defaults). ``past_present_share_buffer`` is false: the graph appends the new keys and values
to the past (``present`` = past + sequence positions), it does not write into a preallocated buffer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["GENAI_CONFIG", "genai_config", "write_genai_files"]

GENAI_CONFIG = "genai_config.json"


def _token_id(config: Any, name: str, fallback: int | None) -> int | None:
    value = getattr(config, name, None)
    if isinstance(value, list):
        value = value[0] if value else None
    return int(value) if value is not None else fallback


def genai_config(config: Any, filename: str) -> dict[str, Any]:
    """The ``genai_config.json`` content for ``filename``, a decoder exported from a model with ``config``.

    Args:
        config: The transformers config (``num_hidden_layers``, ``num_attention_heads``, ``num_key_value_heads``,
            ``hidden_size``, ``head_dim``, ``vocab_size``, ``max_position_embeddings``, token ids, ``model_type``).
        filename: The ONNX file name, relative to the folder.
    """
    heads = int(config.num_attention_heads)
    context = int(getattr(config, "max_position_embeddings", 0) or 2048)
    eos = _token_id(config, "eos_token_id", None)
    return {
        "model": {
            "bos_token_id": _token_id(config, "bos_token_id", eos),
            "context_length": context,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": []},
                "filename": filename,
                "head_size": int(getattr(config, "head_dim", None) or config.hidden_size // heads),
                "hidden_size": int(config.hidden_size),
                "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask",
                           "position_ids": "position_ids", "past_key_names": "past_key_values.%d.key",
                           "past_value_names": "past_key_values.%d.value"},
                "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                            "present_value_names": "present.%d.value"},
                "num_attention_heads": heads,
                "num_hidden_layers": int(config.num_hidden_layers),
                "num_key_value_heads": int(getattr(config, "num_key_value_heads", None) or heads),
            },
            "eos_token_id": eos,
            "pad_token_id": _token_id(config, "pad_token_id", eos),
            "type": str(config.model_type),
            "vocab_size": int(config.vocab_size),
        },
        "search": {"diversity_penalty": 0.0, "do_sample": False, "early_stopping": True, "length_penalty": 1.0,
                   "max_length": context, "min_length": 0, "no_repeat_ngram_size": 0, "num_beams": 1,
                   "num_return_sequences": 1, "past_present_share_buffer": False, "repetition_penalty": 1.0,
                   "temperature": 1.0, "top_k": 1, "top_p": 1.0},
    }


def write_genai_files(onnx_path: str | Path, config: Any, tokenizer: Any) -> list[Path]:
    """Write ``genai_config.json`` and the tokenizer files into ``onnx_path``'s folder; return what was written.

    Raises:
        ValueError: The config names no EOS token (generation could not stop; onnxruntime-genai requires one).
    """
    onnx_path = Path(onnx_path)
    content = genai_config(config, onnx_path.name)
    if content["model"]["eos_token_id"] is None:
        raise ValueError("the model's config has no eos_token_id, which onnxruntime-genai needs to stop "
                         "generating; set config.eos_token_id (and save it) before quantizing")
    folder = onnx_path.parent
    written = [folder / GENAI_CONFIG]
    written[0].write_text(json.dumps(content, indent=4) + "\n", encoding="utf-8")
    if tokenizer is not None:
        written += [folder / name for name in tokenizer.save_pretrained(folder) if Path(name).name != GENAI_CONFIG]
    return written
