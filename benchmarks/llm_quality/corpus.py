"""The text every Python ships, split into training and held-out documents, and a BPE tokenizer trained on it.

Documents: each entry of ``pydoc_data.topics.topics`` and each standard-library source file's docstrings (the
module's, every class's and function's, read with :mod:`ast`, so no module is imported). Files under ``test/``,
``tests/``, ``idlelib/`` and ``site-packages/`` are left out. A document is held out when
``crc32(name) % HELD_OUT_EVERY == 0``: the split depends only on the names, never on the order of the walk, and no
held-out document is seen by the tokenizer or the training.
"""

from __future__ import annotations

import ast
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["HELD_OUT_EVERY", "VOCAB_SIZE", "SPECIAL_TOKENS", "Document", "documents", "split", "train_tokenizer"]

#: One document in this many (by name hash) is held out.
HELD_OUT_EVERY = 10
#: BPE vocabulary size, special tokens included.
VOCAB_SIZE = 2048
#: ``<unk>``, ``<s>`` (BOS), ``</s>`` (EOS, also the document separator) = ids 0, 1, 2.
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>")
_SKIPPED_PARTS = {"test", "tests", "idlelib", "site-packages", "__pycache__"}


@dataclass(frozen=True)
class Document:
    """One named text: ``topics/<key>`` or ``stdlib/<relative path>``."""

    name: str
    text: str


def _docstrings(source: str) -> list[str]:
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return []
    nodes = [tree, *(n for n in ast.walk(tree)
                     if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)))]
    found = (ast.get_docstring(n) for n in nodes)
    return [text for text in found if text and len(text) >= 40]


def documents() -> list[Document]:
    """Every document, sorted by name (module docstring)."""
    from pydoc_data.topics import topics

    docs = [Document(f"topics/{key}", text) for key, text in topics.items()]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.rglob("*.py")):
        relative = path.relative_to(stdlib)
        if _SKIPPED_PARTS & set(relative.parts[:-1]):
            continue
        texts = _docstrings(path.read_text(encoding="utf-8", errors="replace"))
        if texts:
            docs.append(Document(f"stdlib/{relative.as_posix()}", "\n\n".join(texts)))
    return sorted(docs, key=lambda d: d.name)


def split(docs: list[Document]) -> tuple[list[Document], list[Document]]:
    """``(training, held_out)``: held out when ``crc32(name) % HELD_OUT_EVERY == 0``."""
    held = [d for d in docs if zlib.crc32(d.name.encode()) % HELD_OUT_EVERY == 0]
    return [d for d in docs if zlib.crc32(d.name.encode()) % HELD_OUT_EVERY != 0], held


def train_tokenizer(training: list[Document]) -> Any:
    """A byte-level BPE (``tokenizers``) of :data:`VOCAB_SIZE` on the training documents, as a
    ``PreTrainedTokenizerFast`` with ``<unk>`` / ``<s>`` / ``</s>`` (no pad token, as decoder tokenizers come)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE(unk_token=SPECIAL_TOKENS[0]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=list(SPECIAL_TOKENS), show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator((d.text for d in training), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token=SPECIAL_TOKENS[0],
                                   bos_token=SPECIAL_TOKENS[1], eos_token=SPECIAL_TOKENS[2])
