"""`mismatch trend`: the mismatch over a training run's steps, where it changed and why.

steps (one audit's results dir each: summary.json and rollouts.parquet, never tokens.parquet) →
series per metric with 95% CIs over rollouts → change points (changes: ruptures + an F-test) and
jumps between consecutive steps → what changed there (attribution: strata, turns, branch kinds,
layers, engine configuration, weights) → the whole run's growth split by strata.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from mismatch.errors import MismatchError
from mismatch.results import json_safe
from mismatch.trend.attribution import configuration_changes, grown, layer_change, strata_growth
from mismatch.trend.changes import ALPHA, ChangePoint, change_points
from mismatch.trend.steps import MEAN_METRICS, Z95, Step, load_steps

__all__ = ["MEAN_METRICS", "Step", "analyze_steps", "analyze_trend", "load_steps", "series"]

WINDOW = 5  # steps each side of a change whose summaries are pooled to say what changed there


def series(steps: list[Step], pair: str, metric: str) -> list[dict[str, Any]]:
    """The metric per step: value and its 95% CI over rollouts (null where it has none)."""
    rows = []
    for step in steps:
        value = step.value(pair, metric)
        if math.isnan(value) and ":" in metric:  # a framework's own name: "verl:rollout_corr/kl"
            value = step.frameworks.get(pair, {}).get(metric, math.nan)
        low, high = step.ci.get(pair, {}).get(metric, (None, None))
        rows.append({"step": step.step, "value": value, "ci_low": low, "ci_high": high})
    return rows


def analyze_trend(paths: list[Path], *, pair: str = "train/sampler", metric: str = "kl_k3",
                  weights: bool = False) -> dict[str, Any]:
    """The trend of `metric` of `pair` over the results dirs: what `mismatch trend --json` prints
    and the trend page draws. `weights`: diff the checkpoints across each change and jump."""
    return analyze_steps(load_steps(paths), pair=pair, metric=metric, weights=weights)


def analyze_steps(steps: list[Step], *, pair: str, metric: str, weights: bool = False) -> dict[str, Any]:
    """analyze_trend of steps already loaded (the trend gate checks several metrics of one run)."""
    _check_known(steps, pair, metric)
    numbers = np.array([step.step for step in steps], np.float64)
    headline = series(steps, pair, metric)
    values = np.array([row["value"] for row in headline], np.float64)
    errors = np.array([(row["ci_high"] - row["ci_low"]) / (2 * Z95) if row["ci_low"] is not None else math.nan
                       for row in headline])
    found = change_points(numbers, values, errors)
    changes = [_change(steps, point, pair, metric, weights=weights) for point in found]
    # Each move is listed once: a step that is a change point is not listed again as a jump.
    jumps, recorded = _jumps(steps, values, errors, weights=weights, skip={point.index for point in found})
    half = max(1, min(WINDOW, len(steps) // 2))
    metrics = [m for m in MEAN_METRICS + ("ratio_q001", "ratio_q999", "ess", "log_ratio_abs_max")
               if any(m in step.pairs.get(pair, {}) for step in steps)]
    frameworks = sorted({name for step in steps for name in step.frameworks.get(pair, {})})
    return json_safe({
        "pair": pair, "metric": metric, "num_steps": len(steps), "step_from": steps[0].step_from,
        "steps": [{"step": s.step, "dir": str(s.path), "checkpoint": s.checkpoint, "headline": s.headline,
                   "report": str(s.path / "index.html") if s.has_report else None} for s in steps],
        # The metric asked for first where it is none of these (dist.kl: a step's --distribution mean).
        "series": {name: series(steps, pair, name)
                   for name in [*([metric] if metric not in (*metrics, *frameworks) else []), *metrics, *frameworks]},
        "change_points": [steps[point.index].step for point in found],
        "changes": changes, "jumps": jumps, "configuration_changes": recorded,
        "growth": {"before": [s.step for s in steps[:half]], "after": [s.step for s in steps[-half:]],
                   "strata": strata_growth(steps[:half], steps[-half:], pair)} if len(steps) >= 2 else None,
        "method": {"change_points": "ruptures PELT on a line per segment, weighted by each step's standard error, "
                                    "pen 5·log n; each kept if one line against two is rejected at "
                                    f"{ALPHA} (Bonferroni; χ² with the steps' errors, else F), and a change of "
                                    "level only where the step's 95% CI excludes the level before",
                   "ci": "95%, delta method over rollouts (rollouts.parquet), for token-weighted means "
                         "and ESS (on log ESS, from ratio_mean and chi2_token); none for quantiles and maxima",
                   "jumps": f"consecutive steps whose difference passes a two-sided z-test at {ALPHA} "
                            "(Bonferroni over the steps), from their CIs, not already a change point",
                   "configuration_changes": "every step where an engine's recorded configuration changed "
                                            "(a per-step sampling seed or rollout count is none), with the "
                                            "same z-test: a change recorded is not a change measured"},
    })


def _check_known(steps: list[Step], pair: str, metric: str) -> None:
    pairs = sorted({name for step in steps for name in step.pairs})
    if pair not in pairs:
        raise MismatchError(f"trend: no pair {pair!r} in these summaries (pairs: {', '.join(pairs)})")
    known = {m for step in steps for m in step.pairs.get(pair, {})} | \
            {m for step in steps for m in step.frameworks.get(pair, {})}
    if metric not in known:
        raise MismatchError(f"trend: no metric {metric!r} for {pair} (e.g. {', '.join(sorted(known)[:8])}, "
                            "or a framework's own name as FRAMEWORK:NAME)")


def _change(steps: list[Step], point: ChangePoint, pair: str, metric: str, *, weights: bool) -> dict[str, Any]:
    """A change point with what changed there: the windows before and after it compared."""
    k = point.index
    before, after = steps[max(0, k - WINDOW):k], steps[k:k + WINDOW]
    previous, current = steps[k - 1], steps[k]
    found = {"step": current.step, "kind": point.kind, "p_value": point.p_value, "separated": point.separated,
             "before": {"level": point.before[0], "slope_per_step": point.before[1]},
             "after": {"level": point.after[0], "slope_per_step": point.after[1]},
             "strata": strata_growth(before, after, pair),
             "turns": grown([s.turns for s in before], [s.turns for s in after], "turn", pair, metric),
             "branch_kinds": grown([s.branch_kinds for s in before], [s.branch_kinds for s in after],
                                   "branch_kind", pair, metric),
             "layers": layer_change(previous, current),
             "configuration": configuration_changes(previous, current)}
    if weights:
        found["weights"] = weights_between(steps, k)
    found["causes"] = causes(found)
    return found


def _jumps(steps: list[Step], values: np.ndarray, errors: np.ndarray, *, weights: bool,
           skip: set[int]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(jumps, configuration changes): consecutive steps whose values differ past their CIs (z-test,
    Bonferroni over the steps) and are no change point already; and every step where an engine's
    recorded configuration changed, with the same test's answer, whether or not it passes."""
    from scipy import stats

    jumps, recorded = [], []
    tests = max(len(steps) - 1, 1)
    for k in range(1, len(steps)):
        se = math.hypot(errors[k - 1], errors[k])
        z = (values[k] - values[k - 1]) / se if se > 0 else math.nan
        p = float(2 * stats.norm.sf(abs(z))) if math.isfinite(z) else None
        configuration = configuration_changes(steps[k - 1], steps[k])
        significant = p is not None and p < ALPHA / tests
        if not ((significant and k not in skip) or configuration):
            continue
        entry = {"step": steps[k].step, "from_step": steps[k - 1].step, "before": values[k - 1],
                 "after": values[k], "p_value": p, "significant": significant, "configuration": configuration}
        if weights:
            entry["weights"] = weights_between(steps, k)
        entry["causes"] = causes(entry)
        if significant and k not in skip:
            jumps.append(entry)
        if configuration:
            recorded.append(entry)
    return jumps, recorded


