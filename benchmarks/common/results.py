"""Result containers every benchmark section returns; ``report.py`` turns them into RESULTS.md."""

from __future__ import annotations

import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TypeVar

T = TypeVar("T")


@dataclass
class Table:
    """One markdown table with a caption."""

    caption: str
    headers: list[str]
    rows: list[list[str]] = field(default_factory=list)

    def add(self, *cells: object) -> None:
        """Append a row; every cell is converted with ``str``."""
        self.rows.append([str(c) for c in cells])


@dataclass
class SectionResult:
    """Everything one section measured: tables, notes, losses of ours (computed from the numbers) and errors."""

    key: str
    title: str
    tables: list[Table] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    losses: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0
    body: str = ""  # extra markdown rendered after the tables (sections that build their own tables)


@dataclass(frozen=True)
class Outcome:
    """The value of an attempted measurement, or the error that prevented it."""

    value: object | None
    error: str | None

    @property
    def ok(self) -> bool:
        """Whether the measurement succeeded."""
        return self.error is None


def attempt(fn: Callable[[], T], section: SectionResult | None = None, what: str = "") -> Outcome:
    """Run ``fn``; on failure record ``what: error`` in ``section.errors`` instead of aborting the section."""
    try:
        return Outcome(fn(), None)
    except Exception as exc:  # noqa: BLE001 - a failing row must not abort the benchmark run
        lines = [line.strip() for line in str(exc).splitlines()]
        text = " ".join(line for line in lines if line and "errors.pydantic" not in line)
        message = f"{type(exc).__name__}: {text[:400]}"
        if section is not None:
            section.errors.append(f"{what}: {message}" if what else message)
            last = traceback.extract_tb(exc.__traceback__)[-1]
            section.errors[-1] += f" (at {last.filename.split('/')[-1]}:{last.lineno})"
        return Outcome(None, message)


def fmt_pct(x: float | None) -> str:
    """Accuracy as a percentage with two decimals, or ``n/a``."""
    return "n/a" if x is None else f"{100 * x:.2f}"


def fmt_ms(x: float | None) -> str:
    """Milliseconds with adaptive precision, or ``n/a``."""
    if x is None:
        return "n/a"
    return f"{x:.2f}" if x < 10 else f"{x:.1f}"


def fmt_ratio(x: float | None) -> str:
    """A ratio such as ``0.93×``, or ``n/a``."""
    return "n/a" if x is None else f"{x:.2f}×"
