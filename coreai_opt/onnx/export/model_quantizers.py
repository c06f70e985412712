"""Find a model's quantizers and check that it is converted (every FakeQuantize frozen in export mode)."""

from __future__ import annotations

from torch import nn

from coreai_opt.graph.graph_meta import get_graph_meta
from coreai_opt.onnx.export.opset import QuantizerUse
from coreai_opt.quantization.fake_quantize.bias_fake_quantize import BiasFakeQuantize
from coreai_opt.quantization.fake_quantize.fake_quantize import FakeQuantize
from coreai_opt.quantization.spec.granularity import PerBlock, PerToken

__all__ = ["converted_quantizers", "quantizer_uses"]

_CONVERT_HINT = "call coreai_opt.convert(prepared) and export the model it returns"


def converted_quantizers(model: nn.Module) -> list[nn.Module]:
    """Return the model's FakeQuantize / BiasFakeQuantize modules after checking it is ready for export.

    A model is ready when it carries at least one FakeQuantize, every FakeQuantize is in export mode, and, for a
    GraphModule made by ``coreai_opt.prepare``, ``gm.meta["coreai_opt"]["converted"]`` is True.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: The model is a float model, a prepared but not converted model, or has quantizers that are
            not in export mode; the message says to call ``coreai_opt.convert(prepared)``.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"export needs the torch.nn.Module returned by coreai_opt.convert, got {type(model).__name__}")
    meta = get_graph_meta(model)
    if meta is not None and meta.converted is not True:
        raise ValueError(f"the model is prepared but not converted (gm.meta['coreai_opt']['converted'] is not True); "
                         f"{_CONVERT_HINT}")
    fake_quantizers = [m for m in model.modules() if isinstance(m, FakeQuantize)]
    if not fake_quantizers:
        raise ValueError(
            f"{type(model).__name__} has no coreai_opt quantizers: it is a float model. Quantize it with "
            "coreai_opt.prepare -> coreai_opt.calibrate -> coreai_opt.convert first (or export a float model with "
            "torch.onnx.export directly)"
        )
    not_frozen = [fq.name for fq in fake_quantizers if not fq.export_mode]
    if not_frozen:
        shown = ", ".join(repr(n) for n in not_frozen[:5]) + (" ..." if len(not_frozen) > 5 else "")
        raise ValueError(f"{len(not_frozen)} quantizer(s) are not in export mode ({shown}); {_CONVERT_HINT}")
    biases = [m for m in model.modules() if isinstance(m, BiasFakeQuantize)]
    return [*fake_quantizers, *biases]


def quantizer_uses(quantizers: list[nn.Module]) -> list[QuantizerUse]:
    """Describe what each quantizer needs from the ONNX opset (dtype, per-block or not)."""
    uses = []
    for q in quantizers:
        if isinstance(q, BiasFakeQuantize):
            uses.append(QuantizerUse("int32", False, q.name))
        else:
            uses.append(QuantizerUse(q.spec.dtype, isinstance(q.spec.granularity, (PerBlock, PerToken)), q.name))
    return uses
