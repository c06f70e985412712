"""Fingerprints of what ``prepare`` builds and ``export_onnx`` writes for every zoo model x preset.

A fingerprint holds, per case:

* the list of ``(quantizer module name, spec dict)`` of the prepared model (derived int32 bias quantizers listed
  with the spec ``"derived"``);
* ``onnx_structure_sha256``: the sha256 of the exported model with every tensor's values cleared (names, dtypes,
  shapes, nodes, attributes and metadata kept);
* ``onnx_values``: per initializer and ``Constant`` output, ``[data_type, count, sum, sum of |x|]``;
* ``eager_output``: ``[sum, sum of |y|, sum of y^2]`` of the converted model's eager output;
* ``float_output_sha256``: the sha256 of the *float* model's output on the example, a probe of this machine's
  kernels for this model;
* the exact sha256s of the exported file's bytes, of its ``model.graph.SerializeToString()`` (for diagnosis: a
  file-only change is in the model-level metadata, e.g. the rewrite report) and of the converted model's output.

Why both: calibration observes conv and matmul outputs, whose last bits depend on the CPU's kernels (oneDNN and
MKL block by cache size and ISA). On an AMD EPYC the float outputs of the zoo models differ in the last bits from
the Intel machine the record was first made on, so activation scales move by ~1 ulp and an int32 bias or a
zero point by one step: the exact sha256s cannot hold across machines. The structure and the quantizers are
machine-independent and always compared exactly; the values within a tolerance; the exact sha256s whenever the
float probe shows the machine computes this model bit-identically to the recording one.

``tests/fingerprints/zoo_fingerprints.json`` holds the values recorded (spec dicts stored once under
``"specs"`` and named by :func:`spec_key`); ``test_zoo_fingerprints.py`` checks the current code still builds
the same quantizers and writes the same ONNX files. Run ``python -m tests.fingerprints.zoo_fingerprints OUT.json``
to record the current code's fingerprints in the layout of ``zoo_fingerprints.json``.
"""

from __future__ import annotations

import hashlib
import json
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import torch
from onnx import numpy_helper
from torch import nn

import coreai_opt
from coreai_opt.config import QuantizerConfig
from coreai_opt.onnx import export_onnx
from coreai_opt.quantization.spec import BiasFakeQuantize, FakeQuantize
from tests.zoo import PRESETS, ZOO, build, preset_config

__all__ = ["CASES", "fingerprint", "onnx_structure", "onnx_values", "record", "spec_key", "to_json"]

JSON_PATH = Path(__file__).with_name("zoo_fingerprints.json")
TRANSFORMERS = tuple(name for name, entry in ZOO.items() if not entry.is_cnn)

#: (zoo model, preset, smoothing): every zoo model x every zoo preset, plus w8a8_dynamic (alone and after
#: SmoothQuant with and without inserted Mul) and w8a8 after SmoothQuant on the transformer models.
CASES: tuple[tuple[str, str, str], ...] = (
    tuple((name, preset, "none") for name in ZOO for preset in PRESETS)
    + tuple((name, "w8a8_dynamic", "none") for name in ZOO)
    + tuple((name, preset, smooth) for name in TRANSFORMERS for preset in ("w8a8_dynamic", "w8a8")
            for smooth in ("fold", "insert_mul"))
)


def spec_key(spec: dict[str, Any] | str) -> str:
    """A spec dict's short sha256 (of its sorted JSON); ``"derived"`` (int32 bias) stays as it is."""
    return spec if isinstance(spec, str) else hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]


def _config(preset: str, model: nn.Module) -> QuantizerConfig:
    if preset == "w8a8_dynamic":
        return QuantizerConfig.presets.w8a8_dynamic()
    return preset_config(preset, model)


def _quantizers(prepared: nn.Module) -> list[list[Any]]:
    rows: list[list[Any]] = []
    for name, module in prepared.named_modules():
        if isinstance(module, FakeQuantize):
            rows.append([name, module.spec.to_dict()])
        elif isinstance(module, BiasFakeQuantize):
            rows.append([name, "derived"])
    return rows


#: The TensorProto fields that hold values (cleared for the structure sha256).
_VALUE_FIELDS = ("raw_data", "float_data", "int32_data", "string_data", "int64_data", "double_data", "uint64_data")


def _tensors(graph: onnx.GraphProto) -> Iterator[tuple[str, onnx.TensorProto]]:
    """Every ``(name, tensor)`` of a graph: its initializers and its nodes' tensor attributes, subgraphs included."""
    for tensor in graph.initializer:
        yield tensor.name, tensor
    for node in graph.node:
        for attribute in node.attribute:
            label = node.output[0] if node.op_type == "Constant" else f"{node.name}.{attribute.name}"
            if attribute.HasField("t"):
                yield label, attribute.t
            for i, tensor in enumerate(attribute.tensors):
                yield f"{label}[{i}]", tensor
            for subgraph in (*([attribute.g] if attribute.HasField("g") else []), *attribute.graphs):
                yield from _tensors(subgraph)


