"""The rule contract of the ONNX post-passes and the one driver that applies rules in order.

A rule looks at one anchor node at a time:

* ``match(node, graph)`` returns a :class:`Match` (the nodes and values the rewrite needs), a :class:`Fail`
  naming the one check a real candidate failed (a near miss, recorded in the report), or None when the node is
  not a candidate at all (most nodes: no reason is recorded for them);
* ``rewrite(match, graph)`` edits the graph through :class:`~coreai_opt.onnx.rewrite.graph.OnnxGraph`.

The driver offers every node whose ``op_type`` is in ``rule.anchors`` to ``match``, in graph order, and rewrites
each match at once, so later matches see the rewritten graph. After the last node it calls ``rule.finish`` (when
something was rewritten) and, once the rule edited the graph, removes what it left unused (nodes and initializers no
output needs). A rule with ``matches_first`` is matched on every anchor of the graph as it was before it ran, and
only then are its matches rewritten, in order (for decisions that must not see the rule's own earlier rewrites). A
rule with ``restart_after_rewrite`` is rescanned from the first node after every rewrite until a full scan rewrites
nothing; a rule with ``only_after = "name"`` is skipped when that rule ran before it in the list and rewrote nothing
(in a list without that rule it runs). A rule that writes ops of a domain other than the default one declares it in
``domains`` (``{domain: opset version}``); :func:`import_domains` adds those opset imports to the model after the
rules ran, for each rule that rewrote something.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import ClassVar

import onnx
from onnx import helper

from coreai_opt.onnx.rewrite.graph import OnnxGraph
from coreai_opt.onnx.rewrite.rewrite_report import RewriteReport, Skip, module_path

__all__ = ["Rule", "Match", "Fail", "run_rules", "import_domains", "CONTRIB_DOMAIN"]

_LOG = logging.getLogger("coreai_opt.onnx.rewrite")

#: Domain of onnxruntime's contrib ops (``MatMulNBits``, ``GatherBlockQuantized``).
CONTRIB_DOMAIN = "com.microsoft"


@dataclass(frozen=True)
class Match:
    """A site ``rule.match`` found; rules subclass it with what their rewrite needs.

    Attributes:
        node: The anchor node.
    """

    node: onnx.NodeProto


@dataclass(frozen=True)
class Fail:
    """Why an anchor node was not rewritten (short and specific: ``"weight is per-block"``)."""

    reason: str


class Rule(ABC):
    """One ONNX rewrite (see the module docstring for the contract).

    Class attributes:
        name: The rule's name in the report (the name of its module).
        anchors: Op types ``match`` is called for.
        matches_first: Match every anchor before rewriting any (decisions see the graph as it was).
        restart_after_rewrite: Rescan from the first node after each rewrite.
        only_after: Skip the rule when the rule of that name ran earlier in the list and rewrote nothing.
        domains: ``{domain: opset version}`` of the non-default ops the rule writes (imported by
            :func:`import_domains` when it rewrote something).
    """

    name: ClassVar[str]
    anchors: ClassVar[frozenset[str]]
    matches_first: ClassVar[bool] = False
    restart_after_rewrite: ClassVar[bool] = False
    only_after: ClassVar[str | None] = None
    domains: ClassVar[Mapping[str, int]] = {}

    @abstractmethod
    def match(self, node: onnx.NodeProto, graph: OnnxGraph) -> Match | Fail | None:
        """Decide whether ``node`` is a site of this rule; must not edit the graph."""

    @abstractmethod
    def rewrite(self, match: Match, graph: OnnxGraph) -> None:
        """Rewrite the site ``match`` describes."""

    def finish(self, graph: OnnxGraph) -> None:  # noqa: B027 - optional hook, empty by default
        """Called once after the last rewrite of a run (only when something was rewritten)."""


def _scan(rule: Rule, graph: OnnxGraph, skipped: list[Skip]) -> int:
    """One pass over a snapshot of the nodes; returns the number of rewrites (stops after one if restarting)."""
    rewritten, pending = 0, []
    for node in graph.nodes:
        if node.op_type not in rule.anchors or not graph.contains(node):
            continue
        result = rule.match(node, graph)
        if isinstance(result, Fail):
            skip = Skip(rule.name, node.name or node.output[0], module_path(node), result.reason)
            _LOG.debug("%s", skip)
            skipped.append(skip)
        elif result is not None and rule.matches_first:
            pending.append(result)
        elif result is not None:
            rule.rewrite(result, graph)
            rewritten += 1
            if rule.restart_after_rewrite:
                break
    for match in pending:
        rule.rewrite(match, graph)
    return rewritten + len(pending)


def _run(rule: Rule, graph: OnnxGraph) -> tuple[int, list[Skip]]:
    count, limit = 0, 2 * len(graph.nodes) + 10
    while True:
        skipped: list[Skip] = []
        rewritten = _scan(rule, graph, skipped)
        count += rewritten
        if not (rule.restart_after_rewrite and rewritten):
            return count, skipped
        if count > limit:
            raise RuntimeError(f"rewrite rule {rule.name} did not converge after {count} rewrites")


def run_rules(rules: Sequence[Rule], graph: OnnxGraph) -> RewriteReport:
    """Apply ``rules`` in order to ``graph``; return ``{rule: count}`` and the near misses."""
    counts: dict[str, int] = {}
    skipped: list[Skip] = []
    for rule in rules:
        if rule.only_after in counts and not counts[rule.only_after]:
            counts[rule.name] = 0
            continue
        edits = graph.edits
        count, misses = _run(rule, graph)
        if count:
            rule.finish(graph)
        if graph.edits != edits:
            graph.remove_dead()
        counts[rule.name] = count
        skipped += misses
        _LOG.debug("%s: %d rewrite(s), %d near miss(es)", rule.name, count, len(misses))
    return RewriteReport(counts, tuple(skipped))


def import_domains(model: onnx.ModelProto, rules: Sequence[Rule], report: RewriteReport) -> None:
    """Import the opset of each domain declared by a rule that rewrote something (rule order; once per domain)."""
    for rule in rules:
        if not report.counts.get(rule.name):
            continue
        for domain, version in rule.domains.items():
            if all(o.domain != domain for o in model.opset_import):
                model.opset_import.append(helper.make_opsetid(domain, version))
