"""``OnnxGraph``: the one index and edit API the ONNX rewrite rules share.

It wraps the main graph of a ``ModelProto`` for one rewrite session: who produces and who reads each value (kept
up to date by every edit), constants as numpy arrays (initializers that are not graph inputs, and ``Constant``
nodes), the shapes the graph records (graph inputs, ``value_info``, graph outputs; read once), unique value and
node names, and the edits (insert / replace / remove nodes, rewire uses, add / change / remove initializers,
remove what nothing reads). Nodes are kept in a Python list in graph order and written back with
:meth:`OnnxGraph.write_back`; ``value_info`` is edited in the protobuf directly, initializers through
:class:`~coreai_opt.onnx.rewrite.initializers.Initializers` (the large ones the rules write are held outside the
protobuf until the session ends, so a replaced one is freed).

Rules edit only through these methods (never ``node.input[i] = ...`` on a node of the graph), so the maps stay
right. Why not ``onnx_ir``: see :mod:`coreai_opt.onnx.rewrite` (a round trip already changes the file's bytes).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, MutableMapping

import numpy as np
import onnx
from onnx import helper, numpy_helper

from coreai_opt.onnx.rewrite.initializers import CACHED_CONSTANT_BYTES, Initializers

__all__ = ["OnnxGraph", "Dim", "attributes_of"]

#: One dimension of a recorded shape: its size, its symbol (``"batch"``), or None when unknown.
Dim = int | str | None


def attributes_of(node: onnx.NodeProto) -> dict[str, object]:
    """The node's attributes as ``{name: Python value}``."""
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _subgraph_inputs(node: onnx.NodeProto) -> Iterator[str]:
    """Names read inside the node's subgraph attributes (``If`` / ``Loop`` bodies), recursively."""
    for attr in node.attribute:
        for graph in (*([attr.g] if attr.HasField("g") else []), *attr.graphs):
            for inner in graph.node:
                yield from inner.input
                yield from _subgraph_inputs(inner)


