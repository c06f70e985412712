"""Post-training quantization of the digits CNN with each activation range calculator.

The ``w8a8`` preset (int8 per-channel weights, uint8 per-tensor activations) takes ``activation_range=``:

* ``minmax``: global min / max over all calibration batches;
* ``moving_average``: min / max smoothed from batch to batch;
* ``percentile``: clip at the 99.99th percentile of a histogram of all batches;
* ``mse``: the clipping range that minimises the quantization mean squared error on that histogram;
* ``entropy``: the range that minimises the KL divergence between the float and quantized histograms.

For each one the script calibrates, converts, exports and verifies, then prints one table: the width of the
activation ranges it chose (mean activation scale relative to ``minmax``: below 100 % means it clips outliers),
fake-quant accuracy, onnxruntime int8 accuracy and the eager-vs-onnxruntime top-1 agreement. Digits at 8 bits
are easy, so the accuracies barely move even where the ranges differ.

Run: ``python examples/digits_ptq.py [OUTPUT_DIR]``
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import onnxruntime as ort
import torch

import coreai_opt as co
from coreai_opt.config.presets import ACTIVATION_RANGES
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


def onnxruntime_predict(path: Path):
    """Return a batch -> logits function running ``path`` in onnxruntime."""
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    input_name = session.get_inputs()[0].name
    return lambda x: session.run(None, {input_name: x.numpy()})[0]


def activation_scales(converted) -> dict[str, float]:
    """Scale of every activation quantizer, keyed by the tensor it quantizes (from ``co.summary``)."""
    rows = co.summary(converted).quantizers
    return {
        row.serves: float(converted.get_submodule(row.module).get_qparams().scale)
        for row in rows
        if row.role == "activation"
    }


torch.manual_seed(SEED)
torch.set_num_threads(THREADS)
OUTPUT_DIR.mkdir(parents=True, exist_ok=True)

split = load_digits_split(seed=SEED)
model = train_classifier(DigitsCNN(), split, epochs=EPOCHS, lr=LEARNING_RATE, seed=SEED)
float_accuracy = accuracy(model, split.x_test, split.y_test)
print(f"float accuracy: {float_accuracy:.2%}")

example_inputs = (split.x_train[:BATCH_SIZE],)
batches = [split.x_train[i : i + BATCH_SIZE] for i in range(0, CALIBRATION_BATCHES * BATCH_SIZE, BATCH_SIZE)]

rows = []
minmax_scales: dict[str, float] = {}
for activation_range in ACTIVATION_RANGES:
    start = time.perf_counter()
    config = co.QuantizerConfig.presets.w8a8(activation_range=activation_range)
    prepared = co.prepare(model, config, example_inputs)
    co.calibrate(prepared, batches, progress=False)
    converted = co.convert(prepared)
    fake_quant_accuracy = accuracy(converted, split.x_test, split.y_test)
    scales = activation_scales(converted)
    minmax_scales = minmax_scales or scales  # "minmax" comes first
    relative_range = sum(scales[k] / minmax_scales[k] for k in scales) / len(scales)

    path = co.export_onnx(converted, example_inputs, OUTPUT_DIR / f"digits.w8a8_{activation_range}.onnx")
    report = co.verify_onnx(converted, path, split.x_test)
    ort_accuracy = accuracy(onnxruntime_predict(path), split.x_test, split.y_test)
    rows.append(
        (
            activation_range,
            relative_range,
            fake_quant_accuracy,
            ort_accuracy,
            report.argmax_agreement,
            report.ok,
            time.perf_counter() - start,
        )
    )

print()
print(
    f"{'activation range':<18} {'range':>7} {'fake-quant':>10} {'onnxruntime':>11} {'top-1 agree':>11} {'ok':>5} "
    f"{'time':>6}"
)
print(f"{'(float)':<18} {'':>7} {float_accuracy:>10.2%}")
for name, relative, fq, ort_acc, agree, ok, seconds in rows:
    print(f"{name:<18} {relative:>7.1%} {fq:>10.2%} {ort_acc:>11.2%} {agree:>11.2%} {str(ok):>5} {seconds:>5.1f}s")

best = max(rows, key=lambda row: row[3])
print(f"\nbest onnxruntime accuracy: {best[0]} ({best[3]:.2%}; float {float_accuracy:.2%})")
if not all(row[5] for row in rows):
    sys.exit("onnxruntime disagrees with the eager quantized model for at least one calculator")