def causes(found: dict[str, Any]) -> list[str]:
    """What the recorded evidence names as the cause of a change, most specific first."""
    named = []
    for change in found.get("configuration") or []:
        named.append(f"{change['cause']}: {change['engine']}.{change['key']} {change['before']!r} → {change['after']!r}")
    weights = found.get("weights")
    if isinstance(weights, dict) and weights.get("outlier"):
        named.append(f"weights: the step's update is {weights['ratio']:.3g}× the run's typical one "
                     f"({weights['top_tensor']})")
    for explained in (found.get("strata") or {}).get("explained_by") or []:
        hot = found["strata"][explained]["hot"]
        named.append(f"concentrated in {hot['where']}: their gap grew {hot['factor']:.3g}×, the rest's "
                     f"{hot['rest_factor']:.3g}× ({hot['growth_share']:.0%} of the growth, "
                     f"{hot['token_share']:.0%} of the tokens)")
    if not named:
        named.append("no recorded input changed here (engines, dtype, versions); optimizer state and "
                     "the trainer's RNG are not recorded by an audit")
    return named


def weights_between(steps: list[Step], k: int) -> dict[str, Any]:
    """The weights diff of steps k-1 → k against the run's consecutive diffs before it (the
    largest tensor's relative L2 change), so an outlier update (a resume that loaded other weights)
    stands out; a step whose checkpoint is not a directory is said, not guessed."""
    from mismatch.weights import diff_checkpoints

    def change(a: Step, b: Step) -> tuple[float, str] | None:
        if not (Path(a.checkpoint).is_dir() and Path(b.checkpoint).is_dir()):
            return None
        differing = diff_checkpoints(a.checkpoint, b.checkpoint).brief(limit=1)["differing"]
        if not differing:
            return 0.0, "none"
        return float(differing[0]["rel_l2_diff"] or math.inf), differing[0]["name"]

    here = change(steps[k - 1], steps[k])
    if here is None:
        return {"compared": False, "why": "the steps' checkpoints are not directories here"}
    typical = [c[0] for c in (change(steps[i - 1], steps[i]) for i in range(max(1, k - WINDOW), k)) if c]
    median = float(np.median(typical)) if typical else math.nan
    ratio = here[0] / median if median > 0 else math.inf if here[0] > 0 else 1.0
    return {"compared": True, "rel_l2": here[0], "top_tensor": here[1], "typical_rel_l2": median,
            "ratio": ratio, "outlier": bool(typical) and ratio >= 10}
