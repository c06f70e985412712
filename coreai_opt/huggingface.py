"""Load a local Hugging Face ``save_pretrained`` directory as a float model plus ready-made inputs, offline.

``from_pretrained(directory)`` reads ``config.json`` and the weights with ``local_files_only=True`` (no network,
no hub), builds the task head named in the config's ``architectures`` (e.g. ``BertForSequenceClassification``;
the bare ``AutoModel`` when the config names none), and finds the tokenizer or image processor saved in the same
directory. The result knows the model's input names (in ``forward()`` order) and turns text lines, image files
or random values into input tensors (one tensor per input, sample dimension first)::

    hf = co.from_pretrained("./bert-dir", seq_len=128)
    inputs = hf.text_inputs(open("calib.txt").read().splitlines())   # (input_ids, attention_mask, ...)
    prepared = co.prepare(hf.model, config, tuple(t[:1] for t in inputs), capture="export")

Only architectures built into ``transformers`` load (``trust_remote_code`` stays off: a directory's own Python
code is never run). Text is padded and truncated to ``seq_len`` tokens: the exported ONNX file has that
sequence length (only the batch dimension is dynamic).

Needs the ``hf`` extra (``pip install "coreai-opt-qdq[hf]"``: ``transformers``; image folders also need Pillow).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from coreai_opt.error_boundary import public_api
from coreai_opt.errors import CoreaiOptError

__all__ = ["PretrainedModel", "MissingExtraError", "from_pretrained", "is_pretrained_directory", "is_causal_lm",
           "IMAGE_SUFFIXES"]

#: Image files read from a calibration folder.
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".webp")
_TEXT_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


class MissingExtraError(CoreaiOptError, ImportError):
    """An optional dependency is missing; the message names the extra to install."""


def is_pretrained_directory(path: str | Path) -> bool:
    """True for a directory holding a ``config.json`` (what ``save_pretrained`` writes)."""
    path = Path(path)
    return path.is_dir() and (path / "config.json").is_file()


def _import_transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise MissingExtraError(
            "loading a Hugging Face directory needs the 'transformers' package; install the hf extra: "
            "pip install \"coreai-opt-qdq[hf]\""
        ) from None
    return transformers


@contextmanager
def _quiet_transformers(transformers: Any) -> Iterator[None]:
    """Hide transformers' per-load progress bar ("Loading weights") for the duration."""
    logging = transformers.utils.logging
    was_enabled = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            logging.enable_progress_bar()


def forward_input_names(model: nn.Module) -> tuple[str, ...]:
    """Names of the positional-or-keyword parameters of ``model.forward``, in order."""
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return tuple(p.name for p in inspect.signature(model.forward).parameters.values() if p.kind in kinds)


def is_causal_lm(architecture: str) -> bool:
    """``architecture`` is one of transformers' causal LMs (``GPT2LMHeadModel`` as well as every ``*ForCausalLM``).

    The table is transformers' own ``AutoModelForCausalLM`` mapping.
    """
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return architecture in set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()) or architecture.endswith("ForCausalLM")


