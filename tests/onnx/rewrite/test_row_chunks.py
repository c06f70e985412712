"""Row-chunked clamp folds give exactly the whole-tensor integers (the 2.4 GB w8a8 export peaked there)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from coreai_opt.onnx.rewrite import row_chunks
from coreai_opt.onnx.rewrite.constant_folder import ConstantFolder, expand_qparam
from coreai_opt.onnx.rewrite.graph import OnnxGraph
from coreai_opt.onnx.rewrite.rules.narrow_range_clamp import plan_clamp_fold

RNG = np.random.default_rng(0)
ROWS, COLS = 36, 16


def _clamped_dequantize(q: np.ndarray, scale: np.ndarray, attrs: dict[str, int], low: np.ndarray,
                        high: np.ndarray) -> tuple[onnx.NodeProto, OnnxGraph]:
    """``x + Min(Max(DequantizeLinear(q), low), high)`` with every input an initializer."""
    nodes = [helper.make_node("DequantizeLinear", ["q", "s", "z"], ["wd"], **attrs),
             helper.make_node("Max", ["wd", "lo"], ["wmax"]), helper.make_node("Min", ["wmax", "hi"], ["wc"]),
             helper.make_node("Add", ["x", "wc"], ["y"])]
    inits = [numpy_helper.from_array(a, n) for a, n in ((q, "q"), (scale, "s"), (np.zeros(scale.shape, np.int8), "z"),
                                                        (low, "lo"), (high, "hi"))]
    io = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [ROWS, COLS]) for n in ("x", "y")]
    model = helper.make_model(helper.make_graph(nodes, "g", io[:1], io[1:], inits),
                              opset_imports=[helper.make_opsetid("", 21)])
    return model.graph.node[0], OnnxGraph(model)


# (scale shape, DequantizeLinear attributes, the clamp bound's shape) for a (36, 16) weight
CASES = {
    "per_tensor": ((), {}, ()),
    "per_channel_rows": ((ROWS,), {"axis": 0}, (ROWS, 1)),
    "per_channel_columns": ((COLS,), {"axis": 1}, (COLS,)),
    "per_channel_columns_2d": ((COLS,), {"axis": 1}, (1, COLS)),
    "blocked_columns": ((ROWS, COLS // 8), {"axis": 1, "block_size": 8}, (ROWS, COLS)),
    "blocked_rows": ((ROWS // 4, COLS), {"axis": 0, "block_size": 4}, (ROWS, COLS)),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("exact", [True, False])
def test_chunked_clamp_fold_equals_the_whole_tensor_fold(monkeypatch: pytest.MonkeyPatch, case: str,
                                                         exact: bool) -> None:
    scale_shape, attrs, bound_shape = CASES[case]
    q = RNG.integers(-128, 128, (ROWS, COLS)).astype(np.int8)
    q[::3, 0] = -128  # the narrow clamp moves these to -127
    scale = (RNG.random(scale_shape) * 0.1 + 0.01).astype(np.float32)
    grid = expand_qparam(scale, q, attrs.get("axis", 0), attrs.get("block_size", 0)) * np.ones_like(q, np.float32)
    grid = grid[(slice(None), slice(0, 1))] if bound_shape == (ROWS, 1) else grid
    if len(bound_shape) < 2 or bound_shape[0] == 1:  # constant along the rows
        grid = grid[0, :int(np.prod(bound_shape))].reshape(bound_shape)
    low, high = np.float32(-127) * grid, np.float32(127) * grid  # the narrow int8 range, on the grid
    if not exact:  # a bound between two grid points (in the last rows where it can be): the fold is refused
        high = np.float32(126.5) * grid
    node, graph = _clamped_dequantize(q, scale, attrs, low, high)
    folder = ConstantFolder(graph)
    whole = plan_clamp_fold(node, graph, folder, q, scale, np.zeros(scale.shape, np.int8))
    monkeypatch.setattr(row_chunks, "CHUNK_BYTES", 4 * 4 * COLS)  # four rows at a time (one row block)
    assert len(row_chunks.row_ranges(q.shape, attrs.get("axis", 0), attrs.get("block_size", 0))) == ROWS // 4
    chunked = plan_clamp_fold(node, graph, folder, q, scale, np.zeros(scale.shape, np.int8))
    if not exact:
        assert whole is None and chunked is None
        return
    assert whole is not None and chunked is not None
    assert [n.op_type for n in chunked.chain] == ["Max", "Min"]
    assert (whole.stored != q).sum() >= ROWS // 3 and whole.stored.min() == -127  # the clamp moved integers
    assert chunked.stored.dtype == np.int8
    np.testing.assert_array_equal(chunked.stored, whole.stored)


def test_row_ranges_cover_every_row_once_on_block_boundaries() -> None:
    ranges = row_chunks.row_ranges((100, 10), axis=0, block_size=8, chunk_bytes=4 * 10 * 20)
    assert [(r.start, r.stop) for r in ranges] == [(0, 16), (16, 32), (32, 48), (48, 64), (64, 80), (80, 96),
                                                   (96, 100)]
    assert [(r.start, r.stop) for r in row_chunks.row_ranges((5, 1 << 20), 0, 0, chunk_bytes=1)] == [
        (0, 1), (1, 2), (2, 3), (3, 4), (4, 5)]
