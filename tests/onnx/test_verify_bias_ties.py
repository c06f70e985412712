"""Rule 4 (bias) of verify's per-quantizer codes: a kernel's tie rule may move a few codes in 10⁴ one way, a defect
that shifts a fraction of the codes is still flagged (issue 30: timm repvit_m1, 1.2 M codes, a few all -1)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import onnx
import pytest
import torch

from coreai_opt.onnx.verify.code_rules import BIAS_TIES, BIAS_Z
from coreai_opt.onnx.verify.code_rules import judge_codes as _judge

N = 1_204_224  # repvit_m1's token mixer output, batch 2


def _judged(moved: int) -> object:
    """An integer-kernel quantizer whose inputs agree, with ``moved`` codes one step below eager's."""
    rng = np.random.default_rng(0)
    codes = rng.integers(-100, 100, N).astype(np.int8)
    eager = torch.from_numpy(codes.astype(np.float32) * 0.05)  # y = q · s, zero point 0: q_eager = codes
    got = codes.copy()
    got[rng.choice(N, moved, replace=False)] -= 1
    node = onnx.helper.make_node("QuantizeLinear", [], [])
    boundary = SimpleNamespace(scale=np.array(0.05, np.float32), zero_point=np.array(0, np.int8), axis=1, call=39,
                               module="stages.0.blocks.1.token_mixer", node=node)
    return _judge(boundary, got, (eager, torch.tensor(0.05), torch.tensor(0)), "integer", 17.0, 0.0)


@pytest.mark.parametrize("moved", [0, 60, 120])
def test_a_few_codes_in_ten_thousand_moved_one_way_by_a_tie_rule_pass(moved: int) -> None:
    codes = _judged(moved)
    assert moved == 0 or moved > BIAS_Z * np.sqrt(moved) + 1.0  # z > 6: what the rule flagged before
    assert codes.ok and codes.rule == "integer kernels", str(codes)


@pytest.mark.parametrize("moved", [2_000, 6_000])  # 0.17 % and 0.5 % of the codes one way: under rule 3's 1 %
def test_a_one_way_shift_of_a_fraction_of_the_codes_is_still_flagged_by_the_bias_rule(moved: int) -> None:
    codes = _judged(moved)
    assert moved > BIAS_Z * np.sqrt(moved) + 1.0 + BIAS_TIES * N
    assert not codes.ok and codes.rule == "bias", str(codes)
