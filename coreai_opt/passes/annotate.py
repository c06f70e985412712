"""Decide which tensors get a quantizer: one pattern per op kind, applied by one matcher.

The placement is the one onnxruntime needs to run integer kernels (``DQ → op → Q`` fusion):

==========================================  ===============================================================
op kind                                     quantized edges
==========================================  ===============================================================
conv, conv_transpose, linear                input, weight, output (after a following relu/relu6/hardtanh);
                                            bias int32 with derived scale ``s_in · s_w`` (``int32_bias``)
matmul                                      both operands (a ``get_attr`` operand as a weight), output
embedding                                   weight only (indices are integers)
add, mul, sub, div                          every tensor operand and the output (after a following relu);
                                            none with a number operand (``float_only_ops``)
interpolate, avg_pool, sigmoid             input and output; none for a mean other than a 4-D
                                            spatial one (``float_only_ops``)
relu, relu6, hardtanh                       output only: onnxruntime has no integer kernel for them and folds
                                            them into the Q after them; an input quantizer of a float producer
                                            (an unfoldable BatchNorm) would round the tensor twice. On an
                                            input already quantized (a cat's, an add's with other readers)
                                            the output shares that quantizer (``_shares_input_grid``)
layer_norm, group_norm, gelu, silu,         none of their own under the global spec (no onnxruntime integer
hardswish, tanh                             kernel: ``float_only_ops``); an op_kind / module entry: input
                                            and output
softmax                                     input and output, output range fixed to [0, 1]
                                            (``fixed_range_outputs``) with its upper end shrunk to a
                                            power-of-two step (uint8: [0, 255/256], see ``_power_of_two_step``)
cat                                         every input (its producer's quantizer) and the output: its own
                                            range, onnxruntime requantizes each input (``QLinearConcat``)
move (reshape, view, permute, getitem ...), output shares the input's quantizer (no requantization)
dropout / identity, max_pool
==========================================  ===============================================================

Tensors computed from the integer graph inputs and constants only (a rotary embedding's ``position · inv_freq``
angles, their cos / sin, masks built from ``attention_mask``; :func:`integer_input_derived`) stay float and no op
quantizes them as an input: their range grows with the sequence, so a range calibrated on short prompts would
clip every longer position.

A dynamic activation spec (its fake-quantize class ``exports_dynamic``, e.g. ``DynamicFakeQuantize``) is
requested only on the input edges of linear layers, ``edge_only``: nothing else reads it. A linear reached
through value-moving ops only (attention's ``transpose → reshape → out_proj``) gets it on its own input
edge, which is exact because per-tensor dynamic quantization commutes with moving values (same values, same
min/max, same qparams); the exported ``DequantizeLinear`` then feeds the ``MatMul`` directly, the pattern
the ONNX rule ``dynamic_matmuls_to_integer`` rewrites. Other ops keep float activations.

Sigmoid and tanh outputs are calibrated like any activation. Their known ranges [0, 1] / [-1, 1] only bound
the calibrated one, and every range calculator already returns a range inside the observed min / max, so
"calibrated ∩ known" is the calibrated range: an efficientnet squeeze-excite gate that calibrates to
[0, 0.54] gets a step of 0.54/255 instead of 1/255 (measured on the corpus: efficientnet-b0 35.05 → 35.51 dB
over 192 images).
Cat does not share one quantizer across its inputs (PT2E's choice): a shared quantizer is calibrated on the union
of every input's range and, through value-moving ops (max_pool, reshape), on the inputs of the cats before it, so
one wide branch coarsens every narrow one. Each input keeps its producer's quantizer and the output gets its own,
as onnxruntime's ``quantize_static`` does; onnxruntime runs ``DQ → Concat → Q`` as ``QLinearConcat``, requantizing
each input onto the output grid. Measured on timm's Inception-v3 (branch scales differing up to 9×): 19.3 dB
shared vs 25.2 dB own (quantize_static 25.3), with the same 95 integer conv / matmul kernels.
Softmax keeps its fixed range: its probabilities reach 1 wherever attention is sharp, and only a power-of-two
step lets onnxruntime's ``QLinearSoftmax`` reproduce the eager grid bit for bit.

Weight granularity axes in a config are written for the canonical ``[out, in, *kernel]`` layout
(per-channel axis 0 = output channels, per-block axis 1 = input channels). This pass maps them to the op's
real layout: ``conv_transpose`` weights are ``[in, out/groups, *k]`` (axes 0 and 1 swap) and a ``[K, N]``
matmul operand, like ``addmm(bias, x, W)``'s weight (a linear, GPT-2's ``Conv1D``), has its output channels
last. An axis out of range or a block size that does not divide its dimension is reported for every offending
node at once. Ops left float get a reason in
``NodeMeta.float_reason``. The decisions are :class:`~coreai_opt.graph.node_meta.Annotation` values.
"""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import NamedTuple

