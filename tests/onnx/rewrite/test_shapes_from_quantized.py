"""shapes_from_quantized: a ``Shape`` reader of a conv's output no longer keeps onnxruntime from fusing the conv."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from coreai_opt.onnx import fusion_report
from coreai_opt.onnx.rewrite import apply
from coreai_opt.onnx.rewrite.rules.shapes_from_quantized import ShapesFromQuantized
from tests.onnx.onnx_graphs import conv_qdq_model, run, save
from tests.onnx.rewrite.rule_checks import assert_idempotent

RULE = ShapesFromQuantized()


def _conv_with_shape_reader(other_reader: bool = False) -> onnx.ModelProto:
    """The QDQ conv of ``conv_qdq_model`` whose float output ``c`` is also read by ``Shape`` (its spatial sizes, as
    timm's ``Conv2dSame`` reads them to pad the next conv), placed before the output ``QuantizeLinear``."""
    model = conv_qdq_model(float_weight_q=False)
    nodes = list(model.graph.node)
    position = next(i for i, n in enumerate(nodes) if n.op_type == "Conv") + 1
    nodes.insert(position, helper.make_node("Shape", ["c"], ["hw"], start=2, end=4))
    if other_reader:
        nodes.append(helper.make_node("Relu", ["c"], ["r"]))
        model.graph.output.append(helper.make_tensor_value_info("r", TensorProto.FLOAT, ["N", 8, 8, 8]))
    del model.graph.node[:]
    model.graph.node.extend(nodes)
    model.graph.output.append(helper.make_tensor_value_info("hw", TensorProto.INT64, [2]))
    return model


def test_shape_reads_the_quantized_output_and_onnxruntime_then_fuses_the_conv(tmp_path: Path) -> None:
    model = _conv_with_shape_reader()
    assert fusion_report(save(model, tmp_path / "before.onnx")).float_compute == {"Conv": 1}
    rewritten = onnx.ModelProto()
    rewritten.CopyFrom(model)
    report = apply(rewritten, [RULE])
    assert report.counts[RULE.name] == 1 and not report.skipped
    onnx.checker.check_model(rewritten, full_check=True)
    shape = next(n for n in rewritten.graph.node if n.op_type == "Shape")
    assert shape.input[0] == "cq"  # the QuantizeLinear's output: same shape, and c has one reader left
    names = [o for n in rewritten.graph.node for o in n.output]
    assert names.index("cq") < names.index("hw")  # topological order restored
    assert fusion_report(save(rewritten, tmp_path / "after.onnx")).integer_compute == {"QLinearConv": 1}
    x = np.random.default_rng(3).standard_normal((2, 3, 8, 8)).astype(np.float32)
    for optimize in (False, True):
        before, after = run(model, {"x": x}, optimize), run(rewritten, {"x": x}, optimize=False)
        np.testing.assert_array_equal(after[1], [8, 8])
        np.testing.assert_array_equal(after[1], before[1])
        if not optimize:
            np.testing.assert_array_equal(after[0], before[0])
    assert_idempotent(rewritten, RULE)


def test_a_value_with_another_float_reader_is_left_alone() -> None:
    model = _conv_with_shape_reader(other_reader=True)  # the Relu reads c as float: no fusion to win
    report = apply(model, [RULE])
    assert not report.counts.get(RULE.name) and not report.skipped
    assert next(n for n in model.graph.node if n.op_type == "Shape").input[0] == "c"
