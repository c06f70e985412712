"""The real-architecture corpus as data: 28 ``transformers`` models and 12 ``timm`` models, random-initialised.

Every entry is a tiny configuration of a real architecture (hidden size ≤ 128, 2 layers, 32–96 px images, 16 tokens)
so that one model goes through the whole pipeline in seconds. An entry says how to build the model, how to draw its
inputs from a seeded generator (token ids inside the vocabulary with a right-padded attention mask, images, raw
audio, log-mel features) and what its output is:

* ``"classifier"``: ``[N, C]`` logits (sequence / image / audio classification heads);
* ``"lm"``: ``[N, T, V]`` next-token logits (decoder language models);
* ``"hidden"``: ``[N, T, D]`` hidden states (the T5 encoder).

HF models are wrapped (:class:`TokenClassifierInputs`, :class:`SingleInput`) so that they take positional tensors and
return the first field of their output (logits or last hidden state) as one tensor; text models use
``use_cache=False``. Models whose weights are
random give nearly tied logits; BatchNorm running statistics are randomised like the test zoo so folding matters.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from benchmarks.common.torchvision_ops import declare_torchvision_ops
from coreai_opt.reference_models import randomize_batchnorm

__all__ = ["CorpusModel", "CORPUS", "corpus_entry"]

VOCAB = 1000
SEQ = 16
HIDDEN = 64
LAYERS = 2
HEADS = 4
FFN = 128
NUM_LABELS = 10

Inputs = Callable[[torch.Generator, int], tuple[Tensor, ...]]


@dataclass(frozen=True)
class CorpusModel:
    """One architecture of the corpus.

    Attributes:
        name: Short name, e.g. ``"hf-bert"`` or ``"timm-resnet18"``.
        family: ``"cnn"``, ``"encoder"``, ``"decoder"``, ``"vit"`` or ``"speech"``.
        build: Returns a fresh model (eval mode) after ``torch.manual_seed`` was set by the caller.
        inputs: ``inputs(generator, batch)`` -> positional input tensors of one batch.
        input_names: Names of those inputs (ONNX graph inputs of the float and the quantized export).
        output: ``"classifier"``, ``"lm"`` or ``"hidden"``.
    """

    name: str
    family: str
    build: Callable[[], nn.Module]
    inputs: Inputs
    input_names: tuple[str, ...]
    output: str

    @property
    def has_logits(self) -> bool:
        """Whether top-1 agreement is meaningful (classifier or LM logits)."""
        return self.output in ("classifier", "lm")


class TokenClassifierInputs(nn.Module):
    """HF text model called as ``forward(input_ids, attention_mask)`` (named so export and FX see two inputs)."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:  # noqa: D102
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, return_dict=True)
        return out[0]


class SingleInput(nn.Module):
    """HF model with one tensor input (pixels, waveform or features), called by keyword ``name``."""

    def __init__(self, model: nn.Module, name: str) -> None:
        super().__init__()
        self.model = model
        self.name = name

    def forward(self, x: Tensor) -> Tensor:  # noqa: D102
        return self.model(**{self.name: x}, return_dict=True)[0]


# ----------------------------------------------------------------------------------------------- inputs


def tokens(gen: torch.Generator, batch: int) -> tuple[Tensor, Tensor]:
    """Token ids in ``[0, VOCAB)`` and a right-padded attention mask (every row keeps at least half its tokens)."""
    ids = torch.randint(0, VOCAB, (batch, SEQ), generator=gen)
    lengths = torch.randint(SEQ // 2, SEQ + 1, (batch,), generator=gen)
    lengths[0] = SEQ  # one unpadded row per batch
    mask = (torch.arange(SEQ).unsqueeze(0) < lengths.unsqueeze(1)).long()
    return ids, mask


def images(size: int) -> Inputs:
    """Normalised RGB images ``[N, 3, size, size]``."""
    return lambda gen, batch: (torch.randn(batch, 3, size, size, generator=gen),)


def waveform(gen: torch.Generator, batch: int) -> tuple[Tensor]:
    """0.1 s of 16 kHz audio-like noise ``[N, 1600]``."""
    return (0.1 * torch.randn(batch, 1600, generator=gen),)


def log_mel(bins: int, frames: int) -> Inputs:
    """Whisper-style log-mel features ``[N, bins, frames]`` in about ``[-1, 1]``."""
    return lambda gen, batch: (torch.randn(batch, bins, frames, generator=gen).clamp(-3, 3) / 3,)


# ----------------------------------------------------------------------------------------------- builders


def _text(model_cls: str, config_cls: str, **overrides: object) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        declare_torchvision_ops()  # transformers imports torchvision when it is installed
        import transformers

        base = {"vocab_size": VOCAB, "hidden_size": HIDDEN, "num_hidden_layers": LAYERS,
                "num_attention_heads": HEADS, "intermediate_size": FFN, "max_position_embeddings": 64,
                "num_labels": NUM_LABELS}
        config = getattr(transformers, config_cls)(**{**base, **overrides})
        if hasattr(config, "use_cache"):
            config.use_cache = False
        return TokenClassifierInputs(getattr(transformers, model_cls)(config)).eval()

    return build


def _hf_single(model_cls: str, config_cls: str, input_name: str, **config: object) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        declare_torchvision_ops()
        import transformers

        model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**config))
        return randomize_batchnorm(SingleInput(model, input_name)).eval()

    return build