class OnnxGraph:
    """Live index over ``model.graph`` plus the edits the rules make (see the module docstring).

    Args:
        model: The model whose main graph is rewritten in place (functions and subgraphs are not rewritten).
        precomputed: Computed constants evaluated outside the graph (the large weights of
            :mod:`coreai_opt.onnx.export.prequantize_weights`, keyed by their ``QuantizeLinear`` output), which the
            constant folder takes instead of evaluating their nodes; used, not copied (a rule deletes what it stored).
        detached: Large initializers held outside the protobuf from the start (owned by the graph from now on).

    Attributes:
        precomputed: The ``precomputed`` values not used up yet.
    """

    def __init__(self, model: onnx.ModelProto, precomputed: MutableMapping[str, np.ndarray] | None = None,
                 detached: dict[str, onnx.TensorProto] | None = None) -> None:
        self.proto = model.graph
        self.precomputed: MutableMapping[str, np.ndarray] = {} if precomputed is None else precomputed
        self._nodes: list[onnx.NodeProto] = list(self.proto.node)
        self.inputs = frozenset(value.name for value in self.proto.input)
        self.outputs = frozenset(value.name for value in self.proto.output)
        self.edits = 0
        self._taken_values: set[str] = set()
        self._taken_nodes: set[str] = set()
        self._store = Initializers(self.proto, detached)
        self._node_constants: dict[str, np.ndarray] = {}
        self._producer: dict[str, onnx.NodeProto] = {}
        self._readers: dict[str, list[onnx.NodeProto]] = {}
        self._members: set[int] = set()
        self._position: dict[int, int] | None = None
        self._shared: dict[tuple[str, str, tuple[int, ...], bytes], str] = {}
        for node in self._nodes:
            self._index(node)
        self._shapes: dict[str, tuple[Dim, ...]] = {}
        for value in (*self.proto.input, *self.proto.value_info, *self.proto.output):
            if value.type.tensor_type.HasField("shape"):
                self._shapes[value.name] = tuple(
                    d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                    for d in value.type.tensor_type.shape.dim
                )
        self._taken_values.update(self._store, self.inputs, self.outputs)

    # ---- look-ups -------------------------------------------------------------------------------------------

    @property
    def nodes(self) -> tuple[onnx.NodeProto, ...]:
        """The nodes in graph order (a snapshot: edits do not change a tuple already returned)."""
        return tuple(self._nodes)

    def producer(self, name: str) -> onnx.NodeProto | None:
        """The node producing ``name`` (None for graph inputs, initializers and unknown names)."""
        return self._producer.get(name)

    def readers(self, name: str) -> list[onnx.NodeProto]:
        """The nodes reading ``name``, in graph order; a node reading it twice is listed twice."""
        readers = self._readers.get(name, [])
        if len(readers) > 1:
            position = self._positions()
            readers = sorted(readers, key=lambda node: position[id(node)])
        return list(readers)

    def only_reader(self, name: str) -> onnx.NodeProto | None:
        """The single node reading ``name`` once, unless it is also a graph output; else None."""
        readers = self._readers.get(name, [])
        return readers[0] if len(readers) == 1 and name not in self.outputs else None

    def contains(self, node: onnx.NodeProto) -> bool:
        """Whether ``node`` is (still) in the graph."""
        return id(node) in self._members

    def initializer(self, name: str) -> onnx.TensorProto | None:
        """The initializer called ``name``, if any (also when a graph input of that name overrides it)."""
        return self._store.get(name)

    def initializers(self) -> Iterator[onnx.TensorProto]:
        """The initializers, in file order."""
        return self._store.tensors()

    def constant(self, name: str) -> np.ndarray | None:
        """The value of ``name`` if it is a constant: an initializer that is not a graph input, or a ``Constant``."""
        if name in self._store:
            return None if name in self.inputs else self._store.array(name)
        if name in self._node_constants:
            return self._node_constants[name]
        node = self._producer.get(name)
        if node is None or node.op_type != "Constant" or node.domain not in ("", "ai.onnx"):
            return None
        value = _constant_node_value(node)
        if value is not None and value.nbytes <= CACHED_CONSTANT_BYTES:
            self._node_constants[name] = value
        return value

    def shape(self, name: str) -> tuple[Dim, ...] | None:
        """The recorded shape of ``name`` (graph input, ``value_info`` or graph output), None if none."""
        return self._shapes.get(name)

    def rank(self, name: str) -> int | None:
        """The recorded rank of ``name``, None if unknown."""
        shape = self._shapes.get(name)
        return None if shape is None else len(shape)

    # ---- names ----------------------------------------------------------------------------------------------

    def unique_name(self, base: str) -> str:
        """A value name not used in the graph nor handed out before: ``base``, else ``base_1``, ``base_2``, ..."""
        return _reserve(base, self._taken_values)

    def unique_node_name(self, base: str) -> str:
        """A node name not used in the graph nor handed out before (same scheme as :meth:`unique_name`)."""
        return _reserve(base, self._taken_nodes)

    # ---- node edits -----------------------------------------------------------------------------------------

    def insert_before(self, anchor: onnx.NodeProto, nodes: Iterable[onnx.NodeProto]) -> None:
        """Insert ``nodes`` (new ``NodeProto`` objects) right before ``anchor``, in the given order."""
        self._insert_at(self._positions()[id(anchor)], nodes)

    def insert_after(self, anchor: onnx.NodeProto, nodes: Iterable[onnx.NodeProto]) -> None:
        """Insert ``nodes`` (new ``NodeProto`` objects) right after ``anchor``, in the given order."""
        self._insert_at(self._positions()[id(anchor)] + 1, nodes)

    def replace(self, node: onnx.NodeProto, nodes: Iterable[onnx.NodeProto]) -> None:
        """Put ``nodes`` where ``node`` is and remove ``node``."""
        self.insert_before(node, nodes)
        self.remove(node)

    def remove(self, node: onnx.NodeProto) -> None:
        """Remove ``node`` (its readers keep their input names; rewire them first if they must read another)."""
        self._nodes.pop(self._positions()[id(node)])
        self._unindex(node)
        self._changed()

    def set_input(self, node: onnx.NodeProto, index: int, name: str) -> None:
        """Make input ``index`` of ``node`` read ``name``."""
        self._drop_reader(node.input[index], node)
        node.input[index] = name
        self._readers.setdefault(name, []).append(node)
        self._changed()

    def remove_input(self, node: onnx.NodeProto, index: int) -> None:
        """Delete input ``index`` of ``node`` (an optional trailing input such as a bias or a zero point)."""
        self._drop_reader(node.input[index], node)
        del node.input[index]
        self._changed()

    def set_output(self, node: onnx.NodeProto, index: int, name: str) -> None:
        """Make ``node`` produce ``name`` as its output ``index`` (``name`` must have no other producer)."""
        old = node.output[index]
        if self._producer.get(old) is node:
            del self._producer[old]
            self._forget_value(old)
        node.output[index] = name
        self._producer[name] = node
        self._taken_values.add(name)
        self._changed()

    def replace_uses(self, old: str, new: str) -> None:
        """Make every reader of ``old`` read ``new`` instead."""
        for node in self.readers(old):
            for index, name in enumerate(node.input):
                if name == old:
                    self.set_input(node, index, new)

    def sort_topologically(self) -> None:
        """Order nodes so each input is produced before it is read, in sweeps that keep the given order.

        Each sweep appends, in list order, every pending node whose inputs are all available; the nodes it had to
        skip wait for the next sweep.

        Raises:
            ValueError: A cycle or an input that nothing produces.
        """
        available = {*self._store, *self.inputs, ""}
        pending, ordered = list(self._nodes), []
        while pending:
            blocked = []
            for node in pending:
                if all(name in available for name in node.input):
                    ordered.append(node)
                    available.update(node.output)
                else:
                    blocked.append(node)
            if len(blocked) == len(pending):
                raise ValueError(f"the rewritten graph has a cycle or a missing input at node {blocked[0].name!r}")
            pending = blocked
        if any(a is not b for a, b in zip(ordered, self._nodes, strict=True)):
            self._nodes = ordered
            self._changed()

    # ---- initializers and shapes ----------------------------------------------------------------------------

    def add_initializer(self, name: str, value: np.ndarray) -> str:
        """Append an initializer called ``name`` (already unique) holding ``value``; return ``name``."""
        self._store.add(name, value)
        self._taken_values.add(name)
        self.edits += 1
        return name

    def shared_constant(self, base: str, value: np.ndarray) -> str:
        """The initializer this graph object added for ``(base, value)`` before, else a new one (unique name).

        For a constant many rewrites of one rule read (e.g. one guard bound): the first call adds it, the others
        reuse it, so a rule needs no state of its own.
        """
        key = (base, value.dtype.str, value.shape, value.tobytes())
        if key not in self._shared:
            self._shared[key] = self.add_initializer(self.unique_name(base), value)
        return self._shared[key]

    def set_initializer(self, name: str, value: np.ndarray) -> None:
        """Replace the data of initializer ``name`` in place (same position in the file)."""
        self._store.set(name, value)
        self.edits += 1

    def remove_unread(self, names: Iterable[str]) -> None:
        """Remove those of the initializers ``names`` that no node reads now (a large one is freed at once)."""
        if self._store.remove({n for n in names if n not in self._readers and n not in self.outputs}):
            self.edits += 1

    def annotate(self, name: str, elem_type: int, dims: list[Dim]) -> None:
        """Record the type and shape of a value a rule created in ``value_info`` (None: unknown dimension)."""
        self.proto.value_info.append(helper.make_tensor_value_info(name, elem_type, dims))
        self._shapes[name] = tuple(dims)
        self.edits += 1

    def set_known_shape(self, name: str, dims: tuple[Dim, ...] | None) -> None:
        """Remember (or with None forget) a value's shape for the following checks, without writing it to the file."""
        if dims is None:
            self._shapes.pop(name, None)
        else:
            self._shapes[name] = dims

    def forget_shapes(self, names: set[str]) -> None:
        """Remove the ``value_info`` of ``names`` (their shape changed) and forget their shapes."""
        for name in names:
            self._shapes.pop(name, None)
        if any(value.name in names for value in self.proto.value_info):
            kept = [value for value in self.proto.value_info if value.name not in names]
            del self.proto.value_info[:]
            self.proto.value_info.extend(kept)
            self.edits += 1

    # ---- clean-up and write back ----------------------------------------------------------------------------

    def remove_dead(self) -> None:
        """Remove the nodes no graph output depends on, then the initializers nothing reads (graph order kept)."""
        live = set(self.outputs)
        kept: list[onnx.NodeProto] = []
        for node in reversed(self._nodes):
            if any(name in live for name in node.output if name):
                kept.append(node)
                live.update(node.input)
                live.update(_subgraph_inputs(node))
        if len(kept) != len(self._nodes):
            kept_ids = {id(node) for node in kept}
            for node in self._nodes:
                if id(node) not in kept_ids:
                    self._unindex(node)
            self._nodes = kept[::-1]
            self._changed()
        if self._store.keep_only(live):
            self.edits += 1

    def write_back(self, *, detached: bool = False) -> dict[str, onnx.TensorProto]:
        """Store the nodes and the detached initializers in the protobuf (the object is not used afterwards).

        With ``detached`` the detached initializers are returned instead (their stubs stay, for
        :func:`~coreai_opt.onnx.export.save.save_model_atomically` to stream), else ``{}``. The ``value_info`` of
        values no node produces any more (folded away by a rule: a float weight, the scale chain of its fake
        quantizer) is dropped: it only adds bytes, and a later pass re-creating the name would inherit a stale shape.
        """
        released = self._store.release() if detached else {}
        if not detached:
            self._store.attach()
        del self.proto.node[:]
        self.proto.node.extend(self._nodes)
        live = set(self._producer) | {value.name for value in self.proto.input}
        live |= {tensor.name for tensor in self.proto.initializer}
        if any(value.name not in live for value in self.proto.value_info):
            kept = [value for value in self.proto.value_info if value.name in live]
            del self.proto.value_info[:]
            self.proto.value_info.extend(kept)
        self._members.clear()
        return released

    # ---- internals ------------------------------------------------------------------------------------------

    def _insert_at(self, index: int, nodes: Iterable[onnx.NodeProto]) -> None:
        new = list(nodes)
        self._nodes[index:index] = new
        for node in new:
            self._index(node)
        self._changed()

    def _index(self, node: onnx.NodeProto) -> None:
        self._members.add(id(node))
        for name in node.input:
            self._readers.setdefault(name, []).append(node)
        for name in node.output:
            if name:
                self._producer[name] = node
                self._taken_values.add(name)
        self._taken_nodes.add(node.name)

    def _unindex(self, node: onnx.NodeProto) -> None:
        self._members.discard(id(node))
        for name in node.input:
            self._drop_reader(name, node)
        for name in node.output:
            if self._producer.get(name) is node:
                del self._producer[name]
                self._forget_value(name)

    def _drop_reader(self, name: str, node: onnx.NodeProto) -> None:
        readers = self._readers.get(name, [])
        for i, reader in enumerate(readers):
            if reader is node:
                del readers[i]
                break
        if not readers:
            self._readers.pop(name, None)

    def _forget_value(self, name: str) -> None:
        if name not in self._store:
            self._node_constants.pop(name, None)

    def _positions(self) -> dict[int, int]:
        if self._position is None:
            self._position = {id(node): i for i, node in enumerate(self._nodes)}
        return self._position

    def _changed(self) -> None:
        self._position = None
        self.edits += 1


def _constant_node_value(node: onnx.NodeProto) -> np.ndarray | None:
    """The tensor a ``Constant`` node holds (``value`` or a float / int (list) attribute), None for other kinds."""
    attrs = attributes_of(node)
    if "value" in attrs:
        return numpy_helper.to_array(attrs["value"])
    for key, dtype in (("value_float", np.float32), ("value_floats", np.float32), ("value_int", np.int64),
                       ("value_ints", np.int64)):
        if key in attrs:
            return np.asarray(attrs[key], dtype=dtype)
    return None


def _reserve(base: str, taken: set[str]) -> str:
    name, i = base, 1
    while name in taken:
        name, i = f"{base}_{i}", i + 1
    taken.add(name)
    return name
