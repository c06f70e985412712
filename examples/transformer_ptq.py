"""Post-training quantization of a small transformer encoder, checked in onnxruntime.

The model is the hand-written ``transformer_encoder`` from ``coreai_opt.reference_models``: q/k/v/o linears,
matmul, softmax, LayerNorm, GELU and residual adds in plain torch, so ``torch.fx`` traces through every layer.

Synthetic task: each sequence of 16 tokens from a vocabulary of 10 is random, except that one token (the label)
is planted on 6 random positions; the model must say which token is the most frequent. Training takes a few
seconds. The script then quantizes with ``w8a8`` and reports float, fake-quant and onnxruntime accuracy, and the
eager-vs-onnxruntime top-1 agreement twice: with onnxruntime's integer kernels (its default), and with graph
optimizations off, which runs the exported QDQ graph exactly as written.

Run: ``python examples/transformer_ptq.py [OUTPUT_DIR]``
"""

from __future__ import annotations

import sys
from pathlib import Path

import onnxruntime as ort
import torch
from torch import nn

import coreai_opt as co
from coreai_opt.datasets import accuracy
from coreai_opt.reference_models import transformer_encoder

# Settings
THREADS = 1  # the model is tiny: more torch threads only add synchronisation
OUTPUT_DIR = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("example_outputs")
SEED = 0
VOCAB = 10
SEQ_LEN = 16
PLANTED = 6
DIM, DEPTH, HEADS = 32, 2, 4
TRAIN_STEPS = 150
BATCH_SIZE = 64
LEARNING_RATE = 3e-3
CALIBRATION_BATCHES = 8
TEST_SIZE = 1000


def make_batch(n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random token sequences with the label token planted on ``PLANTED`` positions."""
    tokens = torch.randint(0, VOCAB, (n, SEQ_LEN), generator=generator)
    labels = torch.randint(0, VOCAB, (n,), generator=generator)
    positions = torch.rand(n, SEQ_LEN, generator=generator).argsort(dim=1)[:, :PLANTED]
    tokens.scatter_(1, positions, labels[:, None].expand(-1, PLANTED))
    return tokens, labels


torch.manual_seed(SEED)
torch.set_num_threads(THREADS)
OUTPUT_DIR.mkdir(parents=True, exist_ok=True)
generator = torch.Generator().manual_seed(SEED)

# 1. Train the float model on freshly sampled batches.
model = transformer_encoder(dim=DIM, depth=DEPTH, heads=HEADS, vocab_size=VOCAB, num_classes=VOCAB, max_len=SEQ_LEN)
optimizer = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
loss_fn = nn.CrossEntropyLoss()
model.train()
for _ in range(TRAIN_STEPS):
    tokens, labels = make_batch(BATCH_SIZE, generator)
    optimizer.zero_grad(set_to_none=True)
    loss_fn(model(tokens), labels).backward()
    optimizer.step()
model.eval()

x_test, y_test = make_batch(TEST_SIZE, generator)
float_accuracy = accuracy(model, x_test, y_test)
print(f"float accuracy: {float_accuracy:.2%}")

# 2. Quantize: int8 weights for every linear, uint8 activations, calibrated on a few fresh batches.
example_inputs = (make_batch(BATCH_SIZE, generator)[0],)
prepared = co.prepare(model, co.QuantizerConfig.presets.w8a8(), example_inputs)
co.calibrate(prepared, [make_batch(BATCH_SIZE, generator)[0] for _ in range(CALIBRATION_BATCHES)])
converted = co.convert(prepared)
print(co.summary(converted))
fake_quant_accuracy = accuracy(converted, x_test, y_test)

# 3. Export and verify. verify_onnx runs the file with onnxruntime's default optimizations, which replace QDQ
# patterns with integer kernels (QLinearMatMul, QLinearSoftmax with a lookup table, MatMulIntegerToFloat, ...).
# Those kernels round intermediate results differently from the QDQ graph, so outputs can move by a few
# quantization steps. Running the same file with optimizations disabled executes the QDQ graph as written,
# which shows how exact the export itself is.
path = co.export_onnx(converted, example_inputs, OUTPUT_DIR / "transformer.int8.onnx")
report = co.verify_onnx(converted, path, x_test)
print(report)


def onnxruntime_logits(level: ort.GraphOptimizationLevel) -> torch.Tensor:
    options = ort.SessionOptions()
    options.graph_optimization_level = level
    session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
    return torch.from_numpy(session.run(None, {session.get_inputs()[0].name: x_test.numpy()})[0])


with torch.no_grad():
    eager = converted(x_test)
fused = onnxruntime_logits(ort.GraphOptimizationLevel.ORT_ENABLE_ALL)
plain = onnxruntime_logits(ort.GraphOptimizationLevel.ORT_DISABLE_ALL)
ort_accuracy = float((fused.argmax(1) == y_test).float().mean())
fused_agreement = float((fused.argmax(1) == eager.argmax(1)).float().mean())
plain_agreement = float((plain.argmax(1) == eager.argmax(1)).float().mean())

print()
print(f"{'float accuracy':<56} {float_accuracy:>8.2%}")
print(f"{'fake-quant accuracy (eager, w8a8)':<56} {fake_quant_accuracy:>8.2%}")
print(f"{'int8 accuracy (onnxruntime)':<56} {ort_accuracy:>8.2%}")
print(f"{'top-1 agreement eager vs onnxruntime (integer kernels)':<56} {fused_agreement:>8.2%}")
print(f"{'  max |diff| of the logits':<56} {float((fused - eager).abs().max()):>8.4f}")
print(f"{'top-1 agreement eager vs onnxruntime (QDQ as written)':<56} {plain_agreement:>8.2%}")
print(f"{'  max |diff| of the logits':<56} {float((plain - eager).abs().max()):>8.4f}")
print(f"wrote {path}")
