"""Chart data for the report: log-ratio histograms and breakdowns by turn, position and probability.

Everything is reduced to binned counts and per-bin statistics here, so the page's size depends on
the number of bins, never on the number of tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from mismatch.analysis import terms

# Breakdown statistics, with the summary.json names they share (ARCHITECTURE.md, "Results dir").
BREAKDOWN_METRICS: dict[str, str] = {
    "log_ratio_abs_mean": "mean |log-ratio|",
    "kl_k3": "kl_k3 (per token)",
    "log_ratio_abs_max": "max |log-ratio|",
    "frac_outside_2": "share outside [0.5, 2]",
    "n_tokens": "tokens",
}
NUM_HIST_BINS = 121  # odd, so exact zeros sit alone in the middle bin's centre
MAX_POSITION_BINS = 40


@dataclass(kw_only=True, slots=True, frozen=True)
class PairTokens:
    """One pair's trainable tokens with both log-probs: what every chart of that pair is made of."""

    pair: str
    log_ratio: np.ndarray  # logp_A - logp_B, float64
    logp_b: np.ndarray
    turn: np.ndarray
    pos: np.ndarray


def pair_roles(pair: str) -> tuple[str, str]:
    a, _, b = pair.partition("/")
    return a, b


def has_pair(tokens: pd.DataFrame, pair: str) -> bool:
    return all(f"logp_{role}" in tokens.columns for role in pair_roles(pair))


def trainable_columns(tokens: pd.DataFrame) -> dict[str, np.ndarray]:
    """turn, pos and every logp_* column over trainable tokens, selected once for all pairs.

    Only trainable tokens enter the PPO loss: the same selection as summary.json's pairs.
    """
    trainable = tokens["trainable"].to_numpy(dtype=bool)
    names = ["turn", "pos", *(str(c) for c in tokens.columns if str(c).startswith("logp_"))]
    return {name: tokens[name].to_numpy()[trainable] for name in names}


def pair_tokens(trainable: dict[str, np.ndarray], pair: str) -> PairTokens | None:
    """None when the token table lacks a column of the pair (then its charts are left out)."""
    a, b = (f"logp_{role}" for role in pair_roles(pair))
    if a not in trainable or b not in trainable:
        return None
    logp_a, logp_b = trainable[a].astype(np.float64, copy=False), trainable[b].astype(np.float64, copy=False)
    valid = ~(np.isnan(logp_a) | np.isnan(logp_b))
    return PairTokens(pair=pair, log_ratio=(logp_a - logp_b)[valid], logp_b=logp_b[valid],
                      turn=trainable["turn"][valid], pos=trainable["pos"][valid])


def nice_ceil(value: float) -> float:
    """The smallest 1, 2 or 5 × 10^k at or above `value`: axis limits and bin widths people read."""
    if value <= 0:
        return 0.0
    exponent = math.floor(math.log10(value))
    for step in (1, 2, 5, 10):
        candidate = step * 10.0 ** exponent
        if candidate >= value * (1 - 1e-12):
            return candidate
    return 10.0 ** (exponent + 1)


def histogram_limit(log_ratios: list[np.ndarray]) -> float:
    """One symmetric x-range for every pair's histogram, so panels compare at a glance.

    The full range unless a few outliers would squash the body into the middle bin: then 4× the
    largest p99.9 of |log-ratio|, with the outliers counted in the edge bins and said so.
    """
    finite = [np.abs(x[np.isfinite(x)]) for x in log_ratios if len(x)]
    finite = [x for x in finite if len(x)]
    if not finite:
        return 1e-3
    max_abs = max(float(x.max()) for x in finite)
    p999 = max(float(np.quantile(x, 0.999)) for x in finite)
    limit = max_abs if (p999 == 0 or max_abs <= 4 * p999) else 4 * p999
    return nice_ceil(limit) if limit > 0 else 1e-3


def histogram(log_ratio: np.ndarray, limit: float, num_bins: int = NUM_HIST_BINS) -> dict[str, Any]:
    """Counts over [-limit, limit]; values beyond land in the edge bins and are counted apart."""
    edges = np.linspace(-limit, limit, num_bins + 1)
    below = int(np.sum(log_ratio < -limit))
    above = int(np.sum(log_ratio > limit))  # +inf (an overflowing ratio) is counted here
    nan = int(np.sum(np.isnan(log_ratio)))
    clipped = np.clip(log_ratio[~np.isnan(log_ratio)], -limit, limit)
    counts, _ = np.histogram(clipped, bins=edges)
    return {"edges": edges.tolist(), "counts": counts.astype(int).tolist(), "n": int(len(log_ratio)),
            "n_below": below, "n_above": above, "n_nan": nan, "limit": limit,
            "min": _finite_or_none(np.nanmin(log_ratio)) if len(log_ratio) else None,
            "max": _finite_or_none(np.nanmax(log_ratio)) if len(log_ratio) else None}