from torch.fx import GraphModule, Node

from coreai_opt.config.resolution import Resolver
from coreai_opt.graph.activation_ranges import edge_request_spec, fixed_range_spec
from coreai_opt.graph.float_only_ops import float_only_reason, yields_to_neighbours
from coreai_opt.graph.graph_attrs import node_shape
from coreai_opt.graph.identity_ops import skip_identities
from coreai_opt.graph.integer_inputs import integer_input_derived, is_float_tensor
from coreai_opt.graph.node_meta import (
    Annotation,
    DerivedSpec,
    EdgeSpec,
    QuantSpec,
    Role,
    SharedSpec,
    always_empty,
    get_meta,
    set_meta,
)
from coreai_opt.graph.op_kinds import ArgLayout, OpKind, lookup_op
from coreai_opt.graph.op_patterns import (
    CANONICAL_AXES,
    CLAMP_KINDS,
    MATMUL_AXES,
    PATTERNS,
    map_weight_spec,
    weight_axes_of,
)
from coreai_opt.graph.pass_result import PassResult
from coreai_opt.graph.shape_queries import value_users
from coreai_opt.graph.unread_outputs import drop_unread_linear_outputs
from coreai_opt.quantization.spec import FAKE_QUANTIZE, PerBlock, PerChannel, QuantizationSpec

__all__ = ["annotate"]


class _Resolved(NamedTuple):
    weight: QuantizationSpec | None
    activation: QuantizationSpec | None
    source: str



def _data_args(node: Node, layout: ArgLayout) -> list[Node]:
    out: list[Node] = []
    for ref in layout.data:
        value = ArgLayout.get(node, ref)
        values = value if isinstance(value, (list, tuple)) else [value]
        out.extend(v for v in values if isinstance(v, Node))
    return out


def _label(node: Node) -> str:
    meta = get_meta(node)
    return f"{meta.module_name} ({node.name})" if meta.module_name else node.name


def _activation_source(source: str) -> str:
    """The entry an activation spec came from, out of :meth:`QuantizerConfig.resolve`'s ``source``."""
    return source.rsplit("activation from ", 1)[-1]


