"""A captured ``reshape`` traced as a view of SDPA's output keeps working once attention is decomposed (issue 13)."""

import torch
import torch.nn.functional as F
from torch import nn

import coreai_opt as co
from coreai_opt.passes.capture import capture
from coreai_opt.passes.decompose_attention import decompose_attention
from coreai_opt.passes.views_to_reshapes import views_to_reshapes

B, H, T, E = 2, 4, 6, 8


class _HeadsMerged(nn.Module):
    """The T5 / BEiT / Swin tail of attention: ``sdpa(q, k, v).transpose(1, 2).reshape(B, T, -1)``.

    The in-place residual add makes the capture functionalize the program (``run_decompositions({})``), which
    lowers ``reshape`` to ``view`` wherever the traced strides allow it.
    """

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(H * E, 3 * H * E)
        self.out = nn.Linear(H * E, H * E)

    def forward(self, x):
        q, k, v = self.qkv(x).reshape(x.shape[0], T, 3, H, E).permute(2, 0, 3, 1, 4).unbind(0)
        attended = F.scaled_dot_product_attention(q, k, v)
        y = self.out(attended.transpose(1, 2).reshape(x.shape[0], T, -1))
        y += x
        return y


def _inputs(seed: int = 0) -> tuple[torch.Tensor]:
    return (torch.randn(B, T, H * E, generator=torch.Generator().manual_seed(seed)),)


def test_export_capture_has_no_view_left_and_decomposed_attention_runs_exactly():
    model = _HeadsMerged().eval()
    gm = capture(model, _inputs(), method="export")
    targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.view.default not in targets
    assert targets.count(torch.ops.aten.reshape.default) >= 2
    gm = decompose_attention(gm).graph_module
    x = _inputs(1)[0]
    torch.testing.assert_close(gm(x), model(x), rtol=1e-5, atol=1e-6)


def test_without_the_rewrite_the_decomposed_attention_raises_the_stride_error():
    """Proves the graph needs the rule: the view torch.export traced only fits SDPA's kernel strides."""
    model = _HeadsMerged().eval()
    program = torch.export.export(model, _inputs(), strict=False).run_decompositions({})
    views = [n for n in program.graph.nodes if n.target is torch.ops.aten.view.default]
    assert views, "torch.export no longer records this reshape as a view; the rule may be obsolete"
    gm = decompose_attention(program.module()).graph_module
    try:
        gm(*_inputs(1))
    except RuntimeError as exc:
        assert "view size is not compatible" in str(exc)
    else:
        raise AssertionError("the traced view ran on the decomposed attention's strides")
    assert views_to_reshapes(gm).changes == len(views)
    torch.testing.assert_close(gm(*_inputs(1)), model(*_inputs(1)), rtol=1e-5, atol=1e-6)


def test_a_view_written_through_in_place_stays_a_view():
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    view = graph.call_function(torch.ops.aten.view.default, (x, [4]))
    graph.call_function(torch.ops.aten.add_.Tensor, (view, 1.0))
    graph.output(x)
    gm = torch.fx.GraphModule(nn.Module(), graph)
    assert views_to_reshapes(gm).changes == 0
    out = gm(torch.zeros(2, 2))
    assert out.tolist() == [[1.0, 1.0], [1.0, 1.0]]


def test_w8a8_attention_model_calibrates_and_exports(tmp_path):
    model = _HeadsMerged().eval()
    prepared = co.prepare(model, co.QuantizerConfig.presets.w8a8(), _inputs(), capture="export")
    co.calibrate(prepared, [_inputs(s) for s in range(3)], progress=False)
    converted = co.convert(prepared)
    path = co.export_onnx(converted, _inputs(), tmp_path / "m.onnx")
    report = co.verify_onnx(converted, path, [_inputs(7)])
    assert report.ok, report
