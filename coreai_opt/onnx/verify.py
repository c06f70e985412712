"""``verify_onnx``: run the exported file in onnxruntime and the converted model in eager on the same inputs.

Tolerances behind :attr:`VerificationReport.ok` (whole model; single quantize-dequantize ops are bit-exact, which
the tests check separately):

* an output produced by a ``DequantizeLinear`` (a quantized output) may differ by at most
  :data:`MAX_OUTPUT_STEPS` of its quantization step (the scale of that ``DequantizeLinear``): float convolutions
  in onnxruntime (MLAS) and torch (oneDNN) accumulate in different orders, which flips a few rounding ties, and a
  flip propagates by one step per quantizer. The step used for this check is at least an 8-bit step of the
  output's range (``range / 255``): accumulation-order noise is the same whatever the output dtype, so a 16-bit
  output is judged at 8-bit resolution (``max_diff_steps`` still reports its own steps);
* a float output may differ by at most :data:`FLOAT_RELATIVE_TOLERANCE` of its reference range
  ``max(ref) - min(ref)`` (plus :data:`FLOAT_ABSOLUTE_TOLERANCE` for constant outputs);
* a classifier-shaped output (2-D ``[N, C]`` with ``C > 1``) must agree on every row's argmax, except rows
  whose eager top-2 margin is within twice the output tolerance above (a near tie: both logits may move by the
  tolerated difference, so either answer is consistent with it). Such flips are counted in
  ``argmax_flips_within_tolerance``; ``argmax_agreement`` always reports the raw fraction over all rows.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch
from torch import nn

from coreai_opt.onnx.fusion_report import FusionReport, fusion_report
from coreai_opt.onnx.rewrite.graph import OnnxGraph
from coreai_opt.onnx.rewrite.qdq import QdqView

__all__ = [
    "VerificationReport",
    "OutputComparison",
    "verify_onnx",
    "MAX_OUTPUT_STEPS",
    "FLOAT_RELATIVE_TOLERANCE",
    "FLOAT_ABSOLUTE_TOLERANCE",
]

#: Largest accepted difference of a quantized output, in quantization steps.
MAX_OUTPUT_STEPS = 3.0
#: Largest accepted difference of a float output, as a fraction of the reference output's range.
FLOAT_RELATIVE_TOLERANCE = 0.02
#: Absolute slack added to the float tolerance (covers constant outputs, whose range is 0).
FLOAT_ABSOLUTE_TOLERANCE = 1e-6

# Dequantized values are float32 products (q - z) * s, so an exact k-step difference measures k * (1 ± 2^-23).
_STEP_ROUNDING = 1e-3
# Quantized outputs are judged at no finer than 8-bit resolution of their range.
_EIGHT_BIT_LEVELS = 255.0

# Ops that move values without changing them: a DequantizeLinear seen through them still defines the step.
_VALUE_PRESERVING = frozenset({"Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose"})


@dataclass(frozen=True)
class OutputComparison:
    """Eager vs onnxruntime for one graph output, over all batches.

    Attributes:
        name: ONNX output name.
        shape: Shape of the output of the first batch.
        max_abs_diff: Largest ``|onnxruntime - eager|``.
        step: Per-tensor quantization step of the output (None for a float or per-channel-quantized output).
        max_diff_steps: Largest difference divided by the (per-element) step, None for float outputs.
        reference_range: ``max(eager) - min(eager)``.
        argmax_agreement: Fraction of rows whose argmax agrees (2-D ``[N, C>1]`` outputs), else None.
        argmax_flips_within_tolerance: Rows whose argmax differs but whose eager top-2 margin is within twice
            the output tolerance (near ties), else 0.
        ok: Within the module's tolerances.
    """

    name: str
    shape: tuple[int, ...]
    max_abs_diff: float
    step: float | None
    max_diff_steps: float | None
    reference_range: float
    argmax_agreement: float | None
    argmax_flips_within_tolerance: int
    ok: bool


@dataclass(frozen=True)
class VerificationReport:
    """Result of :func:`verify_onnx`; ``str(report)`` is a table.

    Attributes:
        path: The ONNX file.
        num_batches: Batches compared.
        num_samples: Samples compared (sum of batch sizes of the first input).
        outputs: One :class:`OutputComparison` per graph output.
        fusion: onnxruntime's fusion report for the file.
    """

    path: Path
    num_batches: int
    num_samples: int
    outputs: tuple[OutputComparison, ...]
    fusion: FusionReport

    @property
    def max_abs_diff(self) -> float:
        """Largest absolute difference over all outputs."""
        return max(o.max_abs_diff for o in self.outputs)

    @property
    def argmax_agreement(self) -> float | None:
        """Lowest argmax agreement over the classifier-shaped outputs (None if there are none)."""
        values = [o.argmax_agreement for o in self.outputs if o.argmax_agreement is not None]
        return min(values) if values else None

    @property
    def bit_exact(self) -> bool:
        """True when every output matched exactly."""
        return self.max_abs_diff == 0.0

    @property
    def ok(self) -> bool:
        """True when every output is within the documented tolerances."""
        return all(o.ok for o in self.outputs)

    def __str__(self) -> str:
        header = ("output", "shape", "max |diff|", "steps", "argmax agree", "ok")
        rows = [header]
        for o in self.outputs:
            steps = "-" if o.max_diff_steps is None else f"{o.max_diff_steps:.2f}"
            agree = "-" if o.argmax_agreement is None else f"{100 * o.argmax_agreement:.1f}%"
            if o.argmax_flips_within_tolerance:
                agree += f" ({o.argmax_flips_within_tolerance} near-tie flip(s))"
            rows.append((o.name, "x".join(map(str, o.shape)), f"{o.max_abs_diff:.3g}", steps, agree, str(o.ok)))
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        title = f"ONNX verification of {self.path.name}: {self.num_batches} batch(es), {self.num_samples} sample(s)"
        lines = [f"{title}, ok={self.ok}"]
        lines += ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
        return "\n".join(lines) + "\n" + str(self.fusion)


def _batches(inputs: object) -> list[tuple[torch.Tensor, ...]]:
    """A tensor or a tuple of tensors is one batch; any other iterable yields batches (tensors or tuples)."""
    if isinstance(inputs, torch.Tensor) or (
        isinstance(inputs, tuple) and inputs and all(isinstance(t, torch.Tensor) for t in inputs)
    ):
        return [inputs if isinstance(inputs, tuple) else (inputs,)]
    if not isinstance(inputs, Iterable) or isinstance(inputs, (str, bytes)):
        raise TypeError(
            f"inputs must be a tensor, a tuple of tensors or an iterable of batches, got {type(inputs).__name__}"
        )
    batches = []
    for i, batch in enumerate(inputs):
        if isinstance(batch, torch.Tensor):
            batch = (batch,)
        if not isinstance(batch, (tuple, list)) or not batch or not all(isinstance(t, torch.Tensor) for t in batch):
            raise TypeError(f"batch {i} must be a tensor or a tuple of tensors, got {type(batch).__name__}")
        batches.append(tuple(batch))
    if not batches:
        raise ValueError("inputs yielded no batches; pass at least one input tensor")
    return batches


def _output_steps(model: onnx.ModelProto) -> dict[str, tuple[np.ndarray, int]]:
    """(scale, axis) of the DequantizeLinear producing each graph output, seen through value-preserving ops.

    A per-channel scale is only used when the DequantizeLinear produces the output directly (a reshape would
    move its axis).
    """
    graph = OnnxGraph(model)
    steps: dict[str, tuple[np.ndarray, int]] = {}
    for output in model.graph.output:
        node, moved = graph.producer(output.name), False
        while node is not None and node.op_type in _VALUE_PRESERVING:
            node, moved = graph.producer(node.input[0]), True
        view = QdqView.of(node, graph)
        if view is None or not view.is_dequantize or view.scale is None:
            continue
        scale = view.scale.astype(np.float64)
        if scale.size == 1 or not moved:
            steps[output.name] = (scale, view.axis)
    return steps


def _broadcast_step(step: np.ndarray, axis: int, reference: np.ndarray) -> np.ndarray:
    if step.size == 1:
        return step.reshape(())
    shape = [1] * reference.ndim
    shape[axis % reference.ndim] = -1
    return step.reshape(shape)


def _run_eager(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> list[np.ndarray]:
    with torch.no_grad():
        outputs = model(*batch)
    return [t.detach().cpu().numpy() for t in torch.utils._pytree.tree_leaves(outputs)]


def _compare(name: str, refs: list[np.ndarray], gots: list[np.ndarray],
             step: tuple[np.ndarray, int] | None) -> OutputComparison:
    for ref, got in zip(refs, gots, strict=True):
        if ref.shape != got.shape:
            raise ValueError(f"output {name!r}: onnxruntime shape {got.shape} differs from eager shape {ref.shape}")
    diffs = [np.abs(got.astype(np.float64) - ref.astype(np.float64)) for ref, got in zip(refs, gots, strict=True)]
    nonempty = [(ref, diff) for ref, diff in zip(refs, diffs, strict=True) if ref.size]
    max_diff = max((float(diff.max()) for _, diff in nonempty), default=0.0)
    lo = min((float(ref.min()) for ref, _ in nonempty), default=0.0)
    ref_range = max((float(ref.max()) for ref, _ in nonempty), default=0.0) - lo
    max_steps = judged_steps = None
    if step is not None:
        own = [diff / _broadcast_step(*step, ref) for ref, diff in nonempty]
        coarsest = ref_range / _EIGHT_BIT_LEVELS
        floored = [diff / np.maximum(_broadcast_step(*step, ref), coarsest) for ref, diff in nonempty]
        max_steps = max((float(d.max()) for d in own), default=0.0)
        judged_steps = max((float(d.max()) for d in floored), default=0.0)
        ok = judged_steps <= MAX_OUTPUT_STEPS + _STEP_ROUNDING
        tolerance = (MAX_OUTPUT_STEPS + _STEP_ROUNDING) * max(float(step[0].max()), coarsest)
    else:
        tolerance = FLOAT_RELATIVE_TOLERANCE * ref_range + FLOAT_ABSOLUTE_TOLERANCE
        ok = max_diff <= tolerance
    agreement, near_tie_flips = None, 0
    if refs[0].ndim == 2 and refs[0].shape[1] > 1:  # classifier-shaped [N, C]
        rows = sum(ref.shape[0] for ref in refs)
        flips = [ref.argmax(1) != got.argmax(1) for ref, got in zip(refs, gots, strict=True)]
        agreement = 1.0 - sum(int(f.sum()) for f in flips) / rows if rows else None
        margins = [np.diff(np.sort(ref, axis=1)[:, -2:], axis=1)[:, 0] for ref in refs]  # eager top-1 minus top-2
        near_tie_flips = sum(int((f & (m <= 2 * tolerance)).sum()) for f, m in zip(flips, margins, strict=True))
        decisive_flips = sum(int(f.sum()) for f in flips) - near_tie_flips
        ok = ok and decisive_flips == 0
    step_value = float(step[0].reshape(-1)[0]) if step is not None and step[0].size == 1 else None
    return OutputComparison(
        name, tuple(refs[0].shape), max_diff, step_value, max_steps, ref_range, agreement, near_tie_flips, ok
    )


def verify_onnx(
    model: nn.Module,
    path: str | os.PathLike[str],
    inputs: torch.Tensor | tuple[torch.Tensor, ...] | Iterable[torch.Tensor | Sequence[torch.Tensor]],
    *,
    providers: Sequence[str] = ("CPUExecutionProvider",),
) -> VerificationReport:
    """Compare onnxruntime on ``path`` with the eager ``model`` on the same inputs.

    Args:
        model: The converted model that was exported (run in eager, in ``torch.no_grad``).
        path: The ONNX file written by :func:`coreai_opt.onnx.export_onnx`.
        inputs: One batch (a tensor, or a tuple of tensors with one per model input) or an iterable of batches
            (a list, a generator, a DataLoader yielding tensors or tuples of tensors).
        providers: onnxruntime execution providers.

    Returns:
        A :class:`VerificationReport`: per-output max abs diff, diff in output quantization steps, argmax
        agreement for ``[N, C]`` outputs, ``ok`` against the module's tolerances, and the fusion report.

    Raises:
        FileNotFoundError: No file at ``path``.
        TypeError / ValueError: Inputs of the wrong kind or count, or output shapes that disagree.
    """
    import onnxruntime as ort

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"verify_onnx: no ONNX file at {path}; pass the path export_onnx returned")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be the converted torch.nn.Module that was exported, got {type(model).__name__}")
    batches = _batches(inputs)
    session = ort.InferenceSession(str(path), providers=list(providers))
    input_names = [i.name for i in session.get_inputs()]
    output_names = [o.name for o in session.get_outputs()]
    refs: list[list[np.ndarray]] = [[] for _ in output_names]
    gots: list[list[np.ndarray]] = [[] for _ in output_names]
    for i, batch in enumerate(batches):
        if len(batch) != len(input_names):
            raise ValueError(f"batch {i} has {len(batch)} tensor(s) but the ONNX model takes {len(input_names)} "
                             f"({input_names})")
        eager = _run_eager(model, batch)
        feed = {name: t.detach().cpu().numpy() for name, t in zip(input_names, batch, strict=True)}
        onnx_out = session.run(output_names, feed)
        if len(eager) != len(onnx_out):
            raise ValueError(f"the eager model returned {len(eager)} output(s), the ONNX model {len(onnx_out)}")
        for k, (ref, got) in enumerate(zip(eager, onnx_out, strict=True)):
            refs[k].append(ref)
            gots[k].append(got)
    proto = onnx.load(str(path), load_external_data=False)
    steps = _output_steps(proto)
    outputs = tuple(
        _compare(name, refs[k], gots[k], steps.get(name)) for k, name in enumerate(output_names)
    )
    num_samples = sum(int(b[0].shape[0]) if b[0].dim() else 1 for b in batches)
    return VerificationReport(path, len(batches), num_samples, outputs, fusion_report(path))
