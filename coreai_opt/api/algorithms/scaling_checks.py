"""What SmoothQuant and AWQ share: a token sample per site, the check that scaling kept the float model, the table.

Both rewrite ``X @ W^T`` as ``(X / s) @ (s * W)^T``, which is exact in real arithmetic; the check after the
rewrite catches a site that was wrongly judged foldable (the float model would change, silently).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Generic, TypeVar

from torch import Tensor, fx

from coreai_opt.error_boundary import public_api
from coreai_opt.passes.smooth_linear_inputs import SmoothingSite

__all__ = ["ScaledModel", "keep_token_rows", "check_float_outputs_kept", "site_cells", "sites_table"]

SiteReportT = TypeVar("SiteReportT")


def site_cells(site: SmoothingSite, alpha: float | None) -> list[str]:
    """The first cells of a site's row: the linears it feeds (``input of``), its kind and ``α`` (``—``: unscaled)."""
    consumers = ", ".join(c.removesuffix(".weight") for c in site.consumers)
    return [f"`{consumers}`", site.kind, "—" if alpha is None else f"{alpha:g}"]


def sites_table(columns: Sequence[str], rows: Iterable[Sequence[str]]) -> str:
    """A markdown table of per-site rows, the ``α`` column right-aligned."""
    rule = ["---:" if column == "α" else "---" for column in columns]
    lines = ["| " + " | ".join(columns) + " |", "|" + "|".join(rule) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


@dataclass(frozen=True)
class ScaledModel(Generic[SiteReportT]):
    """A scaled float model (a captured GraphModule) and one report per site.

    Subclasses name their table's ``columns`` and render one report as a row (:meth:`_row`).
    """

    model: fx.GraphModule
    sites: tuple[SiteReportT, ...]

    columns: ClassVar[tuple[str, ...]] = ()

    def _row(self, report: SiteReportT) -> list[str]:
        raise NotImplementedError(f"{type(self).__name__} must define _row")

    @public_api
    def table(self) -> str:
        """Markdown table of the sites, one row per site report."""
        return sites_table(self.columns, (self._row(report) for report in self.sites))


def keep_token_rows(samples: dict[str, list[Tensor]], name: str, rows: Tensor, max_tokens: int) -> None:
    """Append the first rows of ``rows`` (``[tokens, channels]``) to ``samples[name]``, up to ``max_tokens`` in all."""
    kept = sum(t.shape[0] for t in samples.get(name, []))
    if kept < max_tokens:
        samples.setdefault(name, []).append(rows[: max_tokens - kept].clone())


def check_float_outputs_kept(reference: Sequence[Any], scaled: Sequence[Any], rtol: float, *, change: str,
                             workaround: str) -> None:
    """Raise when a float output moved by more than ``rtol`` of its range: ``max|a - b| > rtol · max(max|a|, 1e-12)``.

    Args:
        reference: The output leaves of the model before scaling.
        scaled: The output leaves after scaling, in the same order.
        rtol: Allowed max difference relative to the reference's largest magnitude.
        change: What was applied, for the message (e.g. ``"smoothing"``).
        workaround: How the user avoids the misclassified site, for the message.

    Raises:
        RuntimeError: an output moved by more than the bound.
    """
    for before, after in zip(reference, scaled, strict=True):
        if isinstance(before, Tensor) and before.is_floating_point():
            diff = float((before - after).abs().max())
            bound = rtol * max(float(before.abs().max()), 1e-12)
            if diff > bound:
                raise RuntimeError(
                    f"{change} changed the float output by {diff:.3g} (allowed {bound:.3g}); a site was "
                    f"misclassified as foldable. Report the model; as a workaround {workaround}"
                )
