"""Shared fixtures of the spec-layer tests."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from coreai_opt.quantization.spec import quantize_dequantize_translation_table
from coreai_opt.quantization.spec.registry import Registry


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
    np.random.seed(0)


@pytest.fixture
def temporary_registration() -> Iterator[Callable[[Registry, str], Callable[[type], type]]]:
    """Register classes for one test and unregister them afterwards."""
    added: list[tuple[Registry, str]] = []

    def register(registry: Registry, key: str) -> Callable[[type], type]:
        decorator = registry.register(key)

        def wrapped(cls: type) -> type:
            decorator(cls)
            added.append((registry, key))
            return cls

        return wrapped

    yield register
    for registry, key in added:
        registry.unregister(key)


def _export_onnx_model(
    module: torch.nn.Module,
    args: tuple[Any, ...],
    opset: int,
    dynamic_shapes: Any = None,
) -> onnx.ModelProto:
    """Export with the dynamo exporter and the quantize-dequantize translation table."""
    program = torch.onnx.export(
        module,
        args,
        dynamo=True,
        opset_version=opset,
        verbose=False,
        dynamic_shapes=dynamic_shapes,
        custom_translation_table=quantize_dequantize_translation_table(opset),
    )
    return program.model_proto


def _ort_session(model: onnx.ModelProto) -> ort.InferenceSession:
    """An onnxruntime CPU session for ``model``."""
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.fixture(scope="session")
def export_onnx_model() -> Callable[..., onnx.ModelProto]:
    """``export_onnx_model(module, args, opset, dynamic_shapes=None) -> ModelProto``."""
    return _export_onnx_model


@pytest.fixture(scope="session")
def ort_session() -> Callable[[onnx.ModelProto], ort.InferenceSession]:
    """``ort_session(model) -> InferenceSession`` on the CPU provider."""
    return _ort_session