class _Matcher:
    """Applies :data:`PATTERNS` to one graph; collects granularity errors so they are reported together."""

    def __init__(
        self, gm: GraphModule, resolve: Resolver, int32_bias: bool, fixed_range_outputs: bool, block_fallback: bool
    ) -> None:
        self.gm, self.resolve = gm, resolve
        self.int32_bias, self.fixed_range_outputs = int32_bias, fixed_range_outputs
        self.block_fallback = block_fallback
        self.errors: list[str] = []
        self.error_kinds: set[str] = set()  # "block" (block size does not divide) / "axis" (axis out of range)
        self.fallbacks: list[str] = []
        self.fused: dict[Node, QuantSpec] = {}
        self.global_linear_outputs: list[Node] = []  # own output spec from the global default (unread_outputs)
        self._resolved: dict[Node, _Resolved] = {}
        self.integer_derived = integer_input_derived(gm)

    def specs(self, node: Node) -> _Resolved:
        """The config's specs for ``node``, resolved once (each input edge asks for its producer's too)."""
        if node not in self._resolved:
            meta = get_meta(node)
            r = self.resolve(meta.kind.value, meta.module_name, meta.module_type)
            self._resolved[node] = _Resolved(r.weight, r.activation, r.source)
        return self._resolved[node]

    def _shares_input_grid(self, clamp: Node, resolved: _Resolved) -> bool:
        """Whether the relu / relu6 / hardtanh ``clamp`` reuses its input's quantizer instead of its own.

        Its input already lies on a grid when a quantizer of the producer's output (or of a value-moving chain
        from it) precedes it. Clamping values of that grid keeps them on it (0 is a grid point: the zero point is
        an integer), so a second quantizer could only round them again onto a coarser or finer grid: in eager
        ``Q_B(relu(Q_A(x)))``, and in onnxruntime, which folds the relu into ``Q_B`` (zero point 0) and then merges
        ``Q_A → DQ_A → Q_B → DQ_B`` into one pair at a third scale, so eager and the file part. Sharing is exact.
        Only when the clamp's configured activation spec is the one that quantizer was built from (or refines):
        a config giving the clamp a spec of its own (another dtype, range) is obeyed, and so is one keeping it
        float.
        """
        act = resolved.activation
        if act is None or FAKE_QUANTIZE.get_class(act.fake_quantize).exports_dynamic or not clamp.args:
            return False
        tensor = clamp.args[0]
        while isinstance(tensor, Node):
            annotation = get_meta(tensor).annotation
            output = annotation.output if annotation is not None else None
            if isinstance(output, QuantSpec):  # a linear's dropped as unread drops its sharers (unread_outputs)
                return act in (output.spec, output.refines)
            if not isinstance(output, SharedSpec) or not isinstance(output.edge_or_node, Node):
                return False
            tensor = output.edge_or_node
        return False

    def weight_spec(self, op: Node, weight: Node, spec: QuantizationSpec, axes: dict[int, int]) -> QuantSpec | None:
        shape = node_shape(weight, self.gm)
        mapped = map_weight_spec(spec, axes, shape)
        try:
            mapped.granularity.qparam_shape(shape)
        except ValueError as exc:
            if self.block_fallback and isinstance(mapped.granularity, PerBlock):
                per_channel = mapped.model_copy(update={"granularity": PerChannel(axes.get(0, 0))})
                self.fallbacks.append(f"{_label(op)} weight {tuple(shape)}")
                return QuantSpec(per_channel, Role.WEIGHT)
            self.errors.append(f"{_label(op)} weight {tuple(shape)}: {exc}")
            self.error_kinds.add("block" if "does not divide" in str(exc) else "axis")
            return None
        return QuantSpec(mapped, Role.WEIGHT)

    def match(self, node: Node) -> tuple[Annotation | None, str | None]:
        """Return the node's annotation (None: nothing quantized) and why its output stays float."""
        meta = get_meta(node)
        if node in self.fused:
            return Annotation(output=self.fused[node]), None
        pattern = PATTERNS.get(meta.kind)
        produces_float = is_float_tensor(node, self.gm)
        if node in self.integer_derived:
            reason = (f"{_label(node)} output left float: computed from integer inputs (positions, masks) only, "
                      "its range grows with the sequence and a calibrated range would clip longer inputs"
                      if produces_float and meta.kind not in (OpKind.INPUT, OpKind.OUTPUT) else None)
            return None, reason
        if produces_float and always_empty(node) and meta.kind not in (OpKind.INPUT, OpKind.OUTPUT):
            return None, f"{_label(node)} output left float: it is empty for every input (a size-0 dimension)"
        if pattern is None:
            plain_op = meta.kind not in (OpKind.INPUT, OpKind.PARAMETER, OpKind.OUTPUT)
            reason = (f"{_label(node)} output left float: op kind '{meta.kind.value}' has no quantization pattern"
                      if produces_float and plain_op else None)
            return None, reason
        layout = lookup_op(node, self.gm).layout
        data = [a for a in _data_args(node, layout)
                if is_float_tensor(a, self.gm) and a not in self.integer_derived and not always_empty(a)]
        if pattern.output == "share":
            source = node.args[0] if node.args else None
            if isinstance(source, Node) and (is_float_tensor(source, self.gm) or get_meta(source).kind is OpKind.MOVE):
                return Annotation(output=SharedSpec(source)), None
            return None, None
        label = _label(node)
        resolved = self.specs(node)
        if meta.kind in CLAMP_KINDS and self._shares_input_grid(node, resolved):
            return Annotation(output=SharedSpec(node.args[0])), None
        float_only = float_only_reason(node, meta.kind, len(data)) \
            or yields_to_neighbours(meta.kind, _activation_source(resolved.source))
        if float_only is not None:
            return None, f"{label} left float: {float_only}"
        act, inputs = resolved.activation, []
        dynamic = act is not None and FAKE_QUANTIZE.get_class(act.fake_quantize).exports_dynamic
        if dynamic:  # only the input edges of linears read a dynamic quantizer (module docstring)
            if meta.kind is OpKind.LINEAR:
                inputs = [(a, QuantSpec(act, Role.ACTIVATION, edge_only=True)) for a in data]
            act = None
        reason = None if act is not None else f"{label} output left float: " + (
            "dynamic activation quantization applies to linear-layer inputs only" if dynamic
            else f"no activation spec ({resolved.source})")
        weight_node = ArgLayout.get(node, layout.weight)
        if meta.kind is OpKind.MATMUL:  # a get_attr operand is a weight
            for index, arg in enumerate(list(data)):
                if arg.op == "get_attr":
                    data.remove(arg)
                    if resolved.weight is not None:
                        spec = self.weight_spec(node, arg, resolved.weight, MATMUL_AXES[index])
                        inputs += [(arg, spec)] if spec else []
        if pattern.inputs and act is not None:  # each input keeps its producer's range (activation_ranges)
            inputs += [(a, QuantSpec(edge_request_spec(act, self.specs(a).activation), Role.ACTIVATION)) for a in data]
        if pattern.weight_axes is not None and isinstance(weight_node, Node):
            if resolved.weight is None:
                reason = f"{_label(node)} weight left float: no weight spec ({resolved.source})"
            else:
                spec = self.weight_spec(node, weight_node, resolved.weight, weight_axes_of(pattern, layout))
                inputs += [(weight_node, spec)] if spec else []
                bias = self.bias_spec(node, layout, data, weight_node, act, spec, dynamic)
                if isinstance(bias, str):
                    bias = f"{_label(node)} {bias}"
                    reason = bias if reason is None else f"{reason}; {bias}"
                elif bias is not None:
                    inputs.append(bias)
        output: EdgeSpec | None = None
        if pattern.output == "own" and act is not None and produces_float:
            out_spec = act
            if pattern.float_range and self.fixed_range_outputs:
                out_spec = fixed_range_spec(act, pattern.float_range, pattern.power_of_two_step)
            # readers asking for the same spec without the range (the producer's range is the tensor's) share it
            refines = None if out_spec.float_range is None else out_spec.model_copy(update={"float_range": None})
            tail = skip_identities(self.gm, node)  # conv → Identity → relu (timm's BatchNormAct2d) fuses too
            users = value_users(tail)  # x.shape / x.ndim readers do not block the fusion
            if pattern.fuse_activation and len(users) == 1 and get_meta(users[0]).kind in CLAMP_KINDS \
                    and users[0].args and users[0].args[0] is tail:
                self.fused[users[0]] = QuantSpec(out_spec, Role.ACTIVATION, refines=refines)
                fused = f"{get_meta(users[0]).kind.value} '{users[0].name}'"
                reason = reason or f"{_label(node)} output quantized after the fused {fused}"
            else:
                output = QuantSpec(out_spec, Role.ACTIVATION, refines=refines)
                if meta.kind is OpKind.LINEAR and _activation_source(resolved.source) == "global":
                    self.global_linear_outputs.append(node)
        if not inputs and output is None:
            return None, reason
        return Annotation(tuple(inputs), output), reason

    def bias_spec(
        self, node: Node, layout: ArgLayout, data: list[Node], weight: Node, act: QuantizationSpec | None,
        weight_spec: QuantSpec | None, dynamic: bool = False,
    ) -> tuple[Node, DerivedSpec] | str | None:
        bias = ArgLayout.get(node, layout.bias)
        if not isinstance(bias, Node):
            return None
        if not self.int32_bias:
            return "bias left float: int32_bias is off"
        if dynamic:
            return "bias left float: a dynamic (stateless) quantizer has no scale buffer to derive from"
        if act is None or not data or weight_spec is None:
            return "bias left float: needs both the input and the weight quantized"
        if act.dtype_info.is_float or weight_spec.spec.dtype_info.is_float:
            return "bias left float: int32 bias needs integer input and weight dtypes"
        g = weight_spec.spec.granularity
        out_axis = (weight_axes_of(PATTERNS[get_meta(node).kind], layout) or CANONICAL_AXES)[0]
        shape = node_shape(weight, self.gm)
        if isinstance(g, PerBlock) or (isinstance(g, PerChannel) and
                                       (g.axis != out_axis or shape[out_axis] != node_shape(bias, self.gm)[0])):
            return "bias left float: the weight scale is not per-tensor or per-output-channel"
        return bias, DerivedSpec((data[0], weight))


