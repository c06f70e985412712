"""An eager forward that computes onnxruntime's integer kernels integer-exactly: the reference of rule ``exact``.

Where onnxruntime fuses ``DequantizeLinear -> Conv / Gemm / MatMul -> QuantizeLinear`` into ``QLinearConv``,
``QGemm`` (``com.microsoft``) or ``QLinearMatMul``, its MLAS kernels compute, per output element (``xq``, ``wq``:
input and weight codes, ``b``: the int32 bias, ``M[n]``: one float32 multiplier per output channel)::

    acc[m, n] = Σ_k (xq[m, k] - x_zp) · (wq[n, k] - w_zp) + b[n]          (int32)
    M[n]      = fl32(fl32(x_scale · w_scale[n]) / y_scale)                 (float32, in this order)
    y[m, n]   = clamp(round_half_even(fl32(fl32(acc) · M[n])), qmin - y_zp, qmax - y_zp) + y_zp

(``MlasRequantizeOutput``: ``cvtepi32_ps``, a float32 multiply, min / max against the shifted range,
``cvtps_epi32``; ``QLinearConv`` / ``QGemm`` / ``QLinearMatMul`` compute ``M`` as above, per channel for a 1-D weight
scale.) The eager model computes the same layer in float32 (``conv(x_dq, w_dq) + b_dq``, rounded by the next
quantizer), a different summation order: codes differ at rounding ties, and a deep stack amplifies each flip.

:class:`IntegerReference` (a ``TorchDispatchMode``) runs the eager model with this arithmetic at the quantizer calls
it is given: it remembers the scale of every ``coreai_opt::quantize_dequantize`` output (views of it too, e.g. the
transposed weight of a linear), and the exact int32 codes of every derived bias; at ``aten.convolution`` /
``addmm`` / ``mm`` / ``bmm`` (and a bias ``add`` after a matrix product) whose operands are such outputs it
records how to accumulate ``acc``; at a chosen quantizer call reading that accumulator (through views and ``relu``)
it accumulates it exactly in float64 (every partial sum is an integer below ``2**53``: exact at any ``K`` these
models have; nothing is computed for layers no chosen quantizer reads) and returns the requantised codes above,
dequantized as the op does (``(q - z) · s`` in float32), so every later layer reads the codes onnxruntime
computes. Anything it does not recognise (per-block or 16-bit scales, float bias, a transposed convolution, a
per-channel activation scale) is left to the float eager computation, and the call is not listed in
:attr:`IntegerReference.replaced`: its quantizer is judged by the float-kernel rules.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["IntegerReference", "INTEGER_KERNELS", "requantize"]

#: onnxruntime kernels whose requantisation :class:`IntegerReference` reproduces bit-exactly.
INTEGER_KERNELS = frozenset({"QLinearConv", "NhwcQLinearConv", "QGemm", "QLinearMatMul"})

_aten = torch.ops.aten
# Ops that move values without arithmetic: a scale or accumulator tag follows them (applied to the tag's tensor).
_VIEWS = frozenset({_aten.t, _aten.transpose, _aten.permute, _aten.view, _aten._unsafe_view, _aten.reshape,
                    _aten.expand, _aten.unsqueeze, _aten.squeeze, _aten.clone, _aten.contiguous, _aten.detach,
                    _aten.alias, _aten.slice, _aten.select, _aten.flatten, _aten.unflatten, _aten.split,
                    _aten.split_with_sizes, _aten.chunk, _aten.unbind, _aten.lift_fresh})
_MATMULS = frozenset({_aten.mm, _aten.bmm})
_QDQ = torch.ops.coreai_opt.quantize_dequantize.default


@dataclass(frozen=True)
class _Scaled:
    """A tensor that is ``codes · scale``: integer codes (``q - z``) on a float32 grid.

    ``scale`` is 0-d (per tensor) or broadcast to the tensor's shape (an expanded view: no copy). ``codes`` is set
    for an int32 bias, whose codes float32 cannot hold exactly; 8-bit codes are read back as ``rint(value / scale)``.
    """

    scale: torch.Tensor
    codes: torch.Tensor | None = None

    def integers(self, value: torch.Tensor) -> torch.Tensor:
        if self.codes is not None:
            return self.codes
        return torch.round(value.double() / self.scale.double())


@dataclass(frozen=True)
class _Accumulator:
    """The exact int32 accumulator of an integer layer, computed only when a chosen quantizer reads it.

    ``compute()`` returns ``(acc, product_scale)``: ``acc`` float64, the float32 ``x_scale · w_scale`` 0-d or
    broadcast to ``acc``'s shape (per output channel), with every view since the layer applied to both.
    """

    compute: Callable[[], tuple[torch.Tensor, torch.Tensor]]
    relu: bool = False


def requantize(acc: torch.Tensor, product_scale: torch.Tensor, y_scale: torch.Tensor, y_zero_point: torch.Tensor,
               quant_min: int, quant_max: int, relu: bool = False) -> torch.Tensor:
    """MLAS's requantisation of an int32 accumulator (module docstring): the output codes, as float32 integers.

    Args:
        acc: The accumulator (bias included), integer-valued, any float dtype.
        product_scale: float32 ``x_scale · w_scale`` (0-d or broadcastable to ``acc``).
        y_scale: float32 0-d output scale.
        y_zero_point: 0-d output zero point.
        quant_min: Lowest output code.
        quant_max: Highest output code.
        relu: A ReLU sat between the layer and its quantizer (codes below the zero point clamp to it).
    """
    multiplier = product_scale.float() / y_scale.float()
    zp = float(y_zero_point)
    value = acc.float() * multiplier
    value = value.clamp(quant_min - zp, quant_max - zp).round()
    if relu:
        value = value.clamp_min(0.0)
    return value + zp


#: Elements of a matmul's right operand read back as float64 codes at a time (one slice of its columns).
_CHUNK_ELEMENTS = 1 << 20


def _exact_matmul(a: torch.Tensor, b: torch.Tensor, b_tag: _Scaled) -> torch.Tensor:
    """``a @ codes(b)`` for an integer-valued float64 ``a``, ``b``'s codes read back a slice of columns at a time.

    Exact as a whole (every partial sum an integer below ``2**53``); a slice holds at most :data:`_CHUNK_ELEMENTS`
    float64 codes, so verifying a large linear never holds a float64 copy of its whole weight.
    """
    columns = max(1, _CHUNK_ELEMENTS // max(1, b[..., 0].numel()))
    pieces = []
    for start in range(0, b.shape[-1], columns):
        part = slice(start, start + columns)
        scale = b_tag.scale[..., part] if b_tag.scale.dim() else b_tag.scale
        pieces.append(torch.matmul(a, _Scaled(scale).integers(b[..., part])))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1)


def _exact_convolution(x: torch.Tensor, w: torch.Tensor, stride: list[int], padding: list[int],
                       dilation: list[int], groups: int) -> torch.Tensor:
    """``conv(x, w)`` of integer-valued float64 tensors, exact (every partial sum an integer below ``2**53``).

    A 2-D depthwise convolution is summed tap by tap (``Σ_ij x[..., i·d + s·h, j·d + s·w] · w[c, 0, i, j]``):
    ATen's float64 depthwise kernel is about 10x slower than this on CPU (mobilenet_v2's 17 of them).
    """
    if x.dim() != 4 or groups == 1 or w.shape[1] != 1 or groups != x.shape[1]:
        return _aten.convolution.default(x, w, None, stride, padding, dilation, False, [0] * (x.dim() - 2), groups)
    # ATen broadcasts a one-element list to both spatial axes (hf EfficientNet's depthwise convs pass padding=[1])
    stride, padding, dilation = ([v[0]] * 2 if len(v) == 1 else list(v) for v in (stride, padding, dilation))
    x = x.repeat_interleave(w.shape[0] // groups, dim=1) if w.shape[0] != groups else x
    x = torch.nn.functional.pad(x, (padding[1], padding[1], padding[0], padding[0]))
    (sh, sw), (dh, dw), (kh, kw) = stride, dilation, w.shape[2:]
    out_h = (x.shape[2] - dh * (kh - 1) - 1) // sh + 1
    out_w = (x.shape[3] - dw * (kw - 1) - 1) // sw + 1
    acc = x.new_zeros(x.shape[0], w.shape[0], out_h, out_w)
    for i in range(kh):
        for j in range(kw):
            tap = x[:, :, i * dh: i * dh + sh * (out_h - 1) + 1: sh, j * dw: j * dw + sw * (out_w - 1) + 1: sw]
            acc += tap * w[:, 0, i, j].reshape(1, -1, 1, 1)
    return acc


class IntegerReference(TorchDispatchMode):
    """Eager forward with onnxruntime's integer-kernel arithmetic at the chosen quantizer calls (module docstring).

    Attributes:
        calls: Indices (call order) of the ``coreai_opt::quantize_dequantize`` calls onnxruntime computes inside
            an integer kernel (:data:`INTEGER_KERNELS`).
        replaced: The ones whose output this mode computed integer-exactly.
    """

    def __init__(self, calls: set[int]) -> None:
        super().__init__()
        self.calls = calls
        self.replaced: set[int] = set()
        self.count = 0
        self.scaled = WeakIdKeyDictionary()
        self.accumulators = WeakIdKeyDictionary()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204, D105
        kwargs = kwargs or {}
        if not self.calls:  # no integer kernel in the file (16-bit, float8, weight-only): plain eager
            return func(*args, **kwargs)
        if func is _QDQ:
            return self._quantize(args, func(*args, **kwargs))
        result = func(*args, **kwargs)
        packet = func.overloadpacket
        if packet in _VIEWS and args and isinstance(args[0], torch.Tensor):
            self._follow(func, args, kwargs, result)
        elif packet is _aten.convolution:
            self._convolution(args, result)
        elif packet is _aten.addmm:
            self._matmul(args[1], args[2], args[0], result)
        elif packet in _MATMULS:
            self._matmul(args[0], args[1], None, result)
        elif packet is _aten.add and len(args) == 2 and isinstance(args[1], torch.Tensor) and not kwargs:
            self._add_bias(args[0], args[1], result)
        elif packet is _aten.relu and args[0] in self.accumulators:
            self.accumulators[result] = _Accumulator(self.accumulators[args[0]].compute, True)
        return result

    def _quantize(self, args: tuple, result: torch.Tensor) -> torch.Tensor:  # noqa: ANN401
        x, scale, zero_point, quant_min, quant_max, axis, block_size, dtype = args
        index, self.count = self.count, self.count + 1
        if block_size > 0 and scale.dim() > 0 or dtype.startswith("float8"):
            return result
        if index in self.calls and x in self.accumulators and scale.dim() == 0:
            tag = self.accumulators[x]
            try:
                acc, product = tag.compute()
            except RuntimeError:  # a view the accumulator's tensors cannot take: the float eager result stays
                acc = None
            if acc is not None:
                codes = requantize(acc, product, scale, zero_point, quant_min, quant_max, tag.relu)
                result = (codes - zero_point.float()).mul_(scale)
                self.replaced.add(index)
        if scale.dim() == 0:
            full = scale.detach()
        else:
            shape = [-1 if i == axis % result.dim() else 1 for i in range(result.dim())]
            full = scale.detach().reshape(shape).expand(result.shape)
        codes = None
        if dtype == "int32":  # float32 cannot hold every int32 code: keep them, as the op rounds them
            codes = torch.div(x.detach(), full).round().clamp(quant_min, quant_max).double()
        self.scaled[result] = _Scaled(full, codes)
        return result

    def _follow(self, func, args: tuple, kwargs: dict, result: object) -> None:  # noqa: ANN001
        """A view of a tagged tensor carries the tag, moved the same way."""
        source = args[0]
        outputs = result if isinstance(result, (list, tuple)) else (result,)
        if source in self.scaled:
            try:
                moved = self._move_scaled(self.scaled[source], func, args, kwargs)
            except RuntimeError:  # a view the tag's tensors cannot take: leave the result untagged
                return
            if len(moved) == 1 and len(outputs) > 1:  # a per-tensor scale split with its tensor: every piece
                moved = moved * len(outputs)
            if len(moved) != len(outputs):
                return
            for out, tag in zip(outputs, moved, strict=True):
                self.scaled[out] = tag
        if source in self.accumulators:
            tag = self.accumulators[source]
            for i, out in enumerate(outputs):
                self.accumulators[out] = _Accumulator(self._move_accumulator(tag, func, args, kwargs, i), tag.relu)

    @staticmethod
    def _moved(tensor: torch.Tensor, func, args: tuple, kwargs: dict) -> list[torch.Tensor]:  # noqa: ANN001
        if tensor.dim() == 0:
            return [tensor]
        out = func(tensor, *args[1:], **kwargs)
        return list(out) if isinstance(out, (list, tuple)) else [out]

    def _move_scaled(self, tag: _Scaled, func, args: tuple, kwargs: dict) -> list[_Scaled]:  # noqa: ANN001
        scales = self._moved(tag.scale, func, args, kwargs)
        codes = self._moved(tag.codes, func, args, kwargs) if tag.codes is not None else [None] * len(scales)
        if len(scales) == 1 and len(codes) > 1:
            scales = scales * len(codes)
        return [_Scaled(s, c) for s, c in zip(scales, codes, strict=True)]

    def _move_accumulator(self, tag: _Accumulator, func, args: tuple, kwargs: dict,  # noqa: ANN001
                          index: int) -> Callable[[], tuple[torch.Tensor, torch.Tensor]]:
        def compute() -> tuple[torch.Tensor, torch.Tensor]:
            acc, product = tag.compute()
            accs = self._moved(acc, func, args, kwargs)
            scales = self._moved(product, func, args, kwargs)
            if len(accs) <= index:
                raise RuntimeError(f"{func} gave {len(accs)} pieces of the accumulator, not {index + 1}")
            return accs[index], scales[index if len(scales) > 1 else 0]
        return compute

    def _per_tensor(self, t: object) -> _Scaled | None:
        tag = self.scaled.get(t) if isinstance(t, torch.Tensor) else None
        return tag if tag is not None and tag.scale.dim() == 0 and tag.codes is None else None

    def _bias_codes(self, bias: object) -> torch.Tensor | None:
        tag = self.scaled.get(bias) if isinstance(bias, torch.Tensor) else None
        return tag.codes if tag is not None else None

    def _convolution(self, args: tuple, result: torch.Tensor) -> None:
        x, w, bias, stride, padding, dilation, transposed, output_padding, groups = args
        x_tag, w_tag = self._per_tensor(x), self.scaled.get(w)
        if x_tag is None or w_tag is None or w_tag.codes is not None or transposed:
            return
        b = self._bias_codes(bias) if bias is not None else torch.zeros(())
        if b is None:
            return
        def compute() -> tuple[torch.Tensor, torch.Tensor]:
            acc = _exact_convolution(x_tag.integers(x), w_tag.integers(w), stride, padding, dilation, groups)
            shape = [1, -1] + [1] * (acc.dim() - 2)
            acc = acc + b.reshape(shape if b.dim() else ())
            w_scale = w_tag.scale.reshape(w.shape[0], -1)[:, 0] if w_tag.scale.dim() else w_tag.scale
            product = (x_tag.scale.float() * w_scale.float())
            return acc, product.reshape(shape).expand(acc.shape) if product.dim() else product
        self.accumulators[result] = _Accumulator(compute)

    def _matmul(self, a: object, b: object, bias: object, result: torch.Tensor) -> None:
        a_tag = self._per_tensor(a)
        b_tag = self.scaled.get(b) if isinstance(b, torch.Tensor) else None
        if a_tag is None or b_tag is None or b_tag.codes is not None:
            return
        codes = self._bias_codes(bias) if bias is not None else torch.zeros(())
        if codes is None:
            return
        # the weight's scale runs along the output columns (its last axis); the activation's is one number
        b_scale = b_tag.scale[..., :1, :] if b_tag.scale.dim() else b_tag.scale
        if b_tag.scale.dim() and not torch.equal(b_scale.expand(b_tag.scale.shape), b_tag.scale):
            return  # a scale that varies along K is no per-output-channel weight scale

        def compute() -> tuple[torch.Tensor, torch.Tensor]:
            acc = _exact_matmul(a_tag.integers(a), b, b_tag) + codes.double()
            product = a_tag.scale.float() * b_scale.float()
            return acc, product.expand(acc.shape) if product.dim() else product
        self.accumulators[result] = _Accumulator(compute)

    def _add_bias(self, x: object, bias: torch.Tensor, result: torch.Tensor) -> None:
        tag = self.accumulators.get(x) if isinstance(x, torch.Tensor) else None
        codes = self._bias_codes(bias)
        if tag is not None and codes is not None and not tag.relu:
            def compute() -> tuple[torch.Tensor, torch.Tensor]:
                acc, product = tag.compute()
                return acc + codes.double(), product
            self.accumulators[result] = _Accumulator(compute)
