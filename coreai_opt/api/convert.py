"""``convert``: freeze a calibrated (or QAT-trained) model for export.

Returns a copy (parameters of a post-training model share storage with ``prepared``'s, which are read-only;
everything else deep-copied) in which weight qparams are recomputed from the final weights, every ``FakeQuantize``
is in export mode (qparams frozen, observers off, fake quantization on), relu/relu6/hardtanh nodes made
redundant by their output quantizer are removed (exact, see
:mod:`coreai_opt.passes.drop_redundant_activations`), and so is an activation quantizer whose only reader is then
another one (a tensor rounded twice, which onnxruntime merges into one rounding of its own choosing:
:mod:`coreai_opt.passes.drop_requantizations`). BatchNorm was already folded by ``prepare``.
"""

from __future__ import annotations

from dataclasses import replace

from torch import fx

from coreai_opt.api.internals.model_guard import check_model_idle
from coreai_opt.api.internals.quantizer_state import bias_quantizers, commit_weight_qparams, fake_quantizers
from coreai_opt.error_boundary import public_api
from coreai_opt.graph.finite_weights import check_finite_weights
from coreai_opt.graph.graph_meta import require_graph_meta, set_graph_meta
from coreai_opt.graph.shared_parameters import copy_sharing_parameters, protect_shared_parameters
from coreai_opt.passes.drop_redundant_activations import drop_redundant_activations
from coreai_opt.passes.drop_requantizations import drop_requantizations
from coreai_opt.quantization.rounding.weight_rounding import rounding_results

__all__ = ["convert"]


@public_api
def convert(prepared: fx.GraphModule) -> fx.GraphModule:
    """Return a frozen copy of ``prepared`` ready for ONNX export (``prepared`` is unchanged).

    Args:
        prepared: A model from ``prepare``, calibrated unless it quantizes weights only.

    Returns:
        The converted GraphModule in eval mode, ``GraphMeta.converted = True``.

    Raises:
        TypeError: ``prepared`` was not produced by ``prepare``.
        ValueError: already converted, a weight holding NaN (named), activation quantizers that were never
            calibrated, or stateless
            quantizers that cannot export (``DynamicFakeQuantize`` can); the quantizers are named.
        CalibrationInProgressError: ``prepared`` is being calibrated (by another thread) right now.
    """
    meta = require_graph_meta(prepared, "convert")
    if meta.converted:
        raise ValueError("this model is already converted; convert the prepared model instead")
    check_model_idle(prepared, "convert")
    gm = copy_sharing_parameters(prepared, only_shared=True, shared_buffers=rounding_results(prepared))
    protect_shared_parameters(gm)
    check_finite_weights(gm, "convert", "restore weights without NaN (after QAT: a checkpoint from before training "
                                        "diverged, or a lower learning rate)")
    commit_weight_qparams(gm)
    quantizers = fake_quantizers(gm)
    stateful = [fq for _, fq in quantizers if fq.stateful]
    dynamic = [fq.name for _, fq in quantizers if not fq.stateful and not fq.exports_dynamic]
    if dynamic:
        raise ValueError(
            f"quantizers {dynamic} use a dynamic (stateless) qparams calculator whose qparams cannot be frozen "
            "for export; use qparams_calculator='static', 'global_minmax' or 'moving_average' for them, or "
            "fake_quantize='dynamic' (ONNX DynamicQuantizeLinear) for linear-layer inputs"
        )
    missing = [fq.name for fq in stateful if not fq.has_qparams and not fq.has_statistics]
    if missing:
        raise ValueError(
            f"{len(missing)} activation quantizer(s) were never calibrated: {', '.join(missing)}; run "
            "coreai_opt.calibrate(prepared, data) with batches that reach them before convert (a quantizer that saw "
            "only empty tensors, e.g. a boolean-mask selection that picked nothing, observed no value)"
        )
    waiting = [fq.name for _, fq in quantizers if fq.rounding is not None and bool(fq.rounding.awaiting_data)]
    if waiting:
        raise ValueError(
            f"{len(waiting)} weight quantizer(s) round from calibration data that was never observed (or the weight "
            f"changed since): {', '.join(waiting)}; run coreai_opt.calibrate(prepared, data) before convert, or "
            "use a data-free weight_rounding ('rtn', 'hqq', 'mse')"
        )
    for _, fq in quantizers:
        fq.set_export_mode(True)
    for _, bq in bias_quantizers(gm):  # frozen like set_export_mode: fake quantization on
        bq.enable_fake_quant(True)
    gm = drop_redundant_activations(gm).graph_module
    gm = drop_requantizations(gm).graph_module
    gm.eval()
    set_graph_meta(gm, replace(meta, converted=True))
    return gm
