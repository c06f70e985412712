"""The rule driver: order, counts, near misses (recorded, logged, only from the final scan), restarts, only_after."""

from __future__ import annotations

import logging

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from coreai_opt.onnx.rewrite import POST_PASSES, Fail, Match, OnnxGraph, Rule, apply
from coreai_opt.onnx.rewrite.rewrite_report import RewriteReport, Skip, module_path, read_report, record_report
from coreai_opt.onnx.rewrite.rule import CONTRIB_DOMAIN
from coreai_opt.onnx.rewrite.rules.collapse_reshapes import CollapseReshapes
from coreai_opt.onnx.rewrite.rules.linears_to_gemm import LinearsToGemm


class _DropIdentities(Rule):
    """Test rule: remove an Identity (its readers read its input); one that produces a graph output is a near miss."""

    name = "drop_identities"
    anchors = frozenset({"Identity"})

    def match(self, node: onnx.NodeProto, graph: OnnxGraph) -> Match | Fail | None:
        if node.output[0] in graph.outputs:
            return Fail("produces a graph output")
        return Match(node)

    def rewrite(self, match: Match, graph: OnnxGraph) -> None:
        graph.replace_uses(match.node.output[0], match.node.input[0])
        graph.remove(match.node)


class _RestartingDropIdentities(_DropIdentities):
    name = "drop_identities_restarting"
    restart_after_rewrite = True


