"""Quantization-aware training (QAT) of the digits CNN with 4-bit weights.

Four-bit weights hurt a small CNN. Post-training quantization (PTQ) shows how much accuracy they cost, and a few
epochs of training with the fake quantizers in the graph (QAT) recover most of it. The straight-through
estimator passes gradients through the rounding, so the weights learn to sit well on the int4 grid.

The config is built by hand: int4 symmetric per-channel weights (the first conv has a single input channel, so
the per-block ``w4a8`` preset does not apply) and the uint8 activations of the ``w8a8`` preset. int4 needs
ONNX opset 21, which ``export_onnx`` picks by itself.

Run: ``python examples/qat_digits.py [OUTPUT_DIR]``
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

import coreai_opt as co
from coreai_opt.datasets import accuracy, load_digits_split, train_classifier
from coreai_opt.quantization.spec import PerChannel, QuantizationSpec
from coreai_opt.reference_models import DigitsCNN

# Settings
THREADS = 1  # the model is tiny: more torch threads only add synchronisation
OUTPUT_DIR = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("example_outputs")
SEED = 0
EPOCHS = 6
LEARNING_RATE = 1e-2
QAT_EPOCHS = 4
QAT_LEARNING_RATE = 1e-3
BATCH_SIZE = 32
CALIBRATION_BATCHES = 16

torch.manual_seed(SEED)
torch.set_num_threads(THREADS)
OUTPUT_DIR.mkdir(parents=True, exist_ok=True)

split = load_digits_split(seed=SEED)
model = train_classifier(DigitsCNN(), split, epochs=EPOCHS, lr=LEARNING_RATE, seed=SEED)
float_accuracy = accuracy(model, split.x_test, split.y_test)
print(f"float accuracy: {float_accuracy:.2%}")

config = co.QuantizerConfig(
    weight=QuantizationSpec(dtype="int4", qscheme="symmetric", granularity=PerChannel(axis=0)),
    activation=co.QuantizerConfig.presets.w8a8().activation,
)
example_inputs = (split.x_train[:BATCH_SIZE],)
batches = [split.x_train[i : i + BATCH_SIZE] for i in range(0, CALIBRATION_BATCHES * BATCH_SIZE, BATCH_SIZE)]

# PTQ baseline: calibrate and convert, no training.
ptq = co.convert(co.calibrate(co.prepare(model, config, example_inputs), batches, progress=False))
ptq_accuracy = accuracy(ptq, split.x_test, split.y_test)
print(f"PTQ int4-weight accuracy: {ptq_accuracy:.2%}")

# QAT: prepare for training, calibrate once so every quantizer starts from a sensible range, then fine-tune with
# a small learning rate. The weight quantizers keep observing the (changing) weights; the activation ranges
# found by calibration stay fixed.
prepared = co.prepare(copy.deepcopy(model), config, example_inputs, qat=True)
co.calibrate(prepared, batches, progress=False)
train_classifier(prepared, split, epochs=QAT_EPOCHS, lr=QAT_LEARNING_RATE, seed=SEED)
qat = co.convert(prepared)
qat_accuracy = accuracy(qat, split.x_test, split.y_test)
print(f"QAT int4-weight accuracy: {qat_accuracy:.2%}")

path = co.export_onnx(qat, example_inputs, OUTPUT_DIR / "digits.w4a8_qat.onnx")
report = co.verify_onnx(qat, path, split.x_test)
print(report)

print()
print(f"{'model':<32} {'accuracy':>9}")
print(f"{'float':<32} {float_accuracy:>9.2%}")
print(f"{'PTQ  (int4 weights, uint8 act.)':<32} {ptq_accuracy:>9.2%}")
print(f"{'QAT  (int4 weights, uint8 act.)':<32} {qat_accuracy:>9.2%}")
print(f"top-1 agreement eager vs onnxruntime (QAT model): {report.argmax_agreement:.2%}")
print(f"wrote {path}")
if not report.ok:
    sys.exit("onnxruntime disagrees with the eager quantized model")
