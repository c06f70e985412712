"""Per-layer quantization sensitivity: quantize one layer at a time and measure the model's output error.

For every weighted layer (linear / conv) of a calibrated prepared model, only that layer's quantizers (its
weight quantizer and the quantizer feeding its input) are switched on, every other quantizer off, and the
model output ``y`` is compared with the float output ``y⁰`` (all quantizers off) on the given batches::

    error = Σ_batches ‖y − y⁰‖² / Σ_batches ‖y⁰‖²          (relative squared error)

An input quantizer shared by several layers (Q/K/V read one LayerNorm output) is switched on with each of them,
so their errors include each other's input error; the report lists the quantizers every row used.

:func:`keep_sensitive` turns the report into a config: the ``k`` most sensitive layers keep float
activations and weights (``mode="float"``) or get uint16 activations (``mode="int16"``, static configs only).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import fx

from coreai_opt.api.internals.batches import as_call
from coreai_opt.api.internals.model_guard import exclusive_model
from coreai_opt.api.internals.quantizer_state import fake_quantizers
from coreai_opt.config.op_config import OpConfig
from coreai_opt.config.quantizer_config import QuantizerConfig
from coreai_opt.error_boundary import public_api
from coreai_opt.graph.graph_meta import require_graph_meta
from coreai_opt.graph.node_meta import get_meta
from coreai_opt.graph.op_kinds import WEIGHTED_KINDS, OpKind
from coreai_opt.quantization.spec import FakeQuantize, PerTensor, QuantizationScheme, QuantizationSpec

__all__ = ["LayerSensitivity", "SensitivityReport", "keep_sensitive", "layer_quantizers", "sensitivity"]


@dataclass(frozen=True)
class LayerSensitivity:
    """One row of the report.

    Attributes:
        layer: Qualified module name of the layer (``"bert.encoder.layer.0.output.dense"``).
        quantizers: Names of the quantizer modules switched on for it.
        error: Relative squared output error with only this layer quantized.
    """

    layer: str
    quantizers: tuple[str, ...]
    error: float


@dataclass(frozen=True)
class SensitivityReport:
    """Per-layer errors, most sensitive first, plus the error with every quantizer on."""

    rows: tuple[LayerSensitivity, ...]
    all_quantized_error: float

    @public_api
    def most_sensitive(self, k: int) -> list[str]:
        """Names of the ``k`` layers with the largest error."""
        return [r.layer for r in self.rows[:k]]

    @public_api
    def table(self) -> str:
        """Markdown table: rank, layer, relative squared error."""
        lines = ["| rank | layer | rel. squared error |", "|---:|---|---:|"]
        lines += [f"| {i} | `{r.layer}` | {r.error:.3e} |" for i, r in enumerate(self.rows, 1)]
        lines.append(f"| | all layers quantized | {self.all_quantized_error:.3e} |")
        return "\n".join(lines)

    @public_api
    def plot(self, path: str | Path) -> Path:
        """Save a horizontal bar chart of the errors (log scale) to ``path`` (PNG/SVG by suffix)."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        path = Path(path)
        rows = list(reversed(self.rows))
        fig, ax = plt.subplots(figsize=(8, max(2.5, 0.22 * len(rows) + 1)))
        ax.barh([r.layer for r in rows], [max(r.error, 1e-12) for r in rows], color="tab:blue")
        ax.axvline(self.all_quantized_error, color="tab:red", linestyle="--", label="all layers quantized")
        ax.set_xscale("log")
        ax.set_xlabel("relative squared output error (only this layer quantized)")
        ax.tick_params(axis="y", labelsize=6)
        ax.legend(loc="lower right", fontsize=7)
        fig.tight_layout()
        fig.savefig(path, dpi=120)
        plt.close(fig)
        return path


@public_api
def layer_quantizers(prepared: fx.GraphModule) -> dict[str, tuple[str, ...]]:
    """Map each quantized weighted layer's module name to its quantizer module names (weight, input).

    Raises:
        TypeError: ``prepared`` was not produced by ``prepare``.
    """
    require_graph_meta(prepared, "sensitivity")
    layers: dict[str, list[str]] = {}
    for node in prepared.graph.nodes:
        meta = get_meta(node)
        if meta.kind not in WEIGHTED_KINDS or meta.kind is OpKind.EMBEDDING or not meta.module_name:
            continue
        names = []
        for arg in node.args[:2]:
            if isinstance(arg, fx.Node) and arg.op == "call_module" and get_meta(arg).kind is OpKind.QUANTIZE:
                names.append(str(arg.target))
        if names:
            layers.setdefault(meta.module_name, [])
            layers[meta.module_name] += [n for n in names if n not in layers[meta.module_name]]
    return {k: tuple(v) for k, v in layers.items()}


