import pytest

from coreai_opt.api.algorithms.auto_quantize.search import (
    Option,
    greedy_assign,
    latency_front,
    most_accurate_within,
    total,
)

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


def test_most_accurate_within_spends_the_latency_bound_on_the_largest_error_saved_per_microsecond():
    # fastest: static ×3 (25 µs, error 0.82); with 3 µs of slack: unit 0 -> dynamic (+2 µs, -0.49), then unit 2 ->
    # dynamic (+1 µs, -0.25); unit 1 -> dynamic (+2 µs) no longer fits
    chosen = most_accurate_within(_units(), 28.0, ORDER)
    assert chosen == ["dynamic", "static", "dynamic"]
    assert total(_units(), chosen) == Option(pytest.approx(0.08), 28.0)


def test_most_accurate_within_takes_the_fastest_options_when_even_they_exceed_the_bound():
    assert most_accurate_within(_units(), 1.0, ORDER) == ["static", "static", "static"]
    assert most_accurate_within(_units(), 1e9, ORDER) == ["float", "float", "float"]


def test_latency_front_runs_from_fastest_to_zero_error_each_point_faster_or_more_accurate():
    front = latency_front(_units(), ORDER, steps=8)
    assert front[0].choices == ("static", "static", "static") and front[0].latency_us == 25.0
    assert front[-1].choices == ("float", "float", "float") and front[-1].predicted_error == 0.0
    for before, after in zip(front, front[1:], strict=False):
        assert after.latency_us > before.latency_us and after.predicted_error < before.predicted_error
        assert after.latency_us <= after.bound_us
