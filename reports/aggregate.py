"""Chart data for the report: log-ratio histograms and breakdowns by turn, position and probability.

Everything is reduced to binned counts and per-bin statistics here, so the page's size depends on
the number of bins, never on the number of tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, TypedDict

import numpy as np
import pandas as pd

from mismatch.analysis import terms
from mismatch.analysis.pair_tokens import PairTokens
from msgspec import UNSET

from mismatch.results.summary_model import PairMetrics, Summary, partial_metrics, present

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


def pair_roles(pair: str) -> tuple[str, str]:
    a, _, b = pair.partition("/")
    return a, b


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


def limit_rule(max_abs: float, p999: float) -> float:
    """The full range unless a few outliers would squash the body into the middle bin: then 4× the
    largest p99.9 of |log-ratio|, with the outliers counted in the edge bins and said so."""
    limit = max_abs if (p999 == 0 or max_abs <= 4 * p999) else 4 * p999
    return nice_ceil(limit) if limit > 0 else 1e-3


class Histogram(TypedDict):
    """A pair's log-ratio histogram over [-limit, limit] (the page's JSON): bin edges and counts,
    the values beyond the range counted apart, NaN counted apart, the extremes."""

    edges: list[float]
    counts: list[int]
    n: int
    n_below: int
    n_above: int
    n_nan: int
    limit: float
    min: float | None
    max: float | None


class _BreakdownBase(TypedDict):
    x: list[Any]  # the key's values (turns, position bins, buckets, branch kinds)
    labels: list[str]
    x_title: str
    series: dict[str, dict[str, list[Any]]]  # pair -> BREAKDOWN_METRICS name -> one value per x


class Breakdown(_BreakdownBase, total=False):
    """A chart's data by turn, position bin, probability bucket or branch kind (the page's JSON)."""

    integer_ticks: bool
    width: int  # the position bins' width


def histogram(log_ratio: np.ndarray, limit: float, num_bins: int = NUM_HIST_BINS) -> Histogram:
    """Counts over [-limit, limit]; values beyond land in the edge bins and are counted apart."""
    edges = np.linspace(-limit, limit, num_bins + 1)
    below = int(np.sum(log_ratio < -limit))
    above = int(np.sum(log_ratio > limit))  # +inf (an overflowing ratio) is counted here
    nan = int(np.sum(np.isnan(log_ratio)))
    clipped = np.clip(log_ratio[~np.isnan(log_ratio)], -limit, limit)
    # A bin count and a range, not the edges: numpy's equal-bins path (an index per value, checked
    # against these same linspace edges) instead of a sort of every value.
    counts, _ = np.histogram(clipped, bins=num_bins, range=(-limit, limit))
    return {"edges": edges.tolist(), "counts": counts.astype(int).tolist(), "n": len(log_ratio),
            "n_below": below, "n_above": above, "n_nan": nan, "limit": limit,
            "min": _finite_or_none(np.nanmin(log_ratio)) if len(log_ratio) else None,
            "max": _finite_or_none(np.nanmax(log_ratio)) if len(log_ratio) else None}


def merge_histograms(first: Histogram | None, second: Histogram) -> Histogram:
    """Two histograms over the same bins (of two chunks of tokens) as one."""
    if first is None:
        return second
    extremes = {name: [v for v in (first[name], second[name]) if v is not None] for name in ("min", "max")}
    return {**first, "counts": [a + b for a, b in zip(first["counts"], second["counts"])],
            **{name: first[name] + second[name] for name in ("n", "n_below", "n_above", "n_nan")},
            "min": min(extremes["min"]) if extremes["min"] else None,
            "max": max(extremes["max"]) if extremes["max"] else None}


def _finite_or_none(value: float) -> float | None:
    return float(value) if math.isfinite(value) else None


@dataclass(frozen=True, slots=True)
class TokenTerms:
    """The per-token terms GroupSums sums (mismatch.analysis.terms), made once per pair and chunk
    for every breakdown of it (by position, by turn); k3 and the ratio are the pair's own
    (PairTokens: the same bits, made once per chunk for every analysis that reads them)."""

    abs_log_ratio: np.ndarray
    k3: np.ndarray
    outside: np.ndarray  # ratio outside [0.5, 2] (bool)

    @classmethod
    def of(cls, tokens: PairTokens) -> TokenTerms:
        return cls(abs_log_ratio=np.abs(tokens.log_ratio), k3=tokens.k3, outside=terms.outside(tokens.ratio))


class GroupSums:
    """BREAKDOWN_METRICS per integer key, summed chunk by chunk (the per-token terms of
    mismatch.analysis.terms): bincount sums, no groupby, no per-token temporary frames."""

    def __init__(self) -> None:
        self.sums: dict[str, np.ndarray] = {}

    def add(self, keys: np.ndarray, tokens: TokenTerms) -> None:
        keys = np.asarray(keys, dtype=np.int64)
        if not len(keys):
            return
        abs_lr = tokens.abs_log_ratio
        found = {"n": np.bincount(keys).astype(np.float64), "abs": np.bincount(keys, weights=abs_lr),
                 "k3": np.bincount(keys, weights=tokens.k3), "outside": np.bincount(keys, weights=tokens.outside)}
        top = np.full(len(found["n"]), -np.inf)
        np.maximum.at(top, keys, abs_lr)
        found["max"] = top
        self.merge_sums(found)

    def merge(self, other: GroupSums) -> None:
        self.merge_sums(other.sums)

    def merge_sums(self, found: dict[str, np.ndarray]) -> None:
        for name, values in found.items():
            old = self.sums.get(name)
            if old is None:
                self.sums[name] = values
                continue
            size = max(len(old), len(values))
            fill = -np.inf if name == "max" else 0.0
            old, values = (np.pad(x, (0, size - len(x)), constant_values=fill) for x in (old, values))
            self.sums[name] = np.maximum(old, values) if name == "max" else old + values

    def stats(self) -> pd.DataFrame:
        """One row per key with tokens, indexed by the key."""
        if not self.sums:
            return pd.DataFrame(columns=list(BREAKDOWN_METRICS))
        present = np.flatnonzero(self.sums["n"])
        num = self.sums["n"][present]
        return pd.DataFrame({"log_ratio_abs_mean": self.sums["abs"][present] / num,
                             "log_ratio_abs_max": self.sums["max"][present],
                             "kl_k3": self.sums["k3"][present] / num,
                             "frac_outside_2": self.sums["outside"][present] / num,
                             "n_tokens": num.astype(np.int64)}, index=present)


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


def by_position_block(sums: dict[str, GroupSums], width: int) -> Breakdown | None:
    """The position chart's block from each pair's sums per bin (bins `width` tokens wide)."""
    stats = {pair: found.stats() for pair, found in sums.items() if found.sums}
    if not stats:
        return None
    index = sorted(set().union(*(s.index for s in stats.values())))
    return {"x": [int(x) for x in index], "labels": [f"pos {x:,}–{x + width - 1:,}" for x in index],
            "x_title": f"position in the stream (bins of {width:,} token{'s' if width > 1 else ''})",
            "width": width,
            "series": _series(stats, index)}


def by_probability_from_summary(summary: Summary, pairs: list[str]) -> Breakdown | None:
    """summary.json's probability buckets (localization.turns.by_prob_bucket, of the pair the turn
    localizer reads): the report draws the buckets the analysis defined, never its own."""
    turns = summary.localization.turns
    if not turns or turns.by_prob_bucket is UNSET:
        return None
    # each row: its bucket's label and the pair's metrics (localize.turns)
    rows = [(row["bucket"], {present(turns.pair): partial_metrics(row)}) for row in turns.by_prob_bucket]
    return by_key_from_summary(rows, "bucket", pairs, x_title="probability of the token under the pair's B side")


def by_turn_block(sums: dict[str, GroupSums]) -> Breakdown | None:
    """The turn chart from tokens (results whose summary.json has no `turns`)."""
    stats = {pair: found.stats() for pair, found in sums.items() if found.sums}
    if not stats:
        return None
    index = sorted(set().union(*(s.index for s in stats.values())))
    return {"x": [int(x) for x in index], "labels": [f"turn {x}" for x in index], "x_title": "turn",
            "series": _series(stats, index), "integer_ticks": True}


def by_key_from_summary(rows: list[tuple[Any, dict[str, PairMetrics]]], key: str, pairs: list[str], *,
                        x_title: str) -> Breakdown | None:
    """summary.json's own breakdowns (`turns`, `branch_kinds`, the probability buckets), each row
    as (its `key`'s value, {pair: metrics})."""
    if not rows:
        return None
    x = [value for value, _ in rows]
    series = {pair: {name: [_json_number(getattr(metrics[pair], name), name) if pair in metrics else None
                            for _, metrics in rows]
                     for name in BREAKDOWN_METRICS} for pair in pairs}
    # A pair no row has tokens for is left out rather than drawn as an empty line.
    series = {pair: s for pair, s in series.items() if any(n for n in s["n_tokens"])}
    labels = [f"{key.replace('_', ' ')} {v}" if key == "turn" else str(v) for v in x]
    block = {"x": x, "labels": labels, "x_title": x_title, "series": series,
             "integer_ticks": all(isinstance(v, int) for v in x)}
    return block if series else None
