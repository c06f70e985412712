"""The one check of the tensors given to ``calibrate``, ``export_onnx`` and ``verify_onnx`` (and the one error).

Every entry point that feeds tensors to a prepared / converted model calls :func:`check_inputs` (or keeps the
:class:`InputCheck` of :func:`input_check` for many batches). Each rule raises
:class:`~coreai_opt.errors.InputValidationError` (a ``ValueError``) whose message is ``"{where}: {problem}; {fix}"``,
where ``where`` names the call and batch (``"calibration batch 3"``, ``"export_onnx example_inputs"``,
``"verify_onnx batch 0"``) and the rest is the same for the same bad input in every entry point. The checks run
before torch or onnxruntime meet the tensor (their own errors, ``IndexError: index out of range in self`` or
``aminmax: Expected reduction dim 1 to have non-zero size``, name neither). In order:

* **count and names**: at most one positional input per ``forward`` argument; keyword inputs only by those names;
* **dtype and rank**: like the example input given to ``prepare``. A float input may have the recorded dtype or
  the dtype of one of the model's float parameters (``model.float()`` after a bfloat16 prepare); an integer or bool
  input any dtype of its kind;
* **shape, torch.export capture**: the graph is specialised to the example's sizes, except dimension 0 (the batch)
  and the axes the capture kept symbolic (``GraphMeta.dynamic_axes``); an FX graph runs on any size it supports;
* **empty tensors**: an input with a zero-size dimension whose example input had elements;
* **token ids**: an integer input that feeds an embedding directly must hold ids in ``[0, rows)``.

A module that coreai_opt did not prepare (nothing recorded) is not checked.
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

__all__ = ["TokenInput", "InputCheck", "input_check", "check_inputs", "token_inputs", "differing_shape"]


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


def _dtype_name(value: Tensor) -> str:
    return str(value.dtype).removeprefix("torch.")


def _free_dims(meta: GraphMeta, name: str) -> frozenset[int]:
    """Dimensions of input ``name`` that may differ from the example: the batch, and any the capture kept symbolic."""
    return frozenset({0} | set((meta.dynamic_axes or {}).get(name, {})))


def differing_shape(meta: GraphMeta, given: Mapping[str, Any]) -> tuple[InputSpec, tuple[int, ...]] | None:
    """The first input whose sizes differ from the example outside its free dimensions (batch, symbolic axes)."""
    for spec in meta.input_specs:
        value = given.get(spec.name)
        if not isinstance(value, Tensor) or value.dim() != len(spec.shape):
            continue
        free = _free_dims(meta, spec.name)
        if any(size != recorded for d, (size, recorded) in enumerate(zip(value.shape, spec.shape, strict=True))
               if d not in free):
            return spec, tuple(value.shape)
    return None


@dataclass(frozen=True)
class InputCheck:
    """What the checks of one model need, gathered once (``input_check(model)``), applied per batch.

    Attributes:
        meta: The model's graph metadata (input names and the example inputs' specs).
        tokens: The inputs that index an embedding directly.
        float_dtypes: Dtype names of the model's float parameters (a float input may have one of them).
    """

    meta: GraphMeta
    tokens: tuple[TokenInput, ...]
    float_dtypes: frozenset[str]

    @classmethod
    def for_model(cls, model: nn.Module, meta: GraphMeta) -> InputCheck:
        """Gather the checks of ``model``, whose metadata is ``meta``."""
        tokens = tuple(token_inputs(model, list(meta.input_names))) if isinstance(model, fx.GraphModule) else ()
        return cls(meta, tokens, frozenset(_dtype_name(p) for p in model.parameters() if p.is_floating_point()))

    def given(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """Map positional and keyword inputs to the model's input names."""
        return dict(zip(self.meta.input_names, args, strict=False)) | dict(kwargs)

    def __call__(self, args: Sequence[Any], kwargs: Mapping[str, Any], where: str) -> None:
        """Check one call's inputs (module docstring); ``where`` starts the message.

        Raises:
            InputValidationError: naming the input, what ``prepare`` recorded, and the fix.
        """
        self._check_names(args, kwargs, where)
        given = self.given(args, kwargs)
        for spec in self.meta.input_specs:
            value = given.get(spec.name)
            if isinstance(value, Tensor):
                self._check_dtype_and_rank(spec, value, where)
        self._check_specialised_shape(given, where)
        for spec in self.meta.input_specs:
            value = given.get(spec.name)
            if isinstance(value, Tensor):
                _check_nonempty(spec, value, where, _free_dims(self.meta, spec.name) - {0})
        for token in self.tokens:
            value = given.get(token.input)
            if isinstance(value, Tensor):
                _check_token_ids(token, value, where)

    def _check_names(self, args: Sequence[Any], kwargs: Mapping[str, Any], where: str) -> None:
        names = list(self.meta.input_names)
        if not names:
            return
        if len(args) > len(names):
            raise InputValidationError(
                f"{where}: {len(args)} positional inputs given but the model takes {len(names)} ({', '.join(names)});"
                " pass one tensor per model input, in order, like the example inputs given to prepare"
            )
        unknown = [key for key in kwargs if key not in names]
        if unknown:
            raise InputValidationError(
                f"{where}: unknown keyword input(s) {', '.join(map(repr, unknown))}; the model's inputs are "
                f"{', '.join(names)}; use those names as keywords (dict keys)"
            )

    def _check_dtype_and_rank(self, spec: InputSpec, value: Tensor, where: str) -> None:
        dtype = _dtype_name(value)
        same_kind = value.is_floating_point() == getattr(torch, spec.dtype).is_floating_point
        float_ok = not value.is_floating_point() or dtype == spec.dtype or dtype in self.float_dtypes
        if not same_kind or not float_ok or value.dim() != len(spec.shape):
            raise InputValidationError(
                f"{where}: input '{spec.name}' is {dtype} of shape {tuple(value.shape)} but the example input given "
                f"to prepare was {spec.dtype} of shape {spec.shape}; pass inputs of that dtype and rank (only the "
                "batch dimension is free)"
            )

    def _check_specialised_shape(self, given: Mapping[str, Any], where: str) -> None:
        if self.meta.capture != "export":
            return
        differing = differing_shape(self.meta, given)
        if differing is None:
            return
        spec, shape = differing
        free = sorted(_free_dims(self.meta, spec.name))
        which = "the batch dimension" if free == [0] else "dimensions " + ", ".join(map(str, free))
        raise InputValidationError(
            f"{where}: input '{spec.name}' has shape {shape} but the model was captured with torch.export for "
            f"{spec.shape}; pass inputs of shape {spec.shape} (only {which} may change), or prepare with "
            "dynamic_shapes naming the dimensions that vary"
        )