def _timm(arch: str, **kwargs: object) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        declare_torchvision_ops()
        import timm

        model = timm.create_model(arch, pretrained=False, num_classes=NUM_LABELS, **kwargs)
        return randomize_batchnorm(model).eval()

    return build


_DECODER = {"num_key_value_heads": 2}  # grouped-query attention where the architecture has it
_VIT = {"image_size": 32, "patch_size": 8, "num_channels": 3, "hidden_size": HIDDEN, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "intermediate_size": FFN, "num_labels": NUM_LABELS}
_SPEECH = {"vocab_size": 32, "hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
           "intermediate_size": FFN, "conv_dim": (32, 32, 32), "conv_stride": (5, 4, 4), "conv_kernel": (10, 4, 4),
           "num_conv_pos_embeddings": 16, "num_conv_pos_embedding_groups": 4, "num_labels": NUM_LABELS,
           "classifier_proj_size": 32, "mask_time_prob": 0.0}

_TEXT = ("input_ids", "attention_mask")


def _hf_text(name: str, family: str, model_cls: str, config_cls: str, output: str, **overrides: object
             ) -> CorpusModel:
    return CorpusModel(name, family, _text(model_cls, config_cls, **overrides), tokens, _TEXT, output)


CORPUS: dict[str, CorpusModel] = {
    m.name: m
    for m in (
        # --- transformers: encoders (sequence classification heads)
        _hf_text("hf-bert", "encoder", "BertForSequenceClassification", "BertConfig", "classifier"),
        _hf_text("hf-distilbert", "encoder", "DistilBertForSequenceClassification", "DistilBertConfig", "classifier",
                 dim=HIDDEN, n_layers=LAYERS, n_heads=HEADS, hidden_dim=FFN),
        _hf_text("hf-roberta", "encoder", "RobertaForSequenceClassification", "RobertaConfig", "classifier",
                 max_position_embeddings=66),
        _hf_text("hf-albert", "encoder", "AlbertForSequenceClassification", "AlbertConfig", "classifier",
                 embedding_size=32),
        _hf_text("hf-electra", "encoder", "ElectraForSequenceClassification", "ElectraConfig", "classifier",
                 embedding_size=32),
        _hf_text("hf-deberta-v2", "encoder", "DebertaV2ForSequenceClassification", "DebertaV2Config", "classifier"),
        _hf_text("hf-mpnet", "encoder", "MPNetForSequenceClassification", "MPNetConfig", "classifier",
                 max_position_embeddings=66),
        _hf_text("hf-xlm-roberta", "encoder", "XLMRobertaForSequenceClassification", "XLMRobertaConfig",
                 "classifier", max_position_embeddings=66),
        _hf_text("hf-t5-encoder", "encoder", "T5EncoderModel", "T5Config", "hidden",
                 d_model=HIDDEN, d_kv=16, d_ff=FFN, num_layers=LAYERS, num_heads=HEADS),
        # --- transformers: decoder language models (next-token logits)
        _hf_text("hf-gpt2", "decoder", "GPT2LMHeadModel", "GPT2Config", "lm",
                 n_embd=HIDDEN, n_layer=LAYERS, n_head=HEADS, n_positions=64, bos_token_id=0, eos_token_id=0),
        _hf_text("hf-llama", "decoder", "LlamaForCausalLM", "LlamaConfig", "lm", **_DECODER),
        _hf_text("hf-qwen2", "decoder", "Qwen2ForCausalLM", "Qwen2Config", "lm", **_DECODER),
        _hf_text("hf-mistral", "decoder", "MistralForCausalLM", "MistralConfig", "lm", **_DECODER),
        _hf_text("hf-gpt-neo", "decoder", "GPTNeoForCausalLM", "GPTNeoConfig", "lm",
                 num_layers=LAYERS, num_heads=HEADS, attention_types=[[["global", "local"], 1]], window_size=8),
        _hf_text("hf-opt", "decoder", "OPTForCausalLM", "OPTConfig", "lm",
                 ffn_dim=FFN, word_embed_proj_dim=HIDDEN),
        _hf_text("hf-phi", "decoder", "PhiForCausalLM", "PhiConfig", "lm"),
        # --- transformers: vision transformers (image classification heads, 32 px, 8 px patches)
        CorpusModel("hf-vit", "vit", _hf_single("ViTForImageClassification", "ViTConfig", "pixel_values", **_VIT),
                    images(32), ("pixel_values",), "classifier"),
        CorpusModel("hf-deit", "vit", _hf_single("DeiTForImageClassification", "DeiTConfig", "pixel_values",
                                                 **_VIT), images(32), ("pixel_values",), "classifier"),
        CorpusModel("hf-dinov2", "vit", _hf_single("Dinov2ForImageClassification", "Dinov2Config", "pixel_values",
                                                   **_VIT), images(32), ("pixel_values",), "classifier"),
        CorpusModel("hf-beit", "vit", _hf_single("BeitForImageClassification", "BeitConfig", "pixel_values",
                                                 use_relative_position_bias=True, **_VIT),
                    images(32), ("pixel_values",), "classifier"),
        CorpusModel("hf-swin", "vit", _hf_single("SwinForImageClassification", "SwinConfig", "pixel_values",
                                                 image_size=32, patch_size=2, embed_dim=32, depths=[1, 1],
                                                 num_heads=[2, 4], window_size=4, num_labels=NUM_LABELS),
                    images(32), ("pixel_values",), "classifier"),
        # --- transformers: CNNs (BatchNorm after bias-free convolutions)
        CorpusModel("hf-resnet", "cnn", _hf_single("ResNetForImageClassification", "ResNetConfig", "pixel_values",
                                                   embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                                                   layer_type="bottleneck", num_labels=NUM_LABELS),
                    images(32), ("pixel_values",), "classifier"),
        CorpusModel("hf-convnext", "cnn", _hf_single("ConvNextForImageClassification", "ConvNextConfig",
                                                     "pixel_values", hidden_sizes=[16, 32], depths=[1, 1],
                                                     num_stages=2, num_labels=NUM_LABELS),
                    images(32), ("pixel_values",), "classifier"),
        CorpusModel("hf-mobilenet-v2", "cnn", _hf_single("MobileNetV2ForImageClassification", "MobileNetV2Config",
                                                         "pixel_values", image_size=32, depth_multiplier=0.35,
                                                         num_labels=NUM_LABELS),
                    images(32), ("pixel_values",), "classifier"),
        CorpusModel("hf-regnet", "cnn", _hf_single("RegNetForImageClassification", "RegNetConfig", "pixel_values",
                                                   embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1],
                                                   groups_width=8, num_labels=NUM_LABELS),
                    images(32), ("pixel_values",), "classifier"),
        # --- transformers: speech encoders (audio classification heads)
        CorpusModel("hf-wav2vec2", "speech", _hf_single("Wav2Vec2ForSequenceClassification", "Wav2Vec2Config",
                                                        "input_values", **_SPEECH),
                    waveform, ("input_values",), "classifier"),
        CorpusModel("hf-hubert", "speech", _hf_single("HubertForSequenceClassification", "HubertConfig",
                                                      "input_values", **_SPEECH),
                    waveform, ("input_values",), "classifier"),
        CorpusModel("hf-whisper-encoder", "speech", _hf_single(
            "WhisperForAudioClassification", "WhisperConfig", "input_features", num_mel_bins=16, d_model=HIDDEN,
            encoder_layers=LAYERS, encoder_attention_heads=HEADS, encoder_ffn_dim=FFN, decoder_layers=1,
            decoder_attention_heads=HEADS, decoder_ffn_dim=FFN, max_source_positions=16, classifier_proj_size=32,
            num_labels=NUM_LABELS), log_mel(16, 32), ("input_features",), "classifier"),
        # --- timm (pretrained=False)
        CorpusModel("timm-resnet18", "cnn", _timm("resnet18"), images(64), ("x",), "classifier"),
        CorpusModel("timm-efficientnet-b0", "cnn", _timm("efficientnet_b0"), images(64), ("x",), "classifier"),
        CorpusModel("timm-mobilenetv3", "cnn", _timm("mobilenetv3_small_100"), images(64), ("x",), "classifier"),
        CorpusModel("timm-regnetx-002", "cnn", _timm("regnetx_002"), images(64), ("x",), "classifier"),
        CorpusModel("timm-repvgg-a0", "cnn", _timm("repvgg_a0"), images(64), ("x",), "classifier"),
        CorpusModel("timm-densenet121", "cnn", _timm("densenet121"), images(64), ("x",), "classifier"),
        CorpusModel("timm-inception-v3", "cnn", _timm("inception_v3"), images(96), ("x",), "classifier"),
        CorpusModel("timm-convnext-atto", "cnn", _timm("convnext_atto"), images(64), ("x",), "classifier"),
        CorpusModel("timm-ghostnet", "cnn", _timm("ghostnet_100"), images(64), ("x",), "classifier"),
        CorpusModel("timm-vit-tiny", "vit", _timm("vit_tiny_patch16_224", img_size=64, depth=LAYERS),
                    images(64), ("x",), "classifier"),
        CorpusModel("timm-deit-tiny", "vit", _timm("deit_tiny_patch16_224", img_size=64, depth=LAYERS),
                    images(64), ("x",), "classifier"),
        CorpusModel("timm-swin-tiny", "vit", _timm("swin_tiny_patch4_window7_224", img_size=64, window_size=4,
                                                   depths=(1, 1, 1, 1), embed_dim=32, num_heads=(1, 2, 4, 8)),
                    images(64), ("x",), "classifier"),
    )
}


def corpus_entry(name: str) -> CorpusModel:
    """The corpus entry called ``name`` (KeyError listing the names when unknown)."""
    if name not in CORPUS:
        raise KeyError(f"no corpus model {name!r}; known: {', '.join(CORPUS)}")
    return CORPUS[name]
