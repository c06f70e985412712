"""Tiny Hugging Face models saved with save_pretrained, built offline (random weights, a hand-made vocabulary)."""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch

WORDS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]",
         *"the a cat dog sat on mat is good bad movie film very not".split(), *(f"w{i}" for i in range(80))]
CALIB_LINES = ["the cat sat on the mat", "a very good movie", "the dog is bad", "not a good film", "w1 w2 w3 w4",
               "the film is very bad", "a dog sat on a cat", "good good good"]
SEQ_LEN = 16


def one_line_error(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run ``coreai-opt ARGV`` in-process; assert exit code 2 and exactly one stderr line; return that line."""
    from coreai_opt.cli.main import main

    code = main(list(argv))
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err, f"expected one line on stderr, got:\n{err}"
    return lines[0]


@contextmanager
def _no_progress_bars():
    """save_pretrained draws a "Writing model shards" bar on stderr; the tests read stderr."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.enable_progress_bar()


def save_tiny_bert(directory: Path, *, max_positions: int = 64) -> Path:
    """BertForSequenceClassification (2 layers, d=32) + a WordPiece tokenizer, both saved to ``directory``."""
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    torch.manual_seed(0)
    config = BertConfig(vocab_size=len(WORDS), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=max_positions, num_labels=2)
    with _no_progress_bars():
        BertForSequenceClassification(config).eval().save_pretrained(directory)
    BertTokenizerFast(vocab={w: i for i, w in enumerate(WORDS)}).save_pretrained(directory)
    return directory


DECODER_WORDS = ["<unk>", "<s>", "</s>", *WORDS[5:]]


def save_tiny_llama(directory: Path, *, hidden: int = 64, layers: int = 2) -> Path:
    """LlamaForCausalLM (grouped-query attention: 4 heads, 2 KV heads; ``use_cache`` true as saved by default)
    plus a word-level tokenizer with BOS / EOS / UNK and no pad token, like most decoder tokenizers."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(DECODER_WORDS)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>",
                            eos_token="</s>").save_pretrained(directory)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(DECODER_WORDS), hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=256, bos_token_id=1, eos_token_id=2)
    with _no_progress_bars():
        LlamaForCausalLM(config).eval().save_pretrained(directory)
    return directory


def save_tiny_vit(directory: Path) -> Path:
    """ViTForImageClassification on 32x32 images (patch 8) + its image processor."""
    from transformers import ViTConfig, ViTForImageClassification
    from transformers.models.vit.image_processing_pil_vit import ViTImageProcessorPil

    torch.manual_seed(0)
    config = ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                       intermediate_size=64, num_labels=3)
    with _no_progress_bars():
        ViTForImageClassification(config).eval().save_pretrained(directory)
    ViTImageProcessorPil(size={"height": 32, "width": 32}).save_pretrained(directory)
    return directory


def save_images(directory: Path, count: int = 6) -> Path:
    from PIL import Image

    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(count):
        Image.fromarray(rng.integers(0, 256, (40, 48, 3), dtype=np.uint8)).save(directory / f"img{i}.png")
    return directory


@pytest.fixture(scope="session")
def tiny_bert_dir(tmp_path_factory) -> Path:
    return save_tiny_bert(tmp_path_factory.mktemp("hf") / "tiny-bert")


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    return save_tiny_llama(tmp_path_factory.mktemp("hf") / "tiny-llama")


@pytest.fixture(scope="session")
def calib_text(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("text") / "calib.txt"
    path.write_text("\n".join(CALIB_LINES) + "\n")
    return path
