"""Single defects written into an exported QDQ file: the mutation suite that ``verify_onnx`` must catch.

Each mutation takes a loaded ``onnx.ModelProto`` and returns a mutated copy with exactly one defect, or None when the
file has no site for it. Sites are chosen deterministically (the middle candidate in graph order), so a test names
the same defect on every run. The defects are the kind a buggy exporter or a post-processing tool makes:

* ``scale_x1.05`` / ``scale_x1.20``: one activation Q/DQ pair's scale multiplied (a private copy of the initializer,
  so other pairs sharing it keep theirs);
* ``zero_point_+1`` / ``zero_point_-1``: one activation pair's zero point off by one (skipped when it would leave
  the dtype's range);
* ``weight_codes_+3``: 2 % of one weight's int8 codes (at least one) plus 3, saturated;
* ``bias_x1.10``: one int32 bias times 1.1, rounded;
* ``drop_qdq``: one activation Q -> DQ pair removed (its readers read the float tensor);
* ``duplicate_qdq``: one activation pair repeated behind itself, same parameters (numerically idempotent:
  ``Q(DQ(Q(x))) = Q(x)``, so it must not be flagged unless it changes the output);
* ``swap_inputs``: the first two inputs of a non-commutative op (Sub, Div, MatMul, Concat) exchanged; the
  caller drops the mutation when onnxruntime cannot run it (shapes that no longer fit);
* ``per_channel_scale_rolled``: one per-channel weight scale shifted by one channel (each channel gets its
  neighbour's scale, i.e. scales laid out along the wrong channel order);
* ``square_weight_transposed``: one weight with equal first two dimensions (``[n, n]`` or ``[C, C, k, k]``)
  transposed over them.

:func:`judge_defect` applies one defect to an exported file and says what happened: no site, the file no longer
runs, onnxruntime's output unchanged, or changed and then flagged (with the first failing quantizer named) or
missed. The zoo suite (``tests/onnx/test_verify_mutations.py``), the corpus suite
(``tests/corpus/test_verify_corpus.py``) and the ``verify`` study share it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import torch
from onnx import helper, numpy_helper
from torch import nn

__all__ = ["MUTATIONS", "DefectOutcome", "Mutation", "judge_defect", "mutate", "remove_pair", "run_file"]

Mutation = Callable[[onnx.ModelProto], onnx.ModelProto | None]

_NON_COMMUTATIVE = ("Sub", "Div", "MatMul", "Concat")


def _copy(model: onnx.ModelProto) -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    return out


def _initializers(model: onnx.ModelProto) -> dict[str, onnx.TensorProto]:
    return {t.name: t for t in model.graph.initializer}


def _middle(items: list) -> object | None:  # noqa: ANN401 (any candidate)
    return items[len(items) // 2] if items else None


def _add_initializer(model: onnx.ModelProto, base: str, array: np.ndarray) -> str:
    name = f"{base}__mutated"
    model.graph.initializer.append(numpy_helper.from_array(array, name))
    return name


def _overwrite(model: onnx.ModelProto, node: onnx.NodeProto, index: int, array: np.ndarray) -> None:
    """``node``'s input ``index`` holds ``array``: that initializer rewritten under its own name (a corrupted file
    keeps its names) when ``node`` is its only reader, else a new initializer for ``node`` alone."""
    name = node.input[index]
    readers = sum(name in n.input for n in model.graph.node)
    stored = next(t for t in model.graph.initializer if t.name == name)
    if readers == 1:
        stored.CopyFrom(numpy_helper.from_array(array.astype(numpy_helper.to_array(stored).dtype), name))
    else:
        node.input[index] = _add_initializer(model, name, array)


def _activation_pairs(model: onnx.ModelProto) -> list[tuple[onnx.NodeProto, list[onnx.NodeProto]]]:
    """(QuantizeLinear on an activation, the DequantizeLinear nodes reading it) with initializer scales."""
    inits = _initializers(model)
    pairs = []
    for node in model.graph.node:
        if node.op_type != "QuantizeLinear" or node.input[0] in inits or node.input[1] not in inits:
            continue
        readers = [n for n in model.graph.node if node.output[0] in n.input]
        if readers and all(r.op_type == "DequantizeLinear" for r in readers):
            pairs.append((node, readers))
    return pairs


def _weight_dqs(model: onnx.ModelProto, data_type: int) -> list[onnx.NodeProto]:
    """DequantizeLinear nodes whose data input is an initializer of ``data_type``."""
    inits = _initializers(model)
    return [n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[0] in inits
            and inits[n.input[0]].data_type == data_type]


def _set_pair_param(model: onnx.ModelProto, index: int, change: Callable[[np.ndarray], np.ndarray | None]
                    ) -> onnx.ModelProto | None:
    """Give the middle activation pair a private copy of input ``index`` (1 scale, 2 zero point), changed."""
    model = _copy(model)
    pair = _middle(_activation_pairs(model))
    if pair is None:
        return None
    q, dqs = pair
    inits = _initializers(model)
    if len(q.input) <= index or q.input[index] not in inits:
        return None
    changed = change(numpy_helper.to_array(inits[q.input[index]]))
    if changed is None:
        return None
    name = _add_initializer(model, q.input[index], changed)
    for node in (q, *dqs):
        node.input[index] = name
    return model


def _scale(factor: float) -> Mutation:
    def mutate_scale(model: onnx.ModelProto) -> onnx.ModelProto | None:
        return _set_pair_param(model, 1, lambda s: (s.astype(np.float64) * factor).astype(s.dtype))
    return mutate_scale


def _zero_point(delta: int) -> Mutation:
    def shift(z: np.ndarray) -> np.ndarray | None:
        info = np.iinfo(z.dtype)
        moved = z.astype(np.int64) + delta
        return moved.astype(z.dtype) if (moved >= info.min).all() and (moved <= info.max).all() else None

    def mutate_zero_point(model: onnx.ModelProto) -> onnx.ModelProto | None:
        return _set_pair_param(model, 2, shift)
    return mutate_zero_point


def _replace_weight(model: onnx.ModelProto, data_type: int, change: Callable[[np.ndarray], np.ndarray | None],
                    candidates: Callable[[np.ndarray], bool] = lambda a: True) -> onnx.ModelProto | None:
    model = _copy(model)
    inits = _initializers(model)
    dqs = [n for n in _weight_dqs(model, data_type) if candidates(numpy_helper.to_array(inits[n.input[0]]))]
    dq = _middle(dqs)
    if dq is None:
        return None
    changed = change(numpy_helper.to_array(inits[dq.input[0]]))
    if changed is None:
        return None
    _overwrite(model, dq, 0, changed)
    return model


def weight_codes_plus_3(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """2 % of the middle int8 weight's codes (at least one, seeded) plus 3, saturated to int8."""
    def change(codes: np.ndarray) -> np.ndarray:
        flat = codes.astype(np.int16).reshape(-1)
        rng = np.random.default_rng(0)
        picked = rng.choice(flat.size, size=max(1, round(0.02 * flat.size)), replace=False)
        flat[picked] = np.clip(flat[picked] + 3, -128, 127)
        return flat.reshape(codes.shape).astype(np.int8)
    return _replace_weight(model, onnx.TensorProto.INT8, change, lambda a: a.ndim >= 2)


