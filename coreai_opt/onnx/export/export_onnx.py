"""``export_onnx``: a converted model -> one checked, deterministic ONNX QDQ file.

Recipe: check the model is converted -> pick the opset from its quantizers (:mod:`coreai_opt.onnx.export.opset`) ->
``torch.onnx.export(dynamo=True)`` with the spec layer's ``quantize_dequantize`` translation -> quantize the large
weights in chunks before the model is serialised (:mod:`coreai_opt.onnx.export.prequantize_weights`: no float copy of
them reaches the protobuf, and step 1 takes their integers as computed) -> apply the ONNX
post-passes, in order (:data:`coreai_opt.onnx.rewrite.POST_PASSES`, one rule per module of
:mod:`coreai_opt.onnx.rewrite.rules`; the package docstring lists them, numbered, with what each rewrites)
-> record what they did (``{rule: count}`` and the near misses) as the ``coreai_opt.rewrites`` metadata entry
(:mod:`coreai_opt.onnx.rewrite.rewrite_report`) -> keep only the ``namespace`` entry of the exporter's per-node debug
metadata -> ``onnx.checker`` -> atomic write (:mod:`coreai_opt.onnx.export.save`).
"""

from __future__ import annotations

import inspect
import os
from collections.abc import MutableMapping, Sequence
from pathlib import Path

import numpy as np
import onnx
import torch
from torch import nn

from coreai_opt import third_party_noise
from coreai_opt.error_boundary import public_api
from coreai_opt.gc_paused import gc_paused
from coreai_opt.graph.graph_meta import get_graph_meta, output_leaves
from coreai_opt.graph.node_meta import Role, get_meta
from coreai_opt.onnx import rewrite
from coreai_opt.onnx.export.axes_probe import axes_baked_in
from coreai_opt.onnx.export.dynamic_axes import (
    BATCH,
    DynamicShapes,
    captured_bounds,
    check_axes_are_dynamic,
    input_axes,
    requested_axes,
    torch_dynamic_shapes,
)
from coreai_opt.onnx.export.export_routes import UntranslatableOpError, export_with_fallback, torchscript_export
from coreai_opt.onnx.export.exporter_optimizer import without_quadratic_rewrites
from coreai_opt.onnx.export.exporter_repairs import register_dangling_constants
from coreai_opt.onnx.export.extra_translations import extra_translation_table
from coreai_opt.onnx.export.frozen_bias_scales import bias_scales_frozen
from coreai_opt.onnx.export.input_validation import (
    check_export_inputs,
    check_io_names,
    refuse_bfloat16,
    refuse_bfloat16_compute,
)
from coreai_opt.onnx.export.kv_cache import task_io, warn_per_tensor_dynamic
from coreai_opt.onnx.export.local_decompositions import decompositions_local
from coreai_opt.onnx.export.model_quantizers import converted_quantizers, quantizer_uses
from coreai_opt.onnx.export.opset import preferred_opset, select_opset
from coreai_opt.onnx.export.prequantize_weights import (
    check_no_deferred_weights,
    defer_large_weights,
    detach_large_initializers,
    prequantize_initializers,
)
from coreai_opt.onnx.export.rounded_weights import bind_rounded_weights, rounded_weight_buffers
from coreai_opt.onnx.export.save import check_output_path, save_model_atomically
from coreai_opt.onnx.export.torchlib_registry import torchlib_registry_reused
from coreai_opt.onnx.rewrite.rewrite_report import ABSORBED_KEY, record_report
from coreai_opt.onnx.rewrite.rules.write_matmul_nbits import finish_matmul_nbits
from coreai_opt.passes.sink_weight_quantizers import eager_order
from coreai_opt.quantization.fake_quantize.calibration_state import calibration_state_hidden
from coreai_opt.quantization.matmul_nbits.int8_compute_op import Int8ComputeActivation, int8_compute_translation_table
from coreai_opt.quantization.ops.dynamic_quantize_op import dynamic_quantize_dequantize_translation_table
from coreai_opt.quantization.ops.quantize_dequantize_op import quantize_dequantize_translation_table
from coreai_opt.quantization.spec.matmul_compute import get_matmul_compute

