"""fuse_shared_input_matmul_nbits: MatMulNBits readers of one input become one MatMulNBits + Split, bit-identical."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from coreai_opt.onnx.rewrite.rules.fuse_shared_input_matmul_nbits import FuseSharedInputMatMulNBits
from coreai_opt.quantization.matmul_nbits.packing import midpoint_zero_points, pack_matmul_nbits
from tests.onnx.onnx_graphs import run
from tests.onnx.rewrite.rule_checks import apply_rule, assert_idempotent, copy, ops

RULE = FuseSharedInputMatMulNBits()
K = 80  # 3 blocks of 32, the last one partial: odd block count, padded zero-point nibbles


def _linear(name: str, n: int, bits: int, asymmetric: bool, level: int, seed: int, block: int = 32,
            ) -> tuple[onnx.NodeProto, list[onnx.TensorProto]]:
    rng = np.random.default_rng(seed)
    blocks = -(-K // block)
    low, high = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    q = rng.integers(low, high + 1, (n, K))
    zero_point = rng.integers(low, high + 1, (n, blocks)) if asymmetric else None
    packed = pack_matmul_nbits(q, rng.uniform(0.01, 0.1, (n, blocks)).astype(np.float32), zero_point, bits, True,
                               block)
    inits = [helper.make_tensor(f"{name}_B", TensorProto.UINT8, packed.b.shape, packed.b.tobytes(), raw=True),
             helper.make_tensor(f"{name}_scales", TensorProto.FLOAT, packed.scales.shape, packed.scales)]
    inputs = ["x", f"{name}_B", f"{name}_scales"]
    if packed.zero_points is not None:
        inits.append(helper.make_tensor(f"{name}_zp", TensorProto.UINT8, packed.zero_points.shape,
                                        packed.zero_points.tobytes(), raw=True))
        inputs.append(f"{name}_zp")
    node = helper.make_node("MatMulNBits", inputs, [name], name=f"{name}_MatMulNBits", domain="com.microsoft", K=K,
                            N=n, bits=bits, block_size=block, accuracy_level=level)
    return node, inits


def _model(linears: list[tuple[onnx.NodeProto, list[onnx.TensorProto]]], cache: bool = True) -> onnx.ModelProto:
    """The linears reading ``x``; with ``cache``, also a layer's KV cache ``present = Concat(past, new, axis=2)``."""
    nodes = [node for node, _ in linears]
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 5, K])]
    outputs = [helper.make_tensor_value_info(n.output[0], TensorProto.FLOAT, None) for n in nodes]
    inits = [t for _, tensors in linears for t in tensors]
    if cache:
        nodes.append(helper.make_node("Concat", ["past", "new"], ["present"], axis=2))
        inputs.append(helper.make_tensor_value_info("past", TensorProto.FLOAT, [2, 1, "past_sequence", 4]))
        outputs.append(helper.make_tensor_value_info("present", TensorProto.FLOAT, None))
        inits.append(helper.make_tensor("new", TensorProto.FLOAT, [2, 1, 5, 4], np.ones(40, np.float32)))
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets)


@pytest.mark.parametrize("level", [1, 4])
@pytest.mark.parametrize("bits", [4, 8])
def test_q_k_v_readers_become_one_matmul_nbits_and_a_split_with_bit_identical_outputs(bits: int, level: int) -> None:
    # q with zero points, k and v without: the fused weight carries the midpoint zero points for k and v
    model = _model([_linear("q", 48, bits, True, level, 0), _linear("k", 16, bits, False, level, 1),
                    _linear("v", 16, bits, False, level, 2)])
    before = copy(model)
    assert apply_rule(model, RULE) == (1, [])
    assert ops(model) == ["MatMulNBits", "Split", "Concat"]
    fused = model.graph.node[0]
    assert {a.name: a.i for a in fused.attribute} == {"K": K, "N": 80, "bits": bits, "block_size": 32,
                                                      "accuracy_level": level}
    assert [o for o in model.graph.node[1].output] == ["q", "k", "v"]
    x = np.random.default_rng(3).standard_normal((2, 5, K)).astype(np.float32) * 4
    for optimize in (False, True):
        feeds = {"x": x, "past": np.zeros((2, 1, 3, 4), np.float32)}
        for fused_out, plain in zip(run(model, feeds, optimize), run(before, feeds, optimize), strict=True):
            np.testing.assert_array_equal(fused_out, plain)
    assert_idempotent(model, RULE)


def test_midpoint_zero_points_are_what_matmul_nbits_assumes_without_the_input() -> None:
    assert midpoint_zero_points(2, 3, 4).tolist() == [0x88, 0x08, 0x88, 0x08]  # odd last block: zero nibble pad
    assert midpoint_zero_points(1, 2, 8).tolist() == [128, 128]


def test_readers_with_another_block_size_or_level_stay_apart_and_the_rest_fuse() -> None:
    model = _model([_linear("gate", 32, 4, True, 4, 0), _linear("other_block", 32, 4, True, 4, 1, block=16),
                    _linear("up", 32, 4, True, 4, 2), _linear("other_level", 32, 4, True, 1, 3)])
    before = copy(model)
    assert apply_rule(model, RULE) == (1, [])
    assert sorted(ops(model)) == ["Concat", "MatMulNBits", "MatMulNBits", "MatMulNBits", "Split"]
    feeds = {"x": np.random.default_rng(4).standard_normal((2, 5, K)).astype(np.float32),
             "past": np.zeros((2, 1, 3, 4), np.float32)}
    for fused_out, plain in zip(run(model, feeds), run(before, feeds), strict=True):
        np.testing.assert_array_equal(fused_out, plain)


def test_a_run_time_weight_is_a_near_miss_and_a_lone_reader_no_candidate() -> None:
    model = _model([_linear("a", 16, 4, False, 4, 0), _linear("b", 16, 4, False, 4, 1)])
    model.graph.input.append(helper.make_tensor_value_info("w", TensorProto.UINT8, [16, 3, 16]))
    model.graph.node[0].input[1] = "w"
    before = model.SerializeToString()
    assert apply_rule(model, RULE) == (0, [
        "weight, scales or zero points are not initializers (or a g_idx / bias input is given)"])
    assert model.SerializeToString() == before
    lone = _model([_linear("a", 16, 4, False, 4, 0)])
    assert apply_rule(lone, RULE) == (0, [])


def test_without_a_kv_cache_the_readers_stay_apart_and_the_near_miss_says_why() -> None:
    model = _model([_linear("q", 48, 4, True, 4, 0), _linear("k", 16, 4, False, 4, 1),
                    _linear("v", 16, 4, False, 4, 2)], cache=False)
    before = model.SerializeToString()
    assert apply_rule(model, RULE) == (0, [
        "3 readers of one input left apart: the graph has no KV cache, so each run multiplies many rows and the "
        "Split's copy costs more than the launches it saves"])
    assert model.SerializeToString() == before
