r"""Rule: ``MatMulNBits`` nodes that read the same input become one ``MatMulNBits`` and a ``Split``.

A transformer block reads one normalised activation with several linears: q / k / v, and gate / up. Written one
by one they are three (two) ``MatMulNBits`` kernels per block, each quantizing (accuracy level 4) or walking the
same input again; onnxruntime-genai's builder writes them as one. With weights :math:`W_i` of :math:`N_i` rows,

.. math:: [y_1, \dots, y_m] = \mathrm{Split}_{N_1..N_m}\big(\mathrm{MatMulNBits}(x, [W_1; \dots; W_m])\big)

where :math:`[W_1; \dots; W_m]` stacks the packed weights, scales and zero points along ``N`` (each output
column is computed from its own row of weights and the shared input alone, so every output is bit-identical to the
unfused node's; a weight without zero points gets the ``2^(bits-1)`` it implied when another one has them).

Sites: every ``MatMulNBits`` (contrib domain) reading one input with the same ``K``, ``bits``, ``block_size`` and
``accuracy_level``, whose weight, scale and zero-point inputs are initializers and which has no ``g_idx`` / bias
input, **in a graph with a KV cache** (a ``Concat(past graph input, new, axis=2)`` writing a graph output). Readers
of the input that differ in one of those attributes form their own groups; a reader with a run-time weight is a near
miss, and so is every group of a graph without a cache.

Why only with a cache: one kernel saves a launch and, at accuracy level 4, quantizing the input twice more, which
pays when the kernel multiplies few rows, but the ``Split`` copies every output row, which costs when it multiplies
many. A decoder with a cache runs one row per sequence for every generated token; an encoder (or a decoder exported
without a cache) runs every token of every sequence at once. Measured in onnxruntime 1.32 (1 thread, 4-bit, block
32, 30 interleaved rounds, fused / unfused): ``K = 2048``, q / k / v of 2048 / 512 / 512 rows, one row: 0.98
(level 1) and 0.98 (level 4); ``K = 384``, three of 384 rows, one row: 1.00 / 0.95; the same at 768 rows (MiniLM,
batch 16 × 48 tokens): 1.06 / 1.06, and the whole MiniLM w4 file 1.020 → 0.985 × fp32 unfused.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper

from coreai_opt.onnx.rewrite.graph import OnnxGraph, attributes_of
from coreai_opt.onnx.rewrite.kv_cache_codes import cache_concat
from coreai_opt.onnx.rewrite.matmul_nbits_weight import INT8_EMULATED_SUFFIX
from coreai_opt.onnx.rewrite.prune import prune_unread
from coreai_opt.onnx.rewrite.rule import CONTRIB_DOMAIN, Fail, Match, Rule
from coreai_opt.quantization.matmul_nbits.packing import midpoint_zero_points

__all__ = ["FuseSharedInputMatMulNBits"]

_KEY_ATTRIBUTES = ("K", "bits", "block_size", "accuracy_level")


@dataclass(frozen=True)
class _Group(Match):
    members: tuple[onnx.NodeProto, ...]


def _is_matmul_nbits(node: onnx.NodeProto) -> bool:
    return node.op_type == "MatMulNBits" and node.domain == CONTRIB_DOMAIN


def _key(node: onnx.NodeProto) -> tuple[int, ...]:
    attrs = attributes_of(node)
    return tuple(int(attrs.get(name, 0)) for name in _KEY_ATTRIBUTES)


def _has_kv_cache(graph: OnnxGraph) -> bool:
    """Whether a graph input is a layer's past cache (read by a ``Concat`` that writes the present cache)."""
    return any(cache_concat(graph, reader) is not None for name in graph.inputs for reader in graph.readers(name))


def _constant_weights(node: onnx.NodeProto, graph: OnnxGraph) -> bool:
    return len(node.input) <= 4 and all(graph.initializer(name) is not None for name in node.input[1:] if name)


class FuseSharedInputMatMulNBits(Rule):
    """Same-input ``MatMulNBits`` -> one ``MatMulNBits`` + ``Split`` along ``N`` (module docstring)."""

    name = "fuse_shared_input_matmul_nbits"
    anchors = frozenset({"MatMulNBits"})

    def match(self, node: onnx.NodeProto, graph: OnnxGraph) -> _Group | Fail | None:
        """The first of two or more compatible ``MatMulNBits`` readers of ``node``'s input (graph order)."""
        if not _is_matmul_nbits(node):
            return None
        readers = [r for r in graph.readers(node.input[0]) if _is_matmul_nbits(r) and r.input[0] == node.input[0]]
        same = [r for r in readers if _key(r) == _key(node)]
        if len(same) < 2:
            return None
        if not _constant_weights(node, graph):
            return Fail("weight, scales or zero points are not initializers (or a g_idx / bias input is given)")
        members = [r for r in same if _constant_weights(r, graph)]  # readers come in graph order
        if len(members) < 2 or members[0] is not node:
            return None
        if not _has_kv_cache(graph):
            return Fail(f"{len(members)} readers of one input left apart: the graph has no KV cache, so each run "
                        "multiplies many rows and the Split's copy costs more than the launches it saves")
        return _Group(node, tuple(members))

    def rewrite(self, match: Match, graph: OnnxGraph) -> None:
        """Stack the members' initializers, write one ``MatMulNBits`` where the first was, split its output."""
        assert isinstance(match, _Group)
        first = match.node
        attrs = attributes_of(first)
        k, bits, block = (int(attrs[name]) for name in ("K", "bits", "block_size"))
        blocks = -(-k // block)
        sizes = [int(attributes_of(m)["N"]) for m in match.members]
        weights = [graph.constant(m.input[1]) for m in match.members]
        scales = [graph.constant(m.input[2]).reshape(-1) for m in match.members]
        with_zero_points = any(len(m.input) > 3 and m.input[3] for m in match.members)
        stem = first.name.removesuffix(INT8_EMULATED_SUFFIX) + f"_fused{len(sizes)}"
        inputs = [first.input[0],
                  graph.add_initializer(graph.unique_name(f"{stem}_B"), np.concatenate(weights, axis=0)),
                  graph.add_initializer(graph.unique_name(f"{stem}_scales"), np.concatenate(scales))]
        if with_zero_points:
            zero_points = [graph.constant(m.input[3]).reshape(-1) if len(m.input) > 3 and m.input[3]
                           else midpoint_zero_points(n, blocks, bits)
                           for m, n in zip(match.members, sizes, strict=True)]
            inputs.append(graph.add_initializer(graph.unique_name(f"{stem}_zero_points"), np.concatenate(zero_points)))
        fused = graph.unique_name(f"{stem}_out")
        suffix = INT8_EMULATED_SUFFIX if first.name.endswith(INT8_EMULATED_SUFFIX) else ""
        split = graph.shared_constant("matmul_nbits_split", np.array(sizes, np.int64))
        nodes = [helper.make_node("MatMulNBits", inputs, [fused], name=graph.unique_node_name(stem) + suffix,
                                  domain=CONTRIB_DOMAIN, K=k, N=sum(sizes), bits=bits, block_size=block,
                                  accuracy_level=int(attrs.get("accuracy_level", 0))),
                 helper.make_node("Split", [fused, split], [m.output[0] for m in match.members], axis=-1,
                                  name=graph.unique_node_name(f"{stem}_split"))]
        for member in match.members[1:]:
            graph.remove(member)
        graph.replace(first, nodes)
        prune_unread(graph, [name for member in match.members for name in member.input[1:]])  # freed now
