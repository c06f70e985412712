r"""Quantize a KV-cache decoder's cache: one calibrated quantizer per layer's appended keys and values.

A graph captured from :class:`~coreai_opt.graph.kv_cache_decoder.DecoderWithCache` returns
``present.{i}.key = cat([past_key_values.{i}.key, k], dim=-2)`` (and the same for values), where ``k`` holds this
step's keys ``(batch, kv_heads, sequence, head_dim)`` (after rotary). This pass calls a quantizer of spec
``QuantizerConfig.kv_cache`` on ``k``:

.. math::

    \mathrm{present} = [\,\mathrm{past};\; Q(k)\,], \qquad Q(k) = s \cdot \mathrm{clamp}(\mathrm{round}(k / s),
    q_\min, q_\max)

so attention reads the cache as onnxruntime's quantized cache holds it. Every past position was appended by an
earlier step through the same quantizer, so the whole cache lies on the quantizer's grid and the ONNX file can
store it as codes (int8 ``past_key_values`` / ``present`` tensors: rules ``attention_to_group_query_attention`` and
``int8_kv_cache``). The quantizer is an activation quantizer like any other: calibration observes the keys and
values of real prompts (prefill and decode steps), ``convert`` freezes its scale.

With :func:`~coreai_opt.config.presets.int8_kv_cache` (``PerAxes((1, 3))``, symmetric int8 ``[-128, 127]``) the
scale has shape ``(1, kv_heads, 1, head_dim)``: one per head and channel, onnxruntime's ``PER_CHANNEL`` cache.
"""

from __future__ import annotations

import torch
from torch.fx import GraphModule, Node

from coreai_opt.errors import CoreaiOptValueError
from coreai_opt.graph.graph_attrs import node_shape
from coreai_opt.graph.node_meta import NodeMeta, QuantizerInfo, Role, copy_provenance, get_meta, set_meta
from coreai_opt.graph.op_kinds import OpKind
from coreai_opt.graph.pass_result import PassResult
from coreai_opt.quantization.spec import FAKE_QUANTIZE, QuantizationSpec

__all__ = ["quantize_kv_cache", "cache_quantizer_target"]

_CATS = (torch.ops.aten.cat.default, torch.cat)
_FIX = ("wrap the causal LM in coreai_opt.graph.kv_cache_decoder.DecoderWithCache before prepare "
        "(co.from_pretrained(..., task='text-generation') does it), or set QuantizerConfig.kv_cache=None")


def cache_quantizer_target(index: int) -> str:
    """The module path of cache tensor ``index``'s quantizer (layer ``index // 2``, key then value)."""
    return f"kv_cache_quantizers.{index // 2}_{('key', 'value')[index % 2]}"


def _appended(present: Node, past: Node) -> Node:
    """``k`` of ``present = cat([past, k], dim=-2)``; a clear error when the output is not written that way."""
    if present.op != "call_function" or present.target not in _CATS:
        raise CoreaiOptValueError(f"QuantizerConfig.kv_cache quantizes a KV-cache decoder's cache, but the graph "
                                  f"output {present.name!r} (after the past input {past.name!r}) is "
                                  f"{present.format_node()}, not cat([past, new], dim=-2); {_FIX}")
    tensors = list(present.args[0])
    dim = present.args[1] if len(present.args) > 1 else present.kwargs.get("dim", 0)
    if len(tensors) != 2 or tensors[0] is not past or dim not in (-2, 2):
        raise CoreaiOptValueError(f"QuantizerConfig.kv_cache: the graph output {present.name!r} is "
                                  f"{present.format_node()}, not cat([{past.name}, new], dim=-2); {_FIX}")
    new = tensors[1]
    if get_meta(new).kind is OpKind.QUANTIZE or any(get_meta(u).kind is OpKind.QUANTIZE for u in past.users):
        raise CoreaiOptValueError(
            f"QuantizerConfig.kv_cache: the cache tensor {present.name!r} already has an activation quantizer "
            "(a static activation spec such as w8a8 quantizes the keys and values for the attention matmuls); an "
            "int8 cache goes with weight-only or dynamic presets (w4, w8, w8a8_dynamic): set kv_cache=None, or "
            "leave the attention matmuls float (config.set_op_kind('matmul', None))")
    return new


def quantize_kv_cache(gm: GraphModule, spec: QuantizationSpec) -> PassResult:
    """Call a quantizer of ``spec`` on the keys / values each layer appends to its cache (module docstring).

    The quantizers are named after the output they fill (``present.0.key``, ...) and live at
    ``kv_cache_quantizers.{layer}_{key|value}``.

    Raises:
        CoreaiOptValueError: ``gm`` is not a KV-cache decoder graph (``3 + 2 L`` inputs, presents written by
            ``cat([past, new], dim=-2)``), or the cache already has an activation quantizer.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    output = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    results = output.args[0] if isinstance(output.args[0], (tuple, list)) else (output.args[0],)
    pasts = placeholders[3:]
    if not pasts or len(pasts) % 2 or len(results) != 1 + len(pasts):
        raise CoreaiOptValueError(f"QuantizerConfig.kv_cache needs a KV-cache decoder graph (3 + 2 * layers inputs, "
                                  f"logits + 2 * layers outputs), got {len(placeholders)} inputs and "
                                  f"{len(results)} outputs; {_FIX}")
    container = torch.nn.Module()
    gm.add_submodule("kv_cache_quantizers", container)
    for index, (past, present) in enumerate(zip(pasts, results[1:], strict=True)):
        new = _appended(present, past)
        target = cache_quantizer_target(index)
        fq = FAKE_QUANTIZE.get_class(spec.fake_quantize).from_spec(spec)
        serves = f"present.{index // 2}.{('key', 'value')[index % 2]}"
        fq.set_name(serves)
        shape = node_shape(new, gm)
        if shape is not None and len(shape) == 4 and shape[1] > 0 and shape[3] > 0:
            fq.initialize((1, shape[1], 1, shape[3]))
        container.add_module(target.rpartition(".")[2], fq)
        with gm.graph.inserting_after(new):
            call = gm.graph.call_module(target, (new,))
        copy_provenance(new, call)
        set_meta(call, NodeMeta(kind=OpKind.QUANTIZE, module_name=get_meta(new).module_name,
                                module_type=get_meta(new).module_type,
                                quantizer=QuantizerInfo(target, Role.ACTIVATION, serves, OpKind.OTHER)))
        present.replace_input_with(new, call)
    return PassResult.after_edits(gm, len(pasts))
