"""``Initializers``: the initializers of one rewrite session, the large ones it writes held outside the protobuf.

With protobuf's ``upb`` runtime (the one ``pip`` installs) the memory of a message is freed only with the message it
belongs to: an initializer appended to a ``ModelProto`` and later replaced or deleted stays resident until the whole
model goes (measured: appending 500 MB of initializers and deleting them all still holds +562 MB). The rules replace
their large initializers more than once (the folded integers, then the packed ``MatMulNBits`` weights, then their
q / k / v concatenation), so every generation would stay: +2.3 GB on a 1.1 B decoder whose file is 0.7 GB.

So an initializer of more than :data:`DETACHED_BYTES` that the session adds or sets is *detached*: a standalone
``TensorProto`` (its own arena, freed as soon as it is replaced or removed), while the graph's initializer list holds
a *stub* of the same name at its place (the name only). The session reads the detached message wherever it reads an
initializer. When the session ends, :meth:`Initializers.attach` copies each detached tensor into its stub (one at a
time, so the copies never coexist) or :meth:`Initializers.release` hands them to the caller, who streams them into
the file (:func:`coreai_opt.onnx.export.save.save_model_atomically`). Either way the file's order and bytes are those
of a session that appended everything to the protobuf.

Initializers the model arrived with stay where they are (they are in the model's arena already). Constants up to
:data:`CACHED_CONSTANT_BYTES` are also cached as numpy arrays; larger ones are converted when read.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import onnx
from onnx import numpy_helper

__all__ = ["CACHED_CONSTANT_BYTES", "DETACHED_BYTES", "Initializers", "attach_detached"]

#: Constants up to this many bytes are cached as numpy arrays; a weight is converted when read (llm_memory RESULTS).
CACHED_CONSTANT_BYTES = 1 << 20
#: Initializers the session writes that are larger than this are held outside the protobuf until it ends.
DETACHED_BYTES = 1 << 20


class Initializers:
    """The initializers of ``graph`` for one rewrite session (see the module docstring).

    Args:
        graph: The graph whose ``initializer`` list is edited in place.
        detached: Initializers already held outside ``graph`` (its entries of those names are stubs), taken over:
            the store owns them from now on, so one it replaces or removes is freed.
    """

    def __init__(self, graph: onnx.GraphProto, detached: dict[str, onnx.TensorProto] | None = None) -> None:
        self._graph = graph
        self._detached: dict[str, onnx.TensorProto] = {} if detached is None else detached
        self._tensors = {t.name: self._detached.get(t.name, t) for t in graph.initializer}
        self._arrays: dict[str, np.ndarray] = {}

    def __contains__(self, name: object) -> bool:
        return name in self._tensors

    def __iter__(self) -> Iterator[str]:
        """The names, in file order."""
        return (stub.name for stub in self._graph.initializer)

    def get(self, name: str) -> onnx.TensorProto | None:
        """The initializer called ``name`` (the detached message when it is detached), None if there is none."""
        return self._tensors.get(name)

    def tensors(self) -> Iterator[onnx.TensorProto]:
        """The initializers, in file order."""
        return (self._tensors[stub.name] for stub in self._graph.initializer)

    def array(self, name: str) -> np.ndarray | None:
        """The value of initializer ``name`` as numpy (cached up to :data:`CACHED_CONSTANT_BYTES`)."""
        if name in self._arrays:
            return self._arrays[name]
        tensor = self._tensors.get(name)
        if tensor is None:
            return None
        value = numpy_helper.to_array(tensor)
        if value.nbytes <= CACHED_CONSTANT_BYTES:
            self._arrays[name] = value
        return value

    def add(self, name: str, value: np.ndarray) -> None:
        """Append initializer ``name`` (unique) holding ``value``; detached when larger than :data:`DETACHED_BYTES`."""
        tensor = numpy_helper.from_array(value, name)
        if value.nbytes > DETACHED_BYTES:
            self._graph.initializer.add().name = name
            self._detached[name] = self._tensors[name] = tensor
        else:
            self._graph.initializer.append(tensor)
            self._tensors[name] = self._graph.initializer[-1]
        self._cache(name, value)

    def set(self, name: str, value: np.ndarray) -> None:
        """Replace the data of initializer ``name`` (same place in the file); a large value is held detached."""
        tensor = numpy_helper.from_array(value, name)
        if value.nbytes > DETACHED_BYTES or name in self._detached:
            if name not in self._detached:  # the model's own tensor becomes a stub (its bytes stay in the arena)
                stub = self._tensors[name]
                stub.Clear()
                stub.name = name
            self._detached[name] = self._tensors[name] = tensor
        else:
            self._tensors[name].CopyFrom(tensor)
        self._cache(name, value)

    def _cache(self, name: str, value: np.ndarray) -> None:
        self._arrays.pop(name, None)
        if value.nbytes <= CACHED_CONSTANT_BYTES:
            self._arrays[name] = value

    def keep_only(self, live: set[str]) -> bool:
        """Remove the initializers not in ``live`` (file order kept); whether any was removed."""
        return self.remove({name for name in self._tensors if name not in live})

    def remove(self, names: set[str]) -> bool:
        """Remove the initializers ``names`` (one by one, file order kept); whether any was removed."""
        dead = [i for i, stub in enumerate(self._graph.initializer) if stub.name in names]
        for index in reversed(dead):  # re-adding the survivors would copy every weight into the arena again
            name = self._graph.initializer[index].name
            del self._graph.initializer[index]
            for table in (self._tensors, self._detached, self._arrays):
                table.pop(name, None)
        return bool(dead)

    def attach(self) -> None:
        """Copy every detached tensor into its stub, in file order, freeing each as it goes."""
        attach_detached(self._graph, self._detached)
        self._tensors = {stub.name: stub for stub in self._graph.initializer}

    def release(self) -> dict[str, onnx.TensorProto]:
        """Hand the detached tensors to the caller (the graph keeps their stubs) and forget them."""
        released, self._detached = self._detached, {}
        for name in released:
            self._tensors.pop(name, None)
        return released


def attach_detached(graph: onnx.GraphProto, detached: dict[str, onnx.TensorProto]) -> None:
    """Copy each of ``detached`` into ``graph``'s stub of the same name, in file order.

    Each entry is consumed (and freed) as it is copied, so a tensor's two copies never coexist for long.
    """
    for stub in graph.initializer:
        tensor = detached.pop(stub.name, None)
        if tensor is not None:
            stub.CopyFrom(tensor)
            del tensor
