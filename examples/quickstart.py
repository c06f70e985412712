"""Quickstart: quantize a small CNN to int8, export it to ONNX and check it in onnxruntime.

The five calls of the flow are ``prepare`` -> ``calibrate`` -> ``convert`` -> ``export_onnx`` -> ``verify_onnx``.
The model is the digits CNN from ``coreai_opt.reference_models``, trained for a few seconds on scikit-learn's
bundled 8x8 digits.

Run: ``python examples/quickstart.py [OUTPUT_DIR]``
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

import coreai_opt as co
from coreai_opt.datasets import accuracy, load_digits_split, train_classifier
from coreai_opt.reference_models import DigitsCNN

# Settings
THREADS = 1  # the model is tiny: more torch threads only add synchronisation
OUTPUT_DIR = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("example_outputs")
SEED = 0
EPOCHS = 6
LEARNING_RATE = 1e-2
BATCH_SIZE = 32
CALIBRATION_BATCHES = 16

torch.manual_seed(SEED)
torch.set_num_threads(THREADS)
OUTPUT_DIR.mkdir(parents=True, exist_ok=True)

# 1. A trained float model and its data.
split = load_digits_split(seed=SEED)
model = train_classifier(DigitsCNN(), split, epochs=EPOCHS, lr=LEARNING_RATE, seed=SEED)
float_accuracy = accuracy(model, split.x_test, split.y_test)
print(f"float accuracy: {float_accuracy:.2%}")

# 2. prepare: trace the model and insert FakeQuantize modules (int8 weights, uint8 activations).
example_inputs = (split.x_train[:BATCH_SIZE],)
prepared = co.prepare(model, co.QuantizerConfig.presets.w8a8(), example_inputs)

# 3. calibrate: run a few batches so that every activation quantizer sees its range.
batches = [split.x_train[i : i + BATCH_SIZE] for i in range(0, CALIBRATION_BATCHES * BATCH_SIZE, BATCH_SIZE)]
co.calibrate(prepared, batches)

# 4. convert: freeze scale and zero point. The result still runs in PyTorch (fake-quantized).
converted = co.convert(prepared)
print(co.summary(converted))
fake_quant_accuracy = accuracy(converted, split.x_test, split.y_test)
print(f"fake-quant accuracy: {fake_quant_accuracy:.2%}")

# 5. export to ONNX (QuantizeLinear / DequantizeLinear, int8 weight initializers) and verify in onnxruntime.
path = co.export_onnx(converted, example_inputs, OUTPUT_DIR / "digits.int8.onnx")
report = co.verify_onnx(converted, path, split.x_test)
print(report)
print(f"wrote {path}")
print(f"top-1 agreement eager vs onnxruntime: {report.argmax_agreement:.2%}")
if not report.ok:
    sys.exit("onnxruntime disagrees with the eager quantized model")
