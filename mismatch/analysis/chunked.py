"""Pair metrics over a token table read in chunks of whole rollouts: memory of one chunk, not of the table.

Flow: token table -> rollout-aligned chunks -> per chunk, each pair's per-span sums (metrics.SpanSums)
-> concatenated, grouped per breakdown -> metrics.group_metrics. What span sums cannot give, the
ratio quantiles and the rescaled ESS of far-out groups, comes from a second pass over the chunks
that keeps, per group, only the tails its order statistics lie in (`_Tails`).

A rollout is never cut, so a sequence (a branch of a rollout) and a rollout lie in one chunk:
their codes from each chunk, offset by the chunks before, number them over the whole table. A
table whose rollouts are not contiguous is read as one chunk (correct, just not bounded).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pandas as pd

from mismatch.analysis import terms
from mismatch.analysis.groups import (
    Grouping,
    Spans,
    _lerp,
    _ranks,
    key_codes,
    single_group,
)
from mismatch.analysis.metrics import (
    _QUANTILES,
    PAIR_METRICS,
    SpanSums,
    far_groups,
    group_metrics,
    grouped_view_metrics,
    pair_span_sums,
    pair_tokens,
)
from mismatch.analysis.tokenview import TokenView

# Rows per chunk: ~1M rows keep every per-token scratch array near 8 MB.
DEFAULT_CHUNK_ROWS = 1 << 20
OVERALL = ""  # the breakdown name of the one group of all tokens

Chunks = Callable[[], Iterable[pd.DataFrame]]  # a fresh pass over the same chunks, each call


def chunk_bounds(table: pd.DataFrame, rows: int | None = None) -> list[tuple[int, int]]:
    """Row ranges of about `rows` rows (default DEFAULT_CHUNK_ROWS) that start at a rollout's first
    row; one range for a table whose rollouts are not each one contiguous stretch, or is empty
    (an empty chunk still gives every pair its empty span sums)."""
    rows = rows or DEFAULT_CHUNK_ROWS
    num_rows = len(table)
    if num_rows == 0:
        return [(0, 0)]
    codes = key_codes(table["rollout"])
    starts = np.flatnonzero(codes[1:] != codes[:-1]) + 1
    firsts = codes[np.r_[0, starts]]
    if len(np.unique(firsts)) != len(firsts):  # a rollout comes back after another one
        return [(0, num_rows)]
    cuts = np.unique(starts[np.minimum(np.searchsorted(starts, np.arange(rows, num_rows, rows)), len(starts) - 1)]) \
        if len(starts) else np.zeros(0, dtype=np.int64)
    edges = [0, *cuts.tolist(), num_rows]
    return list(itertools.pairwise(edges))


def table_chunks(table: pd.DataFrame, rows: int | None = None) -> Chunks:
    """The table's rollout-aligned chunks (re-iterable: each call starts a new pass)."""
    bounds = chunk_bounds(table, rows)
    return lambda: (table.iloc[lo:hi] for lo, hi in bounds)


@dataclass(slots=True)
class _PairParts:
    """One pair's per-span pieces, chunk after chunk."""

    lengths: list[np.ndarray] = field(default_factory=list)
    sums: list[dict[str, np.ndarray]] = field(default_factory=list)
    span_seq: list[np.ndarray] = field(default_factory=list)
    span_rollout: list[np.ndarray] = field(default_factory=list)
    keys: dict[str, list[pd.Series]] = field(default_factory=dict)
    num_seqs: int = 0
    num_rollouts: int = 0

    def add(self, data: SpanSums, keys: dict[str, pd.Series]) -> None:
        self.lengths.append(data.spans.lengths)
        self.sums.append(data.sums)
        self.span_seq.append(data.span_seq + self.num_seqs)
        self.span_rollout.append(data.span_rollout + self.num_rollouts)
        self.num_seqs += data.num_seqs
        self.num_rollouts += data.num_rollouts
        for name, values in keys.items():
            self.keys.setdefault(name, []).append(values)

    def span_sums(self) -> SpanSums:
        lengths = _concat(self.lengths, np.int64)
        spans = Spans(starts=np.cumsum(lengths) - lengths, lengths=lengths, num_tokens=int(lengths.sum()),
                      rows=np.cumsum(lengths) - lengths)
        names = self.sums[0].keys() if self.sums else ()
        sums = {name: np.concatenate([part[name] for part in self.sums]) for name in names}
        return SpanSums(spans=spans, sums=sums, span_seq=_concat(self.span_seq, np.int64), num_seqs=self.num_seqs,
                        span_rollout=_concat(self.span_rollout, np.int64), num_rollouts=self.num_rollouts)


