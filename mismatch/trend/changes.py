"""Where a metric's series over steps changes level or slope: candidates from `ruptures`, each kept
only if a stated test says the data need it.

Terms: step i has a value y_i and, where its 95% CI over rollouts is known, a standard error
s_i = (CI width) / (2·1.96). A fault makes the gap both larger and noisier (its spread over
rollouts grows with it), so every fit here is weighted least squares: residuals in units of their
own step's s_i (χ² units). An unweighted fit scaled by one σ lets a ×60 jump hide in the noise of
the steps after it.

1. Candidates: ruptures' PELT on the cost of a line per segment (`CostLinear`: y = a + b·step, so a
   jump and a bend are both a change) over the rows (y_i, 1, step_i) divided by s_i, penalized
   BIC-like: pen = 5·log n in χ² units. Steps without a standard error take the median of the
   others'; a series with none takes σ = the robust spread of successive differences
   (1.4826·MAD/√2) for every step.
2. The test: for each candidate k between its neighbours, one line over the two segments against
   a line each (2 more parameters), at α = 0.01 Bonferroni-corrected over the candidates: where
   every step has its own s_i, the drop in χ² (χ² with 2 degrees of freedom, the noise known);
   else the F-test (the noise estimated from the residuals). Backward elimination: while the
   weakest candidate fails, it is dropped and the rest are tested again between their new
   neighbours (a jitter that PELT split off must not shrink a real change's window). A run that only drifts along one line, or only jitters, names no step. Its p-value
   is part of every change point.
3. Separation (`separated`): a change of level is also required to leave the level before it:
   the step's own 95% CI must exclude the line of the segment before, extrapolated to the step.
   A bend (slope only) has no such step; its F-test p-value is the evidence.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

ALPHA = 0.01
Z95 = 1.959963984540054  # the normal 97.5% quantile
MIN_SEGMENT = 3  # steps on each side of a change: a line needs more than two points to be tested


@dataclass(frozen=True, slots=True)
class ChangePoint:
    """A change at `index` (the first step of the new segment) of the series."""

    index: int
    p_value: float
    before: tuple[float, float]  # (level at the change, slope per step) of the segment before
    after: tuple[float, float]   # ... and after, each its own line's fit evaluated at the change
    kind: str                    # "level", "slope" or "level and slope"
    separated: bool              # the step's 95% CI excludes the level before (module docstring, 3)


def noise_sigma(values: np.ndarray, standard_errors: np.ndarray | None) -> float:
    """The typical per-step noise (module docstring, 1): the median standard error, else the
    robust spread of successive differences."""
    if standard_errors is not None:
        finite = standard_errors[np.isfinite(standard_errors) & (standard_errors > 0)]
        if len(finite) >= len(values) // 2 and len(finite):
            return float(np.median(finite))
    diffs = np.diff(values)
    mad = float(np.median(np.abs(diffs - np.median(diffs)))) if len(diffs) else 0.0
    return 1.4826 * mad / math.sqrt(2)


def step_errors(values: np.ndarray, standard_errors: np.ndarray | None) -> np.ndarray:
    """Each step's standard error for the weighted fits: its own where known, the typical one elsewhere."""
    sigma = noise_sigma(values, standard_errors)
    if sigma <= 0:  # a series without noise: any bend is real; still a positive scale
        sigma = 1e-9 * (float(np.max(np.abs(values))) or 1.0)
    if standard_errors is None:
        return np.full(len(values), sigma)
    known = np.isfinite(standard_errors) & (standard_errors > 0)
    if known.sum() < len(values) // 2 or not known.any():
        return np.full(len(values), sigma)
    return np.where(known, standard_errors, sigma)