def bias_x1_10(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """The middle int32 bias times 1.1, rounded."""
    return _replace_weight(model, onnx.TensorProto.INT32,
                           lambda b: np.rint(b.astype(np.float64) * 1.1).astype(np.int32),
                           lambda b: bool(np.abs(b).max(initial=0) > 0))


def square_weight_transposed(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """The middle int8 weight with equal first two dimensions, transposed over them."""
    return _replace_weight(model, onnx.TensorProto.INT8, lambda w: np.ascontiguousarray(np.swapaxes(w, 0, 1)),
                           lambda w: w.ndim >= 2 and w.shape[0] == w.shape[1] > 1 and not np.array_equal(
                               w, np.swapaxes(w, 0, 1)))


def per_channel_scale_rolled(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """The middle per-channel weight scale rolled by one channel (each channel gets its neighbour's scale)."""
    model = _copy(model)
    inits = _initializers(model)
    dqs = [n for n in _weight_dqs(model, onnx.TensorProto.INT8)
           if n.input[1] in inits and numpy_helper.to_array(inits[n.input[1]]).size > 1
           and np.unique(numpy_helper.to_array(inits[n.input[1]])).size > 1]
    dq = _middle(dqs)
    if dq is None:
        return None
    _overwrite(model, dq, 1, np.roll(numpy_helper.to_array(inits[dq.input[1]]), 1))
    return model


def drop_qdq(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """The middle activation Q -> DQ pair removed; its readers read the float tensor the Q read."""
    model = _copy(model)
    pair = _middle(_activation_pairs(model))
    if pair is None:
        return None
    q, dqs = pair
    graph_outputs = {o.name for o in model.graph.output}
    if any(dq.output[0] in graph_outputs for dq in dqs):
        return None
    remove_pair(model, q, dqs)
    return model


def remove_pair(model: onnx.ModelProto, q: onnx.NodeProto, dqs: Sequence[onnx.NodeProto]) -> None:
    """Remove the pair ``q -> dqs`` from ``model`` in place; the DQs' readers read the float tensor ``q`` read."""
    renamed = {dq.output[0]: q.input[0] for dq in dqs}
    for node in model.graph.node:
        node.input[:] = [renamed.get(name, name) for name in node.input]
    for node in (q, *dqs):
        model.graph.node.remove(node)


def duplicate_qdq(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """The middle activation pair's first DQ followed by another Q -> DQ with the same parameters."""
    model = _copy(model)
    pair = _middle(_activation_pairs(model))
    if pair is None:
        return None
    q, (dq, *_) = pair
    graph_outputs = {o.name for o in model.graph.output}
    if dq.output[0] in graph_outputs:
        return None
    old = dq.output[0]
    new_q = helper.make_node("QuantizeLinear", [old, *q.input[1:]], [f"{old}__dup_q"], name=f"{q.name}__dup",
                             axis=next((a.i for a in q.attribute if a.name == "axis"), 1))
    new_dq = helper.make_node("DequantizeLinear", [f"{old}__dup_q", *dq.input[1:]], [f"{old}__dup"],
                              name=f"{dq.name}__dup", axis=next((a.i for a in dq.attribute if a.name == "axis"), 1))
    for node in model.graph.node:
        for i, name in enumerate(node.input):
            if name == old:
                node.input[i] = f"{old}__dup"
    position = list(model.graph.node).index(dq) + 1
    model.graph.node.insert(position, new_dq)
    model.graph.node.insert(position, new_q)
    return model


def swap_inputs(model: onnx.ModelProto) -> onnx.ModelProto | None:
    """The middle non-commutative binary op (Sub, Div, MatMul, Concat) with two distinct activation inputs swapped."""
    model = _copy(model)
    inits = _initializers(model)
    nodes = [n for n in model.graph.node if n.op_type in _NON_COMMUTATIVE and len(n.input) >= 2
             and n.input[0] != n.input[1] and n.input[0] not in inits and n.input[1] not in inits]
    node = _middle(nodes)
    if node is None:
        return None
    first, second = node.input[0], node.input[1]
    node.input[0], node.input[1] = second, first
    return model


MUTATIONS: dict[str, Mutation] = {
    "scale_x1.05": _scale(1.05),
    "scale_x1.20": _scale(1.20),
    "zero_point_+1": _zero_point(1),
    "zero_point_-1": _zero_point(-1),
    "weight_codes_+3": weight_codes_plus_3,
    "bias_x1.10": bias_x1_10,
    "drop_qdq": drop_qdq,
    "duplicate_qdq": duplicate_qdq,
    "swap_inputs": swap_inputs,
    "per_channel_scale_rolled": per_channel_scale_rolled,
    "square_weight_transposed": square_weight_transposed,
}


def mutate(model: onnx.ModelProto, defect: str) -> onnx.ModelProto | None:
    """Apply the named defect of :data:`MUTATIONS` (None when the file has no site for it)."""
    if defect not in MUTATIONS:
        raise KeyError(f"unknown defect {defect!r}; known: {sorted(MUTATIONS)}")
    return MUTATIONS[defect](model)


@dataclass(frozen=True)
class DefectOutcome:
    """What one defect did to one exported file.

    Attributes:
        defect: Key of :data:`MUTATIONS`.
        status: ``"no site"``, ``"does not run"`` (onnxruntime rejects the mutated file), ``"output unchanged"``,
            ``"flagged"`` or ``"missed"`` (the output changed and ``verify_onnx`` said ok).
        output_change: ``max |mutated - clean|`` of onnxruntime's outputs over all batches (None when not run).
        flagged: ``not report.ok`` (None when ``verify_onnx`` did not run).
        first_quantizer: The first failing quantizer's traced call, e.g. ``"quantize_dequantize_3"``.
        first_rule: The rule it failed (``"qparams"``, ``"steps"``, ``"mismatch"``, ``"bias"``, ``"missing"``; ``"weight
            codes"`` when only the stored weights differ, then ``first_quantizer`` is the weight quantizer's module).
        seconds: Time of ``verify_onnx`` on the mutated file.
    """

    defect: str
    status: str
    output_change: float | None = None
    flagged: bool | None = None
    first_quantizer: str | None = None
    first_rule: str | None = None
    seconds: float = 0.0

    @property
    def cell(self) -> str:
        """Short table cell: output change, then F (flagged) / o (ok) / MISSED; ``-`` no site."""
        if self.status == "no site":
            return "-"
        if self.status == "does not run":
            return "no run"
        verdict = "MISSED" if self.status == "missed" else ("F" if self.flagged else "o")
        return f"{self.output_change:.2g} {verdict}"


def run_file(path: Path, batches: Sequence[tuple[torch.Tensor, ...]]) -> list[list[np.ndarray]] | None:
    """onnxruntime's outputs per batch, or None when the session cannot be built or run (a swap that no longer
    fits the shapes)."""
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3
    try:
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        names = [i.name for i in session.get_inputs()]
        return [session.run(None, {n: t.numpy() for n, t in zip(names, b, strict=True)}) for b in batches]
    except Exception:  # noqa: BLE001 (onnxruntime raises its own exception types)
        return None


def _largest_change(got: list[list[np.ndarray]], clean: list[list[np.ndarray]]) -> float:
    return max(float(np.abs(a.astype(np.float64) - b.astype(np.float64)).max(initial=0.0))
               for g, c in zip(got, clean, strict=True) for a, b in zip(g, c, strict=True))


def judge_defect(model: nn.Module, clean_path: Path, batches: Sequence[tuple[torch.Tensor, ...]], defect: str,
                 work_dir: Path, clean_outputs: list[list[np.ndarray]] | None = None) -> DefectOutcome:
    """Write ``defect`` into a copy of ``clean_path``, run it, and verify it against the converted ``model``.

    ``clean_outputs`` (onnxruntime's outputs of the clean file on ``batches``) is computed when not given.
    """
    from coreai_opt.onnx import verify_onnx

    mutated = mutate(onnx.load(str(clean_path)), defect)
    if mutated is None:
        return DefectOutcome(defect, "no site")
    path = work_dir / f"{clean_path.stem}.{defect}.onnx"
    onnx.save(mutated, str(path))
    got = run_file(path, batches)
    if got is None:
        return DefectOutcome(defect, "does not run")
    clean = clean_outputs if clean_outputs is not None else run_file(clean_path, batches)
    changed = _largest_change(got, clean)
    start = time.perf_counter()
    report = verify_onnx(model, path, list(batches))
    seconds = time.perf_counter() - start
    first = report.first_failing_quantizer
    status = "output unchanged" if changed == 0.0 else ("flagged" if not report.ok else "missed")
    if status != "output unchanged" or not report.ok:
        print(f"\n{clean_path.stem} {defect}: output changed by {changed:.3g}\n{report}")
    if first is None and (weight := report.weights.first_failing) is not None:  # caught in the stored weights only
        return DefectOutcome(defect, status, changed, not report.ok, weight.module, "weight codes", seconds)
    return DefectOutcome(defect, status, changed, not report.ok, None if first is None else first.call,
                         None if first is None else first.rule, seconds)
