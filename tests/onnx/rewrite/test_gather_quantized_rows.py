"""gather_quantized_rows: DequantizeLinear(table) -> Gather becomes Gather -> dequantize rows, bit-identical."""

from __future__ import annotations

import collections
import functools
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from torch import nn

import coreai_opt
from coreai_opt.config import QuantizerConfig
from coreai_opt.onnx import export_onnx, verify_onnx
from coreai_opt.onnx.rewrite.rules.gather_quantized_rows import GatherQuantizedRows
from tests.onnx.onnx_graphs import run
from tests.onnx.rewrite.rule_checks import apply_rule, assert_idempotent, rewrite_count

RNG = np.random.default_rng(3)
VOCAB, DIM = 50, 8
RULE = GatherQuantizedRows()

gather_quantized_rows = functools.partial(rewrite_count, rule=RULE)


def _table_model(granularity: str, tied: bool = False, table_type: int = TensorProto.INT8) -> onnx.ModelProto:
    """``DequantizeLinear(table) -> Gather(ids)`` (and, when ``tied``, ``MatMul`` with the same table)."""
    low, high, dtype = (-128, 128, np.int8) if table_type == TensorProto.INT8 else (0, 256, np.uint8)
    table = RNG.integers(low, high, (VOCAB, DIM)).astype(dtype)
    if granularity == "per_tensor":
        scale, zero_point, attrs = np.float32(0.03), np.array(3 if dtype is np.int8 else 130, dtype), {}
    elif granularity == "per_row":
        scale = (RNG.random(VOCAB) * 0.05 + 0.01).astype(np.float32)
        zero_point = RNG.integers(-5, 6, VOCAB).astype(dtype) if dtype is np.int8 else np.full(VOCAB, 128, dtype)
        attrs = {"axis": 0}
    else:  # per_column
        scale = (RNG.random(DIM) * 0.05 + 0.01).astype(np.float32)
        zero_point, attrs = np.zeros(DIM, dtype), {"axis": 1}
    nodes = [
        helper.make_node("DequantizeLinear", ["table_q", "scale", "zp"], ["table"], **attrs),
        helper.make_node("Gather", ["table", "ids"], ["y"], axis=0),
    ]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "s", DIM])]
    if tied:
        nodes.append(helper.make_node("MatMul", ["h", "table"], ["logits"]))
        outputs.append(helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", DIM]))
    inputs = [helper.make_tensor_value_info("ids", TensorProto.INT64, ["b", "s"])]
    if tied:
        inputs.append(helper.make_tensor_value_info("h", TensorProto.FLOAT, ["b", VOCAB]))
    inits = [numpy_helper.from_array(table, "table_q"), numpy_helper.from_array(scale, "scale"),
             numpy_helper.from_array(zero_point, "zp")]
    graph = helper.make_graph(nodes, "embedding", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def _feeds(tied: bool) -> dict[str, np.ndarray]:
    feeds = {"ids": RNG.integers(0, VOCAB, (3, 7)).astype(np.int64)}
    if tied:
        feeds["h"] = RNG.standard_normal((3, VOCAB)).astype(np.float32)
    return feeds


@pytest.mark.parametrize("table_type", [TensorProto.INT8, TensorProto.UINT8])
@pytest.mark.parametrize("granularity", ["per_tensor", "per_row", "per_column"])
def test_gathering_before_dequantizing_is_bit_identical(granularity: str, table_type: int) -> None:
    model = _table_model(granularity, table_type=table_type)
    before = onnx.ModelProto()
    before.CopyFrom(model)
    assert gather_quantized_rows(model) == 1
    onnx.checker.check_model(model, full_check=True)
    ops = [n.op_type for n in model.graph.node]
    assert ops[0] == "Gather" and "DequantizeLinear" not in ops[:1]  # rows are read from the integer table
    assert collections.Counter(n.input[0] for n in model.graph.node)["table_q"] == 1
    feeds = _feeds(False)
    for optimize in (False, True):
        np.testing.assert_array_equal(run(model, feeds, optimize)[0], run(before, feeds, optimize)[0])
    assert_idempotent(model, RULE)


def test_a_table_also_read_by_a_matmul_keeps_its_dequantize_for_that_reader() -> None:
    model = _table_model("per_row", tied=True)
    before = onnx.ModelProto()
    before.CopyFrom(model)
    assert gather_quantized_rows(model) == 1
    matmul = next(n for n in model.graph.node if n.op_type == "MatMul")
    dequantize = next(n for n in model.graph.node if n.output[0] == matmul.input[1])
    assert dequantize.op_type == "DequantizeLinear"
    feeds = _feeds(True)
    for a, b in zip(run(model, feeds), run(before, feeds), strict=True):
        np.testing.assert_array_equal(a, b)


def test_an_int4_table_keeps_its_dequantize_with_its_reason() -> None:
    model = _table_model("per_tensor")
    table = next(t for t in model.graph.initializer if t.name == "table_q")
    table.CopyFrom(numpy_helper.from_array(RNG.integers(-8, 8, (VOCAB, DIM)).astype(ml_dtypes.int4), "table_q"))
    zero_point = next(t for t in model.graph.initializer if t.name == "zp")
    zero_point.CopyFrom(numpy_helper.from_array(np.array(1, ml_dtypes.int4), "zp"))
    feeds = _feeds(False)
    expected = run(model, feeds)[0]
    before = model.SerializeToString()
    assert apply_rule(model, RULE) == (0, ["table is int4 of rank 2 (Gather reads 2-D 8/16-bit tables)"])
    assert model.SerializeToString() == before
    np.testing.assert_array_equal(run(model, feeds)[0], expected)


class _Embedder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.head = nn.Linear(16, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids).mean(dim=1))


def test_exported_embedding_reads_quantized_rows_and_matches_eager(tmp_path: Path) -> None:
    torch.manual_seed(0)
    ids = [torch.randint(0, VOCAB, (4, 9)) for _ in range(3)]
    prepared = coreai_opt.prepare(_Embedder().eval(), QuantizerConfig.presets.w8a8(), (ids[0],))
    coreai_opt.calibrate(prepared, [(i,) for i in ids], progress=False)
    converted = coreai_opt.convert(prepared)
    path = export_onnx(converted, (ids[0],), tmp_path / "embed.onnx")
    graph = onnx.load(str(path)).graph
    table = next(t.name for t in graph.initializer if list(t.dims) == [VOCAB, 16])
    readers = [n.op_type for n in graph.node if table in n.input]
    assert readers == ["Gather"]  # the whole table is never dequantized at run time
    report = verify_onnx(converted, path, [torch.randint(0, VOCAB, (8, 9)) for _ in range(2)])
    assert report.outputs[0].max_diff_steps == 0.0, str(report)
