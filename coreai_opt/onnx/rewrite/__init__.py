"""The ONNX post-passes of ``export_onnx``: rewrite rules over one shared graph index, applied in order.

Each post-pass is a :class:`~coreai_opt.onnx.rewrite.rule.Rule` (``match(node, graph) -> Match | Fail | None``,
``rewrite(match, graph)``) in a module of its own; :data:`POST_PASSES` is the order ``export_onnx`` applies them
in, and :func:`apply` runs them over one :class:`~coreai_opt.onnx.rewrite.graph.OnnxGraph` and returns the
:class:`~coreai_opt.onnx.rewrite.rewrite_report.RewriteReport` (``{rule: count}`` plus the near misses).

1. ``fold_quantized_weights``: constant weight / bias chains -> quantized initializer -> ``DequantizeLinear``.
2. ``dynamic_matmuls_to_integer``: dynamic activation × int8 weight -> ``MatMulInteger`` (``DynamicQuantizeMatMul``).
3. ``fold_weight_transposes``: ``DQ(W) -> Transpose`` -> ``DQ(Wᵀ)`` (``DQ -> MatMul``, e.g. ``MatMulNBits``).
4. ``write_matmul_nbits``: weight-only ``MatMul`` (and int8-marked ``Gemm``) -> ``MatMulNBits`` with the accuracy
   level the weight spec's ``matmul_compute`` names (1: float, eager-equal; 4: int8, emulated in eager).
5. ``gather_block_quantized_rows``: ``DQ(per-block table) -> Gather`` -> ``GatherBlockQuantized`` (rows only;
   a table a ``MatMulNBits`` already stores is read from there).
6. ``gather_quantized_rows``: ``DQ(table) -> Gather`` -> ``Gather -> DQ`` (dequantize only the rows read).
7. ``fuse_shared_input_matmul_nbits``: in a KV-cache decoder, ``MatMulNBits`` readers of one input (q / k / v,
   gate / up) -> one ``MatMulNBits`` over the stacked weights + ``Split`` (bit-identical outputs).
8. ``rms_norms_to_simplified_layer_norm``: ``w · x · rsqrt(mean(x²) + ε)`` as elementwise ops ->
   ``SimplifiedLayerNormalization`` (onnxruntime folds it with the residual ``Add`` into the skip variant).
9. ``attention_to_group_query_attention``: the KV-cache decoder's attention block (rotary, cache ``Concat``,
   causal + padding mask, grouped scores) -> ``RotaryEmbedding`` per q / k + one ``GroupQueryAttention`` (with an
   int8 cache and ``k_scale`` / ``v_scale`` when the cache is quantized).
10. ``int8_kv_cache``: any other quantized cache ``Concat(past, S · Cast(q))`` -> int8 cache codes read back as
    ``Cast · S`` (exact).
11. ``fold_constant_activations``: a ``QuantizeLinear`` of a constant-only branch (e.g. position rows) -> its integers.
12. ``linears_to_gemm``: 8-bit rank > 2 ``MatMul (+ Add)`` -> ``Reshape -> Gemm -> Reshape`` (``QGemm``).
13. ``collapse_reshapes``: drop the reshapes that cancel (only after ``linears_to_gemm`` rewrote something).
14. ``means_to_global_average_pool``: quantized spatial ``ReduceMean`` -> ``GlobalAveragePool``.
15. ``average_pools_as_depthwise_convs``: quantized windowed ``AveragePool`` -> float depthwise ``Conv``
    (onnxruntime's ``QLinearAveragePool`` is the slow kernel).
16. ``means_to_sum_and_divide``: any other quantized ``ReduceMean`` -> ``ReduceSum -> Div(n)`` (OpenVINO).
17. ``guard_quantized_sums``: ``Max(x, lowest)`` between an asymmetric 8/4-bit ``DequantizeLinear`` and a
    ``ReduceSum`` (OpenVINO folds that dequantization into the sum wrongly; onnxruntime stays bit-exact).
18. ``fold_pads_into_convs``: a zero spatial ``Pad -> Q -> DQ`` in front of a ``Conv`` -> the conv's ``pads``
    (TF-style "same" padding; onnxruntime fuses neither the pad nor the requantization around it).
19. ``drop_zero_biases``: remove all-zero conv / gemm bias inputs.
20. ``guard_float8_activations``: ``Relu`` / ``Clip`` before a float8 / 4-bit ``QuantizeLinear`` -> ``Max`` / ``Min``.
21. ``guard_4bit_activations``: ``Max(x, lowest)`` around every int4 / uint4 activation Q / DQ (no 4-bit fusions).
22. ``clip_16bit_activations``: ``Clip((qmin - zp)·s, (qmax - zp)·s)`` before every int16 / uint16 activation
    ``QuantizeLinear`` (OpenVINO strips 16-bit Q/DQ pairs and their saturation; onnxruntime stays bit-exact).
23. ``shapes_from_quantized``: ``Shape`` / ``Size`` of a quantized activation reads its ``QuantizeLinear``'s output,
    so the float output keeps one reader and onnxruntime fuses its producer into an integer kernel.

Why our own small IR and not onnx-ir / the onnxscript rewriter (both installed): an onnx-ir round trip of an
unchanged exported model already changes its bytes (measured on a 3-linear model: it drops the ``value_info`` of 10
folded-away values and adds ``value_info`` for the initializers, in another order), so the export would no longer be
byte-identical to what it was, and most of these rules (the ORT-exact folder, the shared flattening of
``linears_to_gemm``, the rescanning ``collapse_reshapes``) would be hand-written graph code on either IR.
"""

from __future__ import annotations

