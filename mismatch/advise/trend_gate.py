"""The trend gate: `gate --trend DIR... --max-slope METRIC=V --max-step-change METRIC=V`, exit 1 when
the mismatch grows faster than allowed over a run's steps (the same Check and GateResult as the
one-run gate, so the table, JSON and JUnit are the same).

Slope: the least-squares slope per step of the metric since the last change point (the whole run
when there is none), so a run that settled after an early jump is judged on where it is going.
Step change: the largest increase between two consecutive steps. Both in the metric's own units.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

from mismatch.advise.gate import Check, GateResult, parse_limits
from mismatch.errors import MismatchError


def run_trend_gate(paths: list[Path], *, max_slope: list[str], max_step_change: list[str],
                   order: str = "names") -> GateResult:
    """Each limit checked on the run's series of its pair and metric; a step without that pair or
    metric is refused (exit 2), not left out of the series unnamed. `order`: load_steps'."""
    from mismatch.trend import analyze_steps, load_steps
    from mismatch.trend.steps import check_named

    slopes = parse_limits(max_slope, flag="--max-slope")
    changes = parse_limits(max_step_change, flag="--max-step-change")
    if not slopes and not changes:
        raise MismatchError("gate --trend: give --max-slope METRIC=V and/or --max-step-change METRIC=V")
    run, checks = load_steps(paths, order=order), []  # loaded once for every limit
    for kind, limits in (("slope", slopes), ("step_change", changes)):
        for key, limit in limits.items():
            pair, _, metric = key.rpartition(".")
            found = analyze_steps(run, pair=pair, metric=metric)  # an unknown metric is named here
            check_named(run, pair, metric)
            rows = found["series"][metric]
            steps = np.array([row["step"] for row in rows], np.float64)
            values = np.array([math.nan if row["value"] is None else row["value"] for row in rows], np.float64)
            checks.append(_slope_check(key, steps, values, found["change_points"], limit) if kind == "slope"
                          else _step_change_check(key, steps, values, limit))
    return GateResult(checks=tuple(checks))


def _slope_check(key: str, steps: np.ndarray, values: np.ndarray, change_points: list[int], limit: float) -> Check:
    since = change_points[-1] if change_points else steps[0]
    keep = (steps >= since) & np.isfinite(values)
    if keep.sum() < 2:
        return Check(kind="slope", name=key, value=None, limit=limit, passed=False,
                     message=f"slope of {key}: fewer than 2 steps with a value since step {since:g}")
    slope = float(np.polyfit(steps[keep], values[keep], 1)[0])
    passed = slope <= limit
    return Check(kind="slope", name=key, value=slope, limit=limit, passed=passed,
                 message=f"slope of {key} since step {since:g}: {slope:.4g} per step "
                         f"{'<=' if passed else '>'} {limit:g}")


def _step_change_check(key: str, steps: np.ndarray, values: np.ndarray, limit: float) -> Check:
    rises = np.diff(values)
    if not np.isfinite(rises).any():
        return Check(kind="step_change", name=key, value=None, limit=limit, passed=False,
                     message=f"step change of {key}: fewer than 2 steps with a value")
    worst = int(np.nanargmax(rises))
    rise = float(rises[worst])
    passed = rise <= limit
    return Check(kind="step_change", name=key, value=rise, limit=limit, passed=passed,
                 message=f"largest step change of {key}: +{rise:.4g} from step {steps[worst]:g} to "
                         f"{steps[worst + 1]:g} {'<=' if passed else '>'} {limit:g}")
