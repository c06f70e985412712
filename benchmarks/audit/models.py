"""Architectures outside the corpus for the placement audit: small random configs, ``timm`` with ``pretrained=False``.

Same conventions as :mod:`benchmarks.corpus.models` (tiny sizes, seeded inputs, the first output field as one tensor):
the decoders take the corpus's token inputs, the vision models 64 px images.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from benchmarks.common.torchvision_ops import declare_torchvision_ops
from benchmarks.corpus.models import (
    FFN,
    HEADS,
    HIDDEN,
    LAYERS,
    NUM_LABELS,
    VOCAB,
    CorpusModel,
    SingleInput,
    TokenClassifierInputs,
    images,
    tokens,
)
from coreai_opt.reference_models import randomize_batchnorm

__all__ = ["EXTRA"]


def _hf(model_cls: str, config_cls: str, input_name: str | None, **config: object) -> Callable[[], nn.Module]:
    """A ``transformers`` model from ``config``; text models (``input_name`` None) take ids and a mask."""

    def build() -> nn.Module:
        declare_torchvision_ops()
        import transformers

        cfg = getattr(transformers, config_cls)(**config)
        if hasattr(cfg, "use_cache"):
            cfg.use_cache = False
        model = getattr(transformers, model_cls)(cfg)
        wrapped = TokenClassifierInputs(model) if input_name is None else SingleInput(model, input_name)
        return randomize_batchnorm(wrapped).eval()

    return build


def _timm(arch: str, **kwargs: object) -> Callable[[], nn.Module]:
    def build() -> nn.Module:
        declare_torchvision_ops()
        import timm

        return randomize_batchnorm(timm.create_model(arch, pretrained=False, num_classes=NUM_LABELS, **kwargs)).eval()

    return build


_TEXT = ("input_ids", "attention_mask")
_DECODER = {"vocab_size": VOCAB, "hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
            "num_key_value_heads": 2, "intermediate_size": FFN, "max_position_embeddings": 64, "head_dim": 16}


def _decoder(name: str, model_cls: str, config_cls: str, **overrides: object) -> CorpusModel:
    return CorpusModel(name, "decoder", _hf(model_cls, config_cls, None, **{**_DECODER, **overrides}), tokens, _TEXT,
                       "lm")


def _image(name: str, model_cls: str, config_cls: str, **config: object) -> CorpusModel:
    return CorpusModel(name, "cnn", _hf(model_cls, config_cls, "pixel_values", num_labels=NUM_LABELS, **config),
                       images(64), ("pixel_values",), "classifier")


#: Twelve architectures the corpus does not hold (issue 29 named most of them as slower than quantize_static).
EXTRA: dict[str, CorpusModel] = {m.name: m for m in (
    _decoder("hf-gemma", "GemmaForCausalLM", "GemmaConfig"),
    _decoder("hf-gemma2", "Gemma2ForCausalLM", "Gemma2Config", sliding_window=8),
    _decoder("hf-qwen3", "Qwen3ForCausalLM", "Qwen3Config"),
    CorpusModel("hf-bloom", "decoder", _hf("BloomForCausalLM", "BloomConfig", None, vocab_size=VOCAB,
                                           hidden_size=HIDDEN, n_layer=LAYERS, n_head=HEADS), tokens, _TEXT, "lm"),
    CorpusModel("hf-squeezebert", "encoder", _hf(
        "SqueezeBertForSequenceClassification", "SqueezeBertConfig", None, vocab_size=VOCAB, hidden_size=HIDDEN,
        embedding_size=HIDDEN, num_hidden_layers=LAYERS, num_attention_heads=HEADS, intermediate_size=FFN,
        max_position_embeddings=64, num_labels=NUM_LABELS), tokens, _TEXT, "classifier"),
    _image("hf-focalnet", "FocalNetForImageClassification", "FocalNetConfig", image_size=64, patch_size=4,
           embed_dim=16, depths=[1, 1], focal_levels=[2, 2], focal_windows=[3, 3]),
    _image("hf-mobilevitv2", "MobileViTV2ForImageClassification", "MobileViTV2Config", image_size=64,
           width_multiplier=0.5),
    _image("hf-efficientnet", "EfficientNetForImageClassification", "EfficientNetConfig", image_size=64,
           width_coefficient=1.0, depth_coefficient=1.0, hidden_dim=1280),  # B0 (the default config is B7)
    _image("hf-mobilenet-v2-full", "MobileNetV2ForImageClassification", "MobileNetV2Config", image_size=64,
           depth_multiplier=1.0),
    CorpusModel("timm-resnest14d", "cnn", _timm("resnest14d"), images(64), ("x",), "classifier"),
    CorpusModel("timm-efficientnetv2-b0", "cnn", _timm("tf_efficientnetv2_b0"), images(64), ("x",), "classifier"),
    CorpusModel("timm-mobilenetv2", "cnn", _timm("mobilenetv2_100"), images(64), ("x",), "classifier"),
)}