from collections.abc import MutableMapping, Sequence

import numpy as np
import onnx

from coreai_opt.onnx.rewrite.graph import OnnxGraph
from coreai_opt.onnx.rewrite.rewrite_report import RewriteReport, read_report, record_report
from coreai_opt.onnx.rewrite.rule import Fail, Match, Rule, import_domains, run_rules
from coreai_opt.onnx.rewrite.rules.attention_to_group_query_attention import AttentionToGroupQueryAttention
from coreai_opt.onnx.rewrite.rules.average_pools_as_depthwise_convs import AveragePoolsAsDepthwiseConvs
from coreai_opt.onnx.rewrite.rules.clip_16bit_activations import ClipSixteenBitActivations
from coreai_opt.onnx.rewrite.rules.collapse_reshapes import CollapseReshapes
from coreai_opt.onnx.rewrite.rules.drop_zero_biases import DropZeroBiases
from coreai_opt.onnx.rewrite.rules.dynamic_matmuls_to_integer import DynamicMatmulsToInteger
from coreai_opt.onnx.rewrite.rules.fold_constant_activations import FoldConstantActivations
from coreai_opt.onnx.rewrite.rules.fold_pads_into_convs import FoldPadsIntoConvs
from coreai_opt.onnx.rewrite.rules.fold_quantized_weights import FoldQuantizedWeights
from coreai_opt.onnx.rewrite.rules.fold_weight_transposes import FoldWeightTransposes
from coreai_opt.onnx.rewrite.rules.fuse_shared_input_matmul_nbits import FuseSharedInputMatMulNBits
from coreai_opt.onnx.rewrite.rules.gather_block_quantized_rows import GatherBlockQuantizedRows
from coreai_opt.onnx.rewrite.rules.gather_quantized_rows import GatherQuantizedRows
from coreai_opt.onnx.rewrite.rules.guard_4bit_activations import GuardFourBitActivations
from coreai_opt.onnx.rewrite.rules.guard_float8_activations import GuardFloat8Activations
from coreai_opt.onnx.rewrite.rules.guard_quantized_sums import GuardQuantizedSums
from coreai_opt.onnx.rewrite.rules.int8_kv_cache import Int8KvCache
from coreai_opt.onnx.rewrite.rules.linears_to_gemm import LinearsToGemm
from coreai_opt.onnx.rewrite.rules.means_to_global_average_pool import MeansToGlobalAveragePool
from coreai_opt.onnx.rewrite.rules.means_to_sum_and_divide import MeansToSumAndDivide
from coreai_opt.onnx.rewrite.rules.rms_norms_to_simplified_layer_norm import RmsNormsToSimplifiedLayerNorm
from coreai_opt.onnx.rewrite.rules.shapes_from_quantized import ShapesFromQuantized
from coreai_opt.onnx.rewrite.rules.write_matmul_nbits import WriteMatMulNBits

__all__ = ["POST_PASSES", "apply", "Rule", "Match", "Fail", "OnnxGraph", "RewriteReport", "read_report",
           "record_report"]

#: The post-passes of ``export_onnx``, in the order they run.
POST_PASSES: tuple[Rule, ...] = (
    FoldQuantizedWeights(),
    DynamicMatmulsToInteger(),
    FoldWeightTransposes(),
    WriteMatMulNBits(),
    GatherBlockQuantizedRows(),
    GatherQuantizedRows(),
    FuseSharedInputMatMulNBits(),
    RmsNormsToSimplifiedLayerNorm(),
    AttentionToGroupQueryAttention(),
    Int8KvCache(),
    FoldConstantActivations(),
    LinearsToGemm(),
    CollapseReshapes(),
    MeansToGlobalAveragePool(),
    AveragePoolsAsDepthwiseConvs(),
    MeansToSumAndDivide(),
    GuardQuantizedSums(),
    FoldPadsIntoConvs(),
    DropZeroBiases(),
    GuardFloat8Activations(),
    GuardFourBitActivations(),
    ClipSixteenBitActivations(),
    ShapesFromQuantized(),
)


def apply(model: onnx.ModelProto, rules: Sequence[Rule] = POST_PASSES,
          precomputed: MutableMapping[str, np.ndarray] | None = None,
          detached: dict[str, onnx.TensorProto] | None = None) -> RewriteReport:
    """Apply ``rules`` in order to the main graph of ``model``, in place.

    Args:
        model: The model to rewrite (functions and subgraphs are not rewritten).
        rules: The rules, default :data:`POST_PASSES`.
        precomputed: Constant values already computed outside the graph (see
            :class:`~coreai_opt.onnx.rewrite.graph.OnnxGraph`).
        detached: Large initializers held outside ``model`` (its entries of those names are stubs); the rewrite
            takes them over (the dict is emptied) and, when the dict is given, puts the large initializers it ends
            with here instead of into ``model`` (which keeps stubs for them), for ``save_model_atomically(model,
            path, detached)`` to stream into the file: a replaced one was freed at once, and none is ever copied
            into the protobuf (:mod:`coreai_opt.onnx.rewrite.initializers`). None: they are copied into ``model``.

    Returns:
        ``{rule name: sites rewritten}`` and the near misses (see :mod:`~coreai_opt.onnx.rewrite.rule`).
    """
    held = dict(detached) if detached else {}
    if detached:
        detached.clear()  # the graph owns them now: one it replaces is freed
    graph = OnnxGraph(model, precomputed, held)
    del held
    report = run_rules(rules, graph)
    released = graph.write_back(detached=detached is not None)
    if detached is not None:
        detached.update(released)
        del released
    import_domains(model, rules, report)
    return report
