"""drop_zero_biases: an all-zero conv / gemm bias input is removed, value-identical; a non-zero one is kept."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from coreai_opt.onnx.rewrite import apply
from coreai_opt.onnx.rewrite.rules.drop_zero_biases import DropZeroBiases
from coreai_opt.onnx.rewrite.rules.fold_quantized_weights import FoldQuantizedWeights
from tests.onnx.onnx_graphs import conv_qdq_model, run
from tests.onnx.rewrite.rule_checks import apply_rule, assert_idempotent, copy

RULE = DropZeroBiases()


def _folded_conv(zero_bias: bool) -> onnx.ModelProto:
    model = conv_qdq_model()
    if zero_bias:
        for init in model.graph.initializer:
            if init.name == "conv.bias":
                init.CopyFrom(numpy_helper.from_array(np.zeros(8, np.float32), "conv.bias"))
    apply(model, [FoldQuantizedWeights()])
    return model


def test_all_zero_int32_bias_is_dropped_with_its_initializer() -> None:
    model = _folded_conv(zero_bias=True)
    before = copy(model)
    assert apply_rule(model, RULE) == (1, [])
    conv = next(n for n in model.graph.node if n.op_type == "Conv")
    assert len(conv.input) == 2
    assert not [t for t in model.graph.initializer if t.data_type == TensorProto.INT32]  # its initializer is gone
    assert "DequantizeLinear" not in [n.op_type for n in model.graph.node if n.output[0] == "bd"]
    x = np.random.default_rng(1).standard_normal((2, 3, 8, 8)).astype(np.float32)
    np.testing.assert_array_equal(run(model, {"x": x})[0], run(before, {"x": x})[0])
    assert_idempotent(model, RULE)


def test_non_zero_bias_is_kept_without_a_reason() -> None:
    model = _folded_conv(zero_bias=False)
    before = model.SerializeToString()
    assert apply_rule(model, RULE) == (0, [])
    assert model.SerializeToString() == before


def test_bias_fed_at_run_time_is_kept_with_its_reason() -> None:
    model = _folded_conv(zero_bias=True)
    model.graph.input.append(helper.make_tensor_value_info("bias_input", TensorProto.FLOAT, [8]))
    next(n for n in model.graph.node if n.op_type == "Conv").input[2] = "bias_input"
    onnx.checker.check_model(model)
    before = model.SerializeToString()
    count, reasons = apply_rule(model, RULE)
    assert (count, reasons) == (0, ["bias is not a constant (nor a DequantizeLinear of one with a zero zero point)"])
    assert model.SerializeToString() == before
