"""The per-token terms every gap metric is made of, each defined once: metrics, breakdowns, trees,
diff, corrections and the report compute them here and only reduce them differently.

A pair's tokens give `log_ratio = logp_A - logp_B` (ratio = pi_A / pi_B, as PPO uses it). Each
function takes arrays and an optional `out` buffer (the analysis reuses one scratch array
instead of a fresh ~40 MB array per term). `PAIR_METRIC_TERMS` says, for every summary.json
pair metric built on a term, which term and which reduction, and whether a larger value is worse.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# ratio outside [1/OUTSIDE_FACTOR, OUTSIDE_FACTOR] counts in frac_outside_2.
OUTSIDE_FACTOR = 2.0


def ratio(log_ratio: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """pi_A / pi_B. An overflowing ratio is inf, not hidden by a clamp: that is the finding."""
    with np.errstate(over="ignore"):
        return np.exp(log_ratio, out=out)


def k1(log_ratio: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """logp_B - logp_A: the k1 estimator of KL(pi_B || pi_A) from samples of pi_B."""
    # 0.0 - x, not -x: the negation of an exact 0.0 stays +0.0.
    return np.subtract(0.0, log_ratio, out=out)


def k2(log_ratio: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """log_ratio^2 / 2 (halving is exact, so mean(k2) == mean(log_ratio^2) / 2 bit for bit)."""
    squared = np.square(log_ratio, out=out)
    return np.multiply(squared, 0.5, out=squared)


def k3(log_ratio: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """r - 1 - log r, without the cancellation of exp(x) - 1 near r = 1 and exactly 0 at r = 1."""
    with np.errstate(over="ignore", invalid="ignore"):
        return np.subtract(np.expm1(log_ratio, out=out), log_ratio, out=out)


def ratio_sq(ratio_values: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """r^2, whose mean minus 1 is the token-level chi-square divergence."""
    with np.errstate(over="ignore"):
        return np.square(ratio_values, out=out)


def outside(ratio_values: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """ratio > 2 or ratio < 1/2 (bool): the tokens far enough off for any correction to touch."""
    return np.logical_or(ratio_values > OUTSIDE_FACTOR, ratio_values < 1.0 / OUTSIDE_FACTOR, out=out)


def outside_clip(ratio_values: np.ndarray, eps_low: float, eps_high: float,
                 out: np.ndarray | None = None) -> np.ndarray:
    """ratio < 1 - eps_low or ratio > 1 + eps_high (bool): outside PPO's clip range."""
    return np.logical_or(ratio_values < 1.0 - eps_low, ratio_values > 1.0 + eps_high, out=out)


def prob(logp: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """pi = exp(logp), the token's probability."""
    with np.errstate(over="ignore"):
        return np.exp(logp, out=out)


def prob_abs_diff(logp_a: np.ndarray, logp_b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """|pi_A - pi_B| of the token."""
    return prob_gap(prob(logp_a, out=out), prob(logp_b), out=out)


def prob_gap(prob_a: np.ndarray, prob_b: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """|pi_A - pi_B| from the probabilities themselves (`prob_abs_diff`'s bits: the same exp)."""
    with np.errstate(invalid="ignore"):
        return np.abs(np.subtract(prob_a, prob_b, out=out), out=out)


@dataclass(frozen=True, slots=True)
class MetricTerm:
    term: str        # the function of this module the metric reduces
    reduction: str   # "mean" over tokens, "max", or "mean - 1" (chi-square)
    worse: str       # "higher": a larger value is a larger gap


# summary.json pair metrics that reduce one token term (the rest are counts, extremes of the
# ratio, quantiles, or per-sequence: see mismatch.analysis.metrics).
PAIR_METRIC_TERMS: dict[str, MetricTerm] = {
    "log_ratio_abs_mean": MetricTerm("abs(log_ratio)", "mean", "higher"),
    "log_ratio_abs_max": MetricTerm("abs(log_ratio)", "max", "higher"),
    "kl_k1": MetricTerm("k1", "mean", "higher"),
    "kl_k2": MetricTerm("k2", "mean", "higher"),
    "kl_k3": MetricTerm("k3", "mean", "higher"),
    "chi2_token": MetricTerm("ratio_sq", "mean - 1", "higher"),
    "prob_abs_diff_mean": MetricTerm("prob_abs_diff", "mean", "higher"),
    "prob_abs_diff_max": MetricTerm("prob_abs_diff", "max", "higher"),
    "frac_outside_2": MetricTerm("outside", "mean", "higher"),
    "bitwise_equal_frac": MetricTerm("logp_a == logp_b", "mean", "lower"),
}


INF = float("inf")
# The values each summary.json pair metric can take at all (closed bounds, always finite): what
# a value outside them means is a file that was edited or corrupted, not a measurement. k1 is a
# mean log-ratio (either sign); chi-square estimates are mean(r^2) - 1 >= -1; ESS is normalized.
METRIC_RANGES: dict[str, tuple[float, float]] = {
    "n_tokens": (0, INF), "n_rollouts": (0, INF),
    "log_ratio_mean": (-INF, INF), "log_ratio_abs_mean": (0, INF), "log_ratio_abs_max": (0, INF),
    "ratio_mean": (0, INF), "ratio_std": (0, INF), "ratio_min": (0, INF), "ratio_max": (0, INF),
    "ratio_q001": (0, INF), "ratio_q01": (0, INF), "ratio_q99": (0, INF), "ratio_q999": (0, INF),
    "kl_k1": (-INF, INF), "kl_k2": (0, INF), "kl_k3": (0, INF), "chi2_token": (-1, INF),
    "chi2_seq": (-1, INF), "ppl_ratio": (0, INF), "ess": (0, 1),
    "prob_abs_diff_mean": (0, 1), "prob_abs_diff_max": (0, 1), "frac_outside_2": (0, 1),
    "bitwise_equal_frac": (0, 1),
}