__all__ = ["export_onnx", "BATCH_DIM_NAME", "strip_debug_metadata"]

#: Name of the symbolic batch dimension in the exported graph.
BATCH_DIM_NAME = BATCH
#: Exporter node metadata kept in the file (the module path each node came from).
_KEPT_NODE_METADATA = frozenset({"namespace", ABSORBED_KEY})


def _as_input_tuple(example_inputs: object) -> tuple[torch.Tensor, ...]:
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,)
    if isinstance(example_inputs, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in example_inputs):
        if not example_inputs:
            raise ValueError("example_inputs is empty; pass the tensor(s) the model's forward takes")
        return tuple(example_inputs)
    raise TypeError(
        "example_inputs must be a tensor or a tuple of tensors (one per forward argument), "
        f"got {type(example_inputs).__name__}"
    )


def _default_input_names(model: nn.Module, count: int) -> list[str]:
    meta = get_graph_meta(model)
    if meta is not None and meta.input_names:
        names = list(meta.input_names)
    elif isinstance(model, torch.fx.GraphModule):
        names = [str(n.target) for n in model.graph.nodes if n.op == "placeholder"]
    else:
        names = [p.name for p in inspect.signature(model.forward).parameters.values()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return names[:count]


def _names(given: Sequence[str] | None, default: list[str], count: int, what: str) -> list[str]:
    names = list(given) if given is not None else default
    if given is not None and not all(isinstance(n, str) and n for n in names):
        raise TypeError(f"{what} must be non-empty strings, got {given!r}")
    if len(names) != count:
        raise ValueError(f"{what} has {len(names)} name(s) {names} but the model has {count}; pass {count} names")
    if len(set(names)) != count:
        raise ValueError(f"{what} contains duplicates: {names}")
    return names


def _count_outputs(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> int:
    """The number of graph outputs, from the leaves recorded at capture (``GraphMeta.outputs``).

    Only a module without that record (not captured by coreai_opt, saved before it existed) or one that returns no
    leaf is run once to see its outputs.
    """
    meta = get_graph_meta(model)
    leaves = meta.outputs if meta is not None else None
    if not leaves:
        with torch.no_grad():
            outputs = eager_order(model)(*inputs)
        leaves = output_leaves(outputs)
        if not leaves:
            raise TypeError(
                f"the model must return a tensor or a (nested) tuple of tensors, got {type(outputs).__name__}"
            )
    others = [leaf for leaf in leaves if not leaf.is_tensor]
    if others:
        raise TypeError(
            f"output{others[0].path} of the model is {others[0].value} ({others[0].type_name}), and an ONNX graph "
            f"returns only tensors{f' ({len(others)} such outputs)' if len(others) > 1 else ''}; return only tensors "
            "from forward (drop the non-tensor output, or wrap the model in a module that does)"
        )
    return len(leaves)


def strip_debug_metadata(model_proto: onnx.ModelProto) -> None:
    """Keep only the ``namespace`` (module path) and ``coreai_opt.absorbed`` of each node's metadata, no graph's.

    The dynamo exporter also records the FX node text, the class hierarchy and the Python stack trace (absolute
    source paths) on every node; on small models that is as large as the quantized weights and it ties the file's
    bytes to the machine it was exported on. On the graph it records the ``torch.export`` program's signature and
    range constraints (``pkg.torch.export.*``): a list of the traced module's inputs (tens of KB for a ResNet-18),
    not a description of the ONNX graph.
    """
    kept_graph = [entry for entry in model_proto.graph.metadata_props if not entry.key.startswith("pkg.torch.")]
    del model_proto.graph.metadata_props[:]
    model_proto.graph.metadata_props.extend(kept_graph)
    for node in model_proto.graph.node:
        kept = [entry for entry in node.metadata_props if entry.key in _KEPT_NODE_METADATA]
        del node.metadata_props[:]
        node.metadata_props.extend(kept)


Exported = tuple[onnx.ModelProto, MutableMapping[str, np.ndarray], dict[str, onnx.TensorProto]]


def _export_proto(
    model: nn.Module, inputs: tuple[torch.Tensor, ...], opset: int, axes: list[dict[int, str]],
    input_names: list[str], output_names: list[str],
) -> Exported:
    """The exported protobuf, its large weights quantized in chunks, and its other large initializers held apart.

    On the dynamo route the float copies of those weights never reach the protobuf, nor does any initializer of
    at least ``PREQUANTIZE_MIN_BYTES`` (stubs stand for them: :func:`detach_large_initializers`).
    """

    def dynamo() -> Exported:
        # one rounded weight in memory at a time; derived bias scales computed once; calibration state not lifted
        with (rounded_weight_buffers(model, lazy=True) as placeholders, bias_scales_frozen(model),
              calibration_state_hidden(model)):
            program = _dynamo_export(model, inputs, opset, axes, input_names, output_names)
            register_dangling_constants(program.model)  # torch's unregistered Clip bounds (exporter_repairs.py)
            bind_rounded_weights(program.model, placeholders)
        quantized = defer_large_weights(program.model)
        detached = detach_large_initializers(program.model)
        return program.model_proto, quantized, detached

    def torchscript() -> Exported:
        with rounded_weight_buffers(model, lazy=False), bias_scales_frozen(model), calibration_state_hidden(model):
            proto = torchscript_export(model, inputs, opset, axes, input_names, output_names)
            baked = axes_baked_in(proto, inputs, axes, input_names)  # that exporter records sizes as constants
            if baked:  # export them at their example size: check_axes_are_dynamic then reports them
                fixed = [{d: name for d, name in spec.items() if name not in baked} for spec in axes]
                proto = torchscript_export(model, inputs, opset, fixed, input_names, output_names)
        return proto, prequantize_initializers(proto), {}

    with third_party_noise.scoped():  # the exporter's known harmless warnings, for this call only
        return export_with_fallback(dynamo, torchscript)


def _dynamo_export(
    model: nn.Module, inputs: tuple[torch.Tensor, ...], opset: int, axes: list[dict[int, str]],
    input_names: list[str], output_names: list[str],
) -> torch.onnx.ONNXProgram:
    # one optimizer rule's cost grows with the square of our Slice readers; torchlib's table is built once; the
    # cyclic collector would walk the whole process's objects again and again while torch allocates; only the
    # nodes torchlib cannot translate are decomposed, not the whole graph traced again
    with without_quadratic_rewrites(), torchlib_registry_reused(), gc_paused(), decompositions_local():
        return torch.onnx.export(
            model,
            inputs,
            dynamo=True,
            opset_version=opset,
            custom_translation_table={
                **quantize_dequantize_translation_table(opset),
                **dynamic_quantize_dequantize_translation_table(opset),
                **int8_compute_translation_table(),
                **extra_translation_table(opset),
            },
            dynamic_shapes=torch_dynamic_shapes(axes, captured_bounds(model, axes)),  # one capture, not two
            input_names=input_names,
            output_names=output_names,
            external_data=False,
            verbose=False,
        )


def _check_matmul_compute(model: nn.Module, requested: str | None) -> None:
    """Refuse ``matmul_compute=requested`` when the model was quantized for another compute (names the layers)."""
    if requested is None:
        return
    get_matmul_compute(requested)  # unknown name: ValueError listing the choices
    emulating = [m.name for m in model.modules() if isinstance(m, Int8ComputeActivation)]
    if requested == "float":
        other = emulating
    else:
        weights = {str(n.target) for n in getattr(getattr(model, "graph", None), "nodes", ())
                   if (info := get_meta(n).quantizer) is not None and info.role is Role.WEIGHT}
        other = [model.get_submodule(t).name for t in sorted(weights)
                 if model.get_submodule(t).spec.matmul_compute != requested]
        other = other or ([] if emulating else ["(no linear emulates int8 compute)"])
    if other:
        raise ValueError(
            f"export_onnx(matmul_compute={requested!r}) but the model was quantized for another compute at "
            f"{', '.join(other[:5])}{' ...' if len(other) > 5 else ''}: eager and onnxruntime would differ there. "
            f"Prepare with the weight spec's matmul_compute={requested!r} (e.g. "
            f"QuantizerConfig.presets.w8(compute={requested!r})), or export without matmul_compute")


@public_api
def export_onnx(
    model: nn.Module,
    example_inputs: torch.Tensor | tuple[torch.Tensor, ...],
    path: str | os.PathLike[str],
    *,
    opset: int | None = None,
    dynamic_batch: bool = True,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
    dynamic_shapes: DynamicShapes | None = None,
    matmul_compute: str | None = None,
    task: str | None = None,
) -> Path:
    """Export a converted model to an ONNX QDQ file that onnxruntime runs.

    Every quantizer becomes ``QuantizeLinear -> DequantizeLinear``; quantizers on constant weights and int32
    biases are folded so the file stores integer (or float8) initializers followed by ``DequantizeLinear``;
    weights the graph transposes are stored transposed; weight-only linears are written as ``MatMulNBits``
    (``accuracy_level=1``, float compute, or 4 for ``matmul_compute="int8"``, see ``matmul_compute`` below); 8-bit
    linears on rank > 2 inputs (a transformer's ``[batch, seq, K]``)
    are written as ``Reshape -> Gemm -> Reshape`` so onnxruntime runs them as ``QGemm`` with the int32 bias, the
    same arithmetic as ``MatMul + Add``. Of the exporter's per-node debug metadata only ``namespace`` (the
    module path) is kept: stack traces with absolute source paths would tie the bytes to the machine. What the
    post-passes rewrote, and why they skipped the near misses (``linears_to_gemm skipped node_MatMul_3
    (q_proj/linear): weight is per-block``), is stored in the file (``coreai_opt.rewrites`` metadata; shown by
    ``fusion_report(path)`` and ``coreai-opt inspect``).

    Path rules: the directory of ``path`` must exist (it is not created). Models up to
    :data:`coreai_opt.onnx.export.save.SINGLE_FILE_LIMIT_BYTES` of tensor data are one file; larger ones put their
    tensors in ``<file name>.data`` next to ``path`` (``model.onnx`` -> ``model.onnx.data``), referenced by that
    relative name, so move both files together. Files are written to temporaries in the same directory and
    moved into place with ``os.replace``, so a failed export never leaves a partial file and never damages an
    existing file at ``path``. Exporting the same model twice gives byte-identical files.

    Args:
        model: A model returned by ``coreai_opt.convert`` (or any module whose coreai_opt quantizers are all in
            export mode).
        example_inputs: A tensor or a tuple of tensors, one per forward argument.
        path: Output file.
        opset: ONNX opset; None picks the lowest one the model's dtypes and granularities allow (int8/uint8: 18,
            float8: 19, int16/uint16/int4/uint4 or any per-block quantizer: 21), and at least 20 when the model
            has a GELU, so it exports as one ``Gelu`` op (see :mod:`coreai_opt.onnx.export.opset`).
        dynamic_batch: Make dimension 0 of every input (and the outputs depending on it) symbolic (``"batch"``).
            Other axes: a model captured with ``torch.export`` keeps every axis its capture kept symbolic
            (``"sequence"``, ``"height"``, ``"width"``, ``"<input>_dim<i>"``); other models only the batch.
        input_names: Graph input names; default: the model's argument names.
        output_names: Graph output names; default ``"output"`` (one output) or ``"output_0"``, ``"output_1"``, ...
        dynamic_shapes: Per graph input name, ``{dimension: axis name}`` to make symbolic, or None for a fixed
            shape; replaces the default for the inputs it names (see :mod:`coreai_opt.onnx.export.dynamic_axes`).
        matmul_compute: How weight-only linears run in onnxruntime. They are always written as ``MatMulNBits``
            (4- / 8-bit weights, blocks of a power of two >= 16) with the accuracy level their weight spec's
            ``matmul_compute`` names: ``"float"`` (``accuracy_level=1``, exact float compute, the default of every
            preset) or ``"int8"`` (``accuracy_level=4``, int8 activations; the eager model emulates them). The
            choice is made at ``prepare`` (``QuantizerConfig.presets.w8(compute="int8")``) because the eager model
            must emulate it; passing it here only checks that the model was quantized that way and raises
            ``ValueError`` naming the layers otherwise. None: no check.
        task: ``"text-generation"``: the model is a KV-cache decoder (``coreai_opt.graph.kv_cache_decoder``); its
            inputs and outputs get onnxruntime-genai's names and symbolic axes (``input_ids``, ``attention_mask``,
            ``position_ids``, ``past_key_values.{i}.key`` ... -> ``logits``, ``present.{i}.key`` ...; see
            :mod:`coreai_opt.onnx.export.kv_cache`). None: a plain forward.

    Returns:
        The path written, as a :class:`~pathlib.Path`.

    Raises:
        TypeError: ``model`` is not an ``nn.Module`` or the inputs/names have the wrong type.
        ValueError: The model is not converted (call ``coreai_opt.convert(prepared)``), ``opset`` is too low for
            one of its dtypes, a dtype has no onnxruntime kernel, or the names do not match the model.
        FileNotFoundError: The directory of ``path`` does not exist.
    """
    quantizers = converted_quantizers(model)
    if isinstance(example_inputs, (str, os.PathLike)) and not isinstance(path, (str, os.PathLike)):
        raise TypeError("export_onnx(model, example_inputs, path) got the path before the example inputs; "
                        "pass them in that order")
    path = check_output_path(path)
    _check_matmul_compute(model, matmul_compute)
    inputs = _as_input_tuple(example_inputs)
    check_export_inputs(model, inputs)
    refuse_bfloat16(model, inputs)
    chosen_opset = select_opset(quantizer_uses(quantizers), opset, preferred=preferred_opset(model))
    if task is not None:
        input_names, output_names, dynamic_shapes = task_io(task, len(inputs), input_names, output_names,
                                                            dynamic_shapes)
        warn_per_tensor_dynamic(quantizers)
    in_names = _names(input_names, _default_input_names(model, len(inputs)), len(inputs), "input_names")
    num_outputs = _count_outputs(model, inputs)
    default_out = ["output"] if num_outputs == 1 else [f"output_{i}" for i in range(num_outputs)]
    out_names = _names(output_names, default_out, num_outputs, "output_names")
    check_io_names(in_names, out_names)

    axes = input_axes(model, inputs, in_names, dynamic_batch, dynamic_shapes)
    requested = requested_axes(in_names, dynamic_batch, dynamic_shapes)
    try:
        model_proto, quantized, detached = _export_proto(model, inputs, chosen_opset, axes, in_names, out_names)
    except UntranslatableOpError as exc:
        # a size the capture kept symbolic used as a number (timm mvitv2's relative positions: `arange(w) * (w / q)`)
        # has no ONNX translation; the axes nobody asked for are exported at their example size instead
        asked = [{d: name for d, name in spec.items() if d in dims} for spec, dims in zip(axes, requested, strict=True)]
        if "SymbolicTensor" not in str(exc) or asked == axes:
            raise
        model_proto, quantized, detached = _export_proto(model, inputs, chosen_opset, asked, in_names, out_names)
    check_axes_are_dynamic(model_proto, axes, requested)
    refuse_bfloat16_compute(model_proto)
    # the large initializers, held apart: taken over by the rewrite, then those it ends with, streamed by the save
    report = rewrite.apply(model_proto, rewrite.POST_PASSES, precomputed=quantized, detached=detached)
    del quantized
    check_no_deferred_weights(model_proto, detached)
    finish_matmul_nbits(model_proto, report)
    record_report(model_proto, report)
    strip_debug_metadata(model_proto)
    save_model_atomically(model_proto, path, detached)
    return path
