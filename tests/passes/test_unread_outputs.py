"""A linear output no integer kernel reads stays float (coreai_opt.graph.unread_outputs), measured in onnxruntime."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import torch
from torch import nn

import coreai_opt as co
from coreai_opt.config import QuantizerConfig
from coreai_opt.onnx.verify.fusion_report import optimized_model
from coreai_opt.quantization.spec import FakeQuantize

W8A8 = QuantizerConfig.presets.w8a8


class _FeedForward(nn.Module):
    """BERT's feed-forward block on ``[batch, tokens, C]``: ``x + down(gelu(up(x)))``."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(x)))


def _ops(config: QuantizerConfig, tmp_path: Path, label: str) -> tuple[Counter[str], bool, int]:
    torch.manual_seed(0)
    batches = [(torch.randn(2, 6, 16),) for _ in range(3)]
    model = _FeedForward().eval()
    prepared = co.prepare(model, config, batches[0])
    co.calibrate(prepared, batches, progress=False)
    converted = co.convert(prepared)
    path = co.export_onnx(converted, batches[0], tmp_path / f"{label}.onnx")
    ops = Counter(n.op_type for n in optimized_model(path, level="all").graph.node)
    quantizers = sum(isinstance(m, FakeQuantize) for m in converted.modules())
    return ops, co.verify_onnx(converted, path, batches).ok, quantizers


def test_a_linear_read_by_gelu_only_writes_float_from_its_integer_kernel(tmp_path: Path) -> None:
    ops, ok, quantizers = _ops(W8A8(), tmp_path, "default")
    assert ok
    # up's output is read by the GELU alone: no Q -> DQ pair there, and up still runs as an integer QGemm
    assert ops["QGemm"] == 2 and ops["QLinearAdd"] == 1
    # Q: x and the gelu output; DQ: the model output after QLinearAdd
    assert (ops["QuantizeLinear"], ops["DequantizeLinear"]) == (2, 1)
    # an op_kind entry naming linear is the user asking for every linear output: up's comes back
    named_ops, named_ok, named_quantizers = _ops(W8A8().set_op_kind("linear", {"activation": W8A8().activation}),
                                                 tmp_path, "named")
    assert named_ok and named_quantizers == quantizers + 1
    assert (named_ops["QuantizeLinear"], named_ops["DequantizeLinear"]) == (2, 2)  # up's Q runs inside its QGemm


def test_a_float_residual_stream_leaves_the_projections_into_it_float() -> None:
    torch.manual_seed(0)
    x = torch.randn(2, 6, 16)
    config = W8A8().set_op_kind("add", None)  # residual adds and layer norms in float: the static-MiniLM recipe
    prepared = co.prepare(_FeedForward().eval(), config, (x,))
    names = sorted(name for name, m in prepared.named_modules() if isinstance(m, FakeQuantize))
    # x (up's input), gelu's output (down's input) and the two weights: neither linear output is read quantized
    assert names == ["down_weight_fq", "gelu_output_fq", "up_weight_fq", "x_input_fq"]