def _check_nonempty(spec: InputSpec, value: Tensor, where: str, symbolic: frozenset[int]) -> None:
    """Refuse an empty input whose example had elements.

    An input empty only along axes the capture kept symbolic (besides the batch) passes: a KV cache of past
    length 0 at prefill.
    """
    if value.numel() > 0 or (value.dim() > 0 and value.shape[0] > 0
                             and all(d in symbolic for d, size in enumerate(value.shape) if size == 0)):
        return
    if all(size > 0 for size in spec.shape):
        raise InputValidationError(
            f"{where}: input '{spec.name}' has shape {tuple(value.shape)}, which holds no elements (the example "
            f"input given to prepare had shape {spec.shape}); skip empty batches (e.g. a DataLoader over an empty "
            "shard, or a filtered batch with no samples left)"
        )


def _check_token_ids(token: TokenInput, value: Tensor, where: str) -> None:
    if value.is_floating_point() or value.is_complex() or value.numel() == 0:
        return
    low, high = (int(v) for v in torch.aminmax(value.detach().reshape(-1).long()))
    if low < 0 or high >= token.rows:
        bad = low if low < 0 else high
        raise InputValidationError(
            f"{where}: input '{token.input}' holds token id {bad}, but embedding '{token.embedding}' has "
            f"{token.rows} rows (valid ids 0..{token.rows - 1}); use the tokenizer that matches the model's "
            f"vocabulary, and pad with an id below {token.rows}"
        )


def input_check(model: nn.Module) -> InputCheck | None:
    """The :class:`InputCheck` of a prepared / converted model, or None for a module coreai_opt did not prepare."""
    meta = get_graph_meta(model)
    return InputCheck.for_model(model, meta) if meta is not None else None


def check_inputs(model: nn.Module, args: Sequence[Any], kwargs: Mapping[str, Any], where: str) -> None:
    """Check one call's inputs against what ``prepare`` recorded (module docstring); no-op for other modules.

    Raises:
        InputValidationError: ``"{where}: {problem}; {fix}"``, naming the input.
    """
    check = input_check(model)
    if check is not None:
        check(args, kwargs, where)
