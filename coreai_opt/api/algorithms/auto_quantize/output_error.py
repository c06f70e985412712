r"""Error measurement against the float model: the metric, the held-out split and the one-unit-at-a-time sweep.

The default metric is the relative squared error of the model outputs ``y`` against the float outputs ``y⁰``
over all evaluation batches (every output tensor flattened and concatenated)::

    E = Σ_batches ‖y − y⁰‖² / Σ_batches ‖y⁰‖²

For L2-normalised embeddings ``E ≈ 2 (1 − mean cos)``. A custom metric is any
``metric(outputs, references) -> float`` on the per-batch lists (lower is better, 0 when equal).

:func:`unit_errors` measures, on a prepared and calibrated model in which every unit has the same candidate, the
error with only one unit's quantizers switched on (all others off): the unit's *error contribution*. Contributions
are summed by the search as an estimate of the combined error, which the search then measures for real.
An ``int8_compute`` layer's activation quantization is an ``Int8ComputeActivation`` module, not a fake quantizer
with a switch: :func:`int8_compute_emulation` passes the input of every other one through unchanged for the time
of a measurement (and of the float reference, where all of them are off).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, fx, nn

from coreai_opt.api.algorithms.auto_quantize.units import Unit, layer_int8_compute, layer_quantizers
from coreai_opt.api.internals.batches import as_call
from coreai_opt.api.internals.quantizer_state import fake_quantizers
from coreai_opt.quantization.matmul_nbits.int8_compute_op import Int8ComputeActivation

__all__ = ["Metric", "int8_compute_emulation", "model_outputs", "relative_squared_error", "split_held_out",
           "unit_errors"]

#: ``metric(outputs, references) -> error`` over the per-batch output lists.
Metric = Callable[[Sequence[Tensor], Sequence[Tensor]], float]


def relative_squared_error(outputs: Sequence[Tensor], references: Sequence[Tensor]) -> float:
    """``Σ ‖y − y⁰‖² / Σ ‖y⁰‖²`` over the batches (module docstring)."""
    num = sum(float(((o.double() - r.double()) ** 2).sum()) for o, r in zip(outputs, references, strict=True))
    den = sum(float((r.double() ** 2).sum()) for r in references)
    return num / max(den, 1e-30)


def model_outputs(model: torch.nn.Module, batches: Sequence[Any]) -> list[Tensor]:
    """Every batch's output tensors, flattened and concatenated (float32), computed without autograd."""
    outs = []
    with torch.no_grad():
        for batch in batches:
            args, kwargs = as_call(batch)
            leaves = torch.utils._pytree.tree_leaves(model(*args, **kwargs))
            outs.append(torch.cat([t.detach().float().flatten() for t in leaves if isinstance(t, Tensor)]))
    return outs


def split_held_out(batches: Sequence[Any]) -> tuple[list[Any], list[Any]]:
    """``(calibration, held_out)``: every fourth batch (indices 3, 7, ...) is held out; at least one of each.

    With a single batch both lists hold it (the error is then measured on the calibration data itself).
    """
    batches = list(batches)
    if len(batches) < 2:
        return batches, batches
    held = [b for i, b in enumerate(batches) if i % 4 == 3] or [batches[-1]]
    held_ids = {id(b) for b in held}
    return [b for b in batches if id(b) not in held_ids], held


def _set_submodule(gm: fx.GraphModule, target: str, module: nn.Module) -> None:
    owner, _, attr = target.rpartition(".")
    setattr(gm.get_submodule(owner) if owner else gm, attr, module)


@contextmanager
def int8_compute_emulation(gm: fx.GraphModule, on: Iterable[str] = ()) -> Iterator[None]:
    """Within the block only the ``Int8ComputeActivation`` modules named in ``on`` quantize; the others are identity.

    The generated code of ``gm`` looks its submodules up at call time, so the swap needs no recompile; the modules
    are put back on exit.
    """
    keep = set(on)
    modules = {name: m for name, m in gm.named_modules() if isinstance(m, Int8ComputeActivation)}
    try:
        for name in modules:
            if name not in keep:
                _set_submodule(gm, name, nn.Identity())
        yield
    finally:
        for name, module in modules.items():
            _set_submodule(gm, name, module)


def unit_errors(prepared: fx.GraphModule, units: Sequence[Unit], batches: Sequence[Any],
                references: Sequence[Tensor], metric: Metric, tick: Callable[[], None] = lambda: None
                ) -> list[float | None]:
    """Error with only each unit's quantizers on (module docstring); None where the unit has no quantizer.

    The quantizer flags of ``prepared`` are restored afterwards.
    """
    by_layer, emulations = layer_quantizers(prepared), layer_int8_compute(prepared)
    quantizers = dict(fake_quantizers(prepared))
    saved = {name: (bool(fq.observer_enabled), bool(fq.fake_quant_enabled)) for name, fq in quantizers.items()}
    out: list[float | None] = []
    try:
        for fq in quantizers.values():
            fq.enable_observer(False)
        for unit in units:
            names = {q for layer in unit.names for q in by_layer.get(layer, ())}
            if not names:
                out.append(None)
                tick()
                continue
            _switch(quantizers, names)
            with int8_compute_emulation(prepared, (m for layer in unit.names for m in emulations.get(layer, ()))):
                out.append(float(metric(model_outputs(prepared, batches), references)))
            tick()
    finally:
        for name, fq in quantizers.items():
            fq.enable_observer(saved[name][0])
            fq.enable_fake_quant(saved[name][1])
    return out


def _switch(quantizers: dict[str, Any], on: Iterable[str]) -> None:
    on = set(on)
    for name, fq in quantizers.items():
        fq.enable_fake_quant(name in on)