def onnx_structure(model: onnx.ModelProto) -> bytes:
    """The serialised model with every tensor's values cleared: its nodes, names, dtypes, shapes and metadata."""
    bare = onnx.ModelProto()
    bare.CopyFrom(model)
    for _, tensor in _tensors(bare.graph):
        for value_field in _VALUE_FIELDS:
            tensor.ClearField(value_field)
    return bare.SerializeToString()


def _sums(values: np.ndarray) -> list[float]:
    as_float = values.astype(np.float64)
    return [float(f"{as_float.sum():.10g}"), float(f"{np.abs(as_float).sum():.10g}")]


def onnx_values(model: onnx.ModelProto) -> dict[str, list[float]]:
    """``{tensor name: [onnx data_type, element count, sum, sum of |x|]}`` of every stored tensor."""
    return {name: [tensor.data_type, int(np.prod(tensor.dims)), *_sums(numpy_helper.to_array(tensor))]
            for name, tensor in _tensors(model.graph)}


def fingerprint(name: str, preset: str, smooth: str, directory: Path) -> dict[str, Any]:
    """Prepare, calibrate, convert and export one case; return its quantizers and the fingerprints of its export."""
    model, example, batches = build(name)
    with torch.no_grad():
        float_output = model(*example)
    capture = "auto"
    if smooth != "none":
        from coreai_opt.api.algorithms.smooth_quant import smooth_quant

        model = smooth_quant(model, [(b,) for b in batches], example, alpha=0.5,
                             insert_mul=smooth == "insert_mul").model
        capture = "export"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = coreai_opt.prepare(model, _config(preset, model), example, capture=capture)
        quantizers = _quantizers(prepared)
        if not quantizers:  # w8a8_dynamic on a model without linear layers: nothing to export
            return {"quantizers": [], "prepared_code": prepared.code}
        coreai_opt.calibrate(prepared, batches, progress=False)
        converted = coreai_opt.convert(prepared)
        path = export_onnx(converted, example, directory / f"{name}_{preset}_{smooth}.onnx")
    data = path.read_bytes()
    exported = onnx.load_from_string(data)
    with torch.no_grad():
        output = converted(*example).detach().contiguous().numpy()
    return {"quantizers": quantizers, "prepared_code": prepared.code,
            "onnx_structure_sha256": hashlib.sha256(onnx_structure(exported)).hexdigest(),
            "onnx_values": onnx_values(exported),
            "eager_output": [*_sums(output), float(f"{np.square(output.astype(np.float64)).sum():.10g}")],
            "float_output_sha256": _sha256(float_output.detach().contiguous().numpy().tobytes()),
            "onnx_file_sha256": _sha256(data),
            "onnx_graph_sha256": _sha256(exported.graph.SerializeToString()),
            "eager_output_sha256": _sha256(output.tobytes())}


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def record() -> Iterator[tuple[str, dict[str, Any]]]:
    """Yield ``("model/preset/smoothing", fingerprint)`` for every case."""
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        for name, preset, smooth in CASES:
            yield f"{name}/{preset}/{smooth}", fingerprint(name, preset, smooth, Path(tmp))


#: What the JSON keeps of a fingerprint, besides its quantizers (``prepared_code`` is for diagnosis only).
RECORDED_FIELDS = ("onnx_structure_sha256", "onnx_values", "eager_output", "float_output_sha256",
                   "onnx_file_sha256", "onnx_graph_sha256", "eager_output_sha256")


def to_json(fingerprints: dict[str, dict[str, Any]]) -> str:
    """The layout of ``zoo_fingerprints.json``: each spec dict once under ``"specs"``, one line per spec and case."""
    specs = {spec_key(spec): spec for value in fingerprints.values() for _, spec in value["quantizers"]
             if spec != "derived"}
    cases = {key: {"quantizers": [[name, spec_key(spec)] for name, spec in value["quantizers"]],
                   **{field: value[field] for field in RECORDED_FIELDS if field in value}}
             for key, value in fingerprints.items()}

    def block(entries: dict[str, Any]) -> str:
        return ",\n".join(f"  {json.dumps(k)}: {json.dumps(v, sort_keys=True)}" for k, v in sorted(entries.items()))

    return f'{{\n "specs": {{\n{block(specs)}\n }},\n "cases": {{\n{block(cases)}\n }}\n}}\n'


if __name__ == "__main__":
    recorded: dict[str, dict[str, Any]] = {}
    for key, value in record():
        recorded[key] = value
        print(key, value.get("onnx_file_sha256", "-")[:12], len(value["quantizers"]), flush=True)
        Path(sys.argv[1]).write_text(to_json(recorded))
