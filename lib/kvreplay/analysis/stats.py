"""Endpoint statistics (paper §3.4 endpoints and statistics).

Thin wrappers over statsmodels and scipy; no statistic is computed by hand.

* :func:`wilson` -- a rate with its Wilson score interval.
* :func:`paired_bootstrap` -- percentile bootstrap CI of a paired difference
  in means (``b`` minus ``a``).
* :func:`mcnemar_exact` -- exact McNemar test on paired binary outcomes.
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass

import numpy as np
from numpy.typing import ArrayLike
from scipy import stats as _sps
from statsmodels.stats.contingency_tables import mcnemar as _sm_mcnemar
from statsmodels.stats.proportion import proportion_confint

__all__ = [
    "Proportion",
    "wilson",
    "PairedDifference",
    "paired_bootstrap",
    "McNemar",
    "mcnemar_exact",
]


# --------------------------------------------------------------------------
# Wilson interval

@dataclass(frozen=True)
class Proportion:
    """A rate ``k/n`` with its Wilson confidence interval.

    Attributes:
        k: Successes (count).
        n: Trials (count, > 0).
        rate: ``k / n`` as a fraction in [0, 1].
        low: Lower interval bound, fraction in [0, 1].
        high: Upper interval bound, fraction in [0, 1].
        confidence: Interval coverage as a fraction (``1 - alpha``).
    """
    k: int
    n: int
    rate: float
    low: float
    high: float
    confidence: float = 0.95

    def pct(self) -> str:
        """Format as e.g. ``"166/200 (83.0%; Wilson 95% CI [77.18, 87.57])"``."""
        return (
            f"{self.k}/{self.n} ({100 * self.rate:.1f}%; "
            f"Wilson {100 * self.confidence:g}% CI "
            f"[{100 * self.low:.2f}, {100 * self.high:.2f}])"
        )


def wilson(k: int, n: int, alpha: float = 0.05) -> Proportion:
    """Wilson score interval for ``k`` successes in ``n`` trials (paper §3.4).

    Calls ``statsmodels.stats.proportion.proportion_confint(method="wilson")``.
    Bounds are clipped to [0, 1]; ``k == 0`` gives ``low == 0.0`` exactly and
    ``k == n`` gives ``high == 1.0`` exactly (statsmodels can return float
    noise such as 2.8e-17 there).

    Args:
        k: Number of successes (int, 0 <= k <= n).
        n: Number of trials (int, > 0).
        alpha: Two-sided error rate (fraction in (0, 1)); 0.05 gives a 95% CI.

    Returns:
        A :class:`Proportion` with rate and bounds as fractions.

    Raises:
        ValueError: If ``n <= 0``, ``k`` is outside [0, n], or ``alpha`` is
            outside (0, 1).
    """
    k, n = int(k), int(n)
    if n <= 0:
        raise ValueError(f"wilson: number of trials n must be positive, got n={n}")
    if not 0 <= k <= n:
        raise ValueError(f"wilson: successes k={k} must lie in [0, n={n}]")
    if not 0.0 < alpha < 1.0:
        raise ValueError(f"wilson: alpha must lie in (0, 1), got {alpha}")
    low, high = proportion_confint(k, n, alpha=alpha, method="wilson")
    low = 0.0 if k == 0 else min(max(float(low), 0.0), 1.0)
    high = 1.0 if k == n else min(max(float(high), 0.0), 1.0)
    return Proportion(k=k, n=n, rate=k / n, low=low, high=high, confidence=1.0 - alpha)


# --------------------------------------------------------------------------
# paired bootstrap

@dataclass(frozen=True)
class PairedDifference:
    """Paired difference in means, ``mean(b) - mean(a)``, with a bootstrap CI.

    Attributes:
        estimate: ``mean(b) - mean(a)`` (units of the inputs; for 0/1
            outcomes, a difference of rates as a fraction).
        low: Lower percentile-bootstrap bound (same units).
        high: Upper percentile-bootstrap bound (same units).
        n: Number of pairs.
        n_resamples: Bootstrap resamples drawn.
        seed: Seed of the ``numpy.random.default_rng`` generator used.
    """
    estimate: float
    low: float
    high: float
    n: int
    n_resamples: int
    seed: int


def _diff_of_means(x: np.ndarray, y: np.ndarray, axis: int = -1) -> np.ndarray:
    return np.mean(y, axis=axis) - np.mean(x, axis=axis)


def _paired_arrays(a: ArrayLike, b: ArrayLike, name: str) -> tuple[np.ndarray, np.ndarray]:
    x, y = np.asarray(a), np.asarray(b)
    if x.ndim != 1 or y.ndim != 1:
        raise ValueError(f"{name}: a and b must be 1-D, got shapes {x.shape} and {y.shape}")
    if x.shape != y.shape:
        raise ValueError(f"{name}: a and b must have equal length, got {x.size} and {y.size}")
    if x.size == 0:
        raise ValueError(f"{name}: a and b are empty")
    return x, y


def paired_bootstrap(
    a: ArrayLike,
    b: ArrayLike,
    n_resamples: int = 20000,
    seed: int = 20260729,
    confidence: float = 0.95,
) -> PairedDifference:
    """Percentile bootstrap CI of ``mean(b) - mean(a)`` over pairs (paper §3.4).

    The direction is **b minus a**: a positive estimate means ``b`` scores
    higher. Pairs (one per problem) are resampled together by
    ``scipy.stats.bootstrap(paired=True, method="percentile")`` with a
    ``numpy.random.default_rng(seed)`` generator, so identical inputs give
    identical output. When every paired difference is the same (e.g. all
    zero), the bootstrap distribution is degenerate. SciPy's percentile
    interval is then already ``[d, d]``, any scipy ``DegenerateDataWarning`` is
    silenced, and the bounds are set to exactly ``d`` (``[0.0, 0.0]`` for no
    difference) so no NaN can come back.

    Args:
        a: First arm, 1-D array of 0/1 outcomes (or floats), one per problem.
        b: Second arm, same length and order as ``a``.
        n_resamples: Bootstrap resamples (int, >= 1).
        seed: Seed for ``numpy.random.default_rng``.
        confidence: Interval coverage as a fraction in (0, 1).

    Returns:
        A :class:`PairedDifference`.

    Raises:
        ValueError: If ``a``/``b`` are not 1-D, differ in length, have fewer
            than two pairs, hold non-finite values, or if ``n_resamples`` or
            ``confidence`` is out of range.
    """
    x, y = _paired_arrays(a, b, "paired_bootstrap")
    x, y = x.astype(float), y.astype(float)
    if x.size < 2:
        raise ValueError("paired_bootstrap: need at least two pairs to bootstrap")
    if not (np.all(np.isfinite(x)) and np.all(np.isfinite(y))):
        raise ValueError("paired_bootstrap: a and b must hold finite values")
    if int(n_resamples) < 1:
        raise ValueError(f"paired_bootstrap: n_resamples must be >= 1, got {n_resamples}")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"paired_bootstrap: confidence must lie in (0, 1), got {confidence}")

    estimate = float(_diff_of_means(x, y))
    rng = np.random.default_rng(seed)
    # scipy >= 1.15 names the generator argument `rng`; older ones `random_state`.
    rng_kw = "rng" if "rng" in inspect.signature(_sps.bootstrap).parameters else "random_state"
    with warnings.catch_warnings():
        degenerate = getattr(_sps, "DegenerateDataWarning", None)
        if degenerate is not None:
            warnings.simplefilter("ignore", degenerate)
        res = _sps.bootstrap(
            (x, y),
            _diff_of_means,
            paired=True,
            vectorized=True,
            method="percentile",
            n_resamples=int(n_resamples),
            confidence_level=confidence,
            **{rng_kw: rng},
        )
    low, high = float(res.confidence_interval.low), float(res.confidence_interval.high)
    diffs = y - x
    if np.all(diffs == diffs[0]):
        low = high = float(diffs[0])
    if np.isnan(low) or np.isnan(high):
        raise RuntimeError("paired_bootstrap: scipy returned a NaN interval")
    return PairedDifference(
        estimate=estimate, low=low, high=high, n=int(x.size),
        n_resamples=int(n_resamples), seed=int(seed),
    )


# --------------------------------------------------------------------------
# McNemar

@dataclass(frozen=True)
class McNemar:
    """Exact McNemar test on paired binary outcomes.

    Attributes:
        b: Discordant pairs with ``a`` correct and ``b`` wrong (first only).
        c: Discordant pairs with ``a`` wrong and ``b`` correct (second only).
        statistic: statsmodels' exact statistic, ``min(b, c)`` (count).
        pvalue: Two-sided exact binomial p-value on the discordant pairs.
    """
    b: int
    c: int
    statistic: float
    pvalue: float


def mcnemar_exact(a: ArrayLike, b: ArrayLike) -> McNemar:
    """Exact McNemar test of paired binary outcomes (paper §3.4).

    Builds the 2x2 table (rows: ``a`` correct / wrong; columns: ``b`` correct
    / wrong) and calls
    ``statsmodels.stats.contingency_tables.mcnemar(table, exact=True)``, an
    exact two-sided binomial test on the discordant pairs. With no discordant
    pairs the p-value is 1.0.

    The test reads *direction*: a small p-value says the discordant pairs lean
    one way. A large p-value is not evidence that ``a`` and ``b`` are
    equivalent; showing equivalence needs a margin and an interval (see
    :func:`paired_bootstrap`).

    Args:
        a: First arm, 1-D boolean (or 0/1) array, one entry per problem.
        b: Second arm, same length and order as ``a``.

    Returns:
        A :class:`McNemar`; note its field ``b`` counts (a correct, b wrong)
        and ``c`` counts (a wrong, b correct).

    Raises:
        ValueError: If ``a``/``b`` are not 1-D, differ in length, are empty,
            or hold values other than 0/1/True/False.
    """
    x, y = _paired_arrays(a, b, "mcnemar_exact")
    for name, arr in (("a", x), ("b", y)):
        if arr.dtype != bool and not np.isin(arr, (0, 1)).all():
            raise ValueError(f"mcnemar_exact: {name} must be boolean or 0/1")
    x, y = x.astype(bool), y.astype(bool)
    table = np.array(
        [
            [np.sum(x & y), np.sum(x & ~y)],
            [np.sum(~x & y), np.sum(~x & ~y)],
        ]
    )
    n10, n01 = int(table[0, 1]), int(table[1, 0])
    res = _sm_mcnemar(table, exact=True)
    pvalue = 1.0 if n10 + n01 == 0 else min(float(res.pvalue), 1.0)
    return McNemar(b=n10, c=n01, statistic=float(res.statistic), pvalue=pvalue)
