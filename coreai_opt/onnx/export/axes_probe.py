"""Which symbolic axes of a TorchScript-route file really run at another size.

The TorchScript exporter (:func:`coreai_opt.onnx.export.export_routes.torchscript_export`, the fallback when the
dynamo exporter's decomposition fails) traces with the example inputs and records every size the model's Python
code reads as a constant. An input axis it was told to make symbolic then *looks* dynamic in the file, but a
reshape downstream still holds the example's size: hf XLNet's relative attention, exported with batch 2, fails in
onnxruntime at batch 4 ("Einsum operands could not be broadcast together ... {32,2,2,16}"). That file would load and
run at the example size and fail (or compute something else) at any other: a defect found by the user at run time.

:func:`axes_baked_in` runs the file once per axis name with that axis one larger (the last slice of each input
along it repeated) and returns the names at which onnxruntime fails. (A size baked into a reshape that still runs
would compute other values without failing; ``verify_onnx`` at the sizes the user runs is the check for that.)
``export_onnx`` then exports those axes with their example size, so the file says what it computes, and
:func:`~coreai_opt.onnx.export.dynamic_axes.check_axes_are_dynamic` reports them (an error for an axis the caller
asked for, a warning for the default batch axis).
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import onnx
import torch

__all__ = ["axes_baked_in"]

#: Largest model probed (serialised for onnxruntime in memory; protobuf's limit is 2 GiB).
_PROBE_MAX_BYTES = 1_900_000_000


def _grown(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """``tensor`` one larger along ``dim``: its last slice repeated (valid token ids and mask values stay valid)."""
    return torch.cat([tensor, tensor.narrow(dim, tensor.shape[dim] - 1, 1)], dim=dim)


def axes_baked_in(model: onnx.ModelProto, inputs: Sequence[torch.Tensor], axes: Sequence[dict[int, str]],
                  input_names: Sequence[str]) -> list[str]:
    """The symbolic axis names of ``model`` at which it does not run one size larger (module docstring).

    Args:
        model: The exported file.
        inputs: The example inputs it was exported with.
        axes: Per input, ``{dimension: axis name}`` (what the exporter was asked to make symbolic).
        input_names: The graph input names, in the order of ``inputs``.

    Returns:
        The axis names that fail, sorted; empty when every one runs (or there are none).
    """
    import onnxruntime as ort

    names = sorted({name for spec in axes for name in spec.values()})
    if not names:
        return []
    if model.ByteSize() > _PROBE_MAX_BYTES:  # onnxruntime reads a model from bytes only below protobuf's 2 GiB
        warnings.warn(f"the TorchScript exporter wrote this model, which may record sizes as constants, and it is "
                      f"too large ({model.ByteSize() / 1e9:.1f} GB) to run once per symbolic axis ({', '.join(names)})"
                      " to check them: run the file at the sizes you use (verify_onnx)", stacklevel=3)
        return []
    options = ort.SessionOptions()
    options.log_severity_level = 4
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    baked = []
    for name in names:
        grown = list(inputs)
        for index, spec in enumerate(axes):
            for dim, axis in spec.items():
                if axis == name:
                    grown[index] = _grown(grown[index], dim)
        try:
            session.run(None, _feed(grown, input_names))
        except Exception:  # noqa: BLE001 - any failure at the new size means the axis is not symbolic in fact
            baked.append(name)
    return baked


def _feed(inputs: Sequence[torch.Tensor], input_names: Sequence[str]) -> dict[str, np.ndarray]:
    return {name: tensor.detach().cpu().numpy() for name, tensor in zip(input_names, inputs, strict=True)}