def _finite_or_none(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None


def group_stats(keys: np.ndarray, log_ratio: np.ndarray) -> pd.DataFrame:
    """BREAKDOWN_METRICS per key (non-negative ints), with the per-token terms of mismatch.analysis.metrics.

    bincount sums rather than a DataFrame groupby: one pass, no 13M-row temporary frames.
    """
    keys = np.asarray(keys, dtype=np.int64)
    abs_lr = np.abs(log_ratio)
    with np.errstate(over="ignore", invalid="ignore"):
        outside = terms.outside(terms.ratio(log_ratio))
        k3 = terms.k3(log_ratio)
        counts = np.bincount(keys)
        present = np.flatnonzero(counts)
        num = counts[present]
        stats = pd.DataFrame({
            "log_ratio_abs_mean": np.bincount(keys, weights=abs_lr)[present] / num,
            "log_ratio_abs_max": pd.Series(abs_lr).groupby(keys).max().reindex(present).to_numpy(),
            "kl_k3": np.bincount(keys, weights=k3)[present] / num,
            "frac_outside_2": np.bincount(keys, weights=outside)[present] / num,
            "n_tokens": num}, index=present)
    return stats


def _series(stats_by_pair: dict[str, pd.DataFrame], index: list[Any]) -> dict[str, dict[str, list]]:
    """{pair: {metric: values aligned with index}}; None where a pair has no tokens in a group."""
    out: dict[str, dict[str, list]] = {}
    for pair, stats in stats_by_pair.items():
        aligned = stats.reindex(index)
        out[pair] = {name: [_json_number(v, name) for v in aligned[name].to_numpy()]
                     for name in BREAKDOWN_METRICS}
    return out


def _json_number(value: Any, name: str) -> Any:
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return None
    if name == "n_tokens":
        return int(value)
    return float(value)


def by_position(pairs: list[PairTokens]) -> dict[str, Any] | None:
    """Position bins of a nice width (≤ MAX_POSITION_BINS of them) over every pair's range."""
    populated = [p for p in pairs if len(p.pos)]
    if not populated:
        return None
    max_pos = max(int(p.pos.max()) for p in populated)
    width = max(1, int(nice_ceil((max_pos + 1) / MAX_POSITION_BINS)))
    stats = {p.pair: group_stats((p.pos // width) * width, p.log_ratio) for p in populated}
    index = sorted(set().union(*(s.index for s in stats.values())))
    return {"x": [int(x) for x in index], "labels": [f"pos {x:,}–{x + width - 1:,}" for x in index],
            "x_title": f"position in the stream (bins of {width:,} token{'s' if width > 1 else ''})",
            "width": width,
            "series": _series(stats, index)}


def by_probability_from_summary(summary: dict[str, Any], pairs: list[str]) -> dict[str, Any] | None:
    """summary.json's probability buckets (localization.turns.by_prob_bucket, of the pair the turn
    localizer reads): the report draws the buckets the analysis defined, never its own."""
    turns = (summary.get("localization") or {}).get("turns")
    if not isinstance(turns, dict) or not isinstance(turns.get("by_prob_bucket"), list):
        return None
    rows = [{"bucket": row.get("bucket"), "pairs": {turns.get("pair"): row}}
            for row in turns["by_prob_bucket"] if isinstance(row, dict)]
    return by_key_from_summary(rows, "bucket", pairs, x_title="probability of the token under the pair's B side")


def by_turn_from_tokens(pairs: list[PairTokens]) -> dict[str, Any] | None:
    populated = [p for p in pairs if len(p.turn)]
    if not populated:
        return None
    stats = {p.pair: group_stats(p.turn, p.log_ratio) for p in populated}
    index = sorted(set().union(*(s.index for s in stats.values())))
    return {"x": [int(x) for x in index], "labels": [f"turn {x}" for x in index], "x_title": "turn",
            "series": _series(stats, index), "integer_ticks": True}


def by_key_from_summary(rows: list[dict[str, Any]], key: str, pairs: list[str], *,
                        x_title: str) -> dict[str, Any] | None:
    """summary.json's own breakdowns (`turns`, `branch_kinds`): [{key, "pairs": {pair: metrics}}]."""
    rows = [r for r in rows or [] if isinstance(r, dict) and key in r and isinstance(r.get("pairs"), dict)]
    if not rows:
        return None
    x = [r[key] for r in rows]
    series = {pair: {name: [_json_number(r["pairs"].get(pair, {}).get(name), name) for r in rows]
                     for name in BREAKDOWN_METRICS} for pair in pairs}
    # A pair no row has tokens for is left out rather than drawn as an empty line.
    series = {pair: s for pair, s in series.items() if any(n for n in s["n_tokens"])}
    labels = [f"{key.replace('_', ' ')} {v}" if key == "turn" else str(v) for v in x]
    block = {"x": x, "labels": labels, "x_title": x_title, "series": series,
             "integer_ticks": all(isinstance(v, int) for v in x)}
    return block if series else None