def annotate(
    gm: GraphModule, resolve: Resolver, *, int32_bias: bool = True, fixed_range_outputs: bool = True,
    per_block_fallback: str = "error",
) -> PassResult:
    """Write an :class:`Annotation` (and float reasons) on every node that needs quantizers.

    Args:
        gm: A classified, functionalized GraphModule (BatchNorm already folded where possible).
        resolve: ``QuantizerConfig.resolve``-compatible callable; ``None`` specs mean float.
        int32_bias: Quantize conv/linear biases to int32 with derived scale when input and weight are quantized.
        fixed_range_outputs: Use the fixed range [0, 1] (upper end shrunk to a power-of-two step) for softmax
            outputs; sigmoid / tanh outputs are calibrated either way (module docstring).
        per_block_fallback: ``"error"`` or ``"per_channel"``: what a per-block weight spec becomes on a weight
            whose blocked dimension the block size does not divide (``"per_channel"`` warns, listing them).

    Returns:
        ``PassResult`` counting annotated nodes.

    Raises:
        ValueError: the graph was not classified, or weight granularities do not fit (every node listed).
    """
    if per_block_fallback not in ("error", "per_channel"):
        raise ValueError(f"per_block_fallback must be 'error' or 'per_channel', got {per_block_fallback!r}")
    matcher = _Matcher(gm, resolve, int32_bias, fixed_range_outputs, per_block_fallback == "per_channel")
    changes = 0
    for node in gm.graph.nodes:
        meta = get_meta(node)
        if meta.kind is None:
            raise ValueError(f"annotate needs op kinds on {node.format_node()}; run classify_ops first")
        annotation, reason = matcher.match(node)
        reason = "; ".join(r for r in (meta.float_reason, reason) if r) or None  # keep earlier passes' reasons
        set_meta(node, replace(meta, annotation=annotation, float_reason=reason))
        changes += annotation is not None
    drop_unread_linear_outputs(matcher.global_linear_outputs)  # onnxruntime's integer linears write float
    if matcher.fallbacks:
        warnings.warn(
            "per-block weight quantization does not fit these layers, which use per-channel scales instead: "
            + ", ".join(matcher.fallbacks),
            UserWarning,
            stacklevel=3,
        )
    if matcher.errors:
        fixes = {
            "block": "pick a block size that divides these dimensions (or set the config's "
            "per_block_fallback='per_channel')",
            "axis": "pick a granularity axis within the weight's rank (axis 0 = output channels)",
        }
        fix = "; ".join(fixes[k] for k in ("block", "axis") if k in matcher.error_kinds)
        raise ValueError(
            "weight granularity does not fit:\n  " + "\n  ".join(matcher.errors)
            + f"\nFix: {fix}, or override the listed modules with "
            "config.set_module_name(<name regex>, OpConfig(weight=<per-channel spec>))."
        )
    return PassResult(gm, changes)