def change_points(steps: np.ndarray, values: np.ndarray, standard_errors: np.ndarray | None = None) -> list[ChangePoint]:
    """The changes of level or slope in `values` over `steps` that pass the test (indices into them)."""
    import ruptures

    keep = np.isfinite(values)
    steps, values = steps[keep].astype(np.float64), values[keep].astype(np.float64)
    index_of = np.flatnonzero(keep)
    n = len(values)
    if n < 2 * MIN_SEGMENT:
        return []
    measured = standard_errors is not None and bool(np.all(np.isfinite(standard_errors[keep]) & (standard_errors[keep] > 0)))
    errors = step_errors(values, standard_errors[keep] if standard_errors is not None else None)
    x = (steps - steps[0]) / max(steps[-1] - steps[0], 1.0)
    # Each row divided by its step's error: ruptures' least squares becomes the weighted one (χ² units).
    signal = np.column_stack([values / errors, 1 / errors, x / errors])
    # 5: on 300 simulated noisy lines of 30 steps, 5·log n named no step where 3·log n named 23
    # (tests/test_trend.py holds the 0); the F-test below then judges what PELT proposes.
    ends = ruptures.Pelt(model="linear", min_size=MIN_SEGMENT, jump=1).fit(signal).predict(pen=5 * math.log(n))
    proposed = ends[:-1]
    threshold = ALPHA / max(len(proposed), 1)  # Bonferroni over what PELT proposed
    kept, tests = _eliminate(list(proposed), n, steps, values, errors, measured, threshold)
    found = []
    for k, (p_value, before, after, window) in zip(kept, tests):
        kind = _kind(before, after, errors[k], steps[window], k - window.start)
        separated = _separated(values[k], errors[k], before[0])
        if kind != "slope" and not separated:
            continue  # a level "change" whose own step sits inside the level before: not claimed
        found.append(ChangePoint(index=int(index_of[k]), p_value=p_value, before=before, after=after, kind=kind,
                                 separated=separated))
    return found


def _eliminate(candidates: list[int], n: int, steps: np.ndarray, values: np.ndarray, errors: np.ndarray,
               measured: bool, threshold: float) -> tuple[list[int], list[tuple]]:
    """Backward elimination (module docstring, 2): test every candidate between its neighbours;
    while the weakest fails, drop it and test again, so a jitter PELT split off does not shrink
    the window a real change is tested on."""
    while True:
        bounds = [0, *candidates, n]
        tests = []
        for i, k in enumerate(candidates):
            window = slice(bounds[i], bounds[i + 2])
            tests.append((*_line_test(steps[window], values[window], errors[window], k - window.start, measured),
                          window))
        if not tests:
            return [], []
        weakest = max(range(len(tests)), key=lambda i: tests[i][0])
        if tests[weakest][0] < threshold:
            return candidates, tests
        del candidates[weakest]


def _separated(value: float, error: float, level_before: float) -> bool:
    """The step's 95% CI (value ± 1.96·s) excludes the level the segment before predicts there."""
    return abs(value - level_before) > Z95 * error


def _fit(x: np.ndarray, y: np.ndarray, errors: np.ndarray) -> tuple[np.ndarray, float]:
    """Weighted least squares of y = a + b·x: (a, b) and the residual sum of squares in χ² units."""
    design = np.column_stack([np.ones_like(x), x]) / errors[:, None]
    coef, *_ = np.linalg.lstsq(design, y / errors, rcond=None)
    return coef, float(np.sum((y / errors - design @ coef) ** 2))


def _line_test(x: np.ndarray, y: np.ndarray, errors: np.ndarray, k: int,
               measured: bool) -> tuple[float, tuple[float, float], tuple[float, float]]:
    """p of "one line" against "a line each side of k"; each side's (level at x[k], slope).
    `measured`: every step has its own standard error, so the χ² drop (2 dof) is the test; else the
    noise is estimated from the residuals, and it is the F-test."""
    from scipy import stats

    _, rss_one = _fit(x, y, errors)
    coef_a, rss_a = _fit(x[:k], y[:k], errors[:k])
    coef_b, rss_b = _fit(x[k:], y[k:], errors[k:])
    rss_two, dof = rss_a + rss_b, len(x) - 4
    at = x[k]
    before = (float(coef_a[0] + coef_a[1] * at), float(coef_a[1]))
    after = (float(coef_b[0] + coef_b[1] * at), float(coef_b[1]))
    if measured:
        return float(stats.chi2.sf(max(rss_one - rss_two, 0.0), 2)), before, after
    if dof <= 0:
        return 1.0, before, after
    if rss_two <= 0:
        return (0.0 if rss_one > 0 else 1.0), before, after
    f = ((rss_one - rss_two) / 2) / (rss_two / dof)
    return float(stats.f.sf(f, 2, dof)), before, after


def _kind(before: tuple[float, float], after: tuple[float, float], sigma: float, x: np.ndarray, k: int) -> str:
    """Which of level and slope moved: both when the jump at the change and the slopes' difference
    over the later segment each move the line past 2σ; else the larger of the two."""
    jump = abs(after[0] - before[0])
    bend = abs(after[1] - before[1]) * max(float(x[-1] - x[k]), 1.0)
    if jump > 2 * sigma and bend > 2 * sigma:
        return "level and slope"
    return "level" if jump >= bend else "slope"
