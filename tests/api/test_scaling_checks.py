"""The float-equivalence check SmoothQuant and AWQ run after scaling, and their bounded token sample."""

from __future__ import annotations

import pytest
import torch

from coreai_opt.api.algorithms.scaling_checks import check_float_outputs_kept, keep_token_rows


def test_check_accepts_a_move_at_the_bound_and_names_the_change_above_it() -> None:
    reference = [torch.tensor([2.0, -4.0]), "not a tensor", torch.tensor([1, 2])]
    at_bound = [torch.tensor([2.004, -4.0]), "not a tensor", torch.tensor([1, 2])]  # 0.004 = 1e-3 * max|ref| 4
    check_float_outputs_kept(reference, at_bound, 1e-3, change="smoothing", workaround="pass insert_mul=False")
    above = [torch.tensor([2.0, -4.01]), "not a tensor", torch.tensor([1, 2])]
    with pytest.raises(RuntimeError, match=r"smoothing changed the float output by 0\.01 \(allowed 0\.004\).*"
                                           r"as a workaround pass insert_mul=False"):
        check_float_outputs_kept(reference, above, 1e-3, change="smoothing", workaround="pass insert_mul=False")


def test_check_refuses_outputs_of_a_different_count() -> None:
    with pytest.raises(ValueError):
        check_float_outputs_kept([torch.ones(1)], [], 1e-3, change="awq", workaround="x")


def test_token_sample_keeps_exactly_max_tokens_rows_as_copies() -> None:
    samples: dict[str, list[torch.Tensor]] = {}
    first = torch.arange(12.0).reshape(6, 2)
    keep_token_rows(samples, "x", first, 8)
    keep_token_rows(samples, "x", torch.full((6, 2), -1.0), 8)
    keep_token_rows(samples, "x", torch.full((6, 2), -2.0), 8)
    first.zero_()  # the sample is a copy, not a view of the caller's tensor
    kept = torch.cat(samples["x"])
    assert kept.shape == (8, 2) and kept[:6].flatten().tolist() == list(range(12)) and (kept[6:] == -1).all()


def test_sites_table_right_aligns_only_the_alpha_column_and_keeps_every_row():
    from coreai_opt.api.algorithms.scaling_checks import sites_table

    text = sites_table(["input of", "kind", "α", "applied"], [["`fc1`", "layer_norm", "0.5", "yes"],
                                                            ["`fc2`", "linear", "—", "no"]])
    assert text.split("\n") == ["| input of | kind | α | applied |", "|---|---|---:|---|",
                                "| `fc1` | layer_norm | 0.5 | yes |", "| `fc2` | linear | — | no |"]
