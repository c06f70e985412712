"""ONNX helpers shared by the benchmark sections: float export and its axes, onnxruntime sessions, predictors."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import torch
from torch import Tensor, nn

FLOAT_OPSET = 20


def same_axes(path: Path) -> tuple[dict[int, Any], ...]:
    """``dynamic_shapes`` for ``torch.onnx.export`` making dynamic exactly the input dimensions ``path`` names."""
    graph = onnx.load(str(path), load_external_data=False).graph
    initializers = {t.name for t in graph.initializer}
    dims: dict[str, Any] = {}
    shapes = []
    for value in graph.input:
        if value.name in initializers:
            continue
        named = {i: d.dim_param for i, d in enumerate(value.type.tensor_type.shape.dim) if d.dim_param}
        shapes.append({i: dims.setdefault(name, torch.export.Dim(name)) for i, name in named.items()})
    return tuple(shapes)


def export_float(model: nn.Module, example: Tensor, path: Path, input_name: str = "input") -> Path:
    """Export the single-input float ``model`` with the dynamo exporter, dynamic batch, weights inside the file."""
    batch = torch.export.Dim("batch", min=1, max=1024)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model.eval(),
            (example,),
            str(path),
            dynamo=True,
            opset_version=FLOAT_OPSET,
            external_data=False,
            verbose=False,
            input_names=[input_name],
            output_names=["output"],
            dynamic_shapes=({0: batch},),
        )
    return path


def input_name(path: Path) -> str:
    """Name of the single graph input of the ONNX model at ``path``."""
    return onnx.load(str(path), load_external_data=False).graph.input[0].name


def session(
    path: Path, threads: int = 2, optimized_path: Path | None = None, level: str = "ORT_ENABLE_ALL"
) -> ort.InferenceSession:
    """A CPU onnxruntime session with ``threads`` intra-op threads (optionally dumping the optimized graph)."""
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    options.graph_optimization_level = getattr(ort.GraphOptimizationLevel, level)
    options.log_severity_level = 3
    if optimized_path is not None:
        options.optimized_model_filepath = str(optimized_path)
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def ort_predict_fn(path: Path, threads: int = 2, level: str = "ORT_ENABLE_ALL") -> Callable[[Tensor], np.ndarray]:
    """A predict function (torch batch -> numpy logits) running the ONNX model at ``path`` in onnxruntime."""
    sess = session(path, threads, level=level)
    name = sess.get_inputs()[0].name

    def predict(x: Tensor) -> np.ndarray:
        return sess.run(None, {name: x.numpy()})[0]

    return predict
