"""Quantizers are judged after the quantizers they read in onnxruntime's graph, whatever the file's order."""

from __future__ import annotations

from coreai_opt.onnx.verify.reading_order import reading_order


def test_a_quantizer_onnxruntime_computes_from_a_later_one_is_judged_after_it() -> None:
    # timm rdnet_tiny: the conv's NCHW quantizer (b) is a Transpose of the permuted copy (c) the NHWC QLinearConv
    # writes, so c must be judged before b even though the file lists b first
    assert reading_order(["a", "b", "c", "d"], {"b": {"c"}, "c": {"a"}, "d": {"b"}}) == [0, 2, 1, 3]


def test_the_files_order_is_kept_where_nothing_constrains_it() -> None:
    assert reading_order(["a", "b", "c"], {"c": {"a"}}) == [0, 1, 2]
    assert reading_order(["x", "y"], {"x": {"x", "unknown"}}) == [0, 1]  # itself and non-quantizer tensors ignored


def test_a_cycle_keeps_the_rest_in_the_files_order() -> None:
    assert reading_order(["a", "b", "c"], {"a": {"b"}, "b": {"a"}}) == [2, 0, 1]
