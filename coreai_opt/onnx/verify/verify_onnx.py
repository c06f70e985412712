"""``verify_onnx``: run the exported file in onnxruntime (or OpenVINO) and the converted model in eager, same inputs.

Tolerances behind :attr:`VerificationReport.ok` are derived per output from the kernels onnxruntime actually runs
(:mod:`coreai_opt.onnx.verify.tolerance`, table :mod:`coreai_opt.onnx.verify.ort_kernels`); each output's rule and
reason are in
its :class:`OutputComparison` and in ``str(report)``:

* a quantized output (produced by a ``DequantizeLinear``) is judged in its own steps (its scale; per-channel
  scales per element; float8 the grid spacing at the value): 0 steps when every op from the quantizers feeding it
  is exact, else one step per quantizer stage after float accumulation or an integer kernel's requantisation;
* a float output with no activation quantizer on its path (weight-only models) at float precision,
  :data:`~coreai_opt.onnx.verify.tolerance.FLOAT_PRECISION` of its reference range ``max(ref) - min(ref)`` (plus
  :data:`FLOAT_ABSOLUTE_TOLERANCE`);
* a classifier-shaped output (2-D ``[N, C]`` with ``C > 1``) must agree on every row's argmax, except rows
  whose eager top-2 margin is within twice the output tolerance above (a near tie: both logits may move by the
  tolerated difference, so either answer is consistent with it). Such flips are counted in
  ``argmax_flips_within_tolerance``; ``argmax_agreement`` always reports the raw fraction over all rows.

Inside the graph, every activation quantizer is judged on the first batch
(:mod:`coreai_opt.onnx.verify.quantizer_codes`): the file's scale and zero point must equal eager's, and the codes
onnxruntime computes must differ from eager's only as rounding does (sparse ±1 flips at ties, as many up as down,
no more than the kernels before the quantizer and the differences it inherits explain). Where onnxruntime runs
``QLinearConv`` / ``QGemm`` / ``QLinearMatMul``, the eager reference computes that layer with the kernel's integer
arithmetic (:mod:`coreai_opt.onnx.verify.integer_reference`), so those codes must be identical (rule class
``integer-exact``: 0 steps, 0 differing codes, when the quantizers it reads agree).
:attr:`VerificationReport.quantizers` holds each quantizer's statistics and the rule that judged it; ``ok`` needs
every quantizer to pass as well as every output. An activation quantizer eager calls that no node of the file was
traced from (a dropped Q/DQ pair) fails as ``missing``. An output with a class or vocabulary axis (``[N, C]``, or
``[B, T, V]`` judged per token over the last axis) reports its top-1 agreement and fails on any flip whose eager
margin is not a near tie, and, over at least 200 rows, on an agreement below 99.5 % even when every flip is a near
tie (:data:`~coreai_opt.onnx.verify.output_comparison.MIN_ARGMAX_AGREEMENT`: many near ties at once are a shift).
An output that fails free-running is judged again with eager reading onnxruntime's codes at every quantizer
(:class:`~coreai_opt.onnx.verify.quantize_calls.ForceQuantizeCalls`), on every batch, against the same tolerance:
what the ops after the last quantizers add. Within it, the free-running difference is inherited from rounding flips
upstream, which the quantizer rules judge one by one, and the output passes (hf beam: 78 steps free-running).

When an output or a quantizer fails, the first failing quantizer is named (:attr:`VerificationReport.divergence`:
from :func:`coreai_opt.onnx.verify.localize.localize_divergence` when an output fails, else the first quantizer whose
statistics fail).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import onnx
import torch
from torch import nn

from coreai_opt.api.internals.input_checks import input_check
from coreai_opt.error_boundary import public_api
from coreai_opt.onnx.verify.cache_codes import cache_scales
from coreai_opt.onnx.verify.code_rules import QuantizerCodes
from coreai_opt.onnx.verify.fusion_report import FusionReport, fusion_report, optimized_model
from coreai_opt.onnx.verify.int8_compute_steps import int8_step_units
from coreai_opt.onnx.verify.localize import Divergence, localize_divergence
from coreai_opt.onnx.verify.output_comparison import (
    FLOAT_ABSOLUTE_TOLERANCE,
    OutputComparison,
    compare_output,
    output_steps_of,
)
from coreai_opt.onnx.verify.output_steps import OutputStep
from coreai_opt.onnx.verify.quantizer_codes import compare_quantizer_codes
from coreai_opt.onnx.verify.runtimes import graph_input_names, open_runner
from coreai_opt.onnx.verify.sample_budget import (
    ActivationBytes,
    batch_size,
    leading_rows,
    leading_samples,
    samples_within_budget,
)
from coreai_opt.onnx.verify.tolerance import OutputTolerance, derive_tolerances
from coreai_opt.onnx.verify.weight_codes import WeightCheck, compare_weight_codes
from coreai_opt.passes.sink_weight_quantizers import eager_order

__all__ = [
    "VerificationReport",
    "OutputComparison",
    "verify_onnx",
    "FLOAT_ABSOLUTE_TOLERANCE",
]

@dataclass(frozen=True)
class VerificationReport:
    """Result of :func:`verify_onnx`; ``str(report)`` is a table, one reason line per output, and the fusion report.

    Attributes:
        path: The ONNX file.
        num_batches: Batches compared.
        num_samples: Samples compared (sum of batch sizes of the first input).
        outputs: One :class:`OutputComparison` per graph output.
        fusion: onnxruntime's fusion report for the file.
        runtime: The runtime compared with eager (``"onnxruntime"`` or ``"openvino"``).
        divergence: Where eager and onnxruntime first part, when an output failed (None otherwise).
        quantizers: Eager vs onnxruntime codes at every activation quantizer on the first batch, with the rule
            that judged each (:class:`~coreai_opt.onnx.verify.quantizer_codes.QuantizerCodes`; empty for
            weight-only files, OpenVINO or ``check_quantizers=False``).
        weights: The file's stored 8-bit weights against eager's, code by code
            (:mod:`coreai_opt.onnx.verify.weight_codes`; empty with ``check_quantizers=False``).
        quantizer_samples: Leading samples of the first batch the quantizers were compared on (and of each batch a
            failing output was judged again on): all of them unless their quantizer outputs exceed the memory
            budget (:mod:`coreai_opt.onnx.verify.sample_budget`); 0 when not compared.
    """

    path: Path
    num_batches: int
    num_samples: int
    outputs: tuple[OutputComparison, ...]
    fusion: FusionReport
    runtime: str = "onnxruntime"
    divergence: Divergence | None = None
    quantizers: tuple[QuantizerCodes, ...] = ()
    weights: WeightCheck = WeightCheck()
    quantizer_samples: int = 0

    @property
    def first_failing_quantizer(self) -> QuantizerCodes | None:
        """The first activation quantizer (graph order) whose codes or qparams fail their rule."""
        return next((q for q in self.quantizers if not q.ok), None)

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
        """True when every output is in its tolerance, every activation quantizer passes, every weight matches."""
        return all(o.ok for o in self.outputs) and all(q.ok for q in self.quantizers) and self.weights.ok

    def __str__(self) -> str:
        header = ("output", "shape", "max |diff|", "steps", "allowed", "argmax agree", "ok")
        rows = [header]
        for o in self.outputs:
            steps = "-" if o.max_diff_steps is None else f"{o.max_diff_steps:.2f}"
            allowed = f"{o.tolerance_steps} steps" if o.tolerance_steps is not None else f"{o.tolerance:.3g}"
            agree = "-" if o.argmax_agreement is None else f"{100 * o.argmax_agreement:.1f}%"
            if o.argmax_flips_within_tolerance:
                agree += f" ({o.argmax_flips_within_tolerance} near-tie flip(s))"
            rows.append((o.name, "x".join(map(str, o.shape)), f"{o.max_abs_diff:.3g}", steps, allowed, agree,
                         str(o.ok)))
        widths = [max(len(r[i]) for r in rows) for i in range(len(header))]
        where = "" if self.runtime == "onnxruntime" else f" in {self.runtime}"
        title = (f"ONNX verification of {self.path.name}{where}: {self.num_batches} batch(es), "
                 f"{self.num_samples} sample(s)")
        if self.quantizers:
            failing = sum(not q.ok for q in self.quantizers)
            title += (f", {len(self.quantizers)} quantizer(s) compared on {self.quantizer_samples} sample(s) of the "
                      f"first batch ({failing} failing)")
        if self.weights.weights:
            failing = sum(not w.ok for w in self.weights.weights)
            title += f", {len(self.weights.weights)} weight(s) compared ({failing} failing)"
        lines = [f"{title}, ok={self.ok}"]
        lines += ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
        lines += [f"  tolerance of {o.name} ({o.rule}): {o.reason}" for o in self.outputs]
        lines += [f"  {o.name} on the file's codes at every quantizer (the free-running difference inherited from "
                  f"rounding flips the quantizer rules judge): max |diff| {o.on_file_codes.max_abs_diff:.3g}, "
                  f"ok={o.on_file_codes.ok}" for o in self.outputs if o.on_file_codes is not None]
        lines += [f"  argmax flips of {o.name}: {o.argmax_flips}" for o in self.outputs if o.argmax_flips]
        if self.divergence is not None:
            lines.append(f"  {self.divergence}")
        if (first := self.first_failing_quantizer) is not None:
            lines.append(f"  first failing quantizer: {first}")
        if (weight := self.weights.first_failing) is not None:
            lines.append(f"  first failing {weight}")
        return "\n".join(lines) + "\n" + str(self.fusion)


def _on_file_codes(output: OutputComparison, forced: list[np.ndarray], gots: list[np.ndarray],
                   steps: dict[str, OutputStep], tolerances: dict[str, OutputTolerance],
                   units: dict[str, list[np.ndarray]]) -> OutputComparison:
    """A failing output judged again against eager on the file's codes (``OutputComparison.on_file_codes``)."""
    name = output.name
    again = compare_output(name, forced, gots, steps.get(name), tolerances.get(name), units.get(name))
    return replace(output, ok=again.ok, on_file_codes=again)


