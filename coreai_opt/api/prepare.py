"""``prepare``: capture a model and insert quantizers where the config asks for them.

The recipe (each step a pass from :mod:`coreai_opt.passes`)::

    capture (→ functionalize_inplace) → check_finite_weights → complex_as_real → factories_from_metadata →
    remove_dead_nodes → decompose_attention → decompose_silu → recompose_gelu → order_ties → classify_ops →
    functionalize_weights → fold_batchnorm → fold_attention_scale → fold_channel_scales → annotate →
    insert_quantizers → check_activation_axes →
    quantize_kv_cache (``config.kv_cache``) → int8_compute_inputs (weight-only linears with
    ``matmul_compute="int8"``) → insert_weight_statistics

then weight qparams are computed from the weights. A post-training prepared model starts with observers
off and fake quantization on (``calibrate`` turns observers on for its duration); a QAT model
(``qat=True``) starts with both on and in train mode. BatchNorm is folded in both cases (QAT trains the
folded convolution), so ``convert`` only freezes.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from torch import fx, nn

from coreai_opt.api.internals.quantizer_state import bias_quantizers, commit_weight_qparams, fake_quantizers
from coreai_opt.api.internals.unmatched_config import warn_unmatched_entries
from coreai_opt.config import QuantizerConfig
from coreai_opt.error_boundary import public_api
from coreai_opt.gc_paused import gc_paused
from coreai_opt.graph.activation_axes import check_activation_axes
from coreai_opt.graph.dead_code import remove_dead_nodes
from coreai_opt.graph.finite_weights import check_finite_weights
from coreai_opt.graph.graph_meta import get_graph_meta, set_graph_meta
from coreai_opt.graph.node_meta import get_meta
from coreai_opt.graph.shared_parameters import protect_shared_parameters
from coreai_opt.passes.annotate import annotate
from coreai_opt.passes.capture import capture as capture_model
from coreai_opt.passes.classify_ops import classify_ops
from coreai_opt.passes.complex_as_real import complex_as_real
from coreai_opt.passes.decompose_attention import decompose_attention
from coreai_opt.passes.decompose_silu import decompose_silu
from coreai_opt.passes.factories_from_metadata import factories_from_metadata
from coreai_opt.passes.fold_attention_scale import fold_attention_scale
from coreai_opt.passes.fold_batchnorm import fold_batchnorm
from coreai_opt.passes.fold_channel_scales import fold_channel_scales
from coreai_opt.passes.functionalize_weights import functionalize_weights
from coreai_opt.passes.insert_quantizers import insert_quantizers
from coreai_opt.passes.insert_weight_statistics import insert_weight_statistics
from coreai_opt.passes.int8_compute_inputs import int8_compute_inputs
from coreai_opt.passes.order_ties import order_ties
from coreai_opt.passes.quantize_kv_cache import quantize_kv_cache
from coreai_opt.passes.recompose_gelu import recompose_gelu

__all__ = ["prepare"]

#: ``warnings.warn`` stack level of the user's ``prepare(...)`` line, seen from ``prepare`` (one frame for the
#: ``public_api`` wrapper).
_USER_STACKLEVEL = 3


@public_api
def prepare(
    model: nn.Module,
    config: QuantizerConfig,
    example_inputs: tuple[Any, ...],
    *,
    example_kwargs: dict[str, Any] | None = None,
    capture: str = "auto",
    leaf_modules: Sequence[type | str] = (),
    concrete_args: dict[str, Any] | None = None,
    dynamic_shapes: dict[str, Any] | None = None,
    qat: bool = False,
) -> fx.GraphModule:
    """Return a quantization-ready copy of ``model`` (the model itself is never modified).

    Post-training (``qat=False``) the copy shares the storage of ``model``'s parameters instead of duplicating the
    weights (:mod:`coreai_opt.graph.shared_parameters`): they are read-only in the prepared model
    (``requires_grad=False``; ``load_state_dict`` first gives them their own storage). Do not write into them in
    place (that would write into ``model``); prepare with ``qat=True`` to train, which copies the weights.

    Args:
        model: The float model.
        config: Which tensors to quantize and how (e.g. ``QuantizerConfig.presets.w8a8()``).
        example_inputs: Positional example inputs, a tuple (``(x,)``). Used for capture only.
        example_kwargs: Keyword example inputs.
        capture: ``"auto"`` (FX, then torch.export), ``"fx"`` or ``"export"``.
        leaf_modules: Module types or qualified names FX must not trace into.
        concrete_args: Values FX specialises on (Python flags in ``forward``).
        dynamic_shapes: Only for the torch.export capture: per-argument entries in ``torch.export``'s format replacing
            the default (dimension 0 of every tensor input dynamic); ``{"x": None}`` keeps ``x`` at its example shape
            (then export with ``dynamic_batch=False``).
        qat: Prepare for quantization-aware training (train mode, observers and fake quantization on).

    Returns:
        The prepared GraphModule; its :class:`~coreai_opt.graph.graph_meta.GraphMeta`
        (``get_graph_meta(prepared)``) holds ``capture``, ``converted``, ``input_names``, ``config``, ``qat``
        and ``input_specs``.

    Raises:
        TypeError: ``model`` is not an nn.Module, ``config`` not a QuantizerConfig, or ``example_inputs`` not a
            tuple.
        ValueError: capture failed (``CaptureError``: also for an in-place write FX cannot replay, or a ``forward``
            that branches on a dynamic size), a weight holds NaN, a spec does not fit a tensor, or a per-channel
            activation quantizer's axis follows the batch size (the node / tensor is named).

    Example:
        >>> cfg = QuantizerConfig.presets.w8()
        >>> prepared = prepare(nn.Sequential(nn.Linear(4, 2)), cfg, (torch.randn(1, 4),))
        >>> [name for name, _ in fake_quantizers(prepared)]
        ['_0_weight_fq']
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"prepare expects a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(config, QuantizerConfig):
        raise TypeError(
            f"config must be a coreai_opt.QuantizerConfig (e.g. QuantizerConfig.presets.w8a8()), got "
            f"{type(config).__name__}; build one with QuantizerConfig.from_dict(...) if you have a dict"
        )
    meta_tensors = [name for name, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if meta_tensors:
        raise ValueError(
            f"{type(model).__name__} has tensors on the 'meta' device (e.g. {meta_tensors[0]!r}), which hold no "
            "values to quantize; materialize the weights first (model.to_empty(device='cpu') and load a state_dict)"
        )
    if model.training and not qat:
        warnings.warn(
            f"{type(model).__name__} is in train mode; post-training quantization captures and calibrates it in eval "
            "mode (BatchNorm running statistics, no dropout). Call model.eval() first, or pass qat=True for QAT.",
            UserWarning,
            stacklevel=_USER_STACKLEVEL,
        )
    kwargs = dict(example_kwargs or {})
    with gc_paused():  # torch.export and the passes allocate heavily: no full collections meanwhile
        gm = capture_model(model, example_inputs, kwargs, method=capture, leaf_modules=leaf_modules,
                           concrete_args=concrete_args, dynamic_shapes=dynamic_shapes, share_parameters=not qat)
        check_finite_weights(gm, "prepare", "reload or repair the weights (e.g. torch.nan_to_num_ on that tensor) "
                                            "before prepare")
        gm = complex_as_real(gm).graph_module  # complex rotary tables as real pairs: ONNX has no complex ops
        gm = factories_from_metadata(gm).graph_module  # x.new_zeros(...) reads x's dtype only, not its values
        if remove_dead_nodes(gm):  # values no output reads (a branch's empty slice) get no quantizer
            gm.recompile()
        gm = decompose_attention(gm).graph_module
        gm = decompose_silu(gm, config.resolve).graph_module
        gm = recompose_gelu(gm, config.resolve).graph_module  # tanh GELU written as arithmetic: one Gelu in the file
        gm = order_ties(gm).graph_module  # sort / topk ties in onnxruntime's order, so eager and the file agree
        gm = classify_ops(gm).graph_module
        op_kinds = [get_meta(node).kind.value for node in gm.graph.nodes]
        gm = functionalize_weights(gm).graph_module
        if config.fold_batchnorm:
            gm = fold_batchnorm(gm).graph_module
        if config.fold_attention_scale:
            gm = fold_attention_scale(gm).graph_module
        if config.fold_channel_scales and not qat:  # QAT trains the scale on its own
            gm = fold_channel_scales(gm).graph_module
        gm = annotate(gm, config.resolve, int32_bias=config.int32_bias, fixed_range_outputs=config.fixed_range_outputs,
                      per_block_fallback=config.per_block_fallback).graph_module
        gm = insert_quantizers(gm).graph_module
    check_activation_axes(gm, example_inputs, kwargs)
    if config.kv_cache is not None:  # a KV-cache decoder's cache as codes (QuantizerConfig.kv_cache)
        gm = quantize_kv_cache(gm, config.kv_cache).graph_module
    gm = int8_compute_inputs(gm).graph_module  # matmul_compute="int8": eager emulates MatMulNBits' int8 input
    gm = insert_weight_statistics(gm).graph_module  # data-aware weight rounding observes the linears' inputs
    warn_unmatched_entries(config, model, op_kinds, len(fake_quantizers(gm)) + len(bias_quantizers(gm)),
                           stacklevel=_USER_STACKLEVEL)
    commit_weight_qparams(gm)
    for _, fq in fake_quantizers(gm):
        fq.enable_observer(qat)
        fq.enable_fake_quant(True)
    gm.train(qat)
    if not qat:  # weights are only read from here on: later copies (convert) share them too
        protect_shared_parameters(gm, share_all=True)
    set_graph_meta(gm, replace(get_graph_meta(gm), config=config.to_dict(), converted=False, qat=qat))
    return gm
