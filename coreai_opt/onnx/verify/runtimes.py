"""The runtimes ``verify_onnx`` can check a file in: onnxruntime (CPU) and OpenVINO (CPU, float32 inference).

Each is a :class:`Runner`: input names, output names and ``run(feed) -> outputs`` in graph-output order.

OpenVINO is compiled with the two settings that make it compute what the file says (deploy with the same two):

* ``INFERENCE_PRECISION_HINT = f32``: its CPU plugin otherwise runs float layers in bf16 on CPUs that have it
  (measured: 0.05 off even on a float32 file);
* ``DYNAMIC_QUANTIZATION_GROUP_SIZE = 0``: otherwise it quantizes the activations of compressed-weight layers on
  the fly (weight-only files: 1e-3 to 5e-3 off, resnet18 w8 top-1 93.8 %; with 0: 1e-7, float rounding), the
  analogue of onnxruntime's ``MatMulNBits`` accuracy level 4. With it the int4 files agree too (zoo w4: 6e-8 to
  2.4e-7 against eager; the transformer_encoder w4a8 file equals onnxruntime bit for bit with or without it: its
  int4 layers read uint8-fake-quantized float activations, which OpenVINO does not quantize again).

Two OpenVINO numerics choices have no setting (docs/openvino.md defects 4 and 6): float32 -> float8 conversion goes
through float16 (double rounding), and ``DynamicQuantizeLinear``'s scale is ``(max - min) * float32(1/255)``
(onnxruntime divides by 255).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import onnx

__all__ = ["Runner", "RUNTIMES", "OPENVINO_CONFIG", "graph_input_names", "open_runner"]

#: OpenVINO CPU compile settings (module docstring).
OPENVINO_CONFIG: dict[str, str] = {"INFERENCE_PRECISION_HINT": "f32", "DYNAMIC_QUANTIZATION_GROUP_SIZE": "0"}
#: Runtimes ``verify_onnx(runtime=...)`` accepts.
RUNTIMES: tuple[str, ...] = ("onnxruntime", "openvino")


@dataclass
class Runner:
    """A loaded model in one runtime.

    Attributes:
        runtime: ``"onnxruntime"`` or ``"openvino"``.
        input_names: Graph input names, in order.
        output_names: Graph output names, in order.
        handle: The runtime's session / compiled model.
    """

    runtime: str
    input_names: list[str]
    output_names: list[str]
    handle: Any

    def run(self, feed: dict[str, np.ndarray]) -> list[np.ndarray]:
        """Run one batch; returns the outputs in ``output_names`` order."""
        if self.runtime == "onnxruntime":
            return self.handle.run(self.output_names, feed)
        request = self.handle.create_infer_request()
        results = request.infer([feed[name] for name in self.input_names])
        return [np.asarray(results[output]) for output in self.handle.outputs]


def _onnxruntime(path: Path, providers: Sequence[str]) -> Runner:
    import onnxruntime as ort

    session = ort.InferenceSession(str(path), providers=list(providers))
    return Runner("onnxruntime", [i.name for i in session.get_inputs()], [o.name for o in session.get_outputs()],
                  session)


def _openvino(path: Path) -> Runner:
    try:
        import openvino as ov
    except ImportError as error:  # pragma: no cover - depends on the environment
        raise ModuleNotFoundError(
            "verify_onnx(runtime='openvino') needs OpenVINO; install the extra: pip install 'coreai-opt-qdq[openvino]'"
        ) from error
    core = ov.Core()
    try:
        compiled = core.compile_model(str(path), "CPU", dict(OPENVINO_CONFIG))
    except RuntimeError as error:
        detail = " | ".join(line.strip() for line in str(error).splitlines() if line.strip())
        raise RuntimeError(f"OpenVINO could not compile {path.name}: {detail}") from error
    # OpenVINO keeps the file's input and output order but may report another alias of a tensor it merged
    # (16-bit QDQ stripping renames outputs): take the names from the file.
    graph = onnx.load(str(path), load_external_data=False).graph
    return Runner("openvino", graph_input_names(graph), [o.name for o in graph.output], compiled)


def graph_input_names(graph: onnx.GraphProto) -> list[str]:
    """The inputs a caller feeds, in order: the graph inputs that are not initializers."""
    initializers = {t.name for t in graph.initializer}
    return [i.name for i in graph.input if i.name not in initializers]


def open_runner(path: str | Path, runtime: str = "onnxruntime",
                providers: Sequence[str] = ("CPUExecutionProvider",)) -> Runner:
    """Load the ONNX file at ``path`` in ``runtime``.

    Args:
        path: An ONNX file.
        runtime: One of :data:`RUNTIMES`.
        providers: onnxruntime execution providers (ignored by OpenVINO, which always runs on CPU here).

    Raises:
        ValueError: Unknown runtime.
        ModuleNotFoundError: OpenVINO requested but not installed (the message names the extra).
        RuntimeError: OpenVINO failed to compile the file (its message, lines joined with ``|``).
    """
    if runtime not in RUNTIMES:
        raise ValueError(f"runtime must be one of {RUNTIMES}, got {runtime!r}")
    path = Path(path)
    return _onnxruntime(path, providers) if runtime == "onnxruntime" else _openvino(path)
