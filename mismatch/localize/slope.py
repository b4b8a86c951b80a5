"""Does the gap grow with position: the OLS slope of |log_ratio| on a token's position, with its
classic and sequence-clustered (CR1) 95% intervals and Student-t p-values.

Part of the turn step of localize (`turns` fits it over the token table's chunks); numpy only,
scipy.special for the t distribution, imported when a fit needs it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import pandas as pd

from mismatch.analysis.moments import Moments
from mismatch.analysis.groups import dot

POSITION_UNIT = 1000   # slopes are per this many tokens of position
# "Grows with position" is a cause (position_drift), so its test is strict: tokens of one sequence
# are not independent, and |log-ratio| is heavy-tailed, so the classic OLS interval at 95% called
# drift on 2 of 5 clean bf16 controls (issue 43). The slope must be positive with a two-sided
# p-value under DRIFT_P, by the cluster-robust test (sequences as clusters) when there are at least
# MIN_SEQUENCES of them, else by the classic one. Calibrated on clean controls (benchmarks/RESULTS.md).
DRIFT_P = 1e-3
MIN_SEQUENCES = 10


class SlopeFit:
    """OLS of y on x from merged moments; residual sums added chunk by chunk."""

    def __init__(self, n: int, x_mean: float, y_mean: float, sxx: float, sxy: float) -> None:
        self.n, self.x_mean, self.y_mean, self.sxx, self.sxy = n, x_mean, y_mean, sxx, sxy
        self.slope = sxy / sxx
        self.sse, self.score_sq, self.num_clusters = 0.0, 0.0, 0

    @classmethod
    def of(cls, moments: Moments, x_range: tuple[float, float]) -> SlopeFit | None:
        """None with fewer than 3 tokens or a single position (no fit)."""
        if moments.n < 3 or x_range[0] == x_range[1] or moments.mean is None or moments.comoment is None:
            return None
        mean, comoment = moments.mean, moments.comoment
        return cls(moments.n, float(mean[0]), float(mean[1]), float(comoment[0, 0]), float(comoment[0, 1]))

    def add_residuals(self, x: np.ndarray, y: np.ndarray,
                      per_cluster: Callable[[np.ndarray], np.ndarray] | None) -> None:
        resid = y - float(self.y_mean - self.slope * self.x_mean) - self.slope * x
        self.sse += dot(resid, resid)
        if per_cluster is not None:
            scores = per_cluster((x - self.x_mean) * resid)
            self.score_sq += dot(scores, scores)
            self.num_clusters += len(scores)

    def merge(self, other: SlopeFit) -> None:
        """Take in the residual sums of later tokens (the same fit)."""
        self.sse += other.sse
        self.score_sq += other.score_sq
        self.num_clusters += other.num_clusters

    def result(self) -> dict[str, Any]:
        clusters = (self.score_sq, self.num_clusters) if self.num_clusters else None
        return slope_from_moments(self.n, self.x_mean, self.y_mean, self.sxx, self.sxy, self.sse, clusters)


def no_slope(n: int) -> dict[str, Any]:
    """The position fit's result where there is none (fewer than 3 tokens, or one position)."""
    return slope_from_moments(n, 0.0, 0.0, 0.0, 0.0, 0.0, None)


def position_slope(pos: np.ndarray, abs_log_ratio: np.ndarray, *,
                   groups: np.ndarray | None = None) -> dict[str, Any]:
    """OLS fit |log_ratio| = intercept + slope * pos/1000, with 95% CIs and a two-sided p-value;
    `grows_with_position` when the slope is positive at p < DRIFT_P (cluster-robust from
    MIN_SEQUENCES sequences on).

    `ci95_per_1k` uses the classic OLS standard error (n - 2 degrees of freedom). With `groups`
    (one id per token, e.g. its sequence) a cluster-robust (CR1) standard error is added, with
    G - 1 degrees of freedom. Fewer than 3 tokens or a single position: slope is None.
    """
    per_cluster = None
    if groups is not None:
        codes, uniques = pd.factorize(np.asarray(groups))
        per_cluster = lambda values: np.bincount(codes, weights=values, minlength=len(uniques))
    x, y = np.asarray(pos, dtype=np.float64) / POSITION_UNIT, np.asarray(abs_log_ratio, dtype=np.float64)
    moments = Moments()
    moments.add(np.stack([x, y]))
    fit = SlopeFit.of(moments, (float(x.min()), float(x.max())) if len(x) else (0.0, 0.0))
    if fit is None:
        return no_slope(len(x))
    fit.add_residuals(x, y, per_cluster)
    return fit.result()


def slope_from_moments(n: int, x_mean: float, y_mean: float, sxx: float, sxy: float, sse: float,
                       clusters: tuple[float, int] | None) -> dict[str, Any]:
    """The fit and its CIs from the centred moments; `clusters` = (sum of squares of the
    per-cluster sums of (x - x mean) * residual, number of clusters), for the cluster-robust (CR1)
    error. Fewer than 3 tokens or one position: no fit."""
    out: dict[str, Any] = {"unit_tokens": POSITION_UNIT, "n_tokens": n, "slope_per_1k": None,
                           "intercept": None, "se": None, "ci95_per_1k": None, "p_value": None,
                           "dof": None, "grows_with_position": False}
    if n < 3 or sxx == 0.0:
        return out
    slope = sxy / sxx
    intercept = y_mean - slope * x_mean
    dof = n - 2
    se = math.sqrt(sse / dof / sxx)
    half = t_critical(0.975, dof) * se
    out.update(slope_per_1k=slope, intercept=intercept, se=se, dof=dof,
               ci95_per_1k=[slope - half, slope + half], p_value=_p_two_sided(slope, se, dof),
               grows_with_position=bool(slope > 0 and _p_two_sided(slope, se, dof) < DRIFT_P))
    if clusters is not None:
        score_sq, num_groups = clusters
        out["n_sequences"] = num_groups
        if num_groups >= 2:
            # CR1 small-sample correction, as Stata's `regress, vce(cluster)`.
            scale = num_groups / (num_groups - 1) * (n - 1) / (n - 2)
            se_cluster = math.sqrt(scale * score_sq) / sxx
            half_cluster = t_critical(0.975, num_groups - 1) * se_cluster
            out.update(se_cluster=se_cluster,
                       ci95_cluster_per_1k=[slope - half_cluster, slope + half_cluster],
                       p_value_cluster=_p_two_sided(slope, se_cluster, num_groups - 1))
            if num_groups >= MIN_SEQUENCES:
                out["grows_with_position"] = bool(slope > 0 and out["p_value_cluster"] < DRIFT_P)
    return out


def _p_two_sided(estimate: float, se: float, dof: int) -> float:
    if se == 0.0:
        return 0.0 if estimate != 0.0 else 1.0
    return t_sf2(abs(estimate) / se, dof)


def t_sf2(t: float, dof: float) -> float:
    """Two-sided tail P(|T| > |t|) of Student's t."""
    if not math.isfinite(t):  # an infinite or undefined statistic (inf log-ratios): as far out as it gets
        return 0.0
    from scipy import special  # here, so that importing mismatch does not import scipy

    return float(2.0 * special.stdtr(dof, -abs(t)))


def t_critical(q: float, dof: float) -> float:
    """Quantile q of Student's t."""
    from scipy import special

    return float(special.stdtrit(dof, q))
