"""Hand-written reference networks shared by tests, examples, benchmarks and the demo.

torchvision cannot be installed beside the CPU torch build used here, so the architectures that
quantization toolkits are usually judged on are written out in plain ``torch.nn``. Each factory takes
width/depth knobs so that tests can build tiny versions and benchmarks full-size ones.

One module per family: :mod:`.resnet`, :mod:`.mobilenet`, :mod:`.conv_nets` (decoder, 1-D conv, digits CNN),
:mod:`.sequence_models` (transformers, shape unpacking) and :mod:`.batchnorm_statistics`. Import them from here.
:mod:`.pretrained` loads the trained digits CNN shipped with the package (``digits_cnn.pt``, sha256-checked).

This package imports only torch and :mod:`coreai_opt.errors`.
"""

from __future__ import annotations

from coreai_opt.reference_models.batchnorm_statistics import batchnorm_statistics_from_data, randomize_batchnorm
from coreai_opt.reference_models.conv_nets import Conv1dGroupNorm, ConvTransposeDecoder, DigitsCNN
from coreai_opt.reference_models.mobilenet import InvertedResidual, MobileNetV2Style, mobilenet_v2_style
from coreai_opt.reference_models.pretrained import load_digits_cnn
from coreai_opt.reference_models.resnet import BasicBlock, Bottleneck, ResNetStyle, resnet18_style, resnet50_style
from coreai_opt.reference_models.sequence_models import (
    CausalBlock,
    EncoderBlock,
    GPTStyleDecoder,
    SelfAttention,
    ShapeUnpackModel,
    TorchTransformerClassifier,
    TransformerEncoderClassifier,
    transformer_encoder,
)

__all__ = [  # alphabetical
    "BasicBlock",
    "batchnorm_statistics_from_data",
    "CausalBlock",
    "Bottleneck",
    "Conv1dGroupNorm",
    "ConvTransposeDecoder",
    "DigitsCNN",
    "EncoderBlock",
    "GPTStyleDecoder",
    "InvertedResidual",
    "load_digits_cnn",
    "mobilenet_v2_style",
    "MobileNetV2Style",
    "randomize_batchnorm",
    "resnet18_style",
    "resnet50_style",
    "ResNetStyle",
    "SelfAttention",
    "ShapeUnpackModel",
    "TorchTransformerClassifier",
    "transformer_encoder",
    "TransformerEncoderClassifier",
]

# Every public name is addressed as coreai_opt.reference_models.<name>, whichever file holds its code: the exported
# ONNX files name each module's class in their node "namespace" metadata (".../stages.0.0:
# coreai_opt.reference_models.BasicBlock/..."), and pickles, module_type config keys and reprs name it too.
for _name in __all__:
    globals()[_name].__module__ = __name__
del _name
