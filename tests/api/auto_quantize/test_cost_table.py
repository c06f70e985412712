import json

import pytest

from coreai_opt.api.algorithms.auto_quantize import KERNEL_KINDS, CostTable, KernelCost
from tests.api.auto_quantize.conftest import table


def test_kernel_cost_is_overhead_plus_macs_over_throughput():
    assert KernelCost(5.0, 1000.0).latency_us(10_000) == 15.0
    assert table().latency_us("linear_static", 4000) == 2.0 + 4000 / 400.0


def test_cost_table_round_trips_through_json():
    original = table(key="cpu-ort1.32-t1")
    again = CostTable.from_dict(json.loads(json.dumps(original.to_dict())))
    assert again == original
    assert again.latency_us("conv_int16", 900) == original.latency_us("conv_int16", 900) == 0.5 + 10.0


def test_cost_table_names_missing_and_unknown_kinds():
    kernels = {k: KernelCost(1.0, 1.0) for k in KERNEL_KINDS if k != "conv_int16"} | {"conv_int4": KernelCost(1, 1)}
    with pytest.raises(ValueError, match=r"missing kernel kinds \['conv_int16'\], unknown kinds \['conv_int4'\]"):
        CostTable(kernels, "bad")


@pytest.mark.parametrize("overhead, throughput", [(-1.0, 10.0), (0.0, 0.0), (float("nan"), 1.0)])
def test_kernel_cost_rejects_negative_overhead_and_non_positive_throughput(overhead, throughput):
    with pytest.raises(ValueError, match="overhead_us >= 0 and macs_per_us > 0"):
        KernelCost(overhead, throughput)
