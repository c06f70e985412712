"""``summary``: a table of every quantizer of a prepared/converted model and of the ops left float."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from torch import fx

from coreai_opt.error_boundary import public_api
from coreai_opt.graph.graph_meta import require_graph_meta
from coreai_opt.graph.node_meta import Role, get_meta, node_label
from coreai_opt.quantization.spec import FakeQuantize

__all__ = ["summary", "QuantizationSummary", "QuantizerRow", "FloatOpRow"]


@dataclass(frozen=True)
class QuantizerRow:
    """One quantizer module (called at one or more graph nodes).

    Attributes:
        consumers: The ops that read the quantized value (``"b"``, ``"blocks.0.attn.matmul_1"``, ``"output"``),
            so that a tensor whose readers asked for different specs shows one row per quantizer and reader.
    """

    module: str
    nodes: tuple[str, ...]
    consumers: tuple[str, ...]
    serves: str
    op_kind: str
    role: str
    spec: str
    qparams: str


@dataclass(frozen=True)
class FloatOpRow:
    """An op whose output (or weight/bias) stays float, and why."""

    node: str
    module: str
    op_kind: str
    reason: str


@dataclass(frozen=True)
class QuantizationSummary:
    """What ``prepare`` decided; ``str()`` renders both tables."""

    capture: str
    converted: bool
    quantizers: tuple[QuantizerRow, ...]
    float_ops: tuple[FloatOpRow, ...]

    @public_api
    def counts(self, role: str | None = None) -> dict[str, int]:
        """Number of quantizers per op kind (optionally only ``"weight"``, ``"activation"`` or ``"bias"``)."""
        return dict(Counter(r.op_kind for r in self.quantizers if role is None or r.role == role))

    def __str__(self) -> str:
        head = ("quantizer", "nodes", "consumers", "op kind", "role", "spec", "scale / zero point")
        rows = [(r.serves, ",".join(r.nodes), ",".join(r.consumers), r.op_kind, r.role, r.spec, r.qparams)
                for r in self.quantizers]
        lines = [f"coreai_opt summary (capture={self.capture}, converted={self.converted}): "
                 f"{len(self.quantizers)} quantizers, {len(self.float_ops)} float ops"]
        lines += _table(head, rows)
        if self.float_ops:
            lines += ["", "ops left float:"]
            lines += _table(("node", "module", "op kind", "reason"),
                            [(f.node, f.module, f.op_kind, f.reason) for f in self.float_ops])
        return "\n".join(lines)


def _table(head: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows, strict=False)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*head), fmt.format(*("-" * w for w in widths))] + [fmt.format(*r) for r in rows]


def _spec_text(module: object) -> str:
    if not isinstance(module, FakeQuantize):
        return "int32, scale = s_in * s_w (derived)"
    spec = module.spec
    g = spec.granularity
    gran = g.type_name + (f"(axis={g.axis}" + (f", block={g.block_size}" if g.block_size else "") + ")"
                          if hasattr(g, "axis") else "")
    fixed = f" range={tuple(spec.float_range)}" if spec.float_range else ""
    return f"{spec.dtype} {spec.qscheme.value} {gran} {spec.range_calculator}/{spec.qparams_calculator}{fixed}"


def _qparams_text(module: object) -> str:
    if not isinstance(module, FakeQuantize):
        return "derived"
    if not module.stateful:
        return "dynamic"
    if not module.has_qparams:
        return "not calibrated"
    s, zp, _ = module.get_qparams()
    if s.numel() == 1:
        return f"{float(s):.4g} / {int(zp) if zp is not None else '-'}"
    return f"{s.numel()} scales in [{float(s.min()):.3g}, {float(s.max()):.3g}]"


@public_api
def summary(model: fx.GraphModule) -> QuantizationSummary:
    """Describe the quantizers and float ops of a prepared or converted model.

    Raises:
        TypeError: ``model`` was not produced by ``prepare`` / ``convert``.
    """
    meta = require_graph_meta(model, "summary")
    by_module: dict[str, list[fx.Node]] = {}
    for node in model.graph.nodes:
        info = get_meta(node).quantizer
        if info is not None and node.op == "call_module":
            by_module.setdefault(info.module, []).append(node)
    position = {node: i for i, node in enumerate(model.graph.nodes)}
    rows = []
    for module_name, nodes in by_module.items():
        info = get_meta(nodes[0]).quantizer
        module = model.get_submodule(module_name)
        readers = sorted({u for n in nodes for u in n.users}, key=position.__getitem__)
        consumers = tuple(dict.fromkeys(node_label(u) for u in readers))
        rows.append(QuantizerRow(module_name, tuple(n.name for n in nodes), consumers, info.serves,
                                 info.op_kind.value, info.role.value, _spec_text(module), _qparams_text(module)))
    floats = []
    for node in model.graph.nodes:
        m = get_meta(node)
        quantized = any(get_meta(u).quantizer is not None and get_meta(u).quantizer.role is Role.ACTIVATION
                        for u in node.users)
        if m.float_reason and not quantized:
            floats.append(FloatOpRow(node.name, m.module_name or "", m.kind.value if m.kind else "?", m.float_reason))
    return QuantizationSummary(meta.capture, meta.converted, tuple(rows), tuple(floats))
