"""``coreai-opt inspect``: what a QDQ ONNX model contains and what onnxruntime makes of it.

Prints three counts read from the file (QuantizeLinear / DequantizeLinear nodes by zero-point dtype, quantized
initializers by dtype, and all ops by type), then onnxruntime's fusion report (``coreai_opt.fusion_report``):
which quantized patterns its optimizer turned into integer kernels, followed by what export_onnx's rewrite rules
did and the near misses they recorded (also shown with --no-fusion).
"""

from __future__ import annotations

import argparse
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from coreai_opt.cli.usage_errors import EXIT_OK, CliError, one_line

if TYPE_CHECKING:
    import onnx

    from coreai_opt.onnx.rewrite.graph import OnnxGraph

QDQ_OPS = ("QuantizeLinear", "DequantizeLinear")
# Storage dtypes of quantized tensors. An initializer of one of them is a quantized weight or table unless it is
# only a zero point; embedding tables are one (their rows are gathered, then dequantized by Cast and Mul).
QUANTIZED_TYPES = frozenset({
    "int2", "uint2", "int4", "uint4", "int8", "uint8", "int16", "uint16",
    "float8e4m3fn", "float8e4m3fnuz", "float8e5m2", "float8e5m2fnuz",
})
FLOAT_TYPES = ("float", "float16", "bfloat16", "double")
_BITS = {
    **dict.fromkeys(("int2", "uint2"), 2),
    **dict.fromkeys(("int4", "uint4", "float4e2m1"), 4),
    **dict.fromkeys(("int8", "uint8", "bool", "float8e4m3fn", "float8e4m3fnuz", "float8e5m2", "float8e5m2fnuz"), 8),
    **dict.fromkeys(("int16", "uint16", "float16", "bfloat16"), 16),
    **dict.fromkeys(("int32", "uint32", "float"), 32),
    **dict.fromkeys(("int64", "uint64", "double"), 64),
}


@dataclass
class QdqSummary:
    """Counts read from an ONNX graph.

    Attributes:
        qdq: ``(op_type, zero-point dtype) -> number of nodes`` for QuantizeLinear / DequantizeLinear.
        quantized_initializers: ``dtype -> (count, elements)`` of quantized initializers: every initializer of an
            integer / float8 storage dtype that is not only a zero point (weights and embedding tables, whose
            gathered rows are dequantized by Cast and Mul), and every one feeding a DequantizeLinear's data input
            (int32 biases).
        float_initializers: ``(count, elements)`` of float initializers (weights left in float, biases...).
        ops: ``op_type -> count`` over the whole top-level graph.
        opset: The default-domain opset the model imports.
    """

    qdq: Counter[tuple[str, str]] = field(default_factory=Counter)
    quantized_initializers: dict[str, tuple[int, int]] = field(default_factory=dict)
    float_initializers: tuple[int, int] = (0, 0)
    ops: Counter[str] = field(default_factory=Counter)
    opset: int | None = None


