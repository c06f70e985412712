"""Checks of the tensors given to ``calibrate`` / ``export_onnx`` / ``verify_onnx`` against the prepared model.

Each check raises :class:`~coreai_opt.errors.InputValidationError` naming the input and the fix, before torch or
onnxruntime meets the tensor (their own errors, ``IndexError: index out of range in self`` or ``aminmax:
Expected reduction dim 1 to have non-zero size``, name neither):

* **empty tensors**: an input with a zero-size dimension whose example input (given to ``prepare``) had elements;
* **token ids**: an integer input that feeds an embedding directly must hold ids in ``[0, rows)``;
* **dtype and rank** (:func:`check_model_inputs`, for export / verify): like the example input; a float input
  may also have the dtype of the model's parameters (``model.float()`` after a bfloat16 prepare).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, fx, nn

from coreai_opt.errors import InputValidationError
from coreai_opt.graph.graph_attrs import attr_value
from coreai_opt.graph.graph_meta import GraphMeta, InputSpec, get_graph_meta
from coreai_opt.graph.node_meta import get_meta
from coreai_opt.graph.op_kinds import ArgLayout, OpKind, lookup_op

__all__ = ["TokenInput", "token_inputs", "given_inputs", "check_batch", "check_model_inputs", "prepared_meta"]


@dataclass(frozen=True)
class TokenInput:
    """A model input that indexes an embedding directly.

    Attributes:
        input: The model input's name.
        embedding: Name of the embedding (module name, or the graph node).
        rows: Number of rows of the embedding table (valid ids: ``0 .. rows - 1``).
    """

    input: str
    embedding: str
    rows: int


def _table_rows(gm: fx.GraphModule, node: fx.Node, weight: Any) -> int | None:
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        return int(module.num_embeddings) if isinstance(module, nn.Embedding) else None
    while isinstance(weight, fx.Node) and weight.op == "call_module" and weight.args:  # through the weight quantizer
        weight = weight.args[0]
    if isinstance(weight, fx.Node) and weight.op == "get_attr":
        tensor = attr_value(gm, weight.target)
        return int(tensor.shape[0]) if isinstance(tensor, Tensor) and tensor.dim() == 2 else None
    return None


def token_inputs(gm: fx.GraphModule, input_names: Sequence[str]) -> list[TokenInput]:
    """Every ``(input, embedding)`` pair where a model input is the index operand of an embedding."""
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    names = list(input_names) if len(input_names) == len(placeholders) else [str(n.target) for n in placeholders]
    by_node = dict(zip(placeholders, names, strict=True))
    found = []
    for node in gm.graph.nodes:
        meta = get_meta(node)
        if meta.kind is not OpKind.EMBEDDING:
            continue
        layout = lookup_op(node, gm).layout
        indices = ArgLayout.get(node, layout.data[0])
        rows = _table_rows(gm, node, ArgLayout.get(node, layout.weight))
        if indices in by_node and rows is not None:
            found.append(TokenInput(by_node[indices], meta.module_name or node.name, rows))
    return found


def given_inputs(names: Sequence[str], args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Map positional and keyword inputs to the model's input names."""
    return dict(zip(names, args, strict=False)) | dict(kwargs)


def _check_nonempty(specs: Sequence[InputSpec], given: Mapping[str, Any], where: str,
                    dynamic_axes: Mapping[str, Mapping[int, str]] | None = None) -> None:
    for spec in specs:
        value = given.get(spec.name)
        if not isinstance(value, Tensor) or value.numel() > 0:
            continue
        free = set((dynamic_axes or {}).get(spec.name, {})) - {0}
        if value.dim() > 0 and value.shape[0] > 0 and all(d in free for d, size in enumerate(value.shape) if size == 0):
            continue  # empty along an axis the capture kept symbolic (a KV cache of past length 0 at prefill)
        example = tuple(spec.shape)
        if all(size > 0 for size in example):
            raise InputValidationError(
                f"{where}: input '{spec.name}' has shape {tuple(value.shape)}, which holds no elements (the "
                f"example input given to prepare had shape {example}); skip empty batches (e.g. a DataLoader over "
                "an empty shard, or a filtered batch with no samples left)"
            )


def _check_token_ids(tokens: Sequence[TokenInput], given: Mapping[str, Any], where: str) -> None:
    for token in tokens:
        value = given.get(token.input)
        if not isinstance(value, Tensor) or value.is_floating_point() or value.is_complex() or value.numel() == 0:
            continue
        low, high = (int(v) for v in torch.aminmax(value.detach().reshape(-1).long()))
        if low < 0 or high >= token.rows:
            bad = low if low < 0 else high
            raise InputValidationError(
                f"{where}: input '{token.input}' holds token id {bad}, but embedding '{token.embedding}' has "
                f"{token.rows} rows (valid ids 0..{token.rows - 1}); use the tokenizer that matches the model's "
                f"vocabulary, and pad with an id below {token.rows}"
            )


def check_batch(meta: GraphMeta, tokens: Sequence[TokenInput], given: Mapping[str, Any], where: str) -> None:
    """Empty-tensor and token-id checks of one batch (``where`` starts the message, e.g. ``"calibration batch 3"``).

    Raises:
        InputValidationError: an empty input, or a token id outside its embedding.
    """
    _check_nonempty(meta.input_specs, given, where, meta.dynamic_axes)
    _check_token_ids(tokens, given, where)


def prepared_meta(model: object) -> GraphMeta | None:
    """The coreai_opt metadata of a prepared / converted model, or None for any other module."""
    return get_graph_meta(model)


def _float_dtypes(model: nn.Module) -> set[str]:
    return {str(p.dtype).removeprefix("torch.") for p in model.parameters() if p.is_floating_point()}


def _check_dtype_and_rank(model: nn.Module, spec: InputSpec, value: Tensor, where: str) -> None:
    dtype = str(value.dtype).removeprefix("torch.")
    recorded = spec.dtype
    same_kind = value.is_floating_point() == getattr(torch, recorded).is_floating_point
    float_ok = dtype == recorded or not value.is_floating_point() or dtype in _float_dtypes(model)
    if not same_kind or not float_ok or value.dim() != len(spec.shape):
        raise InputValidationError(
            f"{where}: input '{spec.name}' is {dtype} of shape {tuple(value.shape)} but the example input given "
            f"to prepare was {recorded} of shape {spec.shape}; pass inputs of that dtype and rank (only "
            "the batch dimension is free)"
        )


def check_model_inputs(model: nn.Module, args: Sequence[Any], where: str) -> None:
    """Check positional inputs of a prepared / converted model: count, dtype, rank, emptiness, token ids.

    A module that was not prepared by coreai_opt (nothing recorded) is not checked.

    Raises:
        InputValidationError: naming the input, what was recorded at prepare and the fix.
    """
    meta = prepared_meta(model)
    if meta is None:
        return
    names = list(meta.input_names)
    if names and len(args) > len(names):
        raise InputValidationError(
            f"{where}: {len(args)} inputs given but the model takes {len(names)} ({', '.join(names)}); pass one "
            "tensor per model input, in order"
        )
    given = given_inputs(names, args, {})
    for spec in meta.input_specs:
        value = given.get(spec.name)
        if isinstance(value, Tensor):
            _check_dtype_and_rank(model, spec, value, where)
    check_batch(meta, token_inputs(model, names) if isinstance(model, fx.GraphModule) else [], given, where)