def _batches(inputs: object) -> list[tuple[torch.Tensor, ...]]:
    """A tensor or a tuple of tensors is one batch; any other iterable yields batches (tensors or tuples)."""
    if isinstance(inputs, torch.Tensor) or (
        isinstance(inputs, tuple) and inputs and all(isinstance(t, torch.Tensor) for t in inputs)
    ):
        batches = [inputs if isinstance(inputs, tuple) else (inputs,)]
    elif not isinstance(inputs, Iterable) or isinstance(inputs, (str, bytes)):
        raise TypeError(
            f"inputs must be a tensor, a tuple of tensors or an iterable of batches, got {type(inputs).__name__}"
        )
    else:
        batches = []
        for i, batch in enumerate(inputs):
            if isinstance(batch, torch.Tensor):
                batch = (batch,)
            if not isinstance(batch, (tuple, list)) or not batch or not all(isinstance(t, torch.Tensor)
                                                                            for t in batch):
                raise TypeError(f"batch {i} must be a tensor or a tuple of tensors, got {type(batch).__name__}")
            batches.append(tuple(batch))
    if not batches:
        raise ValueError("inputs yielded no batches; pass at least one input tensor")
    return batches


def _refuse_empty(batches: list[tuple[torch.Tensor, ...]]) -> None:
    """After the per-input checks (which name the input): a batch of 0 samples left by a model without specs."""
    for i, batch in enumerate(batches):
        if batch[0].dim() and batch[0].shape[0] == 0:
            raise ValueError(f"batch {i} has 0 samples (first input shape {tuple(batch[0].shape)}); verifying "
                             "nothing proves nothing: pass batches with at least one sample")


