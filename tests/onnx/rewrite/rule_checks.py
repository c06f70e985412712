"""Helpers shared by the rule tests: apply one rule, read its count and reasons, check idempotence."""

from __future__ import annotations

import onnx

from coreai_opt.onnx.rewrite import Rule, apply


def apply_rule(model: onnx.ModelProto, rule: Rule) -> tuple[int, list[str]]:
    """Apply ``rule`` alone to ``model`` in place; return its count and the near-miss reasons."""
    report = apply(model, [rule])
    return report.counts[rule.name], [skip.reason for skip in report.skipped]


def rewrite_count(model: onnx.ModelProto, rule: Rule) -> int:
    """Apply ``rule`` alone to ``model`` in place; return how many sites it rewrote."""
    return apply_rule(model, rule)[0]


def assert_idempotent(model: onnx.ModelProto, rule: Rule) -> None:
    """Applying ``rule`` again to its own output rewrites nothing and leaves the bytes identical."""
    before = model.SerializeToString()
    count, _ = apply_rule(model, rule)
    assert count == 0
    assert model.SerializeToString() == before


def copy(model: onnx.ModelProto) -> onnx.ModelProto:
    duplicate = onnx.ModelProto()
    duplicate.CopyFrom(model)
    return duplicate


def ops(model: onnx.ModelProto) -> list[str]:
    return [node.op_type for node in model.graph.node]