def _outputs(model: fx.GraphModule, batches: Sequence[Any]) -> list[torch.Tensor]:
    outs = []
    with torch.no_grad():
        for batch in batches:
            args, kwargs = as_call(batch)
            leaves = torch.utils._pytree.tree_leaves(model(*args, **kwargs))
            outs.append(torch.cat([t.detach().float().flatten() for t in leaves if isinstance(t, torch.Tensor)]))
    return outs


def _relative_error(outs: list[torch.Tensor], refs: list[torch.Tensor]) -> float:
    num = sum(float(((o - r) ** 2).sum()) for o, r in zip(outs, refs, strict=True))
    den = sum(float((r**2).sum()) for r in refs)
    return num / max(den, 1e-30)


def _set_enabled(quantizers: dict[str, FakeQuantize], on: Iterable[str]) -> None:
    on = set(on)
    for name, fq in quantizers.items():
        fq.enable_fake_quant(name in on)


@public_api
def sensitivity(prepared: fx.GraphModule, data: Iterable[Any], *, layers: Sequence[str] | None = None
                ) -> SensitivityReport:
    """Quantize one layer at a time and measure the relative squared output error (module docstring).

    Args:
        prepared: A calibrated model from ``prepare`` + ``calibrate`` (static quantizers need qparams; dynamic
            ones need none).
        data: Batches as for ``calibrate`` (a few are enough; they are run ``len(layers) + 2`` times).
        layers: Restrict to these layer names (default: every quantized weighted layer).

    Returns:
        The :class:`SensitivityReport`, most sensitive layer first. The model's quantizer flags are restored.

    Raises:
        TypeError: ``prepared`` was not produced by ``prepare``.
        ValueError: no batches, or a requested layer is not a quantized weighted layer (valid names listed).
    """
    batches = list(data)
    if not batches:
        raise ValueError("sensitivity needs at least one batch of data")
    groups = layer_quantizers(prepared)
    if layers is not None:
        unknown = [name for name in layers if name not in groups]
        if unknown:
            raise ValueError(f"layers {unknown} are not quantized weighted layers; valid names: {sorted(groups)}")
        groups = {name: groups[name] for name in layers}
    with exclusive_model(prepared, "sensitivity"):
        quantizers = {name: fq for name, fq in fake_quantizers(prepared)}
        saved = {name: (bool(fq.observer_enabled), bool(fq.fake_quant_enabled)) for name, fq in quantizers.items()}
        was_training = prepared.training
        prepared.eval()
        try:
            for fq in quantizers.values():
                fq.enable_observer(False)
            _set_enabled(quantizers, ())
            reference = _outputs(prepared, batches)
            _set_enabled(quantizers, quantizers)
            all_error = _relative_error(_outputs(prepared, batches), reference)
            rows = []
            for layer, names in groups.items():
                _set_enabled(quantizers, names)
                rows.append(LayerSensitivity(layer, names, _relative_error(_outputs(prepared, batches), reference)))
        finally:
            for name, fq in quantizers.items():
                fq.enable_observer(saved[name][0])
                fq.enable_fake_quant(saved[name][1])
            prepared.train(was_training)
    rows.sort(key=lambda r: r.error, reverse=True)
    return SensitivityReport(tuple(rows), all_error)


@public_api
def keep_sensitive(config: QuantizerConfig, report: SensitivityReport, k: int, mode: str = "float"
                   ) -> QuantizerConfig:
    """Return a copy of ``config`` in which the ``k`` most sensitive layers are kept at higher precision.

    Args:
        config: The config the report was measured with.
        report: From :func:`sensitivity`.
        k: How many layers (0 returns an unchanged copy).
        mode: ``"float"`` (weights and activations float for those layers) or ``"int16"`` (uint16 asymmetric
            per-tensor static activations, minmax; weights unchanged).

    Raises:
        ValueError: ``k`` negative or ``mode`` unknown.
    """
    if not isinstance(k, int) or k < 0:
        raise ValueError(f"k must be a non-negative int, got {k!r}")
    if mode not in ("float", "int16"):
        raise ValueError(f"mode must be 'float' or 'int16', got {mode!r}")
    out = config.model_copy(deep=True)
    for layer in report.most_sensitive(k):
        if mode == "float":
            out.set_module_name(re.escape(layer), None)
        else:
            spec = QuantizationSpec(dtype="uint16", qscheme=QuantizationScheme.ASYMMETRIC, granularity=PerTensor(),
                                    range_calculator="minmax", qparams_calculator="global_minmax")
            out.set_module_name(re.escape(layer), OpConfig(activation=spec))
    return out