def _chain(names: list[str], namespace: str = "") -> onnx.ModelProto:
    """x -> Identity -> ... -> Identity -> y, plus an unused initializer the rewrite leaves behind."""
    values = ["x", *names[:-1], "y"]
    nodes = [helper.make_node("Identity", [values[i]], [values[i + 1]], name=n) for i, n in enumerate(names)]
    for node in nodes:
        node.metadata_props.add(key="namespace", value=namespace)
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])],
                              [numpy_helper.from_array(np.zeros(1, np.float32), "unused")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_driver_counts_rewrites_records_near_misses_and_removes_dead_initializers(
        caplog: pytest.LogCaptureFixture) -> None:
    model = _chain(["a", "b", "c"], namespace="block: m.Block/proj: torch.nn.Linear/identity: aten.alias")
    with caplog.at_level(logging.DEBUG, logger="coreai_opt.onnx.rewrite"):
        report = apply(model, [_DropIdentities()])
    assert report.counts == {"drop_identities": 2}
    assert report.skipped == (Skip("drop_identities", "c", "block/proj/identity", "produces a graph output"),)
    assert str(report.skipped[0]) == "drop_identities skipped c (block/proj/identity): produces a graph output"
    assert "drop_identities skipped c (block/proj/identity): produces a graph output" in caplog.text
    assert [n.name for n in model.graph.node] == ["c"] and list(model.graph.node[0].input) == ["x"]
    assert not model.graph.initializer  # the rule edited the graph: what nothing reads is removed


def test_driver_leaves_an_unmatched_graph_byte_identical() -> None:
    model = _chain(["only"])
    before = model.SerializeToString()
    report = apply(model, [_DropIdentities()])
    assert report.counts == {"drop_identities": 0} and len(report.skipped) == 1
    assert model.SerializeToString() == before  # no edit: not even the unused initializer is touched


def test_restarting_rule_keeps_only_the_near_misses_of_its_final_scan() -> None:
    model = _chain(["a", "b", "c"])
    report = apply(model, [_RestartingDropIdentities()])
    assert report.counts == {"drop_identities_restarting": 2}
    assert [s.node for s in report.skipped] == ["c"]  # found once, not once per rescan


def test_collapse_reshapes_runs_only_after_linears_to_gemm_rewrote_something() -> None:
    nodes = [helper.make_node("Reshape", ["x", "flat"], ["f"]), helper.make_node("Relu", ["f"], ["r"]),
             helper.make_node("Reshape", ["r", "back"], ["y"])]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 4])],
                              [numpy_helper.from_array(np.array([-1, 4], np.int64), "flat"),
                               numpy_helper.from_array(np.array([2, 3, 4], np.int64), "back")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    before = model.SerializeToString()
    report = apply(model, [LinearsToGemm(), CollapseReshapes()])
    assert report.counts == {"linears_to_gemm": 0, "collapse_reshapes": 0}
    assert model.SerializeToString() == before
    assert apply(model, [CollapseReshapes()]).counts == {"collapse_reshapes": 1}  # on its own it does apply


def test_post_passes_are_the_twenty_three_rules_in_export_order_with_unique_names() -> None:
    assert [rule.name for rule in POST_PASSES] == [
        "fold_quantized_weights", "dynamic_matmuls_to_integer", "fold_weight_transposes", "write_matmul_nbits",
        "gather_block_quantized_rows", "gather_quantized_rows", "fuse_shared_input_matmul_nbits",
        "rms_norms_to_simplified_layer_norm", "attention_to_group_query_attention", "int8_kv_cache",
        "fold_constant_activations",
        "linears_to_gemm", "collapse_reshapes",
        "means_to_global_average_pool", "average_pools_as_depthwise_convs",
        "means_to_sum_and_divide", "guard_quantized_sums", "fold_pads_into_convs", "drop_zero_biases",
        "guard_float8_activations", "guard_4bit_activations", "clip_16bit_activations", "shapes_from_quantized",
    ]
    for rule in POST_PASSES:
        assert rule.__module__ == f"coreai_opt.onnx.rewrite.rules.{rule.name}"  # each rule's file is named after it


def test_report_round_trips_through_model_metadata_as_sorted_json() -> None:
    report = RewriteReport({"b_rule": 2, "a_rule": 0}, (Skip("b_rule", "n1", "fc1/linear", "weight is per-block"),))
    model = _chain(["a"])
    model.metadata_props.add(key="other", value="kept")
    record_report(model, report)
    record_report(model, report)  # recording again replaces the entry
    assert [e.key for e in model.metadata_props] == ["other", "coreai_opt.rewrites"]
    assert model.metadata_props[1].value == (
        '{"rules":[["b_rule",2],["a_rule",0]],"skipped":[{"module":"fc1/linear","node":"n1",'
        '"reason":"weight is per-block","rule":"b_rule"}]}')
    assert read_report(model) == report and list(read_report(model).counts) == ["b_rule", "a_rule"]
    assert read_report(_chain(["a"])) is None
    model.metadata_props[1].value = "{"
    with pytest.raises(ValueError, match="coreai_opt.rewrites metadata entry is not a rewrite report"):
        read_report(model)


def test_report_text_lists_counts_in_rule_order_and_each_near_miss() -> None:
    report = RewriteReport({"fold_quantized_weights": 12, "linears_to_gemm": 0},
                           (Skip("linears_to_gemm", "node_MatMul_3", "q_proj/linear", "weight is per-block"),))
    assert str(report).splitlines() == [
        "ONNX rewrites applied by export_onnx",
        "  fold_quantized_weights    12",
        "  linears_to_gemm            0",
        "  near misses (1):",
        "    linears_to_gemm skipped node_MatMul_3 (q_proj/linear): weight is per-block",
    ]


def test_module_path_keeps_the_names_of_the_exporter_namespace() -> None:
    node = helper.make_node("MatMul", ["a", "b"], ["c"])
    assert module_path(node) == ""
    namespace = ": m.Wrapper/fc1: torch.nn.modules.linear.Linear/linear: aten.linear.default"
    node.metadata_props.add(key="namespace", value=namespace)
    assert module_path(node) == "fc1/linear"


class _DropIdentitiesWritingContrib(_DropIdentities):
    name = "drop_identities_contrib"
    domains = {CONTRIB_DOMAIN: 1}


class _AlsoContrib(_DropIdentitiesWritingContrib):
    name = "drop_identities_contrib_again"


def test_a_rule_that_rewrote_imports_the_domains_it_declares_once_and_one_that_did_not_imports_none() -> None:
    model = _chain(["a", "b"])
    apply(model, [_DropIdentitiesWritingContrib(), _AlsoContrib()])  # the second finds nothing left to drop
    assert [(o.domain, o.version) for o in model.opset_import] == [("", 18), (CONTRIB_DOMAIN, 1)]
    imported = _chain(["a", "b"])
    imported.opset_import.insert(0, helper.make_opsetid(CONTRIB_DOMAIN, 1))  # already imported: not again
    apply(imported, [_DropIdentitiesWritingContrib()])
    assert [(o.domain, o.version) for o in imported.opset_import] == [(CONTRIB_DOMAIN, 1), ("", 18)]
    untouched = _chain(["only"])  # its one Identity produces the graph output: a near miss, no rewrite
    apply(untouched, [_DropIdentitiesWritingContrib()])
    assert [(o.domain, o.version) for o in untouched.opset_import] == [("", 18)]


def test_the_contrib_writing_post_passes_declare_the_contrib_domain_and_no_other_rule_declares_one() -> None:
    assert {rule.name: dict(rule.domains) for rule in POST_PASSES if rule.domains} == {
        "write_matmul_nbits": {CONTRIB_DOMAIN: 1}, "gather_block_quantized_rows": {CONTRIB_DOMAIN: 1},
        "rms_norms_to_simplified_layer_norm": {CONTRIB_DOMAIN: 1},
        "attention_to_group_query_attention": {CONTRIB_DOMAIN: 1}}
