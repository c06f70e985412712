"""fold_constant_activations: a constant position-embedding branch up to its QuantizeLinear becomes the int8
initializer it computes: onnxruntime bit-identical, and OpenVINO then compiles the embedding Add (it failed with
``[AddTransformation] ... index < m_inputs.size()``) and agrees with onnxruntime."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from coreai_opt.onnx.rewrite.rules.fold_constant_activations import FoldConstantActivations
from tests.onnx.onnx_graphs import run
from tests.onnx.openvino_graphs import embedding_add
from tests.onnx.rewrite.rule_checks import apply_rule, assert_idempotent

RULE = FoldConstantActivations()
TOKENS = np.random.default_rng(1).integers(0, 100, (32, 16)).astype(np.int64)


def test_constant_position_branch_becomes_the_int8_initializer_it_computes() -> None:
    model = embedding_add(np.random.default_rng(0))
    expected = run(model, {"tokens": TOKENS})[0]
    assert apply_rule(model, RULE) == (1, [])
    onnx.checker.check_model(model, full_check=True)
    stored = {t.name: t for t in model.graph.initializer}
    assert "position" not in stored and "position_ids" not in stored  # the branch is gone, table included
    folded = next(n for n in model.graph.node if n.output[0] == "position_dq")
    assert folded.op_type == "DequantizeLinear" and folded.input[0] == "position_dq_q_folded"
    assert stored["position_dq_q_folded"].data_type == TensorProto.INT8
    hand_folded = {t.name: t for t in embedding_add(np.random.default_rng(0), fold_positions=True).graph.initializer}
    np.testing.assert_array_equal(onnx.numpy_helper.to_array(stored["position_dq_q_folded"]),
                                  onnx.numpy_helper.to_array(hand_folded["position_dq_q"]))
    np.testing.assert_array_equal(run(model, {"tokens": TOKENS})[0], expected)
    np.testing.assert_array_equal(run(model, {"tokens": TOKENS}, optimize=True)[0], expected)
    assert_idempotent(model, RULE)


def test_the_word_branch_reads_tokens_and_is_left_alone() -> None:
    model = embedding_add(np.random.default_rng(0))
    apply_rule(model, RULE)
    word = [n.op_type for n in model.graph.node if n.output[0].startswith("word_")]
    assert word == ["Gather", "Cast", "Gather", "Unsqueeze", "Mul", "QuantizeLinear", "DequantizeLinear"]


def test_a_constant_branch_the_folder_refuses_is_a_recorded_near_miss() -> None:
    """A float16 round trip in the constant branch: the folder leaves float16 casts to onnxruntime."""
    model = embedding_add(np.random.default_rng(0))
    mul = next(n for n in model.graph.node if n.output[0] == "position_rows")
    mul.output[0] = "position_rows_f32"
    at = list(model.graph.node).index(mul) + 1
    model.graph.node.insert(at, helper.make_node("Cast", ["position_rows_f32"], ["position_rows_f16"],
                                                 to=TensorProto.FLOAT16))
    model.graph.node.insert(at + 1, helper.make_node("Cast", ["position_rows_f16"], ["position_rows"],
                                                     to=TensorProto.FLOAT))
    onnx.checker.check_model(model)
    before = model.SerializeToString()
    count, reasons = apply_rule(model, RULE)
    assert count == 0 and model.SerializeToString() == before
    assert reasons == ["constant input not folded: its Cast to float16 is left to onnxruntime"]


def test_openvino_compiles_and_agrees_with_onnxruntime_after_the_fold(tmp_path: Path) -> None:
    pytest.importorskip("openvino")
    from coreai_opt.onnx.verify.runtimes import open_runner

    model = embedding_add(np.random.default_rng(0))
    apply_rule(model, RULE)
    path = tmp_path / "folded.onnx"
    onnx.save(model, str(path))
    expected = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"tokens": TOKENS})[0]
    np.testing.assert_array_equal(open_runner(path, "openvino").run({"tokens": TOKENS})[0], expected)
