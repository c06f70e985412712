"""The rewrite rules torch's exporter runs on our graphs: its optimizer's defaults, less one that is quadratic.

``torch.onnx.export`` ends with onnxscript's optimizer (constant folding, then ``onnxscript.rewriter``'s 46
default pattern rules, twice). One of them, ``SlicesSplit`` (two ``Slice`` nodes of one tensor along its last
axis, ``[0, a)`` and ``[a, b)``, become one ``Split``), has a two-output pattern: the matcher pairs the ``Slice``
readers of every value, so its cost grows with the square of the readers. A quantized graph has many: the shape
arithmetic of each quantized reshape slices the same ``Shape`` values. On timm's CoaT-Tiny (7,463 nodes after
folding) that one rule took 51 s of the optimizer's rewrite pass, and the export took 5.1x torch's float export
of the same model (360 s against 70 s in the sweep); without it, 114 s.

And it rewrites nothing: its pattern is a four-input ``Slice`` (no ``steps``), and torch writes every ``Slice``
with its ``steps`` input. :func:`without_quadratic_rewrites` leaves the rule out of the optimizer's defaults for
the duration of an export (and puts it back); the file is the same node for node
(``tests/onnx/test_exporter_optimizer.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

__all__ = ["QUADRATIC_REWRITES", "without_quadratic_rewrites"]

#: Names of onnxscript's default rewrite rules left out of our exports (module docstring).
QUADRATIC_REWRITES = frozenset({"SlicesSplit"})


@contextlib.contextmanager
def without_quadratic_rewrites() -> Iterator[tuple[str, ...]]:
    """Run the block with onnxscript's default rewrite rules less :data:`QUADRATIC_REWRITES`.

    Yields:
        The names of the rules left out (empty when onnxscript no longer has them).
    """
    from onnxscript import rewriter

    defaults = rewriter._DEFAULT_REWRITE_RULES  # noqa: SLF001 (read by optimize_ir at call time)
    kept = tuple(rule for rule in defaults if getattr(rule, "name", None) not in QUADRATIC_REWRITES)
    rewriter._DEFAULT_REWRITE_RULES = kept  # noqa: SLF001
    try:
        yield tuple(sorted({str(rule.name) for rule in defaults} - {str(rule.name) for rule in kept}))
    finally:
        rewriter._DEFAULT_REWRITE_RULES = defaults  # noqa: SLF001
