"""Where a metric's series over steps changes level or slope: candidates from `ruptures`, each kept
only if a stated test says the data need it.

1. Candidates: ruptures' PELT on the cost of a line per segment (`CostLinear`: y = a + b·step, so a
   jump and a bend are both a change), penalized BIC-like by the noise: pen = 5·σ²·log n, σ the
   median of the steps' own standard errors (their 95% CIs over rollouts) where they have them,
   else the robust spread of successive differences (1.4826·MAD/√2).
2. The test: for each candidate k between its neighbours, the F-test of one line over the two
   segments against a line each (2 more parameters), at α = 0.01 Bonferroni-corrected over the
   candidates. A run that only drifts along one line, or only jitters, names no step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

ALPHA = 0.01
MIN_SEGMENT = 3  # steps on each side of a change: a line needs more than two points to be tested


@dataclass(frozen=True, slots=True)
class ChangePoint:
    """A change at `index` (the first step of the new segment) of the series."""

    index: int
    p_value: float
    before: tuple[float, float]  # (level at the change, slope per step) of the segment before
    after: tuple[float, float]   # ... and after, each its own line's fit evaluated at the change
    kind: str                    # "level", "slope" or "level and slope"


def noise_sigma(values: np.ndarray, standard_errors: np.ndarray | None) -> float:
    """The per-step noise the penalty is scaled by (module docstring, 1)."""
    if standard_errors is not None:
        finite = standard_errors[np.isfinite(standard_errors) & (standard_errors > 0)]
        if len(finite) >= len(values) // 2 and len(finite):
            return float(np.median(finite))
    diffs = np.diff(values)
    mad = float(np.median(np.abs(diffs - np.median(diffs)))) if len(diffs) else 0.0
    return 1.4826 * mad / math.sqrt(2)


def change_points(steps: np.ndarray, values: np.ndarray, standard_errors: np.ndarray | None = None) -> list[ChangePoint]:
    """The changes of level or slope in `values` over `steps` that pass the test (indices into them)."""
    import ruptures

    keep = np.isfinite(values)
    steps, values = steps[keep].astype(np.float64), values[keep].astype(np.float64)
    index_of = np.flatnonzero(keep)
    n = len(values)
    if n < 2 * MIN_SEGMENT:
        return []
    sigma = noise_sigma(values, standard_errors[keep] if standard_errors is not None else None)
    scale = float(np.max(np.abs(values))) or 1.0
    if sigma <= 0:  # a series without noise: any bend is real; still a positive penalty
        sigma = 1e-9 * scale
    # Scaled to ~1 so ruptures' least squares and its penalty compare like quantities.
    signal = np.column_stack([values / sigma, np.ones(n), (steps - steps[0]) / max(steps[-1] - steps[0], 1.0)])
    # 5: on 300 simulated noisy lines of 30 steps, 5·log n named no step where 3·log n named 23
    # (tests/test_trend.py holds the 0); the F-test below then judges what PELT proposes.
    ends = ruptures.Pelt(model="linear", min_size=MIN_SEGMENT, jump=1).fit(signal).predict(pen=5 * math.log(n))
    bounds = [0, *ends]
    candidates = bounds[1:-1]
    found = []
    for i, k in enumerate(candidates):
        start, stop = bounds[i], bounds[i + 2]
        p_value, before, after = _f_test(steps[start:stop], values[start:stop], k - start)
        if p_value < ALPHA / max(len(candidates), 1):
            found.append(ChangePoint(index=int(index_of[k]), p_value=p_value, before=before, after=after,
                                     kind=_kind(before, after, sigma, steps[start:stop], k - start)))
    return found


def _fit(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, float]:
    design = np.column_stack([np.ones_like(x), x])
    coef, *_ = np.linalg.lstsq(design, y, rcond=None)
    return coef, float(np.sum((y - design @ coef) ** 2))


def _f_test(x: np.ndarray, y: np.ndarray, k: int) -> tuple[float, tuple[float, float], tuple[float, float]]:
    """p of "one line" against "a line each side of k"; each side's (level at x[k], slope)."""
    from scipy import stats

    _, rss_one = _fit(x, y)
    coef_a, rss_a = _fit(x[:k], y[:k])
    coef_b, rss_b = _fit(x[k:], y[k:])
    rss_two, dof = rss_a + rss_b, len(x) - 4
    at = x[k]
    before = (float(coef_a[0] + coef_a[1] * at), float(coef_a[1]))
    after = (float(coef_b[0] + coef_b[1] * at), float(coef_b[1]))
    if dof <= 0:
        return 1.0, before, after
    if rss_two <= 0:
        return (0.0 if rss_one > 0 else 1.0), before, after
    f = ((rss_one - rss_two) / 2) / (rss_two / dof)
    return float(stats.f.sf(f, 2, dof)), before, after


def _kind(before: tuple[float, float], after: tuple[float, float], sigma: float, x: np.ndarray, k: int) -> str:
    """Which of level and slope moved: a jump past 2σ at the change, a slope whose difference
    moves the line by 2σ over the later segment."""
    jump = abs(after[0] - before[0]) > 2 * sigma
    bend = abs(after[1] - before[1]) * max(float(x[-1] - x[k]), 1.0) > 2 * sigma
    return "level and slope" if jump and bend else "level" if jump else "slope"