def add_parser(subparsers: Any, parents: list[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """Register the ``inspect`` subcommand.

    Args:
        subparsers: The object returned by ``ArgumentParser.add_subparsers``.
        parents: Parsers whose options every subcommand shares.

    Returns:
        The ``inspect`` subparser.
    """
    parser = subparsers.add_parser(
        "inspect",
        parents=list(parents),
        help="summarize the Q/DQ nodes, quantized initializers and ops of an ONNX model",
        description=__doc__.split("\n\n", 1)[1].replace("``", ""),
    )
    parser.add_argument("model", type=Path, help="path to an .onnx file")
    parser.add_argument("--no-fusion", action="store_true", help="skip the onnxruntime fusion report")
    return parser


def run(args: argparse.Namespace) -> int:
    """Print the QDQ summary and (unless ``--no-fusion``) the onnxruntime fusion report.

    Args:
        args: Parsed ``inspect`` arguments.

    Returns:
        0.

    Raises:
        CliError: Missing or unreadable model file, or an unreadable rewrite report in it.
    """
    from coreai_opt.onnx.rewrite.rewrite_report import read_report

    model = load_onnx(args.model)
    try:
        rewrites = read_report(model)
    except ValueError as exc:
        raise CliError(f"{args.model}: {one_line(exc)}") from None
    print(f"{args.model}")
    print(format_summary(summarize_qdq(model)))
    if not args.no_fusion:
        import coreai_opt as co

        print()
        print(co.fusion_report(args.model))  # ends with the rewrite report
    elif rewrites is not None:
        print()
        print(rewrites)
    return EXIT_OK


def load_onnx(path: Path) -> onnx.ModelProto:
    """Load an ONNX model's graph without its external weight data.

    Raises:
        CliError: The file is missing or is not an ONNX model.
    """
    import onnx

    if not path.is_file():
        raise CliError(f"ONNX file not found: {path}")
    try:
        return onnx.load(str(path), load_external_data=False)
    except Exception as exc:  # noqa: BLE001 - protobuf raises DecodeError and friends
        raise CliError(f"{path} is not a readable ONNX model: {one_line(exc)}") from None


def summarize_qdq(model: onnx.ModelProto) -> QdqSummary:
    """Count Q/DQ nodes by zero-point dtype, quantized initializers by dtype, and ops by type.

    A node without a zero-point input counts as ``uint8`` for QuantizeLinear (the ONNX default) and as its input's
    dtype for DequantizeLinear.

    Args:
        model: The ONNX model (external data need not be loaded).

    Returns:
        The :class:`QdqSummary`.
    """
    from coreai_opt.onnx.rewrite.graph import OnnxGraph

    graph = OnnxGraph(model)
    types = _tensor_types(model)
    summary = QdqSummary(opset=next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None))
    for node in graph.nodes:
        summary.ops[node.op_type] += 1
        if node.op_type not in QDQ_OPS:
            continue
        if len(node.input) > 2 and node.input[2]:
            dtype = types.get(node.input[2], "unknown")
        elif node.op_type == "QuantizeLinear":
            dtype = "uint8"
        else:
            dtype = types.get(node.input[0], "unknown")
        summary.qdq[(node.op_type, dtype)] += 1
    quantized: dict[str, list[int]] = {}
    float_count = float_elements = 0
    for name, tensor in {t.name: t for t in graph.initializers()}.items():
        dtype, elements = types[name], _numel(tensor)
        if _dequantized(graph, name) or (dtype in QUANTIZED_TYPES and _read_as_data(graph, name)):
            entry = quantized.setdefault(dtype, [0, 0])
            entry[0] += 1
            entry[1] += elements
        elif dtype in FLOAT_TYPES:
            float_count += 1
            float_elements += elements
    summary.quantized_initializers = {k: (v[0], v[1]) for k, v in sorted(quantized.items())}
    summary.float_initializers = (float_count, float_elements)
    return summary


def _dequantized(graph: OnnxGraph, name: str) -> bool:
    """``name`` is the data input of a ``DequantizeLinear``."""
    return any(r.op_type == "DequantizeLinear" and r.input[0] == name for r in graph.readers(name))


def _read_as_data(graph: OnnxGraph, name: str) -> bool:
    """``name`` is read somewhere other than as a Q/DQ zero point (input 2)."""
    return any(r.op_type not in QDQ_OPS or index != 2
               for r in graph.readers(name) for index, used in enumerate(r.input) if used == name)


def format_summary(summary: QdqSummary) -> str:
    """Render a :class:`QdqSummary` as three small plain-text tables.

    Returns:
        The text, one table after another.
    """
    lines = [f"opset {summary.opset}", "", "Q/DQ nodes by zero-point dtype"]
    dtypes = sorted({dtype for _, dtype in summary.qdq})
    rows = [(d, str(summary.qdq[("QuantizeLinear", d)]), str(summary.qdq[("DequantizeLinear", d)])) for d in dtypes]
    count, elements = summary.float_initializers
    float_row = ("float (other)", str(count), str(elements), _human_bytes(elements * 4))
    if summary.qdq:
        lines += _table(("dtype", "QuantizeLinear", "DequantizeLinear"), rows)
        lines += ["", "quantized initializers (weights, embedding tables, int32 biases; zero points not counted)"]
        rows = [
            (dtype, str(count), str(elements), _human_bytes(elements * _bits(dtype) // 8))
            for dtype, (count, elements) in summary.quantized_initializers.items()
        ]
        lines += _table(("dtype", "count", "elements", "size"), [*rows, float_row])
    else:
        lines += ["  none: this is a float model (no QuantizeLinear / DequantizeLinear nodes)", "", "initializers"]
        lines += _table(("dtype", "count", "elements", "size"), [("float", *float_row[1:])])
    lines += ["", "ops"]
    lines += _table(("op", "count"), [(op, str(n)) for op, n in sorted(summary.ops.items(), key=lambda kv: -kv[1])])
    return "\n".join(lines)


def _tensor_types(model: onnx.ModelProto) -> dict[str, str]:
    """Map every typed tensor name (initializers, Constant outputs, inputs, value_info) to its dtype name."""
    import onnx

    graph = model.graph
    types: dict[str, str] = {}
    for info in (*graph.input, *graph.output, *graph.value_info):
        if info.type.HasField("tensor_type"):
            types[info.name] = _dtype_name(info.type.tensor_type.elem_type)
    for node in graph.node:
        if node.op_type == "Constant":
            for attr in node.attribute:
                if attr.name == "value" and attr.type == onnx.AttributeProto.TENSOR:
                    types[node.output[0]] = _dtype_name(attr.t.data_type)
    for tensor in graph.initializer:
        types[tensor.name] = _dtype_name(tensor.data_type)
    return types


def _dtype_name(elem_type: int) -> str:
    """``onnx.TensorProto.INT8 -> "int8"``, ``FLOAT8E4M3FN -> "float8e4m3fn"``."""
    import onnx

    return onnx.TensorProto.DataType.Name(elem_type).lower()


def _numel(tensor: onnx.TensorProto) -> int:
    count = 1
    for dim in tensor.dims:
        count *= dim
    return count


def _bits(dtype: str) -> int:
    return _BITS.get(dtype, 32)


def _human_bytes(n: int) -> str:
    return f"{n} B" if n < 1024 else f"{n / 1024:.1f} KiB" if n < 1024**2 else f"{n / 1024**2:.1f} MiB"


def _table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(str(r[i])) for r in (header, *rows)) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return ["  " + fmt.format(*header), "  " + "  ".join("-" * w for w in widths)] + [
        "  " + fmt.format(*row) for row in rows
    ]
