r"""Rule: a quantized KV cache written as float -> the cache stored as int8 codes (any attention).

With ``QuantizerConfig.kv_cache`` every layer writes ``present = Concat(past, S · Cast(q))``, ``q`` the int8 codes
of the new keys / values (:mod:`coreai_opt.onnx.rewrite.kv_cache_codes`): a float cache that only holds values on
the quantizer's grid.
This rule stores it as what it is, for a cache ``attention_to_group_query_attention`` did not take (another
attention form: q / k norms, a sliding window, ALiBi, ...):

.. math::

    \mathrm{present}_q = \mathrm{Concat}(\mathrm{past}_q,\ q), \qquad
    \mathrm{present} = \mathrm{Cast}(\mathrm{present}_q) \cdot S

where ``past_key_values.{i}.*`` and ``present.{i}.*`` become int8 graph inputs / outputs holding codes and the
attention reads the float ``present`` as before. Exact: the attention reads the same float32 values
(``(q - 0) · S`` either way), so the logits do not change by a bit; the cache takes a quarter of the memory.

Sites: ``Concat(axis=2)`` of a graph input (read by that ``Concat`` and ``Shape`` nodes only) and a per-head-and-channel
cache quantizer (:func:`~coreai_opt.onnx.rewrite.kv_cache_codes.cache_codes`), writing a graph output
(:func:`~coreai_opt.onnx.rewrite.kv_cache_codes.cache_concat`).
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx
from onnx import TensorProto, helper

from coreai_opt.onnx.rewrite.graph import OnnxGraph
from coreai_opt.onnx.rewrite.kv_cache_codes import CacheCodes, cache_codes, cache_concat, store_as_codes
from coreai_opt.onnx.rewrite.rule import Fail, Match, Rule

__all__ = ["Int8KvCache"]


@dataclass(frozen=True)
class _Site(Match):
    past: str
    codes: CacheCodes


class Int8KvCache(Rule):
    """``Concat(past, S · Cast(q))`` writing a cache output -> int8 cache codes, read back as ``Cast · S``."""

    name = "int8_kv_cache"
    anchors = frozenset({"Concat"})

    def match(self, node: onnx.NodeProto, graph: OnnxGraph) -> _Site | Fail | None:
        """A two-input ``Concat(axis=2)`` of a graph input and a cache quantizer, writing a graph output."""
        codes = cache_codes(graph, node.input[1]) if cache_concat(graph, node) is not None else None
        if codes is None:
            return None
        others = [r for r in graph.readers(node.input[0]) if r is not node and r.op_type != "Shape"]
        if others:  # a Shape reads only the shape, the same for codes
            return Fail(f"the past cache {node.input[0]!r} is read by {others[0].op_type} besides its Concat")
        return _Site(node, node.input[0], codes)

    def rewrite(self, match: Match, graph: OnnxGraph) -> None:
        """Concatenate codes into the output; the attention reads ``Cast(codes) · S`` under a new name."""
        assert isinstance(match, _Site)
        concat, present = match.node, match.node.output[0]
        scale = store_as_codes(graph, match.past, present, match.codes)
        cast, values = graph.unique_name(f"{present}_codes_float"), graph.unique_name(f"{present}_float")
        graph.replace_uses(present, values)
        graph.set_input(concat, 1, match.codes.codes)
        stem = concat.name or present
        nodes = [helper.make_node("Cast", [present], [cast], name=graph.unique_node_name(f"{stem}_cast"),
                                  to=TensorProto.FLOAT),
                 helper.make_node("Mul", [cast, scale], [values], name=graph.unique_node_name(f"{stem}_scale"))]
        graph.insert_after(concat, nodes)
