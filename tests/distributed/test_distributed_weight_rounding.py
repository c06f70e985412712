"""GPTQ's input statistics merge across gloo ranks: data-parallel calibration gives the single-process integers."""

from __future__ import annotations

import pytest
from dist_harness import RankRun, values
from dist_rounding_workers import calibrated_roundings, gptq_scenario, make_batches

pytestmark = pytest.mark.timeout(180)


def test_gptq_on_uneven_shards_of_two_ranks_equals_single_process_calibration() -> None:
    shards = [3, 1]
    ranks = RankRun(gptq_scenario, 2, shards, timeout=120)
    reference = calibrated_roundings(make_batches(sum(shards)))  # computed while the ranks run
    alone = calibrated_roundings(make_batches(sum(shards))[: shards[0]])
    results = values(ranks.results())
    assert results[0] == results[1] == reference
    assert alone != reference  # the shards really differ: without the merge rank 0 would round otherwise