@dataclass
class PretrainedModel:
    """A float model loaded from a ``save_pretrained`` directory and how to build its inputs.

    Attributes:
        model: The float model in eval mode.
        directory: Where it was loaded from.
        architecture: The class that was built (``BertForSequenceClassification``).
        input_names: The inputs the exported model takes, in ``forward()`` order (a prefix of its parameters).
        modality: ``"text"`` (token ids) or ``"image"`` (pixel values).
        seq_len: Tokens per text sample.
        vocab_size: Size of the token vocabulary (text models).
        image_shape: ``(channels, height, width)`` of one image (image models).
        preprocessor: The tokenizer or image processor found in the directory, or None.
    """

    model: nn.Module
    directory: Path
    architecture: str
    input_names: tuple[str, ...]
    modality: str
    seq_len: int
    vocab_size: int
    image_shape: tuple[int, int, int]
    preprocessor: Any

    @public_api
    def example_inputs(self, batch_size: int = 1) -> tuple[torch.Tensor, ...]:
        """Inputs of ``batch_size`` samples: a tokenized sentence (or zeros) / a constant grey image."""
        if self.modality == "image":
            return (torch.zeros(batch_size, *self.image_shape),)
        if self.preprocessor is not None:
            return tuple(t.repeat(batch_size, 1) for t in self.text_inputs(["the quick brown fox"]))
        return self.random_inputs(batch_size, seed=0)

    @public_api
    def text_inputs(self, lines: Sequence[str]) -> tuple[torch.Tensor, ...]:
        """Tokenize ``lines`` (one sample each), padded / truncated to :attr:`seq_len`.

        Raises:
            ValueError: Not a text model, no tokenizer in the directory, or no lines.
        """
        if self.modality != "text" or self.preprocessor is None:
            raise ValueError(f"{self.directory} has no tokenizer (tokenizer.json / vocab.txt); calibration text "
                             "cannot be tokenized. Save the tokenizer with tokenizer.save_pretrained(directory)")
        if not lines:
            raise ValueError("no text lines to tokenize; give at least one non-empty line")
        encoded = self.preprocessor(list(lines), padding="max_length", truncation=True, max_length=self.seq_len,
                                    return_tensors="pt")
        missing = [name for name in self.input_names if name not in encoded]
        if missing:
            raise ValueError(f"the tokenizer in {self.directory} does not produce {missing}, which the model's "
                             f"forward() takes before the inputs it does produce")
        return tuple(encoded[name].to(torch.int64) for name in self.input_names)

    @public_api
    def prompt_ids(self, lines: Sequence[str]) -> list[torch.Tensor]:
        """Each line tokenized alone at its real length (1-D int64 ids, no padding): prompts for a decoder.

        Raises:
            ValueError: Not a text model, no tokenizer, no lines, or a line that tokenizes to nothing.
        """
        if self.modality != "text" or self.preprocessor is None:
            raise ValueError(f"{self.directory} has no tokenizer (tokenizer.json); prompts cannot be tokenized. "
                             "Save the tokenizer with tokenizer.save_pretrained(directory)")
        if not lines:
            raise ValueError("no text lines to tokenize; give at least one non-empty line")
        prompts = [self.preprocessor(line, return_tensors="pt")["input_ids"][0].to(torch.int64) for line in lines]
        empty = [line for line, ids in zip(lines, prompts, strict=True) if ids.numel() == 0]
        if empty:
            raise ValueError(f"the tokenizer turns {empty[0]!r} into no tokens; remove that line")
        return prompts

    @public_api
    def image_inputs(self, paths: Sequence[Path]) -> tuple[torch.Tensor]:
        """Preprocess image files with the directory's image processor (resize, normalize) into pixel values.

        Raises:
            ValueError: Not an image model, no image processor, or no files.
            MissingExtraError: Pillow is missing.
        """
        if self.modality != "image" or self.preprocessor is None:
            raise ValueError(f"{self.directory} has no image processor (preprocessor_config.json); save it with "
                             "image_processor.save_pretrained(directory)")
        if not paths:
            raise ValueError("no image files to preprocess")
        try:
            from PIL import Image
        except ImportError:
            raise MissingExtraError("reading calibration images needs Pillow: pip install pillow") from None
        images = []
        for path in paths:
            with Image.open(path) as image:
                images.append(image.convert("RGB"))
        pixels = self.preprocessor(images=images, return_tensors="pt")["pixel_values"]
        return (pixels.to(torch.float32),)

    @public_api
    def random_inputs(self, count: int, *, seed: int = 0) -> tuple[torch.Tensor, ...]:
        """``count`` random samples (fine for checking the export, meaningless for accuracy).

        Token ids uniform in ``[0, vocab_size)`` with a full attention mask and zero token types, or
        standard-normal pixel values.
        """
        generator = torch.Generator().manual_seed(seed)
        if self.modality == "image":
            return (torch.randn(count, *self.image_shape, generator=generator),)
        shape = (count, self.seq_len)
        values = {
            "input_ids": torch.randint(0, self.vocab_size, shape, generator=generator),
            "attention_mask": torch.ones(shape, dtype=torch.int64),
            "token_type_ids": torch.zeros(shape, dtype=torch.int64),
        }
        return tuple(values[name] for name in self.input_names)


def _model_class(transformers: Any, config: Any, directory: Path) -> Any:
    names = list(getattr(config, "architectures", None) or [])
    if not names:
        return transformers.AutoModel
    try:
        cls = getattr(transformers, names[0], None)
    except ModuleNotFoundError as exc:  # transformers' lazy import of the class failed underneath
        raise MissingExtraError(_lazy_import_problem(names[0], exc)) from exc
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)):
        raise ValueError(
            f"{directory}/config.json names the architecture {names[0]!r}, which is not built into transformers "
            f"{transformers.__version__}; coreai-opt does not run a directory's own model code "
            "(trust_remote_code stays off). Load it yourself and pass a file.py:factory instead"
        )
    return cls


def _lazy_import_problem(name: str, exc: ModuleNotFoundError) -> str:
    """Name the real cause of a failed lazy import (transformers hides it behind a generic message)."""
    cause = exc.__cause__
    while cause is not None and cause.__cause__ is not None:
        cause = cause.__cause__
    if cause is not None and "torchvision::" in str(cause):
        return (f"transformers could not import {name} because the installed torchvision does not match torch "
                f"({cause}); install the torchvision build made for torch {_torch_version()}, or uninstall "
                "torchvision (text models do not need it)")
    detail = f": {type(cause).__name__}: {cause}" if cause is not None else ""
    return f"transformers could not import {name}{detail}; fix or reinstall the package named there"


def _torch_version() -> str:
    import torch

    return torch.__version__


