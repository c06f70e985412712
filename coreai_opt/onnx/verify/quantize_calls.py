"""Eager's ``coreai_opt::quantize_dequantize`` calls during one forward: recorded, or forced to the file's codes.

:class:`RecordQuantizeCalls` keeps what eager computes at each activation quantizer (rules 1-5 of
:mod:`coreai_opt.onnx.verify.quantizer_codes` compare it with onnxruntime's codes).

:class:`ForceQuantizeCalls` runs eager *on the file's codes*: at each activation quantizer it keeps what eager
computed there, then hands the later ops onnxruntime's codes at that quantizer instead, dequantized as the op does::

    y_forced = (q_onnxruntime - z) · s        (float32, the op's own last two steps: bit-equal to eager's output
                                               wherever the codes agree)

So each quantizer's eager codes come from exactly the inputs onnxruntime's kernels read, and
``q_onnxruntime - q_eager`` there is what the quantizer's own kernels add, none of it inherited. A rounding flip
early in a deep stack spreads over more and more codes downstream (one flipped input of a matrix product moves a
whole output row), which the free-running comparison can only bound with a gain; forced, it stays at the quantizer
that flipped it. A defect is the opposite: it appears where it is, with identical inputs.

**Near ties.** Where eager's value ``x / s`` lies within :data:`NEAR_TIE` of a step's rounding boundary (``k + ½``)
and onnxruntime's code is the other neighbour, the kernel's arithmetic differs from eager's by less than
``NEAR_TIE`` steps there (its requantisation multiplier, its order of operations); eager could as well have
rounded that way. Forced, such a code is kept as onnxruntime's (counted in :attr:`ForceQuantizeCalls.near_ties`),
so a kernel whose tiny offset is one-way does not read as a biased defect of its own (timm RepViT-M1: 158 codes of
301,056 at one ``QLinearAdd``, all +1, all within 10⁻³ step of a boundary). A defect moves values by far more than
that: its differences stay. Where the value comes from a kernel accurate only to an absolute error ``e``
(onnxruntime's logistic: ``Sigmoid``, ``QLinearSigmoid``) and is rounded at a step ``s`` finer than ``e / NEAR_TIE``,
the width is ``e / s`` steps instead (hf bailing_hybrid's forget gate: sigmoid outputs below 4e-5 on a step of
1.5e-7, where the kernel's 1.7e-7 flips 5 of 256 table entries, 4.7 % of the codes).
"""

from __future__ import annotations

import numpy as np
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from coreai_opt.onnx.verify.missing_calls import input_key

__all__ = ["NEAR_TIE", "ForceQuantizeCalls", "RecordQuantizeCalls", "eager_codes"]

#: Steps from a rounding boundary within which a one-step flip is onnxruntime's kernel rounding (module docstring).
NEAR_TIE = 1e-3

_QDQ = torch.ops.coreai_opt.quantize_dequantize.default


def eager_codes(args: tuple, result: torch.Tensor) -> torch.Tensor:  # noqa: ANN401 (the op's own arguments)
    """Eager's codes ``q = round(y / s) + z`` of one ``quantize_dequantize`` output ``y = (q - z) · s``.

    Kept instead of ``y``: int16 for codes of 8-bit grids (half of float32), int32 otherwise; a NaN of ``y`` (a
    0 / 0 upstream, rule ``nan``) is stored as the dtype's minimum, outside every grid. Per-block grids and float8
    keep ``y`` itself (float32).
    """
    scale, zero_point, quant_min, quant_max, axis, block_size, dtype = args[1:8]
    if block_size > 0 or dtype.startswith("float8"):
        return result.detach().clone()
    s, z = scale.detach(), zero_point.detach().float()
    if s.dim() > 0:
        shape = [-1 if i == axis % result.dim() else 1 for i in range(result.dim())]
        s, z = s.reshape(shape), z.reshape(shape)
    q = torch.round(result.detach() / s).add_(z)
    storage = torch.int16 if -32767 <= quant_min and quant_max <= 32767 else torch.int32
    return torch.where(torch.isnan(q), torch.iinfo(storage).min, q).to(storage)


