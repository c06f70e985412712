"""gather_block_quantized_rows: DQ(per-block table) -> Gather becomes GatherBlockQuantized, bit-identical."""

from __future__ import annotations

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
from coreai_opt.onnx.rewrite import apply
from coreai_opt.onnx.rewrite.rules.gather_block_quantized_rows import GatherBlockQuantizedRows
from coreai_opt.onnx.rewrite.rules.write_matmul_nbits import WriteMatMulNBits
from tests.onnx.onnx_graphs import run
from tests.onnx.rewrite.rule_checks import apply_rule, assert_idempotent, copy, ops, rewrite_count

RNG = np.random.default_rng(5)
VOCAB, DIM, BLOCK = 40, 64, 16
RULE = GatherBlockQuantizedRows()
#: ONNX type -> (numpy dtype, lowest, highest + 1).
TYPES = {TensorProto.INT4: (ml_dtypes.int4, -8, 8), TensorProto.UINT4: (ml_dtypes.uint4, 0, 16),
         TensorProto.INT8: (np.int8, -128, 128), TensorProto.UINT8: (np.uint8, 0, 256)}

gather_block_quantized_rows = functools.partial(rewrite_count, rule=RULE)


def _table_model(table_type: int, zero_point: bool = True, dim: int = DIM, block: int = BLOCK, axis: int = 1,
                 tied: bool = False) -> onnx.ModelProto:
    """``DequantizeLinear(table, axis, block_size) -> Gather(ids)`` (and, when ``tied``, ``MatMul(h, tableᵀ)``)."""
    dtype, low, high = TYPES[table_type]
    blocks = (-(-dim // block), dim) if axis == 0 else (VOCAB, -(-dim // block))
    table = RNG.integers(low, high, (VOCAB, dim)).astype(dtype)
    scale = (RNG.random(blocks) * 0.05 + 0.01).astype(np.float32)
    inits = [numpy_helper.from_array(table, "table_q"), numpy_helper.from_array(scale, "scale")]
    dq_inputs = ["table_q", "scale"]
    if zero_point:
        inits.append(numpy_helper.from_array(RNG.integers(low, high, blocks).astype(dtype), "zp"))
        dq_inputs.append("zp")
    nodes = [helper.make_node("DequantizeLinear", dq_inputs, ["table"], axis=axis, block_size=block),
             helper.make_node("Gather", ["table", "ids"], ["y"], axis=0)]
    inputs = [helper.make_tensor_value_info("ids", TensorProto.INT64, ["b", "s"])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["b", "s", dim])]
    if tied:  # the LM head reads the same table: logits = h @ tableᵀ
        nodes += [helper.make_node("Transpose", ["table"], ["table_t"], perm=[1, 0]),
                  helper.make_node("MatMul", ["h", "table_t"], ["logits"])]
        inputs.append(helper.make_tensor_value_info("h", TensorProto.FLOAT, ["b", "s", dim]))
        outputs.append(helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s", VOCAB]))
    graph = helper.make_graph(nodes, "embedding", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def _feeds(tied: bool = False, dim: int = DIM) -> dict[str, np.ndarray]:
    feeds = {"ids": RNG.integers(-VOCAB, VOCAB, (3, 7)).astype(np.int64)}  # negative ids count from the end
    if tied:
        feeds["h"] = RNG.standard_normal((3, 7, dim)).astype(np.float32)
    return feeds


def _assert_same_bits(model: onnx.ModelProto, before: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> None:
    for optimize in (False, True):
        for got, want in zip(run(model, feeds, optimize), run(before, feeds, optimize), strict=True):
            assert got.dtype == want.dtype == np.float32
            np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


@pytest.mark.parametrize("zero_point", [True, False], ids=["zero_point", "no_zero_point"])
@pytest.mark.parametrize("table_type", list(TYPES), ids=[helper.tensor_dtype_to_string(t)[12:] for t in TYPES])
def test_gathering_blocks_before_dequantizing_is_bit_identical(table_type: int, zero_point: bool) -> None:
    model = _table_model(table_type, zero_point)
    before = copy(model)
    assert gather_block_quantized_rows(model) == 1
    onnx.checker.check_model(model, full_check=True)  # the com.microsoft opset is declared
    assert ops(model) == ["GatherBlockQuantized"]
    node = model.graph.node[0]
    bits = 4 if table_type in (TensorProto.INT4, TensorProto.UINT4) else 8
    assert {a.name: a.i for a in node.attribute} == {"bits": bits, "block_size": BLOCK, "gather_axis": 0,
                                                     "quantize_axis": 1}
    table = next(t for t in model.graph.initializer if t.name == node.input[0])
    expected_type = TensorProto.UINT8 if table_type == TensorProto.INT8 else table_type  # int8 is read shifted
    assert table.data_type == expected_type and list(table.dims) == [VOCAB, DIM]
    _assert_same_bits(model, before, _feeds())
    assert_idempotent(model, RULE)


def test_the_file_keeps_the_table_bytes_it_had() -> None:
    for table_type in TYPES:
        model = _table_model(table_type)
        size = sum(len(t.raw_data) for t in model.graph.initializer)
        assert gather_block_quantized_rows(model) == 1
        assert sum(len(t.raw_data) for t in model.graph.initializer) == size  # same tensors, or one shifted copy


def test_a_last_block_shorter_than_block_size_is_bit_identical() -> None:
    model = _table_model(TensorProto.INT4, dim=80, block=32)  # 80 = 32 + 32 + 16
    before = copy(model)
    assert gather_block_quantized_rows(model) == 1
    _assert_same_bits(model, before, _feeds(dim=80))


def test_openvino_reads_the_gathered_blocks_bit_identically(tmp_path: Path) -> None:
    from coreai_opt.onnx.verify.runtimes import open_runner

    for table_type in TYPES:
        model = _table_model(table_type)
        before = copy(model)
        assert gather_block_quantized_rows(model) == 1
        feeds = {"ids": RNG.integers(0, VOCAB, (3, 7)).astype(np.int64)}
        onnx.save(model, tmp_path / "after.onnx")
        got = open_runner(tmp_path / "after.onnx", "openvino").run(feeds)[0]
        np.testing.assert_array_equal(got, run(before, feeds)[0])


@pytest.mark.parametrize(("kwargs", "reason"), [
    ({"block": 8}, "block size 8 is not a power of two >= 16 (GatherBlockQuantized)"),
    ({"block": 24}, "block size 24 is not a power of two >= 16 (GatherBlockQuantized)"),
    ({"axis": 0}, "table blocks run along the rows (axis 0); GatherBlockQuantized needs them along the embedding dim"),
])
def test_a_table_the_kernel_cannot_read_keeps_its_dequantize_with_its_reason(kwargs: dict, reason: str) -> None:
    model = _table_model(TensorProto.INT4, **kwargs)
    before = model.SerializeToString()
    assert apply_rule(model, RULE) == (0, [reason])
    assert model.SerializeToString() == before


def test_a_table_that_is_not_per_block_is_left_to_gather_quantized_rows() -> None:
    model = _table_model(TensorProto.INT8)
    dq = model.graph.node[0]
    del dq.attribute[:]
    dq.attribute.append(helper.make_attribute("axis", 0))
    scale = next(t for t in model.graph.initializer if t.name == "scale")
    scale.CopyFrom(numpy_helper.from_array(np.full(VOCAB, 0.02, np.float32), "scale"))
    zero_point = next(t for t in model.graph.initializer if t.name == "zp")
    zero_point.CopyFrom(numpy_helper.from_array(np.zeros(VOCAB, np.int8), "zp"))
    assert apply_rule(model, RULE) == (0, [])  # not a candidate: no near miss either


@pytest.mark.parametrize("table_type", [TensorProto.INT4, TensorProto.UINT8])
def test_a_tied_table_is_stored_once_and_the_matmul_keeps_its_dequantize(table_type: int) -> None:
    model = _table_model(table_type, tied=True)
    before = copy(model)
    assert gather_block_quantized_rows(model) == 1
    gbq = next(n for n in model.graph.node if n.op_type == "GatherBlockQuantized")
    dq = next(n for n in model.graph.node if n.op_type == "DequantizeLinear")
    assert gbq.input[0] == dq.input[0] == "table_q"  # one table, read by both
    assert sum(list(t.dims) == [VOCAB, DIM] for t in model.graph.initializer) == 1
    _assert_same_bits(model, before, _feeds(tied=True))


def test_a_tied_int8_table_is_not_copied_for_the_gather() -> None:
    model = _table_model(TensorProto.INT8, tied=True)
    assert apply_rule(model, RULE) == (0, ["int8 table is also read by other nodes; GatherBlockQuantized reads 8-bit "
                                           "data as uint8, a shifted copy would store the table twice"])


@pytest.mark.parametrize("table_type", list(TYPES), ids=[helper.tensor_dtype_to_string(t)[12:] for t in TYPES])
def test_a_table_matmul_nbits_stores_is_gathered_from_its_initializers(table_type: int) -> None:
    model = _table_model(table_type, tied=True)
    head_only = copy(model)
    assert apply(head_only, [WriteMatMulNBits()]).counts == {"write_matmul_nbits": 1}
    assert apply(model, [WriteMatMulNBits(), RULE]).counts == {"write_matmul_nbits": 1, RULE.name: 1}
    onnx.checker.check_model(model, full_check=True)
    names = {t.name for t in model.graph.initializer}
    matmul = next(n for n in model.graph.node if n.op_type == "MatMulNBits")
    assert "table_q" not in names and set(matmul.input[1:]) <= names  # the table's own copy is gone
    gbq = next(n for n in model.graph.node if n.op_type == "GatherBlockQuantized")
    reshaped = [next(n for n in model.graph.node if n.output[0] == name).input[0] for name in gbq.input[2:]]
    assert reshaped[0] == matmul.input[2]  # scales; data below (4-bit: low nibble first, as MatMulNBits packs)
    assert next(n for n in model.graph.node if n.output[0] == gbq.input[0]).input[0] == matmul.input[1]
    table_bytes = {t.name: len(t.raw_data) for t in head_only.graph.initializer}
    new_bytes = sum(len(t.raw_data) for t in model.graph.initializer)
    shapes = sum(len(t.raw_data) for t in model.graph.initializer if t.name not in table_bytes)
    assert new_bytes - shapes == sum(table_bytes.values()) - table_bytes["table_q"] - table_bytes["scale"] - \
        table_bytes.get("zp", 0)
    assert shapes <= 16 * len(gbq.input[2:]) + 16  # only the Reshape targets are new (int64 [2] each)
    _assert_same_bits(model, head_only, _feeds(tied=True))


def test_a_table_that_differs_from_the_matmul_nbits_weight_keeps_its_own_copy() -> None:
    model = _table_model(TensorProto.INT4, tied=True)
    apply(model, [WriteMatMulNBits()])
    b = next(t for t in model.graph.initializer if t.name.endswith("nbits_B"))
    values = numpy_helper.to_array(b).copy()
    values[0, 0, 0] ^= 1  # one element differs: not the same table
    b.CopyFrom(numpy_helper.from_array(values, b.name))
    assert rewrite_count(model, RULE) == 1
    gbq = next(n for n in model.graph.node if n.op_type == "GatherBlockQuantized")
    assert gbq.input[0] == "table_q"


class _TiedLM(nn.Module):
    """Embedding -> linear -> LM head tied to the embedding (a MiniLM / GPT-shaped toy)."""

    def __init__(self, vocab: int = 96, dim: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.position = nn.Embedding(16, dim)
        self.mid = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(ids.shape[1]).unsqueeze(0)
        return self.head(torch.relu(self.mid(self.embed(ids) + self.position(positions))))


@pytest.mark.parametrize("algorithm", [None, "gptq"], ids=["minmax", "gptq"])
def test_w4_export_with_int4_embeddings_reads_only_rows_and_verifies(algorithm: str | None, tmp_path: Path) -> None:
    torch.manual_seed(0)
    ids = [torch.randint(0, 96, (4, 12)) for _ in range(3)]
    prepared = coreai_opt.prepare(_TiedLM().eval(), QuantizerConfig.presets.w4(block_size=32, algorithm=algorithm),
                                  (ids[0],))
    coreai_opt.calibrate(prepared, [(i,) for i in ids], progress=False)
    converted = coreai_opt.convert(prepared)
    path = export_onnx(converted, (ids[0],), tmp_path / "lm.onnx")
    graph = onnx.load(str(path)).graph
    assert [n.op_type for n in graph.node].count("GatherBlockQuantized") == 2  # word and position rows
    assert "DequantizeLinear" not in [n.op_type for n in graph.node]  # no table is dequantized whole
    tables = [t for t in graph.initializer if list(t.dims) in ([96, 64], [96, 2, 16])]
    # min/max: the head and the embedding quantize the tied weight alike -> one table (MatMulNBits' B);
    # GPTQ rounds the head with its input statistics -> a second, different table, as the eager model has
    assert len(tables) == (1 if algorithm is None else 2)
    report = verify_onnx(converted, path, [torch.randint(0, 96, (8, 12)) for _ in range(2)])
    assert report.ok and report.outputs[0].max_abs_diff <= 1e-4 * report.outputs[0].reference_range, str(report)
