"""verify_onnx against single defects written into w8a8 zoo exports (benchmarks/verify/mutations.py), and clean files.

A defect *changes the output* when onnxruntime's output on the mutated file differs from its output on the clean
file (4 batches of 16). Acceptance: every output-changing defect is flagged with the first failing quantizer named,
and no clean export (zoo x presets) is flagged.

Measured on the w8a8 zoo (4 batches of 16; seeds of tests/zoo.py), each cell: by how much onnxruntime's output moved
(max |mutated - clean|; 0 = unchanged), then whether ``verify_onnx`` flagged it before this suite (per-output max
difference against the derived step tolerance) > and with the per-quantizer rules of
``coreai_opt/onnx/verify/quantizer_codes.py`` (F: flagged, o: ok). "-": the file has no site for the defect (no
non-commutative binary op; a uint8 zero point of 0 cannot go to -1); "no run": onnxruntime rejects the file.

| defect                   | resnet18  | mobilenet | convT     | tr_enc    | torch_tr  | shape_unp | conv1d_gn |
| ------------------------ | --------- | --------- | --------- | --------- | --------- | --------- | --------- |
| scale_x1.05              | .013 o>F  | .0019 o>F | .004 o>F  | .013 o>F  | .015 o>F  | .015 o>F  | .008 o>F  |
| scale_x1.20              | .0077 o>F | .0019 o>F | .004 o>F  | .018 o>F  | .015 o>F  | .045 o>F  | .008 o>F  |
| zero_point_+1            | .0026 o>F | .0019 o>F | 0 o>F     | 0 o>F     | 0 o>F     | .0025 o>F | 0 o>F     |
| zero_point_-1            | 0 o>F     | -         | -         | .0089 o>F | .0077 o>F | .0025 o>F | 0 o>F     |
| weight_codes_+3          | .0051 o>F | .0019 o>F | .004 o>F  | .013 o>F  | .015 o>F  | .0025 o>F | .008 o>F  |
| bias_x1.10               | .015 o>F  | .0019 o>F | .0081 o>F | .0089 o>F | .015 o>F  | .025 F>F  | .028 o>F  |
| drop_qdq                 | .0077 o>F | .0025 o>F | .004 o>F  | .013 o>F  | 0 o>o     | .0025 o>F | .008 o>F  |
| duplicate_qdq            | 0 o>o     | 0 o>o     | 0 o>o     | 0 o>o     | 0 o>o     | 0 o>o     | 0 o>o     |
| swap_inputs              | -         | -         | .35 F>F   | no run    | .27 F>F   | -         | -         |
| per_channel_scale_rolled | .051 o>F  | .0019 o>F | .004 o>F  | .0089 o>F | .023 o>F  | .023 F>F  | .024 o>F  |
| square_weight_transposed | .11 F>F   | .0019 o>F | .02 F>F   | .04 o>F   | .6 F>F    | .058 F>F  | .55 F>F   |

The tr_enc and shape_unp output changes were measured again (Dec 6) after linear outputs that only float ops read
began to stay float (coreai_opt/graph/unread_outputs.py); every output-changing defect is still flagged.
Output-changing defects: 56; flagged before: 9 (16 %); flagged now: 56 (100 %), each with the first failing
quantizer named (``VerificationReport.first_failing_quantizer``). Zero-point defects that leave the output unchanged
(the pair's Q and DQ moved together, only the clipping range changes) are flagged too (rule ``qparams``); the seven
duplicated Q/DQ pairs (idempotent) and the one dropped pair whose output did not move are not flagged. The
first quantizer a defect reaches differs in 3 % (2 % of shape_unpack's mix weight codes +3) to 100 % of its codes.
Clean files: see ``test_zoo_clean_export_is_never_flagged`` (zoo x presets, ``-m slow``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import onnx
import pytest
import torch
from torch import nn

import coreai_opt
from benchmarks.verify.mutations import MUTATIONS, judge_defect, mutate, remove_pair
from coreai_opt.onnx import export_onnx, verify_onnx
from coreai_opt.onnx.rewrite.graph import OnnxGraph
from coreai_opt.onnx.verify.fusion_report import optimized_model
from coreai_opt.onnx.verify.localize import add_outputs_and_save, quantizer_boundaries
from coreai_opt.onnx.verify.quantizer_codes import integer_kernel_of
from tests.zoo import PRESETS, ZOO, build, preset_config

Exported = tuple[nn.Module, Path, list[torch.Tensor]]


def _inputs(name: str) -> list[torch.Tensor]:
    torch.manual_seed(123)
    return [ZOO[name].make_input(16) for _ in range(4)]


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str, str], Exported]:
    """Converts and exports each (zoo model, preset) once per module."""
    cache: dict[tuple[str, str], Exported] = {}
    directory = tmp_path_factory.mktemp("mutations")

    def get(name: str, preset: str) -> Exported:
        if (name, preset) not in cache:
            model, example, batches = build(name)
            prepared = coreai_opt.prepare(model, preset_config(preset, model), example)
            coreai_opt.calibrate(prepared, batches, progress=False)
            converted = coreai_opt.convert(prepared)
            path = export_onnx(converted, example, directory / f"{name}_{preset}.onnx")
            cache[name, preset] = (converted, path, _inputs(name))
        return cache[name, preset]

    return get


def _check_defect(exported: Callable[[str, str], Exported], tmp_path: Path, name: str, defect: str) -> str:
    """Apply one defect; return what happened ("no site", "does not run", "output unchanged", "flagged")."""
    model, clean_path, inputs = exported(name, "w8a8")
    outcome = judge_defect(model, clean_path, [(x,) for x in inputs], defect, tmp_path)
    assert outcome.status != "missed", f"{defect} changed the output by {outcome.output_change:.3g} but verify passed"
    if outcome.status == "output unchanged":
        return "output unchanged" + (", flagged" if outcome.flagged else "")
    if outcome.status == "flagged":
        assert outcome.first_quantizer is not None, f"{defect} was flagged without naming a quantizer"
        if outcome.first_rule == "weight codes":  # a stored weight differs from eager's: named by its quantizer
            assert outcome.first_quantizer.endswith("_weight_fq"), outcome
        else:
            assert outcome.first_quantizer.startswith("quantize_dequantize_"), outcome
            assert outcome.first_rule in ("qparams", "steps", "mismatch", "bias", "missing"), outcome
    return outcome.status


# Default run: a handful of the table's cells, on the two fastest zoo models.
@pytest.mark.parametrize(("defect", "expected"), [
    ("scale_x1.05", "flagged"), ("zero_point_+1", "flagged"), ("weight_codes_+3", "flagged"),
    ("bias_x1.10", "flagged"), ("per_channel_scale_rolled", "flagged"), ("duplicate_qdq", "output unchanged")])
def test_shape_unpack_w8a8_each_defect_is_flagged_with_its_quantizer_and_the_idempotent_one_is_not(
        exported: Callable[[str, str], Exported], tmp_path: Path, defect: str, expected: str) -> None:
    assert _check_defect(exported, tmp_path, "shape_unpack", defect) == expected


@pytest.mark.parametrize("defect", ["weight_codes_+3", "drop_qdq", "bias_x1.10"])
def test_conv1d_groupnorm_w8a8_defect_changing_output_by_one_step_is_flagged(
        exported: Callable[[str, str], Exported], tmp_path: Path, defect: str) -> None:
    # today's verify passed all three (output moved by 0.008 / 0.008 / 0.028 on a model whose clean diff is 0)
    assert _check_defect(exported, tmp_path, "conv1d_groupnorm", defect) == "flagged"


def test_scale_defect_is_named_at_the_quantizer_whose_scale_changed(exported: Callable[[str, str], Exported],
                                                                    tmp_path: Path) -> None:
    model, clean_path, inputs = exported("shape_unpack", "w8a8")
    path = tmp_path / "scaled.onnx"
    onnx.save(mutate(onnx.load(str(clean_path)), "scale_x1.05"), str(path))
    report = verify_onnx(model, path, inputs)
    first = report.first_failing_quantizer
    assert first is not None and first.rule == "qparams" and not first.qparams_match
    # every quantizer before it passes with identical codes (shape_unpack's clean file is bit-exact)
    before = report.quantizers[:report.quantizers.index(first)]
    assert before and all(q.ok and q.identical == 1.0 for q in before)


def test_clean_shape_unpack_w8a8_codes_identical_at_every_quantizer(exported: Callable[[str, str], Exported]) -> None:
    model, path, inputs = exported("shape_unpack", "w8a8")
    report = verify_onnx(model, path, inputs)
    assert report.ok, str(report)
    # every QuantizeLinear of the file: the input, the GELU and mean outputs, the head's output (proj and mix write
    # float into the GELU and the mean: graph/unread_outputs.py)
    assert len(report.quantizers) == 4
    assert all(q.identical == 1.0 and q.mean_signed == 0.0 and q.qparams_match for q in report.quantizers)
    assert {q.kernels for q in report.quantizers} == {"exact", "integer-exact", "float"}
    # the head's QGemm output is judged by the integer-exact rule: 0 steps, 0 differing codes allowed
    exact = [q for q in report.quantizers if q.kernels == "integer-exact"]
    assert len(exact) == 1 and all(q.allowed_steps == 0 and q.allowed_mismatch == 0 for q in exact)
    assert all(q.rule == "integer-exact kernels" for q in exact)


def test_dropped_pair_is_reported_missing_at_its_own_call(exported: Callable[[str, str], Exported],
                                                           tmp_path: Path) -> None:
    """resnet18 w8a8 with its middle activation pair dropped: no node of the file is traced from that call any more,
    eager still calls it, so rule ``missing`` reports exactly that call; the clean file reports no call missing."""
    from coreai_opt.onnx.verify.localize import quantizer_boundaries
    from coreai_opt.onnx.verify.quantizer_codes import traced_calls

    model, clean_path, inputs = exported("resnet18", "w8a8")
    clean = onnx.load(str(clean_path))
    mutated = mutate(clean, "drop_qdq")
    dropped = {b.call for b in quantizer_boundaries(clean)} - {b.call for b in quantizer_boundaries(mutated)}
    assert len(dropped) == 1 and dropped <= traced_calls(clean) and not dropped & traced_calls(mutated)
    path = tmp_path / "dropped.onnx"
    onnx.save(mutated, str(path))
    report = verify_onnx(model, path, inputs)
    call = f"quantize_dequantize_{dropped.pop()}"
    assert [q.call for q in report.quantizers if q.rule == "missing"] == [call] and not report.ok
    assert "no node of the file" in str(report)
    clean_report = verify_onnx(model, clean_path, inputs)
    assert clean_report.ok and not [q for q in clean_report.quantizers if q.rule == "missing"]
    assert call in [q.call for q in clean_report.quantizers]  # compared there, absent from the mutated file


def _w8a8_exported(module: nn.Module, batches: list[tuple[torch.Tensor, ...]], path: Path) -> tuple[nn.Module, Path]:
    """``module`` prepared w8a8 on ``batches[0]``, calibrated on ``batches[:2]``, converted and exported to ``path``."""
    prepared = coreai_opt.prepare(module.eval(), coreai_opt.QuantizerConfig.presets.w8a8(), batches[0])
    coreai_opt.calibrate(prepared, batches[:2], progress=False)
    model = coreai_opt.convert(prepared)
    return model, export_onnx(model, batches[0], path)


class _TwoGatedLayers(nn.Module):
    """Both layers subtract the same ``(1 - gate) · 3`` (as hf-funnel's blocks each subtract ``(1 - mask) · 1e6``)."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        hidden = torch.relu(self.first(x) - (1 - gate) * 3.0)
        return self.second(hidden) - (1 - gate) * 3.0


def test_duplicate_pair_the_exporter_merged_is_not_missing_but_dropping_it_is(tmp_path: Path) -> None:
    """The two ``(1 - gate) · 3`` quantizers compute equal codes with equal scales; the exporter keeps one Q -> DQ
    pair read by both subtractions, so no node is traced from the second call. Its readers read exactly eager's
    values: ok, nothing missing. Dropping the kept pair (both readers read the float tensor) is still flagged at it."""
    torch.manual_seed(0)
    batches = [(torch.randn(8, 16), torch.rand(8, 16)) for _ in range(3)]
    model, path = _w8a8_exported(_TwoGatedLayers(), batches, tmp_path / "gated.onnx")
    clean = onnx.load(str(path))
    graph = OnnxGraph(clean)
    gate_pairs = [q for q in clean.graph.node if q.op_type == "QuantizeLinear" and "mul" in q.input[1]]
    assert len(gate_pairs) == 1  # one pair left of the two gate quantizers
    (dq,) = graph.readers(gate_pairs[0].output[0])
    assert [r.op_type for r in graph.readers(dq.output[0])] == ["Sub", "Sub"]  # read by both layers
    report = verify_onnx(model, path, batches[2:])
    assert report.ok, str(report)
    assert not [q for q in report.quantizers if q.rule == "missing"]

    remove_pair(clean, gate_pairs[0], [dq])  # drop the kept pair: both subtractions read the float gate
    onnx.save(clean, str(tmp_path / "dropped.onnx"))
    dropped = verify_onnx(model, tmp_path / "dropped.onnx", batches[2:])
    missing = [q.call for q in dropped.quantizers if q.rule == "missing"]
    assert not dropped.ok and len(missing) == 2  # the kept call and its merged duplicate, both read float now
    assert dropped.first_failing_quantizer is not None and dropped.first_failing_quantizer.rule == "missing"

class _ResidualNorm(nn.Module):
    """A residual sum, then the norm's float32 cast (hf-llama's decoder layer)."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(16, 16), nn.Linear(16, 16)
        self.weight = nn.Parameter(torch.ones(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = (x + self.first(x)).to(torch.float32)
        hidden = hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.second(self.weight * hidden.to(x.dtype))


def test_a_dropped_pair_that_its_own_quantizer_repeats_leaves_eagers_values(tmp_path: Path) -> None:
    """The float32 cast is a mover: the sum's quantizer is called again after it (the same module, not a quantizer
    of the cast's own, which rounded twice and which onnxruntime merged). Dropping the sum's first pair then leaves
    the file computing exactly eager's values, Q(sum) = Q(Q(sum)), and verify accepts it: no output or code
    differs. (When the cast had its own quantizer at the same scale, rule ``missing`` named the dropped call.)"""
    torch.manual_seed(0)
    batches = [(torch.randn(8, 16),) for _ in range(3)]
    model, path = _w8a8_exported(_ResidualNorm(), batches, tmp_path / "residual.onnx")
    clean = onnx.load(str(path))
    graph = OnnxGraph(clean)
    q_sum = next(q for q in clean.graph.node if q.op_type == "QuantizeLinear" and graph.producer(q.input[0]) is not None
                 and graph.producer(q.input[0]).op_type == "Add")
    (dq_sum,) = graph.readers(q_sum.output[0])
    (requant,) = graph.readers(dq_sum.output[0])
    assert requant.op_type == "QuantizeLinear" and requant.input[1] == q_sum.input[1]  # the same quantizer again
    assert verify_onnx(model, path, batches[2:]).ok

    remove_pair(clean, q_sum, [dq_sum])
    onnx.save(clean, str(tmp_path / "dropped.onnx"))
    report = verify_onnx(model, tmp_path / "dropped.onnx", batches[2:])
    assert report.ok and report.max_abs_diff == 0.0, report

def test_clean_w4a8_export_with_rounding_flips_is_not_flagged(exported: Callable[[str, str], Exported]) -> None:
    """Behind blocked int4 weights onnxruntime runs Conv in float: sparse ±1 flips (up to 52 % of fc's 160 codes)."""
    model, path, inputs = exported("resnet18", "w4a8")
    report = verify_onnx(model, path, inputs)
    assert report.ok, str(report)
    assert max(1 - q.identical for q in report.quantizers) > 0.1  # the flips are there, and judged legitimate


@pytest.mark.parametrize("name", list(ZOO))
def test_clean_zoo_w8a8_codes_identical_at_every_integer_kernel_quantizer(exported: Callable[[str, str], Exported],
                                                                          tmp_path: Path, name: str) -> None:
    """Every quantizer onnxruntime computes in QLinearConv / QGemm / QLinearMatMul: integer-exact, 0 codes differ."""
    model, path, inputs = exported(name, "w8a8")
    instrumented = add_outputs_and_save(onnx.load(str(path)), [b.tensor for b in quantizer_boundaries(
        onnx.load(str(path)))], tmp_path)  # the copy verify_onnx's quantizer comparison runs
    graph, boundaries = OnnxGraph(optimized_model(instrumented, "all")), quantizer_boundaries(onnx.load(str(path)))
    stops = {b.tensor for b in boundaries}
    integer = {f"quantize_dequantize_{b.call}" for b in boundaries if integer_kernel_of(graph, b.tensor, stops)}
    report = verify_onnx(model, path, inputs)
    judged = {q.call: q for q in report.quantizers}
    assert report.ok, str(report)
    assert integer and integer <= set(judged)
    assert [str(judged[c]) for c in integer if judged[c].kernels != "integer-exact"] == []
    assert all(judged[c].identical == 1.0 and judged[c].max_abs == 0 for c in integer)
    print(f"{name}: {len(integer)} integer-kernel quantizers, codes identical")


@pytest.mark.slow
@pytest.mark.parametrize("defect", list(MUTATIONS))
@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_w8a8_every_output_changing_defect_is_flagged(exported: Callable[[str, str], Exported], tmp_path: Path,
                                                          name: str, defect: str) -> None:
    outcome = _check_defect(exported, tmp_path, name, defect)
    print(f"OUTCOME {name} {defect}: {outcome}")


@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_clean_export_is_never_flagged(exported: Callable[[str, str], Exported], name: str, preset: str) -> None:
    model, path, inputs = exported(name, preset)
    report = verify_onnx(model, path, inputs)
    print(f"\n{name} {preset}\n{report}")
    assert report.ok, str(report)