class RecordQuantizeCalls(TorchDispatchMode):
    """Counts every ``coreai_opt::quantize_dequantize`` call in call order, keeping only the wanted ones.

    A wanted call (an activation boundary) keeps ``(output, scale, zero_point)`` in :attr:`calls`; a fake-quantized
    weight is never copied. Given ``traced``, every activation call also keeps a key of its input's bytes and its
    qparams in :attr:`keys` (:func:`~coreai_opt.onnx.verify.missing_calls.input_key`), to tell a duplicate the
    exporter merged from a dropped pair.
    Every op's outputs computed from a tensor derived from ``inputs`` (the batch) are derived too; a quantizer call
    whose input is derived is an activation call (:attr:`activations`: index -> (shape, storage address of its scale)).
    Quantizers of tensors computed from constants only (a causal mask or rotary table built from ``arange``) are
    not: the exporter folds them into constants with their producers (clean hf-llama: two such calls, no node left
    in the file).
    """

    def __init__(self, wanted: set[int], inputs: tuple[torch.Tensor, ...], traced: set[int] | None = None) -> None:
        super().__init__()
        self.wanted = wanted
        self.traced = traced
        self.count = 0
        self.calls: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.keys: dict[int, tuple[object, ...]] = {}
        self.activations: dict[int, tuple[tuple[int, ...], int]] = {}
        self.derived = WeakIdKeyDictionary()
        for tensor in inputs:
            self.derived[tensor] = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        result = func(*args, **(kwargs or {}))
        derived = any(isinstance(t, torch.Tensor) and t in self.derived
                      for t in pytree.tree_leaves((args, kwargs or {})))
        if derived:
            for t in pytree.tree_leaves(result):
                if isinstance(t, torch.Tensor):
                    self.derived[t] = True
        if func is _QDQ:
            if self.count in self.wanted:
                self.calls[self.count] = (eager_codes(args, result), args[1].detach().clone(),
                                          args[2].detach().clone())
            if args[0] in self.derived:
                self.activations[self.count] = (tuple(args[0].shape), args[1].untyped_storage().data_ptr())
                if self.traced is not None:
                    self.keys[self.count] = input_key(args[0], args[1], args[2])
            self.count += 1
        return result


class ForceQuantizeCalls(TorchDispatchMode):
    """At the wanted calls, keep eager's ``(codes, scale, zero_point)`` and continue from the file's codes.

    Enter it *after* (inside) an :class:`~coreai_opt.onnx.verify.integer_reference.IntegerReference`: the forced
    values are written into the output tensor the reference tagged, so its integer layers read the file's codes.

    Args:
        codes: Call index -> onnxruntime's codes at that quantizer (any shape of the same size: a linear exported
            as ``Reshape -> Gemm`` quantizes the 2-D view). A call whose codes do not fit (another size, a per-block
            or float8 grid) keeps eager's own output.
        near_tie: Call index -> its near-tie width in steps where it is wider than :data:`NEAR_TIE` (a kernel
            accurate to an absolute error only, rounded at a finer step:
            :func:`~coreai_opt.onnx.verify.quantizer_codes.rounding_width`).
    """

    def __init__(self, codes: dict[int, np.ndarray], near_tie: dict[int, float] | None = None) -> None:
        super().__init__()
        self.codes = codes
        self.near_tie = near_tie or {}
        self.count = 0
        self.calls: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.near_ties: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204, D105
        result = func(*args, **(kwargs or {}))
        if func is not _QDQ:
            return result
        index, self.count = self.count, self.count + 1
        forced = self.codes.get(index)
        if forced is None:
            return result
        scale, zero_point, axis, block_size, dtype = args[1], args[2], args[5], args[6], args[7]
        codes = eager_codes(args, result)
        self.calls[index] = (codes, scale.detach().clone(), zero_point.detach().clone())
        if forced.size != result.numel() or block_size > 0 or dtype.startswith("float8"):
            return result
        q = torch.from_numpy(forced.astype(np.float32)).reshape(result.shape)
        s, z = scale.detach(), zero_point.detach().float()
        if s.dim() > 0:  # per channel along axis
            shape = [-1 if i == axis % result.dim() else 1 for i in range(result.dim())]
            s, z = s.reshape(shape), z.reshape(shape)
        width = self.near_tie.get(index, NEAR_TIE)
        self.near_ties[index] = _adopt_near_ties(codes, q, args[0].detach() / s + z, width)
        with torch.no_grad():
            result.copy_((q - z).mul_(s))
        return result


def _adopt_near_ties(codes: torch.Tensor, forced: torch.Tensor, value: torch.Tensor, width: float = NEAR_TIE) -> int:
    """Adopt onnxruntime's ``forced`` code as eager's within ``width`` steps of eager's rounding interval; the count.

    ``value`` is eager's ``x / s + z``. With ``width`` below half a step that is a neighbour code and ``value``
    within ``width`` of the boundary between the two (a near tie); a kernel accurate to ``e`` absolute at a step
    ``s`` may be ``e / s`` steps away (``width`` from :func:`~coreai_opt.onnx.verify.quantizer_codes.rounding_width`).
    """
    adopt = ((forced - value).abs() <= 0.5 + width) & (forced != codes.float())
    count = int(adopt.sum())
    if count:
        codes[adopt] = forced[adopt].to(codes.dtype)
    return count
