"""The runtimes ``verify_onnx`` can check a file in: onnxruntime (CPU) and OpenVINO (CPU, float32 inference).

Each is a :class:`Runner`: input names, output names and ``run(feed) -> outputs`` in graph-output order.

OpenVINO is compiled with ``INFERENCE_PRECISION_HINT = f32``: its CPU plugin otherwise runs float layers in bf16 on
CPUs that have it (measured: 0.05 off even on a float32 file), which says nothing about the quantized file.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["Runner", "RUNTIMES", "open_runner"]

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
        compiled = core.compile_model(str(path), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    except RuntimeError as error:
        raise RuntimeError(f"OpenVINO could not compile {path.name}: {str(error).splitlines()[0]}") from error
    inputs = [i.get_any_name() for i in compiled.inputs]
    outputs = [o.get_any_name() for o in compiled.outputs]
    return Runner("openvino", inputs, outputs, compiled)


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
        RuntimeError: OpenVINO failed to compile the file (its first message line is kept).
    """
    if runtime not in RUNTIMES:
        raise ValueError(f"runtime must be one of {RUNTIMES}, got {runtime!r}")
    path = Path(path)
    return _onnxruntime(path, providers) if runtime == "onnxruntime" else _openvino(path)
