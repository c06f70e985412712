r"""Rule: the KV-cache decoder's float attention block -> per-row ``RotaryEmbedding`` + one ``GroupQueryAttention``.

:mod:`coreai_opt.graph.kv_cache_decoder` exports each layer's attention as about 40 small kernels: the q / k / v
projections reshaped to heads, rotary as ``Slice / Neg / Concat / Mul / Add`` per q and k, the cache ``Concat``,
the grouped scores ``MatMul -> Mul(scale) -> Add(mask bias) -> Softmax -> Mul(live rows) -> MatMul`` and the
``Reshape / Transpose`` chain back to ``(batch, sequence, heads · D)``. On a one-token decode step their per-kernel
overhead dominates. This rule writes the block in three onnxruntime kernels: with :math:`q, k, v` the projections,
:math:`P` the past length, :math:`T = P + S` and positions :math:`p_{b,t}` (``position_ids``, per row),

.. math::

    \mathrm{rot}(x)_{b,t} = x_{b,t} \odot \cos_{p_{b,t}} + [-x_{b,t,D/2:}, x_{b,t,:D/2}] \odot \sin_{p_{b,t}}, \quad
    K = [K_\mathrm{past}; \mathrm{rot}(k)], \; V = [V_\mathrm{past}; v], \quad
    o = \mathrm{softmax}\big(s \cdot \mathrm{rot}(q) K^\top + c + b\big) V

per key / value head group, where :math:`c` is the causal term (0 for key :math:`j \le P + i`, :math:`-\infty`
after), applied by the kernel itself, and :math:`b` is 0 for a key whose ``attention_mask`` is 1 and
:math:`-\infty` for a padding key. The nodes are ``RotaryEmbedding(x, position_ids, cos_cache, sin_cache)``
(``com.microsoft``, ``interleaved=0``) for ``x`` = q and k, on the ``(batch, sequence, heads · D)`` projections,
and ``GroupQueryAttention(rot(q), rot(k), v, past_key, past_value, seqlens_k, total_sequence_length, "", "", "",
attention_bias)`` (``com.microsoft``, ``do_rotary=0``, ``scale`` = s), which writes ``present.{i}.key / value``
itself (BNSH).

**An int8 cache** (``QuantizerConfig.kv_cache``, :mod:`coreai_opt.onnx.rewrite.kv_cache_codes`): when the new keys
and values reach the cache ``Concat`` through the cache quantizers (``S · Cast(q)``, one scale per head and
channel), the kernel takes the float new keys / values, int8 ``past_key`` / ``past_value`` / presents and
``k_scale`` / ``v_scale`` = ``S`` (``k_quant_type = v_quant_type = "PER_CHANNEL"``, ``kv_cache_bit_width = 8``):
onnxruntime quantizes the new positions itself, to the same codes as eager (tests/onnx/test_int8_kv_cache.py:
every cached code and every greedy token identical).

**Why rotary is not inside the kernel.** ``GroupQueryAttention(do_rotary=1)`` of onnxruntime 1.32 (CPU) rotates
every row of a prompt of batch > 1 by row 0's ``position_ids``: a left-padded row (Hugging Face's positions
``cumsum(mask) - 1``) still gets the right logits (rotary is relative) but caches keys rotated by the padding
offset, so its later decode steps were silently wrong (measured: presents off by 0.59 on the tiny Llama; the test
of a left-padded prefill + 3 decode steps pins it). ``RotaryEmbedding`` reads ``position_ids`` as
``(batch, sequence)`` and rotates each row by its own positions; its cost is measured in
``benchmarks/llm_speed/RESULTS.md``.

Computed once per graph from ``attention_mask`` (``Shape / Cast / Sub / Shape / Expand``):
``total_sequence_length`` = its length :math:`T` and ``seqlens_k`` = :math:`T - 1` for every row (int32), so the
kernel's cache layout is the plain ``Concat(past, new)`` of the original graph for every row and its causal term is
the original's; padding comes in through the bias. (The builder's ``seqlens_k = sum(attention_mask) - 1`` tells
the kernel a left-padded row is *shorter*, which moves its keys and positions: measured here, outputs off by 1.2
on a decode step after two padded positions; this form is exact.) The bias is ``Where`` of the graph's own
``(batch, 1, 1, T)`` padding operand of the mask's ``And``, expanded to the ``(batch, 1, S, T)`` the kernel
requires (``Shape(position_ids)[1] / Concat / Expand``); the graph's causal ``Range / LessOrEqual`` term is left
unread and goes away. ``cos_cache`` / ``sin_cache`` (``max_positions × D/2``) are the graph's own rotary factors
(the subgraph from ``position_ids`` to the ``cos`` / ``sin`` the attention multiplies by, including any rotary
scaling) evaluated by onnxruntime for positions ``0 .. max_positions - 1``, so they equal what the original graph
computes at those positions. A position outside ``[0, max_positions)`` makes onnxruntime refuse the step
("position_ids value 4096 at index 0 is out of range [0, 4096)"): loud, never wrong. That includes the -1 a caller
gets at left-padding positions from ``cumsum(mask) - 1`` without Hugging Face's ``masked_fill(mask == 0, 1)``:
the file without the rule serves it, the rewritten one refuses it (fix: clamp padding positions to 0 or 1).

The result equals the original graph's within float rounding (another summation order in the kernel) for every
query that sees at least one key, on prompts, decode steps, batches and left-padded batches (tests pin each case).
A query row whose every key is masked (a left-padding position of a prompt) gets zeros in the original graph and
a mean of the values in the kernel; only padding positions have such rows, and nothing reads their outputs.
onnxruntime's CPU kernel itself refuses a call with batch > 1, sequence > 1 *and* a past (chunked prefill of a
batch): "batch_size must be 1 when sequence_length > 1 and past context is given" (loud).

Sites (anchor: the ``Softmax``; everything below must hold, else the block stays as it is):

* float32 scores ``MatMul(q', Transpose(present_key, [0, 1, 3, 2])) -> Mul(constant scale) ->
  Add(·, Where(Or(mask', dead rows), 0, -inf)) -> Softmax(last axis) [-> Mul(live rows)] -> MatMul(·,
  present_value) [-> Reshape]
  -> Transpose([0, 2, 1, 3]) -> Reshape`` to ``(batch, sequence, heads · D)`` (the first ``Reshape`` unfolds
  grouped heads); no softcap (``Tanh``), no ALiBi or other
  additive bias;
* ``present_key`` / ``present_value`` are graph outputs written by ``Concat(past graph input, new, axis=2)``;
* q and k are ``Transpose([0, 2, 1, 3])(Reshape(projection))`` rotated by the standard rotate-half form over the
  whole head (the two ``Slice`` halves of exactly :math:`D/2`; partial rotary, which slices the head first, and
  interleaved rotary, written with other ops, do not match), with the same ``cos`` / ``sin`` for q and k, computed
  from ``position_ids`` alone, whose two halves are equal (rotate-half layout, checked on the evaluated values);
  q' is q or, for grouped heads, q folded to ``(batch, kv_heads, groups · S, D)``;
* the mask is ``And`` of a causal ``LessOrEqual`` and ``Cast(attention_mask)`` (``(batch, 1, S, T)``, folded like q
  for grouped heads): a sliding window or any other extra term is one more ``And`` and does not match;
* ``D`` a multiple of 16 (onnxruntime's rotary kernel requires it) and heads a multiple of the key / value heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

from coreai_opt.onnx.rewrite.graph import OnnxGraph, attributes_of
from coreai_opt.onnx.rewrite.kv_cache_codes import CacheCodes, cache_codes, cache_concat, store_as_codes
from coreai_opt.onnx.rewrite.rotary_site import ancestors, rotary_tables, rotate_half_of
from coreai_opt.onnx.rewrite.rule import CONTRIB_DOMAIN, Fail, Match, Rule

__all__ = ["AttentionToGroupQueryAttention", "MAX_POSITIONS"]

#: Rows of the ``cos_cache`` / ``sin_cache`` the rule writes: the longest total sequence the file then serves.
MAX_POSITIONS = 4096


@dataclass(frozen=True)
class _Site(Match):
    projections: tuple[str, str, str]  # q (B, S, H·D), k and v (B, S, H_kv·D)
    past: tuple[str, str]
    presents: tuple[onnx.NodeProto, onnx.NodeProto]  # the Concat nodes writing present key / value
    output: onnx.NodeProto  # the last Reshape, (B, S, H·D)
    padding: str  # (B, 1, 1, T) bool, True = not a padding key
    attention_mask: str
    position_ids: str
    cos_sin: tuple[np.ndarray, np.ndarray]  # (max_positions, D/2)
    heads: int
    kv_heads: int
    scale: float
    codes: tuple[CacheCodes, CacheCodes] | None  # a quantized cache (int8 past / present, k_scale / v_scale)


def _op(node: onnx.NodeProto | None, op_type: str) -> bool:
    return node is not None and node.op_type == op_type and node.domain in ("", "ai.onnx")


def _ints(graph: OnnxGraph, name: str) -> list[int] | None:
    value = graph.constant(name)
    return None if value is None else [int(v) for v in value.reshape(-1)]


def _perm(node: onnx.NodeProto | None, perm: list[int]) -> bool:
    return _op(node, "Transpose") and [int(p) for p in attributes_of(node).get("perm", [])] == perm


def _heads_of(graph: OnnxGraph, transposed: str) -> str | None:
    """The projection ``x`` of ``Transpose([0, 2, 1, 3])(Reshape(x))``, else None."""
    transpose = graph.producer(transposed)
    if not _perm(transpose, [0, 2, 1, 3]):
        return None
    reshape = graph.producer(transpose.input[0])
    return reshape.input[0] if _op(reshape, "Reshape") else None


def _causal_and_padding(graph: OnnxGraph, mask: str) -> tuple[str, str] | None:
    """``(attention_mask, padding)`` when ``mask = causal(LessOrEqual) & padding``, else None.

    ``padding`` is the ``And`` operand read from ``Cast(attention_mask)`` (through an ``Unsqueeze``): the
    ``(batch, 1, 1, T)`` boolean "key is not padding".
    """
    both = graph.producer(mask)
    if not _op(both, "And"):
        return None
    causal, padding = [], []
    for operand in both.input:
        source = graph.producer(operand)
        source = graph.producer(source.input[0]) if _op(source, "Unsqueeze") else source
        if _op(source, "LessOrEqual"):
            causal.append(operand)
        elif _op(source, "Cast") and source.input[0] in graph.inputs:
            padding.append((source.input[0], operand))
    if len(causal) != 1 or len(padding) != 1:
        return None
    shape = graph.shape(padding[0][1])
    if shape is None or len(shape) != 4 or shape[1:3] != (1, 1):
        return None
    return padding[0]


def _grouped(graph: OnnxGraph, folded: str, groups: int) -> str | None:
    """The ``(B, 1, S, T)`` mask that ``folded`` repeats per query group (``Reshape(Expand(Unsqueeze(m, 2)))``)."""
    if groups == 1:
        return folded
    reshape = graph.producer(folded)
    expand = graph.producer(reshape.input[0]) if _op(reshape, "Reshape") else None
    unsqueeze = graph.producer(expand.input[0]) if _op(expand, "Expand") else None
    if not _op(unsqueeze, "Unsqueeze") or _ints(graph, unsqueeze.input[1]) != [2]:
        return None
    return unsqueeze.input[0]


class AttentionToGroupQueryAttention(Rule):
    """The KV-cache decoder's attention -> ``RotaryEmbedding`` per q / k + ``GroupQueryAttention`` (module docstring).

    Args:
        max_positions: Rows of the rotary caches (the longest total sequence the file serves).
    """

    name = "attention_to_group_query_attention"
    anchors = frozenset({"Softmax"})
    domains = {CONTRIB_DOMAIN: 1}

    def __init__(self, max_positions: int = MAX_POSITIONS) -> None:
        self.max_positions = max_positions

    def match(self, node: onnx.NodeProto, graph: OnnxGraph) -> _Site | Fail | None:  # noqa: C901, PLR0911, PLR0912
        """Walk from the ``Softmax`` to the scores, the cache, the rotary and the output (module docstring)."""
        if node.domain not in ("", "ai.onnx") or int(attributes_of(node).get("axis", -1)) not in (-1, 3):
            return None
        found = self._masked_scores(graph, node)
        if found is None:
            return None
        scaled, allowed = found
        scores, scale = next(((graph.producer(a), graph.constant(b)) for a, b in (scaled.input, scaled.input[::-1])
                              if graph.constant(b) is not None), (None, None))
        if not _op(scores, "MatMul") or scale is None or scale.size != 1:
            return None
        key_t = graph.producer(scores.input[1])
        if not _perm(key_t, [0, 1, 3, 2]):
            return None
        present_key = graph.producer(key_t.input[0])
        reader = graph.only_reader(node.output[0])
        if _op(reader, "Mul"):  # times the live-row factor (graph/attention_math.py)
            reader = graph.only_reader(reader.output[0])
        if not _op(reader, "MatMul") or reader.input[1] == reader.input[0]:
            return None
        present_value = graph.producer(reader.input[1])
        caches = [cache_concat(graph, c) for c in (present_key, present_value)]
        if None in caches:
            return None
        output = self._output(graph, reader.output[0])
        if output is None:
            return Fail("the attention output is not Reshape -> Transpose(0, 2, 1, 3) -> Reshape")
        shape = graph.shape(present_key.output[0])
        if shape is None or not isinstance(shape[1], int) or not isinstance(shape[3], int):
            return Fail("the key cache's heads / head size are not recorded")
        kv_heads, size = shape[1], shape[3]
        codes = tuple(cache_codes(graph, c.input[1]) for c in (present_key, present_value))
        if (codes[0] is None) != (codes[1] is None):
            return Fail("one of the key / value caches is quantized, the other not")
        new_key, new_value = (c.input[1] if q is None else q.new
                              for c, q in zip((present_key, present_value), codes, strict=True))
        rotated_k = rotate_half_of(graph, new_key, size // 2)
        value = _heads_of(graph, new_value)
        if rotated_k is None or value is None:
            return Fail("the new keys are not rotate-half rotary over the whole head (partial / interleaved rotary) "
                        "or the values are not a head-split projection")
        key, cos, sin = rotated_k
        key = _heads_of(graph, key)
        if key is None:
            return Fail("the keys are not Transpose(Reshape(projection)) (a per-head norm in between, as Qwen3's)")
        query_rot = scores.input[0]
        fold = graph.producer(query_rot)
        if _op(fold, "Reshape"):
            folded = graph.shape(query_rot)
            if folded is None or folded[1] != kv_heads:
                return Fail("the grouped queries are not folded to (batch, kv_heads, groups * S, D)")
            query_rot = fold.input[0]
        rotated_q = rotate_half_of(graph, query_rot, size // 2)
        if rotated_q is None or rotated_q[1:] != (cos, sin):
            return Fail("the queries are not rotated like the keys")
        query = _heads_of(graph, rotated_q[0])
        if query is None:
            return Fail("the queries are not Transpose(Reshape(projection)) (a per-head norm in between, as Qwen3's)")
        q_shape = graph.shape(query)
        if q_shape is None or not isinstance(q_shape[-1], int) or q_shape[-1] % size:
            return Fail("the query projection's width is not recorded as a multiple of the head size")
        heads = q_shape[-1] // size
        if heads % kv_heads or (heads == kv_heads) != (query_rot == scores.input[0]):
            return Fail(f"{heads} query heads over {kv_heads} key / value heads")
        if size % 16:
            return Fail(f"head size {size} is not a multiple of 16 (onnxruntime's rotary kernel)")
        padding = None
        for candidate in allowed:
            mask = _grouped(graph, candidate, heads // kv_heads)
            padding = padding or (_causal_and_padding(graph, mask) if mask is not None else None)
        if padding is None:
            return Fail("the mask is not causal & attention_mask (sliding window or another mask)")
        _, sources = ancestors(graph, [cos, sin])
        if len(sources) != 1:
            return Fail(f"the rotary factors read {sorted(sources)}, not position_ids alone")
        position_ids = sources.pop()
        tables = rotary_tables(graph, cos, sin, position_ids, self.max_positions)
        if tables[0].shape[1] != size or any(not np.array_equal(t[:, :size // 2], t[:, size // 2:]) for t in tables):
            return Fail("the rotary factors are not in rotate-half layout (halves differ)")
        return _Site(node, (query, key, value), (present_key.input[0], present_value.input[0]),
                     (present_key, present_value), output, padding[1], padding[0], position_ids,
                     (tables[0][:, :size // 2].copy(), tables[1][:, :size // 2].copy()), heads, kv_heads,
                     float(scale.reshape(-1)[0]), None if codes[0] is None else (codes[0], codes[1]))

    @staticmethod
    def _masked_scores(graph: OnnxGraph, softmax: onnx.NodeProto) -> tuple[onnx.NodeProto, list[str]] | None:
        """The scaled scores ``Mul`` and the candidate masks of ``Add(scaled, Where(Or(mask, dead), 0, -inf))``."""
        masked = graph.producer(softmax.input[0])
        if not _op(masked, "Add") or graph.only_reader(masked.output[0]) is None:
            return None
        for scores, bias in (masked.input, masked.input[::-1]):
            scaled, where = graph.producer(scores), graph.producer(bias)
            if not _op(scaled, "Mul") or not _op(where, "Where"):
                continue
            zero, fill = graph.constant(where.input[1]), graph.constant(where.input[2])
            either = graph.producer(where.input[0])
            if zero is not None and fill is not None and zero.size == fill.size == 1 and not zero.any() \
                    and np.isneginf(fill).all() and _op(either, "Or"):
                return scaled, list(either.input)
        return None

    @staticmethod
    def _output(graph: OnnxGraph, heads: str) -> onnx.NodeProto | None:
        """The last ``Reshape`` of ``heads [-> Reshape] -> Transpose(0, 2, 1, 3) -> Reshape`` (grouped: unfold)."""
        transpose = graph.only_reader(heads)
        if _op(transpose, "Reshape"):
            transpose = graph.only_reader(transpose.output[0])
        last = graph.only_reader(transpose.output[0]) if _perm(transpose, [0, 2, 1, 3]) else None
        return last if _op(last, "Reshape") else None

    def rewrite(self, match: Match, graph: OnnxGraph) -> None:
        """``RotaryEmbedding`` per q and k (per-row positions); one ``GroupQueryAttention`` writes all three outputs."""
        assert isinstance(match, _Site)
        seqlens, total, bias = self._shared_inputs(match, graph)
        stem = match.output.name or match.output.output[0]
        cos = graph.shared_constant("gqa_cos_cache", match.cos_sin[0])
        sin = graph.shared_constant("gqa_sin_cache", match.cos_sin[1])
        query, key, value = match.projections
        quantized: list[str] = []
        attributes: dict[str, object] = {}
        if match.codes is not None:  # int8 cache: the kernel quantizes the new keys / values with the same S
            quantized = ["", *(store_as_codes(graph, past, present.output[0], codes) for past, present, codes in
                               zip(match.past, match.presents, match.codes, strict=True))]
            attributes = {"k_quant_type": "PER_CHANNEL", "v_quant_type": "PER_CHANNEL", "kv_cache_bit_width": 8}
        rotary = [helper.make_node("RotaryEmbedding", [x, match.position_ids, cos, sin],
                                   [graph.unique_name(f"{x}_rotary")],
                                   name=graph.unique_node_name(f"{stem}_rotary_{part}"), domain=CONTRIB_DOMAIN,
                                   interleaved=0)
                  for part, x in (("query", query), ("key", key))]
        attention = helper.make_node(
            "GroupQueryAttention",
            [rotary[0].output[0], rotary[1].output[0], value, *match.past, seqlens, total, "", "", "", bias,
             *quantized],
            [match.output.output[0], match.presents[0].output[0], match.presents[1].output[0]],
            name=graph.unique_node_name(f"{stem}_group_query_attention"), domain=CONTRIB_DOMAIN,
            num_heads=match.heads, kv_num_heads=match.kv_heads, scale=match.scale, do_rotary=0, **attributes)
        for present in match.presents:
            graph.remove(present)
        graph.replace(match.output, [*rotary, attention])

    @staticmethod
    def _shared_inputs(match: _Site, graph: OnnxGraph) -> tuple[str, str, str]:
        """``seqlens_k`` (B,) = T - 1, ``total_sequence_length`` = T (int32) and the padding bias, made once.

        The bias is 0 for a real key and -inf for a padding key, ``Where`` of the mask's ``(B, 1, 1, T)`` padding
        operand expanded to the ``(B, 1, S, T)`` the kernel requires (``S`` read from ``position_ids``): the kernel
        applies causality itself, so the graph's causal ``Range / LessOrEqual`` term is not read (it becomes dead).
        """
        made = next((r for r in graph.readers(match.padding) if r.op_type == "Where" and r.name.startswith("gqa_")),
                    None)
        if made is not None:
            expand = graph.readers(made.output[0])[0]
            user = graph.readers(expand.output[0])[0]
            return user.input[5], user.input[6], expand.output[0]
        mask = match.attention_mask
        length, total, last, batch, seqlens, keys, rows, shape, bias = (graph.unique_name(f"gqa_{part}") for part in (
            "length", "total_sequence_length", "last", "batch", "seqlens_k", "key_bias", "bias_rows", "bias_shape",
            "attention_bias"))
        nodes = [
            helper.make_node("Shape", [mask], [length], start=1, end=2),
            helper.make_node("Cast", [length], [total], to=TensorProto.INT32),
            helper.make_node("Sub", [total, graph.shared_constant("gqa_one", np.array([1], np.int32))], [last]),
            helper.make_node("Shape", [mask], [batch], start=0, end=1),
            helper.make_node("Expand", [last, batch], [seqlens]),
            helper.make_node("Where", [match.padding, graph.shared_constant("gqa_zero", np.array(0.0, np.float32)),
                                       graph.shared_constant("gqa_minus_inf", np.array(-np.inf, np.float32))],
                             [keys]),
            helper.make_node("Shape", [match.position_ids], [rows], start=1, end=2),
            helper.make_node("Concat", [rows, graph.shared_constant("gqa_one_long", np.array([1], np.int64))],
                             [shape], axis=0),
            helper.make_node("Expand", [keys, shape], [bias]),
        ]
        for node in nodes:
            node.name = graph.unique_node_name(f"{node.output[0]}_{node.op_type.lower()}")
        graph.insert_after(graph.producer(match.padding), nodes)
        return seqlens, total, bias
