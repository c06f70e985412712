import pytest
import torch
import torch.nn.functional as F
from torch import nn

from coreai_opt.graph.attention_math import masked_softmax
from coreai_opt.graph.node_meta import get_meta, tensor_info
from coreai_opt.graph.op_kinds import OpKind
from coreai_opt.passes.capture import capture
from coreai_opt.passes.classify_ops import classify_ops
from coreai_opt.passes.decompose_attention import SDPA_TARGETS, decompose_attention

B, H, L, S, E = 2, 4, 6, 6, 8


class _Attention(nn.Module):
    """q/k/v projections (GQA: fewer key/value heads) and one SDPA call with the given options."""

    def __init__(self, kv_heads: int = H, **sdpa: object) -> None:
        super().__init__()
        self.kv_heads, self.sdpa = kv_heads, sdpa
        self.q = nn.Linear(E * H, E * H)
        self.kv = nn.Linear(E * H, 2 * E * kv_heads)

    def forward(self, x, mask=None):
        q = self.q(x).view(x.shape[0], L, H, E).transpose(1, 2)
        k, v = self.kv(x).view(x.shape[0], L, 2, self.kv_heads, E).permute(2, 0, 3, 1, 4).unbind(0)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **self.sdpa)


def _padding_mask(kind: str) -> torch.Tensor | None:
    keep = torch.ones(B, 1, L, S, dtype=torch.bool)
    keep[1, :, :, S - 2:] = False  # padded keys of row 1
    keep[1, :, 2, :] = False  # one query that may attend to nothing: SDPA gives zeros
    if kind == "bool":
        return keep
    if kind == "float":
        return torch.zeros(B, 1, L, S).masked_fill(~keep, torch.finfo(torch.float32).min)
    return None


CASES = {
    "no mask": ({}, None),
    "bool mask": ({}, "bool"),
    "float mask": ({}, "float"),
    "causal": ({"is_causal": True}, None),
    "causal and bool mask": ({"is_causal": True}, "bool"),
    "explicit scale": ({"scale": 0.3}, "float"),
    "grouped-query": ({"enable_gqa": True, "kv_heads": 2}, None),
}


@pytest.mark.parametrize("how", ["fx", "export"])
@pytest.mark.parametrize("case", list(CASES))
def test_decomposed_attention_matches_sdpa_within_1e6_relative(how, case):
    options, mask_kind = CASES[case]
    options = dict(options)
    torch.manual_seed(0)
    model = _Attention(options.pop("kv_heads", H), **options).eval()
    x, mask = torch.randn(B, L, E * H), _padding_mask(mask_kind)
    args = (x,) if mask is None else (x, mask)
    gm = capture(model, args, method=how)
    assert decompose_attention(gm).changes == 1
    assert not any(n.target in SDPA_TARGETS for n in gm.graph.nodes)
    with torch.no_grad():
        expected, got = model(*args), gm(*args)
    rel = float((got - expected).abs().max() / expected.abs().max())
    print(f"{how} {case}: max rel diff {rel:.2e}")
    assert rel <= 1e-6
    if mask_kind == "bool":  # the query that may attend to nothing: zeros (a finfo.min float mask averages v)
        assert torch.equal(got[1, :, 2], torch.zeros_like(got[1, :, 2]))
    kinds = [get_meta(n).kind for n in classify_ops(gm).graph_module.graph.nodes]
    assert kinds.count(OpKind.MATMUL) == 2 and kinds.count(OpKind.SOFTMAX) == 1
    for node in gm.graph.nodes:  # every new node carries shape metadata for the later passes
        if node.op == "call_function" and node.target in (torch.matmul, torch.softmax, masked_softmax):
            assert tensor_info(node)[0][-2:] in ((L, S), (L, E))


def test_decompose_attention_refuses_a_training_dropout():
    class Dropped(nn.Module):
        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, dropout_p=0.1)

    q = torch.randn(B, H, L, E)
    gm = capture(Dropped(), (q, q, q), method="fx")
    with pytest.raises(ValueError, match=r"dropout_p=0.1.*call model.eval\(\) before prepare"):
        decompose_attention(gm)


def test_decompose_attention_is_a_no_op_without_attention():
    gm = capture(nn.Sequential(nn.Linear(4, 4)), (torch.randn(2, 4),), method="fx")
    before = gm.code
    assert decompose_attention(gm).changes == 0
    assert gm.code == before


class _TimmStyle(nn.Module):
    """timm's VisionTransformer passes ``attn_mask=None, is_causal=False`` forward arguments down to SDPA."""

    def forward(self, q, attn_mask=None, is_causal=False):
        return F.scaled_dot_product_attention(q, q * 0.5, q, attn_mask=attn_mask, is_causal=is_causal)


def test_decompose_attention_specialises_non_tensor_inputs_to_their_captured_value_and_guards_them():
    q = torch.randn(B, H, L, E)
    gm = capture(_TimmStyle(), (q,), method="fx")
    assert decompose_attention(gm).changes == 1
    expected = F.scaled_dot_product_attention(q, q * 0.5, q)  # not causal: the default the input had at capture
    assert float((gm(q) - expected).abs().max()) <= 1e-6
    with pytest.raises(AssertionError, match="is_causal=False"):
        gm(q, None, True)
    with pytest.raises(AssertionError, match="attn_mask=None"):
        gm(q, torch.ones(L, S, dtype=torch.bool))