def _concat(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


class _Tails:
    """Per group: the smallest and the largest values, as many as its quantiles' order statistics
    need (about 1% of the group on each side for ratio_q01/q99), gathered chunk by chunk."""

    def __init__(self, counts: np.ndarray, qs: Sequence[float]) -> None:
        self.counts, self.qs = counts, list(qs)
        self.k_low = np.zeros(len(counts), dtype=np.int64)
        self.k_high = np.zeros(len(counts), dtype=np.int64)
        for group, n in enumerate(counts.tolist()):
            if n:
                lo, hi, _ = _ranks(n, self.qs)
                ranks = np.concatenate([lo, hi])
                low, high = ranks[2 * ranks < n - 1], ranks[2 * ranks >= n - 1]
                self.k_low[group] = low.max() + 1 if len(low) else 0
                self.k_high[group] = n - high.min() if len(high) else 0
        self.low: list[np.ndarray] = [np.zeros(0)] * len(counts)
        self.high: list[np.ndarray] = [np.zeros(0)] * len(counts)

    def add(self, values: np.ndarray, token_group: np.ndarray) -> None:
        if len(self.counts) == 1:
            self._add_group(0, values)
            return
        order = np.argsort(token_group, kind="stable")
        by_group = values[order]
        bounds = np.concatenate([[0], np.cumsum(np.bincount(token_group, minlength=len(self.counts)))])
        for group in np.flatnonzero(np.diff(bounds)).tolist():
            self._add_group(group, by_group[bounds[group]:bounds[group + 1]])

    def _add_group(self, group: int, values: np.ndarray) -> None:
        k_low, k_high = int(self.k_low[group]), int(self.k_high[group])
        if k_low:
            low = np.concatenate([self.low[group], values])
            self.low[group] = low if len(low) <= k_low else np.partition(low, k_low - 1)[:k_low]
        if k_high:
            high = np.concatenate([self.high[group], values])
            self.high[group] = high if len(high) <= k_high else np.partition(high, len(high) - k_high)[-k_high:]

    def quantiles(self) -> np.ndarray:
        """[num_groups, len(qs)], numpy's linear method; NaN for an empty group."""
        out = np.full((len(self.counts), len(self.qs)), np.nan)
        for group, n in enumerate(self.counts.tolist()):
            if not n:
                continue
            low, high = np.sort(self.low[group]), np.sort(self.high[group])
            lo, hi, virtual = _ranks(n, self.qs)
            first_high = n - len(high)
            ordered = {rank: (low[rank] if rank < len(low) else high[rank - first_high])
                       for rank in np.unique(np.concatenate([lo, hi])).tolist()}
            out[group] = _lerp(ordered, lo, hi, virtual)
        return out


@dataclass(frozen=True, slots=True)
class _Gathered:
    """metrics.TokenPass answered from the second pass."""

    table: np.ndarray
    far_sums: tuple[np.ndarray, np.ndarray]

    def quantiles(self, grouping: Grouping) -> np.ndarray:
        return self.table

    def far_weights(self, grouping: Grouping, far: np.ndarray, lr_max: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        return self.far_sums


@dataclass(frozen=True, slots=True)
class _Breakdown:
    """One grouping of a pair's spans and what the second pass gathers for it."""

    grouping: Grouping
    first_span: np.ndarray  # per chunk: the index of its first span in the concatenation
    tails: _Tails
    far: np.ndarray         # groups whose ESS needs exp(log_ratio - group max)
    lr_max: np.ndarray
    far_sums: tuple[np.ndarray, np.ndarray]


class GroupedPairMetrics:
    """PAIR_METRICS of each pair, overall and per `by` column, over a table's chunks.

    Groups are the view's (every key with a row in the view), as `metrics.metrics_by` gives them:
    a pair with no defined log-ratio in a group keeps the group's row, with zero counts.
    `clip` also sums the tokens outside [1 - low, 1 + high] per span (the `clip` summary).
    Without `quantiles` the ratio_q* columns are left out, and so is the second pass unless a
    group's ESS needs it.
    """

    def __init__(self, pairs: Sequence[tuple[str, str]], by: Sequence[str], *, trainable_only: bool,
                 overall: bool = True, clip: tuple[float, float] | None = None, quantiles: bool = True) -> None:
        self.pairs = [(f"logp_{a}", f"logp_{b}") for a, b in pairs]
        self.names = [f"{a}/{b}" for a, b in pairs]
        self.by, self.trainable_only, self.overall, self.clip = list(by), trainable_only, overall, clip
        self.quantiles = quantiles
        self.parts = [_PairParts() for _ in pairs]
        self.view_keys: dict[str, list[pd.Series]] = {name: [] for name in self.by}
        self.chunk_spans: list[list[int]] = [[] for _ in pairs]

    def add(self, chunk: pd.DataFrame) -> None:
        view = TokenView(chunk, trainable_only=self.trainable_only)
        for name in self.by:
            self.view_keys[name].append(view.series_at(name, view.spans.starts))
        for index, (a, b) in enumerate(self.pairs):
            pair = pair_tokens(view, a, b)
            spans = pair.view.spans
            data = pair_span_sums(pair, spans)
            if self.clip is not None:
                outside = terms.outside_clip(pair.ratio, *self.clip)
                data.sums["outside_clip"] = spans.sum(outside, dtype=np.int64)
            self.parts[index].add(data, {name: pair.view.series_at(name, spans.starts) for name in self.by})
            self.chunk_spans[index].append(spans.num_spans)

    def finish(self, chunks: Chunks) -> dict[str, dict[str, pd.DataFrame]]:
        """{breakdown (OVERALL or a `by` column): {pair name: by keys + PAIR_METRICS (+ n_outside_clip)}}."""
        span_sums = [parts.span_sums() for parts in self.parts]
        breakdowns = [self._breakdowns(index, data) for index, data in enumerate(span_sums)]
        if self.quantiles or any(breakdown.far.any() for found in breakdowns for breakdown in found.values()):
            self._second_pass(chunks, breakdowns)
        out: dict[str, dict[str, pd.DataFrame]] = {}
        for name, data, found in zip(self.names, span_sums, breakdowns):
            for by, breakdown in found.items():
                gathered = _Gathered(breakdown.tails.quantiles(), breakdown.far_sums)
                frame = group_metrics(data, breakdown.grouping, gathered, with_quantiles=self.quantiles)
                if "outside_clip" in data.sums:
                    frame["n_outside_clip"] = breakdown.grouping.sum(data.sums["outside_clip"]).astype(np.int64)
                keys = breakdown.grouping.keys.reset_index(drop=True)
                out.setdefault(by, {})[name] = pd.concat([keys, frame], axis=1) if by != OVERALL else frame
        return out

    def _breakdowns(self, index: int, data: SpanSums) -> dict[str, _Breakdown]:
        groupings: dict[str, Grouping] = {}
        if self.overall:
            groupings[OVERALL] = single_group(data.spans)
        for name in self.by:
            groupings[name] = self._view_grouping(name, self.parts[index].keys.get(name, []))
        first_span = np.concatenate([[0], np.cumsum(self.chunk_spans[index])])
        out = {}
        for by, grouping in groupings.items():
            counts = grouping.count(data.spans)
            lr_max = grouping.max(data.sums["log_ratio_max"]) if data.spans.num_spans else np.zeros(grouping.num_groups)
            lr_min = grouping.min(data.sums["log_ratio_min"]) if data.spans.num_spans else np.zeros(grouping.num_groups)
            far = far_groups(lr_min, lr_max)
            zeros = np.zeros(grouping.num_groups)
            tails = _Tails(counts if self.quantiles else np.zeros_like(counts), list(_QUANTILES.values()))
            out[by] = _Breakdown(grouping=grouping, first_span=first_span, tails=tails,
                                 far=far, lr_max=lr_max, far_sums=(zeros.copy(), zeros.copy()))
        return out

    def _view_grouping(self, name: str, pair_keys: list[pd.Series]) -> Grouping:
        """The pair's spans grouped by the view's keys of `name`, sorted like groupby (categoricals
        in category order, missing last): factorized together, the pair's keys (a subset of the
        view's) get the numbers of the view's groups."""
        view_keys = self.view_keys[name]
        every = pd.concat([*view_keys, *pair_keys], ignore_index=True) if view_keys else pd.Series([], dtype=object)
        codes, uniques = pd.factorize(every, sort=True, use_na_sentinel=False)
        first = np.full(len(uniques), len(every), dtype=np.int64)
        np.minimum.at(first, codes, np.arange(len(every)))
        num_view = sum(len(keys) for keys in view_keys)
        keys = pd.DataFrame({name: every.iloc[first].reset_index(drop=True)})
        return Grouping(span_group=codes[num_view:].astype(np.int64), num_groups=len(uniques), keys=keys)

    def _second_pass(self, chunks: Chunks, breakdowns: list[dict[str, _Breakdown]]) -> None:
        for chunk_index, chunk in enumerate(chunks()):
            view = TokenView(chunk, trainable_only=self.trainable_only)
            for index, (a, b) in enumerate(self.pairs):
                pair = pair_tokens(view, a, b)
                spans = pair.view.spans
                for breakdown in breakdowns[index].values():
                    lo = breakdown.first_span[chunk_index]
                    span_group = breakdown.grouping.span_group[lo:lo + spans.num_spans]
                    token_group = spans.spread(span_group)
                    if self.quantiles:
                        breakdown.tails.add(pair.ratio, token_group)
                    if breakdown.far.any():
                        _add_far(breakdown, pair.log_ratio, token_group)


def _add_far(breakdown: _Breakdown, log_ratio: np.ndarray, token_group: np.ndarray) -> None:
    """The far groups' sums of w and w^2, w = exp(log_ratio - group max) (metrics._ess)."""
    picked = breakdown.far[token_group]
    group = token_group[picked]
    weight = np.exp(log_ratio[picked] - breakdown.lr_max[group])
    size = breakdown.grouping.num_groups
    breakdown.far_sums[0][:] += np.bincount(group, weights=weight, minlength=size)
    breakdown.far_sums[1][:] += np.bincount(group, weights=np.square(weight), minlength=size)


def per_rollout_metrics(chunks: Chunks, pairs: Sequence[tuple[str, str]]) -> pd.DataFrame:
    """rollouts.parquet: `pair`, `rollout`, PAIR_METRICS per pair and rollout, chunk by chunk (a
    rollout lies in one chunk, so each one's metrics, quantiles included, are its chunk's)."""
    frames = []
    for chunk in chunks():
        view = TokenView(chunk)
        for a, b in pairs:
            frame = grouped_view_metrics(view, f"logp_{a}", f"logp_{b}", ["rollout"])
            frame.insert(0, "pair", f"{a}/{b}")
            frames.append(frame)
    if not frames:
        return pd.DataFrame(columns=["pair", "rollout", *PAIR_METRICS])
    out = pd.concat(frames, ignore_index=True)
    # metrics_by's order: pair by pair, rollouts sorted by key.
    pair_order = {f"{a}/{b}": index for index, (a, b) in enumerate(pairs)}
    rollout_codes, _ = pd.factorize(out["rollout"], sort=True, use_na_sentinel=False)
    order = np.lexsort((rollout_codes, out["pair"].map(pair_order).to_numpy()))
    return out.iloc[order].reset_index(drop=True)


def table_counts(chunks: Chunks) -> dict[str, int]:
    """summary.json `counts` of rows: rollouts, branches, tokens, trainable tokens."""
    counts = {"rollouts": 0, "branches": 0, "tokens": 0, "trainable_tokens": 0}
    for chunk in chunks():
        counts["rollouts"] += int(chunk["rollout"].nunique())
        counts["branches"] += int(chunk.groupby(["rollout", "branch"], observed=True).ngroups)
        counts["tokens"] += len(chunk)
        counts["trainable_tokens"] += int(chunk["trainable"].to_numpy(dtype=bool).sum())
    return counts


def breakdown_records(frames: dict[str, pd.DataFrame], by: str) -> list[dict[str, Any]]:
    """[{by: key, "pairs": {"A/B": {metric: value}}}] in key order, for summary.json."""
    rows: dict[Any, dict[str, Any]] = {}
    for name, frame in frames.items():
        for record in frame.to_dict("records"):
            key = record[by]
            key = key.item() if hasattr(key, "item") else key
            entry = rows.setdefault(key, {by: key, "pairs": {}})
            entry["pairs"][name] = {metric: record[metric] for metric in PAIR_METRICS}
    return [rows[key] for key in sorted(rows, key=lambda k: (str(type(k)), k))]


def run(chunks: Chunks, accumulators: Sequence[GroupedPairMetrics]) -> Iterator[dict[str, dict[str, pd.DataFrame]]]:
    """Feed every chunk to every accumulator in one pass, then finish each."""
    for chunk in chunks():
        for accumulator in accumulators:
            accumulator.add(chunk)
    return (accumulator.finish(chunks) for accumulator in accumulators)


# Values a pass of the radix selection below keeps in memory at most before it collects them.
_COLLECT = 1 << 20


def _sortable_keys(values: np.ndarray) -> np.ndarray:
    """uint64 keys ordered like the float64 values (negative floats' bits flipped, positive ones'
    sign bit set): the total order the radix selection narrows down 16 bits at a time."""
    bits = np.ascontiguousarray(values, dtype=np.float64).view(np.uint64)
    return np.where(bits >> np.uint64(63), ~bits, bits | np.uint64(1 << 63))


def stream_order_statistics(passes: Callable[[], Iterable[np.ndarray]], ranks: Sequence[int]) -> list[float]:
    """The values at `ranks` (0-based, in sorted order) of the values every pass yields, exactly,
    in memory bounded by _COLLECT values: each pass histograms the next 16 bits of the keys that
    share the rank's prefix, until few enough share it to be collected and partitioned (2 or 3
    passes at 10^8 values). NaN values are not allowed (the callers' values have none)."""
    found: list[float] = []
    for rank in ranks:
        prefix, bits, rank_left, count = np.uint64(0), 0, int(rank), None
        while True:
            if bits == 64:  # more than _COLLECT equal values: any one of them
                found.append(float(next(_sharing(passes, prefix, bits))[0]))
                break
            if count is not None and count <= _COLLECT:
                kept = list(_sharing(passes, prefix, bits))
                collected = np.concatenate(kept) if kept else np.zeros(0)
                found.append(float(np.partition(collected, rank_left)[rank_left]))
                break
            shift = np.uint64(48 - bits)
            histogram = np.zeros(1 << 16, dtype=np.int64)
            for values in _sharing(passes, prefix, bits):
                digits = (_sortable_keys(values) >> shift) & np.uint64(0xFFFF)
                histogram += np.bincount(digits.astype(np.int64), minlength=1 << 16)
            cumulative = np.cumsum(histogram)
            digit = int(np.searchsorted(cumulative, rank_left, side="right"))
            rank_left -= int(cumulative[digit - 1]) if digit else 0
            prefix, bits, count = (prefix << np.uint64(16)) | np.uint64(digit), bits + 16, int(histogram[digit])
    return found


def _sharing(passes: Callable[[], Iterable[np.ndarray]], prefix: np.uint64, bits: int) -> Iterator[np.ndarray]:
    """Each chunk's values whose keys start with the `bits`-bit `prefix`."""
    for values in passes():
        if bits:
            values = values[(_sortable_keys(values) >> np.uint64(64 - bits)) == prefix]
        if len(values):
            yield values


class Moments:
    """Count, means and co-moments (sums of products of deviations) of k values per token, merged
    chunk by chunk by Chan's rule: no E[x^2] - E[x]^2 cancellation, one pass."""

    def __init__(self) -> None:
        self.n = 0
        self.mean: np.ndarray | None = None
        self.comoment: np.ndarray | None = None

    def add(self, rows: np.ndarray) -> None:
        """rows: [k, tokens] (or [tokens] for k = 1)."""
        rows = np.atleast_2d(rows)
        count = rows.shape[1]
        if not count:
            return
        mean = rows.mean(axis=1)
        centered = rows - mean[:, None]
        comoment = centered @ centered.T
        if self.mean is None or self.comoment is None:
            self.n, self.mean, self.comoment = count, mean, comoment
            return
        total = self.n + count
        delta = mean - self.mean
        self.comoment = self.comoment + comoment + np.outer(delta, delta) * (self.n * count / total)
        self.mean = self.mean + delta * (count / total)
        self.n = total
