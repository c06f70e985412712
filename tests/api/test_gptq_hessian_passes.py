"""GPTQ's Hessians in groups, one pass over the data per group (issue 20): bit-identical to one pass, bounded."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import coreai_opt as co
from coreai_opt.api.internals.hessian_groups import hessian_groups
from coreai_opt.api.internals.quantizer_state import fake_quantizers, input_statistics


class _Mlp(nn.Module):
    """Four linears of 48, 64, 96 and 32 input channels (Hessians of 9, 16, 36 and 4 KiB)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(48, 64), nn.Linear(64, 96)
        self.fc3, self.fc4 = nn.Linear(96, 32), nn.Linear(32, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.fc2(torch.relu(self.fc1(x))))
        return self.fc4(torch.relu(self.fc3(h)))


def _data(n: int = 5) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randn(6, 48, generator=gen) for _ in range(n)]


def _prepared() -> torch.fx.GraphModule:
    torch.manual_seed(0)
    return co.prepare(_Mlp().eval(), co.QuantizerConfig.presets.w4a8(block_size=16), (_data()[0],))


def _state(gm: torch.fx.GraphModule) -> dict[str, torch.Tensor]:
    """Every quantizer's qparams and every rounded integer weight."""
    out = {}
    for name, fq in fake_quantizers(gm):
        out[f"{name}.scale"], out[f"{name}.zero_point"] = fq.calculator.scale.clone(), fq.calculator.zero_point.clone()
        if fq.rounding is not None:
            out[f"{name}.q"] = fq.rounding.qweight.clone()
    return out


def _counting(gm: torch.fx.GraphModule) -> list[int]:
    calls = [0]
    gm.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


def test_one_pass_per_hessian_group_gives_bit_identical_integers_and_qparams() -> None:
    one = _prepared()
    co.calibrate(one, _data(), progress=False)
    grouped = _prepared()
    stats = input_statistics(grouped)
    # 9 + 16 KiB, then 36 KiB, then 4 KiB (36 + 4 > 39)
    assert [len(g) for g in hessian_groups(grouped, stats, 39 * 1024)] == [2, 1, 1]
    calls = _counting(grouped)
    co.calibrate(grouped, _data(), progress=False, hessian_memory=39 * 1024)
    assert calls[0] == 3 * 5  # three passes over the five batches
    a, b = _state(one), _state(grouped)
    assert sorted(a) == sorted(b) and len([k for k in a if k.endswith(".q")]) == 4
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])]
    assert all(s.xtx.numel() == 0 for s in stats)  # every Hessian freed after its group was rounded
    assert not any(bool(fq.rounding.awaiting_data) for _, fq in fake_quantizers(grouped) if fq.rounding is not None)
    x = _data(1)[0]
    with torch.no_grad():
        assert torch.equal(co.convert(one)(x), co.convert(grouped)(x))


def test_hessians_that_fit_take_one_pass_and_accept_a_one_shot_iterator() -> None:
    gm = _prepared()
    calls = _counting(gm)
    co.calibrate(gm, (x for x in _data()), progress=False)  # default budget: at least 256 MiB
    assert calls[0] == 5
    assert not any(bool(fq.rounding.awaiting_data) for _, fq in fake_quantizers(gm) if fq.rounding is not None)
    # 9 + 16 + 36 + 4 KiB = 65 KiB of Hessians: one group at 65 KiB, two just below
    assert [len(g) for g in hessian_groups(gm, input_statistics(gm), 65 * 1024)] == [4]
    assert [len(g) for g in hessian_groups(gm, input_statistics(gm), 65 * 1024 - 1)] == [3, 1]


def test_several_passes_refuse_a_one_shot_iterator_and_leave_the_model_uncalibrated() -> None:
    gm = _prepared()
    with pytest.raises(ValueError, match=r"3 passes .*one-shot iterator \(generator\).*re-iterable"):
        co.calibrate(gm, (x for x in _data()), progress=False, hessian_memory=39 * 1024)
    assert all(bool(fq.rounding.awaiting_data) for _, fq in fake_quantizers(gm) if fq.rounding is not None
               and fq.rounding.statistics.attached)
    with pytest.raises(ValueError, match=r"hessian_memory must be a positive number of bytes"):
        co.calibrate(gm, _data(), progress=False, hessian_memory=0)


def test_commit_rounds_from_the_hessian_in_place_with_the_bits_of_a_separate_copy() -> None:
    gm = _prepared()
    rounding = gm.fc3_weight_fq.rounding
    stats = rounding.statistics
    gen = torch.Generator().manual_seed(5)
    for _ in range(3):
        stats.update(torch.relu(torch.randn(20, 96, generator=gen) @ torch.randn(96, 96, generator=gen)))
    weight = gm.fc3.weight.detach()
    copy = type(stats)(hessian=True)
    copy.load_state_dict(stats.state_dict())
    separate = type(rounding)(rounding.spec).round_weight(weight, copy)  # hessian_matrix(): a new d x d tensor
    assert copy.xtx.shape == (96, 96)  # not consumed outside commit
    committed = rounding.commit(weight)  # consumes XᵀX in place, then resets
    assert stats.xtx.numel() == 0
    assert all(torch.equal(a, b) for a, b in zip(separate, committed, strict=True))


def test_prepare_rounds_gptq_linears_provisionally_to_nearest_and_convert_still_refuses_them() -> None:
    torch.manual_seed(0)
    gm = co.prepare(_Mlp().eval(), co.QuantizerConfig.presets.w4(block_size=16), (_data()[0],))  # weight-only
    fq = gm.fc2_weight_fq
    rtn_rounding = co.quantization.rounding.weight_rounding.RTNRounding(fq.rounding.spec)
    rtn = rtn_rounding.round_weight(gm.fc2.weight.detach(), None)
    assert torch.equal(fq.rounding.qweight, rtn.q.to(torch.int8)) and bool(fq.rounding.awaiting_data)
    with pytest.raises(ValueError, match=r"never observed .*fc2\.weight"):
        co.convert(gm)