def _load_preprocessor(transformers: Any, directory: Path, modality: str) -> Any:
    """The tokenizer / image processor saved in ``directory``, or None when there is none."""
    if modality == "text":
        saved = ("tokenizer.json", "tokenizer_config.json", "vocab.txt")
        if not any((directory / name).is_file() for name in saved):
            return None
        return _with_pad_token(transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True))
    if not (directory / "preprocessor_config.json").is_file():
        return None
    return transformers.AutoImageProcessor.from_pretrained(directory, local_files_only=True, backend="pil")


def _with_pad_token(tokenizer: Any) -> Any:
    """Give a tokenizer without a pad token (most decoder tokenizers) one, in memory, so batches can be padded.

    The pad token is the tokenizer's EOS, else UNK, else BOS token (the files on disk are not changed). Padded
    positions get ``attention_mask`` 0, so which id fills them does not change the real tokens' outputs.

    Raises:
        ValueError: The tokenizer has no pad, EOS, UNK or BOS token to pad with.
    """
    if getattr(tokenizer, "pad_token", None) is not None or not hasattr(tokenizer, "pad_token"):
        return tokenizer
    for stand_in in ("eos_token", "unk_token", "bos_token"):
        token = getattr(tokenizer, stand_in, None)
        if token is not None:
            tokenizer.pad_token = token
            return tokenizer
    raise ValueError("the tokenizer has no pad, EOS, UNK or BOS token, so calibration lines of different lengths "
                     "cannot be batched; add one (tokenizer.add_special_tokens({'pad_token': '<pad>'})) and save "
                     "it with tokenizer.save_pretrained(directory)")


def _image_shape(config: Any, preprocessor: Any) -> tuple[int, int, int]:
    channels = int(getattr(config, "num_channels", 3))
    size = getattr(preprocessor, "crop_size", None) or getattr(preprocessor, "size", None)
    height = width = None
    if size is not None:
        size = dict(size)
        height, width = size.get("height"), size.get("width")
        if height is None and size.get("shortest_edge"):
            height = width = size["shortest_edge"]
    if height is None:
        image_size = getattr(config, "image_size", 224)
        height, width = (image_size, image_size) if isinstance(image_size, int) else tuple(image_size)
    return channels, int(height), int(width)


@public_api
def from_pretrained(directory: str | Path, *, seq_len: int = 128) -> PretrainedModel:
    """Load a local ``save_pretrained`` directory (module docstring).

    Args:
        directory: The directory with ``config.json`` and the weights (``model.safetensors`` / ``*.bin``).
        seq_len: Tokens per text sample (the exported model's fixed sequence length).

    Returns:
        The :class:`PretrainedModel`.

    Raises:
        MissingExtraError: ``transformers`` is not installed.
        FileNotFoundError: ``directory`` has no ``config.json``.
        ValueError: ``seq_len`` is not positive or longer than the model's position table, or the architecture
            is not built into transformers, or the model takes neither token ids nor pixel values.
    """
    directory = Path(directory)
    if not is_pretrained_directory(directory):
        raise FileNotFoundError(f"{directory} is not a Hugging Face model directory: it has no config.json "
                                "(write one with model.save_pretrained(directory))")
    if not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    transformers = _import_transformers()
    with _quiet_transformers(transformers):
        config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
        cls = _model_class(transformers, config, directory)
        if getattr(config, "use_cache", False):
            # off in memory only (config.json is not touched): a forward then returns plain tensors, not a
            # DynamicCache, so torch.export can capture it. The KV-cache decoder is coreai_opt.onnx.export.kv_cache.
            config.use_cache = False
        model = cls.from_pretrained(directory, config=config, local_files_only=True).eval()
        names = forward_input_names(model)
        modality = "image" if "pixel_values" in names[:1] else "text" if "input_ids" in names[:1] else ""
        if not modality:
            raise ValueError(f"{type(model).__name__}.forward takes {list(names[:3])} first; coreai-opt builds "
                             "inputs for models that take input_ids or pixel_values")
        preprocessor = _load_preprocessor(transformers, directory, modality)
    max_positions = getattr(config, "max_position_embeddings", None)
    if modality == "text" and isinstance(max_positions, int) and seq_len > max_positions:
        raise ValueError(f"seq_len {seq_len} is longer than the model's {max_positions} positions; pass at most "
                         f"{max_positions}")
    if modality == "image":
        input_names: tuple[str, ...] = ("pixel_values",)
    else:
        produced = set(getattr(preprocessor, "model_input_names", None) or _TEXT_INPUTS[:2])
        # the longest prefix of forward()'s parameters that the tokenizer fills: inputs are passed positionally
        input_names = ()
        for name in names:
            if name not in produced or name not in _TEXT_INPUTS:
                break
            input_names += (name,)
    return PretrainedModel(
        model=model,
        directory=directory,
        architecture=type(model).__name__,
        input_names=input_names,
        modality=modality,
        seq_len=seq_len,
        vocab_size=int(getattr(config, "vocab_size", 0) or 0),
        image_shape=_image_shape(config, preprocessor) if modality == "image" else (0, 0, 0),
        preprocessor=preprocessor,
    )
