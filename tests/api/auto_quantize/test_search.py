import pytest

from coreai_opt.api.algorithms.auto_quantize.search import Option, greedy_assign

ORDER = ["static", "dynamic", "int16", "float"]


def _units():
    # unit 0: static is cheap but bad; unit 1: static good; unit 2: dynamic slightly slower, much better
    return [
        {"static": Option(0.50, 10.0), "dynamic": Option(0.01, 12.0), "float": Option(0.0, 40.0)},
        {"static": Option(0.02, 10.0), "dynamic": Option(0.01, 12.0), "float": Option(0.0, 40.0)},
        {"static": Option(0.30, 5.0), "dynamic": Option(0.05, 6.0), "float": Option(0.0, 20.0)},
    ]


def test_greedy_assign_takes_fastest_options_when_budget_is_loose():
    assert greedy_assign(_units(), 1.0, ORDER) == ["static", "static", "static"]


def test_greedy_assign_upgrades_by_error_saved_per_microsecond():
    # fastest sum 0.82 > 0.1: unit 0 -> dynamic saves 0.49 per 2 µs, unit 2 -> dynamic 0.25 per 1 µs; then 0.08 fits
    chosen = greedy_assign(_units(), 0.1, ORDER)
    assert chosen == ["dynamic", "static", "dynamic"]
    assert sum(u[c].error for u, c in zip(_units(), chosen, strict=True)) == pytest.approx(0.08)


def test_greedy_assign_goes_float_when_only_zero_error_fits():
    assert greedy_assign(_units(), 0.0, ORDER) == ["float", "float", "float"]


def test_greedy_assign_downgrades_again_when_slack_allows():
    units = [{"static": Option(0.3, 1.0), "dynamic": Option(0.2, 2.0), "float": Option(0.0, 50.0)},
             {"static": Option(0.25, 1.0), "float": Option(0.0, 3.0)}]
    # upgrades: unit1 static->float (0.25 per 2 µs) first, then unit0 static->dynamic; the fix-up keeps both
    assert greedy_assign(units, 0.26, ORDER) == ["dynamic", "float"]


def test_greedy_assign_is_deterministic_on_ties():
    units = [{"static": Option(0.1, 1.0), "float": Option(0.0, 2.0)} for _ in range(3)]
    assert greedy_assign(units, 0.15, ORDER) == ["float", "float", "static"]
    assert [greedy_assign(units, 0.15, ORDER) for _ in range(3)] == [["float", "float", "static"]] * 3


def test_greedy_assign_rejects_unit_without_options():
    with pytest.raises(ValueError, match="at least one candidate"):
        greedy_assign([{}], 1.0, ORDER)
