"""Small graphs with the patterns real architectures use, end to end into onnxruntime's integer kernels.

Each graph is one root cause the real-architecture corpus found (issue 13): a timm ``BatchNormAct2d`` after a
bias-free conv (both captures), ``scaled_dot_product_attention`` and GPT-2's ``addmm`` linear.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import onnx
import pytest
import torch

import coreai_opt as co
from coreai_opt.onnx.verify import VerificationReport
from tests.passes.test_fold_batchnorm import _ConvBNAct
from tests.zoo import randomize_batchnorm


def _pipeline(model: torch.nn.Module, batches: list[tuple[torch.Tensor, ...]], path: Path, capture: str = "auto"
              ) -> tuple[torch.nn.Module, VerificationReport]:
    prepared = co.prepare(model, co.QuantizerConfig.presets.w8a8(), batches[0], capture=capture)
    co.calibrate(prepared, batches, progress=False)
    converted = co.convert(prepared)
    co.export_onnx(converted, batches[0], path)
    return converted, co.verify_onnx(converted, path, batches)


def _ops(path: Path) -> Counter[str]:
    return Counter(node.op_type for node in onnx.load(str(path)).graph.node)


@pytest.mark.parametrize("capture", ["fx", "export"])
def test_timm_batchnorm_act_folds_to_zero_batchnormalization_nodes_and_integer_convs(tmp_path, capture):
    torch.manual_seed(0)
    model = randomize_batchnorm(_ConvBNAct()).eval()
    batches = [(torch.randn(4, 3, 8, 8),) for _ in range(3)]
    _, report = _pipeline(model, batches, tmp_path / "m.onnx", capture)
    ops = _ops(tmp_path / "m.onnx")
    print(f"{capture}: {dict(ops)}\n{report}")
    assert ops["BatchNormalization"] == 0 and ops["Relu"] == 0  # folded; relu absorbed by the conv-output Q
    assert report.fusion.integer_compute == {"QLinearConv": 2} and report.fusion.num_float_compute == 0
    assert report.ok
