"""A summary.json's pair metrics against each other and its counts: what no run can write.

The gate reads a file through `check_summary` (advise/gate.py load_summary): a hand-edited or
corrupted summary is bad input (exit 2) naming the file and the keys, never a pass or a failed gate.
"""

from __future__ import annotations

import json
import math
from typing import Any

from mismatch.results.summary_model import JSONObject
from mismatch.analysis.metrics import PAIR_METRICS
from mismatch.analysis.terms import METRIC_RANGES
from mismatch.errors import ResultsError

# What a real summary's pair metrics satisfy whatever the run (ties, one token, a group's nulls): each
# chain is ordered, by the formulas of analysis/metrics.py. _SLACK (relative) absorbs the rounding of
# sums and quantile interpolation; an edited or corrupted value is never that close.
ORDERED = (("ratio_min", "ratio_q001", "ratio_q01", "ratio_q99", "ratio_q999", "ratio_max"),
           ("ratio_min", "ratio_mean", "ratio_max"), ("log_ratio_abs_mean", "log_ratio_abs_max"),
           ("prob_abs_diff_mean", "prob_abs_diff_max"))
_SLACK = 1e-9


def check_summary(summary: JSONObject, *, where: str) -> None:
    """Refuse a summary no run can have written: `pairs` that is not an object of metric objects,
    a metric that is neither a number nor null, a number JSON overflowed to +-inf (summary.json
    writes null), or pair metrics that contradict each other or the counts. A hand-edited or
    corrupted file must not pass a gate, nor fail it as if it were a measured regression. Keys it
    does not know are ignored (a later version's); a missing `pairs` is the gate's failed check."""
    if "pairs" not in summary:
        return
    pairs = summary["pairs"]
    if not isinstance(pairs, dict):
        raise ResultsError(f"{where}: pairs is {_shown_json(pairs)}, not an object of pairs")
    counts = summary.get("counts") if isinstance(summary.get("counts"), dict) else {}
    for pair, metrics in pairs.items():
        label = f"pairs[{pair!r}]"
        if not isinstance(metrics, dict):
            raise ResultsError(f"{where}: {label} is {_shown_json(metrics)}, not an object of metrics")
        values = _known_values(metrics, where=f"{where}: {label}")
        problem = (_range_problem(values) or _count_problem(values, counts) or _order_problem(values)
                   or _identity_problem(values))
        if problem is not None:
            raise ResultsError(f"{where}: {label}: {problem} (edited or corrupted)")


def _shown_json(value: Any) -> str:
    text = json.dumps(value, default=repr)
    return text if len(text) <= 40 else text[:37] + "..."


def _known_values(metrics: JSONObject, *, where: str) -> dict[str, float]:
    """The pair's known metrics as floats, nulls (NaN) left out; anything else is refused."""
    values = {}
    for name in PAIR_METRICS:
        value = metrics.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ResultsError(f"{where}.{name} is {_shown_json(value)}, not a number or null")
        try:
            number = float(value)
        except OverflowError:  # an integer literal past float64
            number = math.copysign(math.inf, value)
        if not math.isfinite(number):
            raise ResultsError(f"{where}.{name} overflows to {number!r} (a number no summary.json holds: it "
                               "writes null)")
        values[name] = number
    return values


def in_range(value: float, low: float, high: float) -> bool:
    return low - _SLACK * abs(low) <= value <= high + _SLACK * abs(high)


def _exceeds(a: float, b: float) -> bool:
    """a > b by more than rounding."""
    return a > b + _SLACK * max(abs(a), abs(b))


def _range_problem(values: dict[str, float]) -> str | None:
    for name, value in values.items():
        low, high = METRIC_RANGES[name]
        if not in_range(value, low, high):
            return f"{name} = {value:.6g} is impossible ({name} lies in [{low:g}, {high:g}])"
    return None


def _count_problem(values: dict[str, float], counts: JSONObject) -> str | None:
    """Whole counts; a pair's rollouts are among its tokens', and both among the run's (`counts`)."""
    for name in ("n_tokens", "n_rollouts"):
        if name in values and values[name] != int(values[name]):
            return f"{name} = {values[name]:.6g} is not a whole count"
    bounds = [("n_rollouts", "n_tokens", values.get("n_tokens"))]
    bounds += [(name, f"counts.{key}", counts.get(key)) for name, key in (("n_rollouts", "rollouts"),
                                                                          ("n_tokens", "trainable_tokens"))]
    for name, bound, limit in bounds:
        if name in values and isinstance(limit, (int, float)) and not isinstance(limit, bool) and values[name] > limit:
            return f"{name} = {values[name]:.6g} > {bound} = {limit:.6g}"
    return None


def _order_problem(values: dict[str, float]) -> str | None:
    for chain in ORDERED:
        present = [name for name in chain if name in values]
        for a, b in zip(present, present[1:]):
            if _exceeds(values[a], values[b]):
                return f"{a} = {values[a]:.6g} > {b} = {values[b]:.6g}"
    return None


def _identity_problem(values: dict[str, float]) -> str | None:
    """What the formulas tie together: |mean| <= mean of |x|, kl_k1 = -log_ratio_mean, and the
    normalized ESS (sum w)^2 / (n sum w^2) >= 1/n (one weight carries it all)."""
    lr_mean, abs_mean, kl_k1 = (values.get(name) for name in ("log_ratio_mean", "log_ratio_abs_mean", "kl_k1"))
    if lr_mean is not None and abs_mean is not None and _exceeds(abs(lr_mean), abs_mean):
        return f"|log_ratio_mean| = {abs(lr_mean):.6g} > log_ratio_abs_mean = {abs_mean:.6g}"
    if lr_mean is not None and kl_k1 is not None and (_exceeds(kl_k1, -lr_mean) or _exceeds(-lr_mean, kl_k1)):
        return f"kl_k1 = {kl_k1:.6g} is not -log_ratio_mean = {-lr_mean:.6g}"
    n, ess = values.get("n_tokens"), values.get("ess")
    if n and ess is not None and _exceeds(1.0, ess * n):
        return f"ess = {ess:.6g} < 1 / n_tokens = {1 / n:.6g}"
    return None
