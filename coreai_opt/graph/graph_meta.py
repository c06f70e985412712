"""Graph-level coreai_opt metadata: one frozen :class:`GraphMeta` in ``gm.meta["coreai_opt"]``, read only here.

``capture`` writes it, ``prepare`` and ``convert`` replace it (``dataclasses.replace``), and every other module
reads it through :func:`get_graph_meta` / :func:`require_graph_meta`. It pickles and deep-copies with the
GraphModule. A plain dict in that slot (a model saved before ``GraphMeta`` existed) is read as one.
``meta["config"]``-style read access keeps working for code written against the earlier dict.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import torch
from torch import Tensor, fx
from torch.utils import _pytree as pytree

from coreai_opt.graph.node_meta import META_KEY

__all__ = ["GraphMeta", "InputSpec", "OutputLeaf", "output_leaves", "get_graph_meta", "require_graph_meta",
           "set_graph_meta"]


@dataclass(frozen=True)
class InputSpec:
    """One tensor input of the example given to ``prepare``: its argument name, dtype name and shape."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    def __getitem__(self, key: str) -> Any:
        """Dict-style read access (``spec["shape"]``), as with the dict this class replaced."""
        return _field(self, key)


@dataclass(frozen=True)
class OutputLeaf:
    """One leaf of what ``forward`` returns, in pytree order (``torch.utils._pytree``; ``None`` is a leaf).

    Attributes:
        path: The pytree key path (``""`` for a lone tensor, ``"[1]"``, ``"['logits']"``).
        type_name: ``"Tensor"``, or the type of a non-tensor leaf (``"NoneType"``, ``"int"``).
        value: ``repr`` of a non-tensor leaf (``"None"``); ``""`` for a tensor.
    """

    path: str
    type_name: str
    value: str = ""

    @property
    def is_tensor(self) -> bool:
        """True for a tensor leaf."""
        return self.type_name == "Tensor"


def output_leaves(outputs: Any) -> tuple[OutputLeaf, ...]:
    """Describe a return value leaf by leaf (a ``torch.SymInt`` of a torch.export capture is an ``int``)."""
    leaves = []
    for path, value in pytree.tree_flatten_with_path(outputs)[0]:
        if isinstance(value, Tensor):
            leaves.append(OutputLeaf(pytree.keystr(path), "Tensor"))
        else:
            type_name = "int" if isinstance(value, torch.SymInt) else type(value).__name__
            leaves.append(OutputLeaf(pytree.keystr(path), type_name, repr(value)))
    return tuple(leaves)


@dataclass(frozen=True)
class GraphMeta:
    """What coreai_opt records about a captured, prepared or converted GraphModule.

    Attributes:
        capture: ``"fx"`` or ``"export"``, the capture that produced the graph.
        input_names: The model's ``forward`` argument names (the graph's inputs).
        converted: True after ``convert``.
        qat: True when prepared for quantization-aware training.
        input_specs: The tensor example inputs, bound to ``forward``'s signature once at capture (calibration
            batches and export / verify inputs are checked against them).
        config: ``QuantizerConfig.to_dict()`` of the config used by ``prepare`` (None before ``prepare``).
        dynamic_axes: The axes the capture kept symbolic, ``{argument: {dimension: axis name}}`` (``batch``,
            ``sequence``, ``height``, ``width``; see :mod:`coreai_opt.graph.dynamic_dims`); None for an FX capture,
            whose export keeps the batch axis only.
        outputs: The leaves of ``forward``'s return value on the example inputs, recorded at capture (the
            exporter names and checks the graph outputs from them); None when not recorded (a model saved before).
        axis_bounds: The largest size the capture allows for each of those axes where the model bounds it,
            ``{axis name: size}`` (``{"sequence": 64}`` for 64 position embeddings); the export declares it.
    """

    capture: str
    input_names: tuple[str, ...] = ()
    converted: bool = False
    qat: bool = False
    input_specs: tuple[InputSpec, ...] = ()
    config: dict[str, Any] | None = None
    dynamic_axes: dict[str, dict[int, str]] | None = None
    outputs: tuple[OutputLeaf, ...] | None = None
    axis_bounds: dict[str, int] | None = None

    def __getitem__(self, key: str) -> Any:
        """Dict-style read access (``meta["config"]``), as with the dict this class replaced."""
        return _field(self, key)

    def get(self, key: str, default: Any = None) -> Any:
        """Dict-style ``meta.get("capture")``: the field's value, ``default`` for a name that is no field."""
        try:
            return _field(self, key)
        except KeyError:
            return default

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GraphMeta:
        """Read the dict that ``gm.meta["coreai_opt"]`` held before this class (unknown keys are ignored)."""
        specs = tuple(InputSpec(s["name"], s["dtype"], tuple(s["shape"])) for s in data.get("input_specs", ()))
        return cls(capture=str(data.get("capture", "?")), input_names=tuple(data.get("input_names", ())),
                   converted=bool(data.get("converted", False)), qat=bool(data.get("qat", False)),
                   input_specs=specs, config=data.get("config"), dynamic_axes=data.get("dynamic_axes"),
                   axis_bounds=data.get("axis_bounds"))


def _field(record: object, key: str) -> Any:
    if key not in {f.name for f in fields(record)}:
        raise KeyError(key)
    return getattr(record, key)


def get_graph_meta(model: object) -> GraphMeta | None:
    """The model's :class:`GraphMeta`, or None when it is not a GraphModule made by coreai_opt."""
    meta = getattr(model, "meta", None) if isinstance(model, fx.GraphModule) else None
    value = meta.get(META_KEY) if isinstance(meta, dict) else None
    if isinstance(value, dict):
        return GraphMeta.from_dict(value)
    return value if isinstance(value, GraphMeta) else None


def require_graph_meta(model: object, caller: str) -> GraphMeta:
    """The model's :class:`GraphMeta`; raise naming the step that produces it.

    Raises:
        TypeError: ``model`` was not produced by ``coreai_opt.prepare``.
    """
    meta = get_graph_meta(model)
    if meta is None:
        raise TypeError(
            f"{caller} expects a model returned by coreai_opt.prepare(...), got {type(model).__name__}; "
            "call prepared = coreai_opt.prepare(model, config, example_inputs) first"
        )
    return meta


def set_graph_meta(gm: fx.GraphModule, meta: GraphMeta) -> None:
    """Store ``meta`` as the GraphModule's coreai_opt metadata."""
    if not isinstance(meta, GraphMeta):
        raise TypeError(f"set_graph_meta needs a GraphMeta, got {type(meta).__name__}")
    gm.meta[META_KEY] = meta
