r"""Quantizer pairs onnxruntime merges: ``Q_A → DQ_A → Q_B → DQ_B`` that ``DoubleQDQPairsRemover`` rounds once.

``verify_onnx`` compares codes on an instrumented copy of the file that reads every quantizer's output, and
onnxruntime leaves a pair whose ``Q`` is a graph output alone; the file itself runs merged. The remover replaces
the two pairs by ``Q_A → DQ_B`` with the intersection of their ranges (float32, as onnxruntime computes it):

.. math::

    lo = \max((q_{min} - z_A) s_A, (q_{min} - z_B) s_B),\quad
    hi = \min((q_{max} - z_A) s_A, (q_{max} - z_B) s_B),\quad
    s = \frac{hi - lo}{q_{max} - q_{min}},\quad z = \mathrm{round}(q_{min} - lo / s).

The merge keeps the file's numbers only where it is the identity: the two pairs share scale and zero point, or
``Q_A`` re-quantizes its own grid (its input a ``DequantizeLinear`` with ``A``'s parameters, through value moves)
and ``(s, z)`` is ``B``'s; scales count as equal within :data:`SCALE_ULPS` float32 steps. Every other such pair
is a place where onnxruntime rounds differently from the file and from eager, by up to a step, which the code
comparison cannot see: :func:`merged_pairs` lists them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx

from coreai_opt.onnx.rewrite.graph import OnnxGraph

__all__ = ["SCALE_ULPS", "MergedPair", "merged_pairs"]

#: Scales this many float32 steps apart are one grid: a code moves only where a value lies within
#: ``255 · 4 · 2⁻²⁴`` of a rounding tie, less than the kernels' own tie flips.
SCALE_ULPS = 4

# ops that hand on their input's values (and so its grid) unchanged
_VALUE_MOVES = frozenset({"Reshape", "Transpose", "Squeeze", "Unsqueeze", "Flatten", "Split", "Slice", "Identity",
                          "MaxPool", "Gather"})


@dataclass(frozen=True)
class MergedPair:
    """One pair onnxruntime merges into a rounding the file does not say.

    Attributes:
        tensor: Output of ``Q_B`` (the second quantizer), the boundary the pair is reported at.
        file_scale: ``B``'s scale in the file.
        file_zero_point: ``B``'s zero point in the file.
        scale: The merged scale onnxruntime computes.
        zero_point: The merged zero point.
        requantizes_own_grid: ``Q_A``'s input already lies on ``A``'s grid (a repeat of a quantizer after moves).
    """

    tensor: str
    file_scale: float
    file_zero_point: int
    scale: float
    zero_point: int
    requantizes_own_grid: bool


def _qparams(node: onnx.NodeProto, graph: OnnxGraph) -> tuple[np.float32, int, np.dtype] | None:
    """Scalar constant (scale, zero point, integer dtype) of a Q / DQ node, else None."""
    if len(node.input) < 3:
        return None
    scale, zero = graph.constant(node.input[1]), graph.constant(node.input[2])
    if scale is None or zero is None or scale.size != 1 or zero.size != 1 or scale.dtype != np.float32 \
            or not np.issubdtype(zero.dtype, np.integer):
        return None
    return np.float32(scale.item()), int(zero.item()), zero.dtype


def _merge(a: tuple[np.float32, int, np.dtype], b: tuple[np.float32, int, np.dtype]) -> tuple[np.float32, int]:
    """The (scale, zero point) onnxruntime gives the pairs ``a`` then ``b`` when it merges them (module docstring)."""
    info = np.iinfo(a[2])
    qmin, qmax = np.float32(info.min), np.float32(info.max)
    lo = max(np.float32(qmin - a[1]) * a[0], np.float32(qmin - b[1]) * b[0])
    hi = min(np.float32(qmax - a[1]) * a[0], np.float32(qmax - b[1]) * b[0])
    scale = np.float32((hi - lo) / np.float32(qmax - qmin))
    shifted = float(np.float32(qmin - lo / scale))
    return scale, int(math.copysign(math.floor(abs(shifted) + 0.5), shifted))  # std::round: half away from zero


def merged_pairs(model: onnx.ModelProto) -> list[MergedPair]:
    """Every ``Q_A → DQ_A → Q_B → DQ_B`` onnxruntime merges into a rounding other than the file's (module docstring).

    The conditions are onnxruntime's: ``Q_A`` and ``DQ_A`` each read by one node and not graph outputs, ``Q_B``
    not a graph output and read only by ``DequantizeLinear`` nodes with its parameters, all scalar constants of
    one integer type.
    """
    graph = OnnxGraph(model)
    found = []
    for q_b in graph.nodes:
        if q_b.op_type != "QuantizeLinear" or q_b.output[0] in graph.outputs:
            continue
        dq_a = graph.producer(q_b.input[0])
        q_a = graph.producer(dq_a.input[0]) if dq_a is not None and dq_a.op_type == "DequantizeLinear" else None
        if q_a is None or q_a.op_type != "QuantizeLinear" or graph.only_reader(dq_a.output[0]) is None \
                or graph.only_reader(q_a.output[0]) is None:
            continue
        a, a_dq, b = _qparams(q_a, graph), _qparams(dq_a, graph), _qparams(q_b, graph)
        b_readers = graph.readers(q_b.output[0])
        if a is None or b is None or a != a_dq or a[2] != b[2] or not b_readers \
                or any(r.op_type != "DequantizeLinear" or _qparams(r, graph) != b for r in b_readers):
            continue
        if _same_grid(a[:2], b[:2]):
            continue  # the same grid twice: the merge is the identity
        scale, zero_point = _merge(a, b)
        own_grid = _on_grid(q_a.input[0], a, graph)
        if own_grid and _same_grid((scale, zero_point), b[:2]):
            continue
        found.append(MergedPair(q_b.output[0], float(b[0]), b[1], float(scale), zero_point, own_grid))
    return found


def _same_grid(a: tuple[np.float32, int], b: tuple[np.float32, int]) -> bool:
    """Equal zero points and scales within :data:`SCALE_ULPS` float32 steps of each other.

    The merge's own float32 arithmetic rounds: hf Zamba's repeat of one quantizer merges to 7.5028445e-05 for the
    file's 7.5028438e-05, one step.
    """
    return a[1] == b[1] and abs(float(a[0]) - float(b[0])) <= SCALE_ULPS * float(np.spacing(np.float32(b[0])))


def _on_grid(tensor: str, qparams: tuple[np.float32, int, np.dtype], graph: OnnxGraph) -> bool:
    """True when ``tensor`` is, through value moves, the output of a ``DequantizeLinear`` with ``qparams``."""
    node = graph.producer(tensor)
    while node is not None and node.op_type in _VALUE_MOVES:
        node = graph.producer(node.input[0])
    return node is not None and node.op_type == "DequantizeLinear" and _qparams(node, graph) == qparams
