from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from torch import Tensor

from coreai_opt.quantization.spec import (
    FAKE_QUANTIZE,
    QPARAMS_CALCULATORS,
    RANGE_CALCULATORS,
    FakeQuantize,
    MinMaxRangeCalculator,
    QParamsCalculatorBase,
    QuantizationSpec,
    RangeCalculatorBase,
    Registry,
    StaticQParamsCalculator,
)


class _Base:
    pass


def test_registry_register_get_and_unregister() -> None:
    reg: Registry = Registry("widget", _Base)

    @reg.register("small_widget")
    class Small(_Base):
        pass

    assert reg.get_class("small_widget") is Small
    assert Small.registry_key == "small_widget"  # type: ignore[attr-defined]
    assert reg.list_registry_keys() == ["small_widget"]
    assert reg.list_registry_values() == [Small]
    assert reg.resolve("small_widget") is Small
    assert reg.key_of(Small) == "small_widget"
    reg.unregister("small_widget")
    assert "small_widget" not in reg


def test_registry_errors_name_the_key_and_the_fix() -> None:
    reg: Registry = Registry("widget", _Base)
    reg.register("a_widget")(type("A", (_Base,), {}))
    with pytest.raises(ValueError, match="unknown widget 'b_widget'; registered widgets are: 'a_widget'"):
        reg.get_class("b_widget")
    with pytest.raises(ValueError, match="already registered"):
        reg.register("a_widget")(type("B", (_Base,), {}))
    with pytest.raises(ValueError, match="snake_case"):
        reg.register("BadKey")
    with pytest.raises(TypeError, match="must subclass _Base"):
        reg.register("other")(int)
    with pytest.raises(TypeError, match="subclass of _Base"):
        reg.resolve(3.0)  # type: ignore[arg-type]


def test_family_classmethods_share_one_registry_per_family() -> None:
    assert RangeCalculatorBase.get_class("minmax") is MinMaxRangeCalculator
    assert "minmax" in RangeCalculatorBase.list_registry_keys()
    assert QParamsCalculatorBase.get_class("static") is StaticQParamsCalculator
    assert {"static", "moving_average", "global_minmax", "dynamic"} <= set(QParamsCalculatorBase.list_registry_keys())
    assert StaticQParamsCalculator in QParamsCalculatorBase.list_registry_values()
    assert FakeQuantize.get_class("default") is FakeQuantize
    assert FakeQuantize.resolve(FakeQuantize) is FakeQuantize
    assert FakeQuantize.list_registry_keys() == FAKE_QUANTIZE.list_registry_keys()


def test_user_range_calculator_registered_by_key_is_used_from_a_spec(
    temporary_registration: Callable[[Registry, str], Callable[[type], type]],
) -> None:
    @temporary_registration(RANGE_CALCULATORS, "abs_max_only")
    class AbsMaxRange(MinMaxRangeCalculator):
        """Symmetric range +-max|x| whatever the sign of the data."""

        def compute_range(self) -> tuple[Tensor, Tensor]:
            mn, mx = super().compute_range()
            m = torch.maximum(mn.abs(), mx.abs())
            return -m, m

    spec = QuantizationSpec(dtype="uint8", qscheme="asymmetric", range_calculator="abs_max_only")
    fq = FakeQuantize(spec)
    assert isinstance(fq.calculator.range_calculator, AbsMaxRange)
    fq(torch.tensor([0.0, 2.55]))
    # Range [-2.55, 2.55] -> scale 5.1 / 255 = 0.02, zero point 0 - round(-2.55 / 0.02) = 128 (not 0).
    assert fq.calculator.zero_point.item() == 128
    assert fq.calculator.scale.item() == pytest.approx(0.02, rel=1e-6)


def test_user_classes_registered_in_each_family_are_used_from_a_spec(
    temporary_registration: Callable[[Registry, str], Callable[[type], type]],
) -> None:
    @temporary_registration(QPARAMS_CALCULATORS, "doubled_static")
    class Doubled(StaticQParamsCalculator):
        def observed_range(self) -> tuple[Tensor, Tensor]:
            mn, mx = super().observed_range()
            return 2 * mn, 2 * mx

    @temporary_registration(FAKE_QUANTIZE, "counting")
    class Counting(FakeQuantize):
        calls = 0

        def forward(self, x: Tensor) -> Tensor:
            type(self).calls += 1
            return super().forward(x)

    spec = QuantizationSpec(dtype="int8", qparams_calculator="doubled_static", fake_quantize="counting")
    fq = FakeQuantize.get_class(spec.fake_quantize).from_spec(spec)
    assert isinstance(fq, Counting) and isinstance(fq.calculator, Doubled)
    fq(torch.tensor([-1.0, 1.0]))
    assert fq.calculator.scale.item() == pytest.approx(2.0 / 127.5, rel=1e-7)
    assert Counting.calls == 1


def test_spec_rejects_unknown_registry_key_naming_the_field_and_known_keys() -> None:
    with pytest.raises(ValueError, match=r"range_calculator\n.*unknown range calculator 'minmaxx'.*'minmax'"):
        QuantizationSpec(dtype="int8", range_calculator="minmaxx")
    with pytest.raises(ValueError, match=r"qparams_calculator\n.*'moving_average'"):
        QuantizationSpec(dtype="int8", qparams_calculator="ema")


def test_registry_classmethods_come_from_one_mixin_bound_to_each_family() -> None:
    from coreai_opt.quantization.rounding import WEIGHT_ROUNDING, WeightRoundingBase
    from coreai_opt.quantization.spec.registry import RegistryFamily

    names = ("register", "get_class", "resolve", "list_registry_keys", "list_registry_values")
    for base, registry in ((RangeCalculatorBase, RANGE_CALCULATORS), (QParamsCalculatorBase, QPARAMS_CALCULATORS),
                           (FakeQuantize, FAKE_QUANTIZE), (WeightRoundingBase, WEIGHT_ROUNDING)):
        assert issubclass(base, RegistryFamily) and base.family_registry is registry
        assert not any(name in vars(base) for name in names)  # written once, in the mixin
    assert MinMaxRangeCalculator.get_class("minmax") is MinMaxRangeCalculator  # subclasses reach the same registry
    assert StaticQParamsCalculator.list_registry_keys() == QPARAMS_CALCULATORS.list_registry_keys()
    assert {"rtn", "mse", "hqq", "gptq", "gptq_mse"} <= set(WeightRoundingBase.list_registry_keys())
    assert WeightRoundingBase.get_class("gptq") is WEIGHT_ROUNDING.get_class("gptq")
