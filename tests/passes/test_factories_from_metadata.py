"""x.new_zeros(...) reads x's dtype only (coreai_opt.passes.factories_from_metadata): x's chain becomes dead."""

from __future__ import annotations

import torch
from torch import nn

from coreai_opt.graph.dead_code import remove_dead_nodes
from coreai_opt.passes.capture import capture
from coreai_opt.passes.factories_from_metadata import factories_from_metadata


class _ReadForItsDtype(nn.Module):
    """DeepSeek-V4's compressor on a short prompt: a projection read only by ``new_zeros`` / ``new_full``."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.kv, self.out = nn.Linear(16, 16), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kv = self.kv(x)
        empty = kv[:, :0].new_zeros((x.shape[0], 0, 4))
        ones = kv.new_full((x.shape[0], 1, 4), 0.5)
        return torch.cat([empty, self.out(torch.relu(x)), ones], dim=1)


def test_the_readers_become_factories_and_the_projection_is_dead_code_on_both_captures():
    x = torch.randn(2, 3, 16)
    model = _ReadForItsDtype().eval()
    for method in ("fx", "export"):
        gm = capture(model, (x,), method=method)
        targets = [str(n.target) for n in gm.graph.nodes]
        assert any("new_full" in t for t in targets), targets  # the premise: the capture keeps the readers
        assert factories_from_metadata(gm).changes == 2
        remove_dead_nodes(gm)
        gm.recompile()
        live = [n for n in gm.graph.nodes if "kv" in str(n.target) or "kv" in n.name]
        assert live == [], (method, live)
        with torch.no_grad():
            assert torch.equal(gm(x), model(x))
