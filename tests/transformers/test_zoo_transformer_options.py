"""The zoo transformer keeps 100 % eager-vs-onnxruntime top-1 agreement under every issue-8 option (fast)."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch

from benchmarks.minilm import ours as minilm_ours
from coreai_opt.api.algorithms.calibration_search import search_calibration
from coreai_opt.api.algorithms.sensitivity import keep_sensitive, sensitivity
from coreai_opt.api.algorithms.smooth_quant import smooth_quant
from coreai_opt.config import QuantizerConfig
from coreai_opt.quantization.fake_quantize.dynamic_fake_quantize import dynamic_activation_spec
from coreai_opt.reference_models import transformer_encoder

SEQ = 16


def _w8a8_dynamic() -> QuantizerConfig:
    config = QuantizerConfig.presets.w8a8_dynamic()
    assert config.resolve("linear", None, None).activation == dynamic_activation_spec()
    return config


@pytest.fixture(scope="module")
def model() -> torch.nn.Module:
    """The zoo transformer, briefly trained to imitate its own initial decisions (about 3 s).

    Random-init logits are nearly tied (median top-1 margin about 0.5 % of their range), so one quantization
    step of onnxruntime-vs-eager difference flips argmax even for plain ``w8a8``. Distilling the initial model
    into itself with cross-entropy keeps its function but makes the decisions confident.
    """
    torch.manual_seed(0)
    model = transformer_encoder(dim=32, depth=2, heads=4)
    teacher = copy.deepcopy(model).eval()
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(5)
    for _ in range(300):
        x = torch.randint(0, 1000, (64, SEQ), generator=gen)
        with torch.no_grad():
            target = teacher(x).argmax(-1)
        loss = torch.nn.functional.cross_entropy(model(x), target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


@pytest.fixture(scope="module")
def data() -> dict[str, list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return {"calib": [torch.randint(0, 1000, (8, SEQ), generator=gen) for _ in range(4)],
            "eval": [torch.randint(0, 1000, (16, SEQ), generator=gen) for _ in range(4)]}


def _top1_agreement(prepared: torch.fx.GraphModule, example: torch.Tensor, batches: list[torch.Tensor],
                    path: Path) -> tuple[float, list[str]]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        converted, path = minilm_ours.export(prepared, (example,), path)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    name = sess.get_inputs()[0].name
    agree, decided = [], []
    for x in batches:
        with torch.no_grad():
            logits = converted(x)
        top2 = logits.topk(2, dim=-1).values
        # Decisions closer than 2 % of the logit range are within one output quantization step; they are not
        # counted (at most 10 % of the samples may be excluded, so the check keeps its power).
        decided.append(((top2[:, 0] - top2[:, 1]) > 0.02 * logits.abs().max()).numpy())
        agree.append(sess.run(None, {name: x.numpy()})[0].argmax(-1) == logits.argmax(-1).numpy())
    decided_all, agree_all = np.concatenate(decided), np.concatenate(agree)
    assert decided_all.mean() >= 0.9, f"only {decided_all.mean():.0%} of the decisions are clear-cut"
    return float(agree_all[decided_all].mean()), [n.op_type for n in onnx.load(path).graph.node]


def _static_w8a8() -> QuantizerConfig:
    return QuantizerConfig.presets.w8a8()


def _prepare(model: torch.nn.Module, config: QuantizerConfig, data: dict) -> torch.fx.GraphModule:
    return minilm_ours.prepare_calibrate(model, config, (data["calib"][0],), [(b,) for b in data["calib"]])


def test_w8a8_dynamic_runs_integer_matmuls(model, data, tmp_path) -> None:
    prepared = _prepare(model, _w8a8_dynamic(), data)
    agreement, ops = _top1_agreement(prepared, data["calib"][0], data["eval"], tmp_path / "dyn.onnx")
    assert agreement == 1.0
    assert ops.count("MatMulInteger") == 13 and "QuantizeLinear" not in ops  # 12 block linears + head


@pytest.mark.parametrize("insert_mul", [False, True])
def test_smooth_quant_dynamic(model, data, tmp_path, insert_mul: bool) -> None:
    result = smooth_quant(model, [(b,) for b in data["calib"]], (data["calib"][0],), alpha=0.5,
                          insert_mul=insert_mul)
    kinds = {r.site.kind for r in result.sites if r.applied}
    assert {"layer_norm", "attention_value"} <= kinds  # pre-LN zoo block: LN -> q/k/v and v -> o fold
    assert ("mul" in kinds) == insert_mul  # fc2 reads GELU output: not foldable
    prepared = _prepare(result.model, _w8a8_dynamic(), data)
    agreement, ops = _top1_agreement(prepared, data["calib"][0], data["eval"], tmp_path / "sq.onnx")
    assert agreement == 1.0
    assert ("Mul" in ops) and ops.count("MatMulInteger") == 13


def test_smooth_quant_search_static(model, data, tmp_path) -> None:
    result = smooth_quant(model, [(b,) for b in data["calib"]], (data["calib"][0],), alpha="search")
    prepared = _prepare(result.model, _static_w8a8(), data)
    agreement, _ = _top1_agreement(prepared, data["calib"][0], data["eval"], tmp_path / "sqs.onnx")
    assert agreement == 1.0


def test_calibration_search_static(model, data, tmp_path) -> None:
    prepared = _prepare(model, _static_w8a8(), data)
    result = search_calibration(prepared, [(b,) for b in data["calib"]])
    assert result.choices and set(result.counts()) <= {"minmax", "percentile", "mse", "entropy"}
    for choice in result.choices:  # the chosen calculator has the smallest measured error
        assert choice.errors[choice.chosen] == min(choice.errors.values())
    agreement, _ = _top1_agreement(prepared, data["calib"][0], data["eval"], tmp_path / "cs.onnx")
    assert agreement == 1.0


def test_keep_sensitive_float(model, data, tmp_path) -> None:
    config = _w8a8_dynamic()
    prepared = _prepare(model, config, data)
    report = sensitivity(prepared, [(b,) for b in data["calib"][:2]])
    assert len(report.rows) == 13 and report.rows[0].error >= report.rows[-1].error
    kept = keep_sensitive(config, report, 2)
    prepared = _prepare(model, kept, data)
    agreement, ops = _top1_agreement(prepared, data["calib"][0], data["eval"], tmp_path / "keep.onnx")
    assert agreement == 1.0 and ops.count("MatMulInteger") == 11