def _run_eager(model: nn.Module, batch: tuple[torch.Tensor, ...]) -> list[np.ndarray]:
    with torch.no_grad():
        outputs = model(*batch)
    return [t.detach().cpu().numpy() for t in torch.utils._pytree.tree_leaves(outputs)]


@public_api
def verify_onnx(
    model: nn.Module,
    path: str | os.PathLike[str],
    inputs: torch.Tensor | tuple[torch.Tensor, ...] | Iterable[torch.Tensor | Sequence[torch.Tensor]],
    *,
    providers: Sequence[str] = ("CPUExecutionProvider",),
    runtime: str = "onnxruntime",
    localize: bool = True,
    check_quantizers: bool = True,
) -> VerificationReport:
    """Compare a runtime on ``path`` with the eager ``model`` on the same inputs.

    Args:
        model: The converted model that was exported (run in eager, in ``torch.no_grad``).
        path: The ONNX file written by :func:`coreai_opt.onnx.export_onnx`.
        inputs: One batch (a tensor, or a tuple of tensors with one per model input) or an iterable of batches
            (a list, a generator, a DataLoader yielding tensors or tuples of tensors).
        providers: onnxruntime execution providers.
        runtime: ``"onnxruntime"`` (default) or ``"openvino"`` (CPU, float32 inference precision; needs the
            ``openvino`` extra). The tolerances are derived from onnxruntime's kernels either way.
        localize: When an output fails (onnxruntime only), find the first diverging quantizer or layer.
        check_quantizers: Compare codes and qparams at every activation quantizer on the first batch
            (onnxruntime only; :mod:`coreai_opt.onnx.verify.quantizer_codes`), and the file's stored weights with
            eager's (any runtime; :mod:`coreai_opt.onnx.verify.weight_codes`).

    Returns:
        A :class:`VerificationReport`: per-output max abs diff, diff in output quantization steps, the derived
        tolerance with its rule and reason, argmax agreement for ``[N, C]`` outputs, ``ok``, the first divergence
        when not ok, and the fusion report.

    Raises:
        FileNotFoundError: No file at ``path``.
        TypeError / ValueError: Inputs of the wrong kind or count, no batches or no samples, or output shapes that
            disagree.
        ModuleNotFoundError: ``runtime="openvino"`` without OpenVINO installed.
    """
    if isinstance(path, nn.Module) and isinstance(model, (str, os.PathLike)):
        raise TypeError("verify_onnx(model, path, inputs) got the ONNX path first and the model second; "
                        "pass the converted model first: verify_onnx(model, path, inputs)")
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be the converted torch.nn.Module that was exported, got {type(model).__name__}")
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"path must be the ONNX file's path (str or os.PathLike), got {type(path).__name__}")
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"verify_onnx: no ONNX file at {path}; pass the path export_onnx returned")
    batches = _batches(inputs)
    check = input_check(model)
    if check is not None:
        for index, batch in enumerate(batches):
            check(batch, {}, f"verify_onnx batch {index}")
    _refuse_empty(batches)
    graph_model = onnx.load(str(path), load_external_data=False)  # released before the eager forwards
    file_inputs = graph_input_names(graph_model.graph)
    steps = output_steps_of(graph_model)
    # the stored weights against eager's, before any inference (coreai_opt.onnx.verify.weight_codes)
    weights = compare_weight_codes(model, graph_model, path.parent) if check_quantizers else WeightCheck()
    codes = cache_scales(model, graph_model.graph)  # an int8 KV cache: fed and compared as the eager floats
    batches = [codes.snap(batch) for batch in batches] if codes else batches
    del graph_model
    for i, batch in enumerate(batches):  # before the eager forward, which would fail with torch's own TypeError
        if len(batch) != len(file_inputs):
            raise ValueError(f"batch {i} has {len(batch)} tensor(s) but the ONNX model takes {len(file_inputs)} "
                             f"({file_inputs})")
    # Every eager reference first, then the runtime: the eager forward's temporaries (a fake-quantized weight at
    # a time) and the session's weights (its integers and prepacked copies) are never resident together.
    eager_model = eager_order(model)
    with ActivationBytes(model) as counted:  # what the code comparison will hold of the first batch (sample_budget)
        eager = [_run_eager(eager_model, batches[0])]
    eager += [_run_eager(eager_model, batch) for batch in batches[1:]]
    del eager_model
    runner = open_runner(path, runtime, providers)
    input_names, output_names = runner.input_names, runner.output_names
    refs: list[list[np.ndarray]] = [[] for _ in output_names]
    gots: list[list[np.ndarray]] = [[] for _ in output_names]
    for i, batch in enumerate(batches):
        onnx_out = codes.values(runner.run(codes.feed(input_names, batch)))
        if len(eager[i]) != len(onnx_out):
            raise ValueError(f"the eager model returned {len(eager[i])} output(s), the ONNX model {len(onnx_out)}")
        for k, (ref, got) in enumerate(zip(eager[i], onnx_out, strict=True)):
            refs[k].append(ref)
            gots[k].append(got)
    del runner, eager  # the sessions below load the file again: never hold two copies of its weights at once
    tolerances = derive_tolerances(optimized_model(path, "all"), set(steps))
    layers = {name: t.int8_layer for name, t in tolerances.items() if t.rule == "int8 compute" and t.int8_layer}
    units = int8_step_units(path, layers, [codes.feed(input_names, b) for b in batches], providers) if layers else {}
    outputs = tuple(
        compare_output(name, refs[k], gots[k], steps.get(name), tolerances.get(name), units.get(name))
        for k, name in enumerate(output_names)
    )
    num_samples = sum(batch_size(b) for b in batches)
    quantizers: tuple[QuantizerCodes, ...] = ()
    quantizer_samples = 0
    if check_quantizers and runtime == "onnxruntime":
        failing = not all(o.ok for o in outputs)  # then judged again on the file's codes (OutputComparison)
        quantizer_samples = samples_within_budget(model, batches[0], counted.bytes)  # memory-bounded
        heads = [leading_samples(b, quantizer_samples) for b in batches]
        quantizers, forced = compare_quantizer_codes(model, path, heads[0], providers=providers,
                                                     forced_batches=heads if failing else ())
        sizes = [batch_size(b) for b in batches]
        outputs = tuple(
            _on_file_codes(o, [f[k] for f in forced],
                           [leading_rows(g, quantizer_samples, n) for g, n in zip(gots[k], sizes, strict=True)],
                           steps, tolerances, units)
            if not o.ok and forced and all(len(f) == len(outputs) for f in forced) else o
            for k, o in enumerate(outputs)
        )
    divergence = None
    judged_ok = all(o.ok for o in outputs) and all(q.ok for q in quantizers) and weights.ok
    if localize and runtime == "onnxruntime" and any(o.on_file_codes is not None or not o.ok for o in outputs) \
            and not judged_ok:  # an output failed free-running, and the file fails: where the two first part
        divergence = localize_divergence(model, path, batches[0], providers=providers)
    return VerificationReport(path, len(batches), num_samples, outputs, fusion_report(path), runtime, divergence,
                              quantizers, weights, quantizer_samples)
