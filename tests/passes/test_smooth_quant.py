"""SmoothQuant sites on captured graphs: classification, exact float equivalence, scale checks."""

from __future__ import annotations

import pytest
import torch

from coreai_opt.passes.capture import capture
from coreai_opt.passes.smooth_linear_inputs import apply_smoothing, find_sites
from coreai_opt.reference_models import transformer_encoder


class _PostLN(torch.nn.Module):
    """A post-LN block: the LayerNorm output also feeds the residual add (BERT layout)."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.ln = torch.nn.LayerNorm(d)
        self.fc1, self.fc2 = torch.nn.Linear(d, 2 * d), torch.nn.Linear(2 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(x)
        return h + self.fc2(torch.nn.functional.gelu(self.fc1(h)))


def _sites(model: torch.nn.Module, x: torch.Tensor):  # noqa: ANN202
    gm = capture(model, (x,), {}, method="export")
    return gm, {tuple(c.rsplit(".", 1)[0] for c in s.consumers): s for s in find_sites(gm)}


def test_zoo_pre_ln_sites() -> None:
    torch.manual_seed(0)
    model = transformer_encoder(dim=32, depth=1, heads=4).eval()
    _, sites = _sites(model, torch.randint(0, 1000, (2, 8)))
    assert sites[("blocks.0.attn.q", "blocks.0.attn.k", "blocks.0.attn.v")].kind == "layer_norm"
    assert sites[("blocks.0.attn.o",)].kind == "attention_value"
    assert sites[("blocks.0.fc1",)].kind == "layer_norm"
    fc2 = sites[("blocks.0.fc2",)]
    assert fc2.kind == "mul" and "non-linear" in fc2.reason


def test_post_ln_residual_is_not_foldable() -> None:
    _, sites = _sites(_PostLN().eval(), torch.randn(2, 4, 16))
    site = sites[("fc1",)]
    assert site.kind == "mul" and "add" in site.reason


@pytest.mark.parametrize("insert_mul", [False, True])
def test_smoothing_preserves_float_output(insert_mul: bool) -> None:
    torch.manual_seed(0)
    model = transformer_encoder(dim=32, depth=2, heads=4).eval()
    x = torch.randint(0, 1000, (3, 8))
    gm, sites = _sites(model, x)
    before = gm(x)
    scales = {s.tensor: torch.rand(32 if "fc2" not in s.consumers[0] else 128) * 3 + 0.2 for s in sites.values()}
    result = apply_smoothing(gm, list(sites.values()), scales, insert_mul=insert_mul)
    foldable = sum(s.foldable for s in sites.values())
    assert result.changes == (len(sites) if insert_mul else foldable)
    torch.testing.assert_close(gm(x), before, rtol=1e-4, atol=1e-5)


def test_bad_scale_is_rejected() -> None:
    torch.manual_seed(0)
    model = transformer_encoder(dim=32, depth=1, heads=4).eval()
    gm, sites = _sites(model, torch.randint(0, 1000, (2, 8)))
    site = sites[("blocks.0.attn.o",)]
    with pytest.raises(ValueError, match="positive, finite and of length 32"):
        apply_smoothing(gm, [site], {site.tensor: -torch.ones(32)})
