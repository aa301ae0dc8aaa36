"""Tests for kvreplay.analysis.stats (paper §3.4 endpoints and statistics)."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
from kvreplay.analysis.stats import (
    McNemar,
    PairedDifference,
    Proportion,
    mcnemar_exact,
    paired_bootstrap,
    wilson,
)

# ---------------------------------------------------------------- Wilson

@pytest.mark.parametrize(
    ("k", "n", "low_pct", "high_pct", "places"),
    [
        (166, 200, 77.18, 87.57, 2),  # paper
        (49, 200, 19.06, 30.90, 2),
        (0, 200, 0.0, 1.88, 2),
        (24, 24, 86.2, 100.0, 1),
        (0, 8, 0.0, 32.4, 1),
        (43, 48, 77.8, 95.5, 1),
        (0, 5, 0.0, 43.4, 1),
    ],
)
def test_wilson_reference_numbers(k: int, n: int, low_pct: float, high_pct: float, places: int) -> None:
    p = wilson(k, n)
    assert round(100 * p.low, places) == pytest.approx(low_pct)
    assert round(100 * p.high, places) == pytest.approx(high_pct)
    assert p.rate == k / n
    assert 0.0 <= p.low <= p.rate <= p.high <= 1.0


def test_wilson_pct_string() -> None:
    assert wilson(166, 200).pct() == "166/200 (83.0%; Wilson 95% CI [77.18, 87.57])"


def test_wilson_extremes_are_exact() -> None:
    for n in range(1, 300):  # statsmodels leaves ~1e-17 noise for some n
        assert wilson(0, n).low == 0.0
        assert wilson(n, n).high == 1.0


def test_wilson_alpha_changes_width() -> None:
    p90, p99 = wilson(50, 100, alpha=0.10), wilson(50, 100, alpha=0.01)
    assert p99.low < p90.low and p99.high > p90.high
    assert "Wilson 90% CI" in p90.pct()


@pytest.mark.parametrize(
    ("k", "n", "alpha"),
    [(0, 0, 0.05), (1, 0, 0.05), (-1, 5, 0.05), (6, 5, 0.05), (1, 5, 0.0), (1, 5, 1.5)],
)
def test_wilson_invalid(k: int, n: int, alpha: float) -> None:
    with pytest.raises(ValueError):
        wilson(k, n, alpha=alpha)


def test_wilson_n_zero_message() -> None:
    with pytest.raises(ValueError, match="n"):
        wilson(0, 0)


def test_proportion_is_frozen() -> None:
    p = wilson(1, 2)
    assert isinstance(p, Proportion)
    with pytest.raises(AttributeError):
        p.k = 3  # type: ignore[misc]


# ---------------------------------------------------------------- bootstrap

def _pairs(seed: int = 0, n: int = 200) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 2, n), rng.integers(0, 2, n)


def test_bootstrap_deterministic() -> None:
    a, b = _pairs()
    r1 = paired_bootstrap(a, b, n_resamples=2000, seed=7)
    r2 = paired_bootstrap(a.copy(), b.copy(), n_resamples=2000, seed=7)
    assert r1 == r2
    assert r1.n == 200 and r1.n_resamples == 2000 and r1.seed == 7


def test_bootstrap_seed_matters() -> None:
    a, b = _pairs()
    r1 = paired_bootstrap(a, b, n_resamples=500, seed=1)
    r2 = paired_bootstrap(a, b, n_resamples=500, seed=2)
    assert r1.estimate == r2.estimate
    assert (r1.low, r1.high) != (r2.low, r2.high)


def test_bootstrap_direction_is_b_minus_a() -> None:
    a = np.r_[np.zeros(30), np.ones(10)]
    b = np.ones(40)
    r = paired_bootstrap(a, b, n_resamples=2000)
    assert r.estimate == pytest.approx(0.75)
    assert paired_bootstrap(b, a, n_resamples=2000).estimate == pytest.approx(-0.75)


def test_bootstrap_large_difference_ci_covers_estimate() -> None:
    a = np.r_[np.ones(34), np.zeros(166)]  # 34/200
    b = np.ones(200)  # 200/200; 166 one-directional discordant pairs
    r = paired_bootstrap(a, b)
    assert r.estimate == pytest.approx(0.83)
    assert r.low <= r.estimate <= r.high
    assert 0.75 < r.low < 0.83 < r.high < 0.90


@pytest.mark.parametrize("value", [0, 1])
def test_bootstrap_all_zero_differences(value: int) -> None:
    a = np.full(50, value)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = paired_bootstrap(a, a.copy(), n_resamples=1000)
    assert r == PairedDifference(0.0, 0.0, 0.0, 50, 1000, 20260729)


def test_bootstrap_identical_mixed_arms() -> None:
    a, _ = _pairs()
    r = paired_bootstrap(a, a, n_resamples=1000)
    assert (r.estimate, r.low, r.high) == (0.0, 0.0, 0.0)


@pytest.mark.parametrize(
    ("a", "b"),
    [([], []), ([1, 0], [1]), ([1], [0]), ([[1, 0]], [[0, 1]]), ([1.0, np.nan], [0.0, 1.0])],
)
def test_bootstrap_invalid_inputs(a: list, b: list) -> None:
    with pytest.raises(ValueError):
        paired_bootstrap(a, b, n_resamples=100)


# ---------------------------------------------------------------- McNemar

def _discordant(first_only: int, second_only: int, both: int = 5, neither: int = 3) -> tuple[np.ndarray, np.ndarray]:
    a = np.r_[np.ones(both), np.ones(first_only), np.zeros(second_only), np.zeros(neither)].astype(bool)
    b = np.r_[np.ones(both), np.zeros(first_only), np.ones(second_only), np.zeros(neither)].astype(bool)
    return a, b


@pytest.mark.parametrize(
    ("first_only", "second_only", "pvalue"),
    [(9, 11, 0.824), (0, 166, 2.14e-50), (166, 0, 2.14e-50), (0, 49, 3.55e-15), (0, 20, 1.91e-6)],
)
def test_mcnemar_reference_numbers(first_only: int, second_only: int, pvalue: float) -> None:
    r = mcnemar_exact(*_discordant(first_only, second_only))
    assert (r.b, r.c) == (first_only, second_only)
    assert r.statistic == min(first_only, second_only)
    assert float(f"{r.pvalue:.3g}") == pvalue  # reported to three significant digits


def test_mcnemar_exact_binomial_value() -> None:
    assert mcnemar_exact(*_discordant(0, 166)).pvalue == pytest.approx(2 * 0.5**166, rel=1e-12)


def test_mcnemar_no_discordant_pairs() -> None:
    a = np.array([True, True, False, False])
    assert mcnemar_exact(a, a) == McNemar(b=0, c=0, statistic=0.0, pvalue=1.0)


def test_mcnemar_balanced_pvalue_capped_at_one() -> None:
    assert mcnemar_exact(*_discordant(10, 10)).pvalue == 1.0


def test_mcnemar_accepts_zero_one_ints() -> None:
    a, b = _discordant(9, 11)
    assert mcnemar_exact(a.astype(int), b.astype(int)) == mcnemar_exact(a, b)


@pytest.mark.parametrize(
    ("a", "b"), [([], []), ([1, 0], [1]), ([2, 0], [1, 0]), ([[1]], [[0]])]
)
def test_mcnemar_invalid_inputs(a: list, b: list) -> None:
    with pytest.raises(ValueError):
        mcnemar_exact(a, b)
