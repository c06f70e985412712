"""``RewriteReport``: what the ONNX rewrite rules did to a model, stored in the file it describes.

``export_onnx`` records it as the model-level ``metadata_props`` entry ``coreai_opt.rewrites``: JSON with sorted
keys, ``{"rules": [[rule, count], ...] (in the order the rules ran), "skipped": [{"rule", "node", "module",
"reason"}, ...]}``. A skip is a near miss: a node the rule looked at as an anchor that failed one check (e.g.
``linears_to_gemm`` skipped ``node_MatMul_3`` (``fc1/linear``): weight is per-block). :func:`read_report` gives
it back from a loaded model; ``fusion_report`` and ``coreai-opt inspect`` print it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import onnx

__all__ = ["METADATA_KEY", "RewriteReport", "Skip", "module_path", "read_report", "record_report"]

#: Model metadata key holding the report.
METADATA_KEY = "coreai_opt.rewrites"


@dataclass(frozen=True)
class Skip:
    """One near miss: ``rule`` did not rewrite ``node`` (from module ``module``) because of ``reason``."""

    rule: str
    node: str
    module: str
    reason: str

    def __str__(self) -> str:
        where = f"{self.node} ({self.module})" if self.module else self.node
        return f"{self.rule} skipped {where}: {self.reason}"


@dataclass(frozen=True)
class RewriteReport:
    """Rewrite counts per rule (in the order the rules ran) and the near misses.

    Attributes:
        counts: ``{rule name: number of sites rewritten}``.
        skipped: The near misses, in the order they were found.
    """

    counts: dict[str, int]
    skipped: tuple[Skip, ...] = ()

    @property
    def total(self) -> int:
        """Number of sites rewritten by all rules."""
        return sum(self.counts.values())

    def to_json(self) -> str:
        """Deterministic JSON (sorted keys, no spaces) of the report."""
        skipped = [{"rule": s.rule, "node": s.node, "module": s.module, "reason": s.reason} for s in self.skipped]
        return json.dumps({"rules": [[k, v] for k, v in self.counts.items()], "skipped": skipped},
                          sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> RewriteReport:
        """Parse :meth:`to_json` output.

        Raises:
            ValueError: ``text`` is not such a report.
        """
        try:
            data = json.loads(text)
            counts = {str(name): int(count) for name, count in data["rules"]}
            skipped = tuple(Skip(s["rule"], s["node"], s["module"], s["reason"]) for s in data["skipped"])
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"the {METADATA_KEY} metadata entry is not a rewrite report: {exc}") from None
        return cls(counts, skipped)

    def __str__(self) -> str:
        width = max((len(name) for name in self.counts), default=0)
        lines = ["ONNX rewrites applied by export_onnx"]
        lines += [f"  {name:<{width}}  {count:>4}" for name, count in self.counts.items()]
        if self.skipped:
            lines.append(f"  near misses ({len(self.skipped)}):")
            lines += [f"    {skip}" for skip in self.skipped]
        return "\n".join(lines)


def module_path(node: onnx.NodeProto) -> str:
    """The module path the exporter recorded for ``node`` (``"fc1/linear"``), ``""`` when none.

    The dynamo exporter's ``namespace`` entry reads ``"fc1: torch.nn.modules.linear.Linear/linear:
    aten.linear.default"``; the path keeps the names and drops the types.
    """
    namespace = next((entry.value for entry in node.metadata_props if entry.key == "namespace"), "")
    names = (segment.split(":", 1)[0].strip() for segment in namespace.split("/"))
    return "/".join(name for name in names if name)


#: Node metadata listing the ``namespace`` entries of the quantizer nodes a rule folded into this node exactly (one
#: per line): the calls they were traced from stay accounted for (:mod:`coreai_opt.onnx.verify.missing_calls`).
ABSORBED_KEY = "coreai_opt.absorbed"


def carry_metadata(new: onnx.NodeProto, old: onnx.NodeProto, *absorbed: onnx.NodeProto) -> onnx.NodeProto:
    """Give ``new`` (replacing ``old``) ``old``'s metadata, and record the traces of the ``absorbed`` nodes.

    Returns:
        ``new``.
    """
    new.metadata_props.extend(old.metadata_props)
    lines = [entry.value for node in absorbed for entry in node.metadata_props
             if entry.key in ("namespace", ABSORBED_KEY)]
    if lines:
        previous = [e.value for e in new.metadata_props if e.key == ABSORBED_KEY]
        kept = [e for e in new.metadata_props if e.key != ABSORBED_KEY]
        del new.metadata_props[:]
        new.metadata_props.extend(kept)
        new.metadata_props.add(key=ABSORBED_KEY, value="\n".join([*previous, *lines]))
    return new


def record_report(model: onnx.ModelProto, report: RewriteReport) -> None:
    """Store ``report`` in ``model.metadata_props`` (replacing an earlier report)."""
    kept = [entry for entry in model.metadata_props if entry.key != METADATA_KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    model.metadata_props.add(key=METADATA_KEY, value=report.to_json())


def read_report(model: onnx.ModelProto) -> RewriteReport | None:
    """The report stored in ``model`` by :func:`record_report`, None when the file has none.

    Raises:
        ValueError: The entry exists but is not a report.
    """
    text = next((entry.value for entry in model.metadata_props if entry.key == METADATA_KEY), None)
    return None if text is None else RewriteReport.from_json(text)
