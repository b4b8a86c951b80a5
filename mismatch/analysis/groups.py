"""Grouped reductions over spans of tokens: spans of equal keys, groups of spans, sums, extremes, quantiles.

The engine under metrics, localize and corrections. A token table is stored rollout by rollout,
branch by branch, in position order, so a key that changes only at turn, role or branch
boundaries is constant over long spans of rows. Each span is reduced once (`ufunc.reduceat`), and
spans are then combined into groups (`np.bincount` over ~1e5 spans instead of ~1e7 tokens): no
hashing of token keys, no groupby machinery. Correctness never depends on the order: an unsorted
table only makes the spans shorter.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd



@dataclass(frozen=True, slots=True, eq=False)
class Spans:
    """Maximal stretches of consecutive tokens whose keys are all equal.

    `starts` index the tokens (the view's positions); `rows` index the same first tokens in the
    table the tokens were taken from. A span is contiguous in both, so a view position maps back
    to its table row through its span, without a row index of every token.
    """

    starts: np.ndarray   # int64, first token of each span
    lengths: np.ndarray  # int64
    num_tokens: int
    rows: np.ndarray     # int64, the table row of each span's first token

    @property
    def num_spans(self) -> int:
        return len(self.starts)

    def sum(self, values: np.ndarray, dtype: type | None = None) -> np.ndarray:
        """Per span: the sum of `values` (bool values count with dtype=np.int64)."""
        if self.num_spans == 0:
            return np.zeros(0, dtype=dtype or np.float64)
        return np.add.reduceat(values, self.starts, dtype=dtype)

    def max(self, values: np.ndarray) -> np.ndarray:
        if self.num_spans == 0:
            return np.zeros(0, dtype=np.float64)
        return np.maximum.reduceat(values, self.starts)

    def min(self, values: np.ndarray) -> np.ndarray:
        if self.num_spans == 0:
            return np.zeros(0, dtype=np.float64)
        return np.minimum.reduceat(values, self.starts)

    def spread(self, per_span: np.ndarray) -> np.ndarray:
        """Per token: the value of its span."""
        return np.repeat(per_span, self.lengths)


def dot(a: np.ndarray, b: np.ndarray) -> float:
    """sum(a * b) without BLAS: OpenBLAS's threads busy-wait between calls and, on a machine of
    few cores, fight the rest of the process for them (tree metrics at 10^7 tokens: 38 s through
    `@`, 5 s with one BLAS thread, the same through einsum)."""
    return float(np.einsum("i,i->", a, b))


def find_spans(keys: Sequence[np.ndarray], num_rows: int, mask: np.ndarray | None = None) -> Spans:
    """Spans of the rows where `mask` (default: all rows), cut wherever any of the aligned key
    arrays changes value or a masked-out row comes between two tokens.

    Two row-length flag buffers, updated in place: fresh arrays of ~1e7 rows cost more in page
    faults than the comparisons (benchmarks/RESULTS.md).
    """
    change = np.zeros(num_rows, dtype=bool)  # row i starts a span (if kept)
    if num_rows == 0:
        return Spans(starts=np.zeros(0, dtype=np.int64), lengths=np.zeros(0, dtype=np.int64), num_tokens=0,
                    rows=np.zeros(0, dtype=np.int64))
    change[0] = True
    flags = np.empty(num_rows - 1, dtype=bool)
    for key in keys:
        np.not_equal(key[1:], key[:-1], out=flags)
        np.logical_or(change[1:], flags, out=change[1:])
    if mask is None:
        rows = np.flatnonzero(change)
        lengths = np.diff(np.append(rows, num_rows))
        return Spans(starts=rows, lengths=lengths, num_tokens=num_rows, rows=rows)
    # A kept row starts a span after a change or after a dropped row, and ends one before a change
    # or a dropped row (or at the end).
    np.logical_or(change[1:], np.logical_not(mask[:-1], out=flags), out=change[1:])
    ends_here = np.empty(num_rows, dtype=bool)
    np.logical_or(change[1:], np.logical_not(mask[1:], out=flags), out=ends_here[:-1])
    ends_here[-1] = True
    np.logical_and(ends_here, mask, out=ends_here)
    np.logical_and(change, mask, out=change)
    rows, ends = np.flatnonzero(change), np.flatnonzero(ends_here)
    lengths = ends - rows + 1
    starts = np.cumsum(lengths) - lengths
    return Spans(starts=starts, lengths=lengths, num_tokens=int(lengths.sum()), rows=rows)


@dataclass(frozen=True, slots=True, eq=False)
class Grouping:
    """Spans assigned to groups numbered 0..num_groups-1 in sorted key order."""

    span_group: np.ndarray  # int64 group of each span
    num_groups: int
    keys: pd.DataFrame     # one row per group: the key columns' values

    def sum(self, per_span: np.ndarray) -> np.ndarray:
        return np.bincount(self.span_group, weights=per_span, minlength=self.num_groups)

    def count(self, spans: Spans) -> np.ndarray:
        return np.bincount(self.span_group, weights=spans.lengths, minlength=self.num_groups).astype(np.int64)

    def max(self, per_span: np.ndarray) -> np.ndarray:
        out = np.full(self.num_groups, -np.inf)
        np.maximum.at(out, self.span_group, per_span)
        return out

    def min(self, per_span: np.ndarray) -> np.ndarray:
        out = np.full(self.num_groups, np.inf)
        np.minimum.at(out, self.span_group, per_span)
        return out

    def pairs_with(self, span_entity: np.ndarray, num_entities: int) -> tuple[np.ndarray, np.ndarray]:
        """Distinct (group, entity) pairs among the spans: (group of each pair, pair of each span)."""
        combined = self.span_group * max(num_entities, 1) + span_entity
        unique, inverse = dense_codes(combined, self.num_groups * max(num_entities, 1))
        return unique // max(num_entities, 1), inverse

    def distinct(self, span_entity: np.ndarray, num_entities: int) -> np.ndarray:
        """Per group: how many distinct entities (e.g. rollouts) its spans belong to."""
        pair_group, _ = self.pairs_with(span_entity, num_entities)
        return np.bincount(pair_group, minlength=self.num_groups).astype(np.int64)


def group_spans(at_start: dict[str, pd.Series], spans: Spans) -> Grouping:
    """Group spans by the key columns' values at each span's first token (`at_start`, one per span).

    Groups are sorted by key like `DataFrame.groupby(sort=True, observed=True, dropna=False)`:
    categoricals in category order, missing keys last. The spans must not cross a change of
    these columns (cut them with `find_spans` on these columns' `key_codes`).
    """
    codes = []
    for values in at_start.values():
        column_codes, _ = pd.factorize(values, sort=True, use_na_sentinel=False)
        codes.append(column_codes.astype(np.int64))
    if not codes or spans.num_spans == 0:
        span_group = np.zeros(spans.num_spans, dtype=np.int64)
        num_groups = 1 if spans.num_spans and not codes else 0
    else:
        # Mixed radix: one integer per key tuple, ordered like the tuples (each code < its column's
        # number of values), then numbered densely.
        combined, domain = np.zeros(spans.num_spans, dtype=np.int64), 1
        for column_codes in codes:
            size = int(column_codes.max()) + 1
            combined, domain = combined * size + column_codes, domain * size
        if domain < 2**62:
            unique, span_group = dense_codes(combined, domain)
        else:  # too many combinations for one int64: rows of codes
            unique, span_group = np.unique(np.stack(codes, axis=1), axis=0, return_inverse=True)
        span_group, num_groups = span_group.reshape(-1).astype(np.int64), len(unique)
    first_span = np.full(num_groups, spans.num_spans, dtype=np.int64)
    np.minimum.at(first_span, span_group, np.arange(spans.num_spans))
    keys = pd.DataFrame({name: values.iloc[first_span].reset_index(drop=True) for name, values in at_start.items()})
    return Grouping(span_group=span_group, num_groups=num_groups, keys=keys)


def dense_codes(values: np.ndarray, domain: int) -> tuple[np.ndarray, np.ndarray]:
    """np.unique(values, return_inverse=True) for non-negative ints below `domain`: by a table of
    the domain when it is not much larger than the values (no sort), else by np.unique."""
    if domain > 4 * len(values) + 4096:
        unique, inverse = np.unique(values, return_inverse=True)
        return unique, inverse.reshape(-1)
    present = np.zeros(domain, dtype=bool)
    present[values] = True
    unique = np.flatnonzero(present)
    rank = np.cumsum(present, dtype=np.int64) - 1
    return unique, rank[values]


def single_group(spans: Spans) -> Grouping:
    """Every span in group 0."""
    return Grouping(span_group=np.zeros(spans.num_spans, dtype=np.int64), num_groups=1, keys=pd.DataFrame(index=[0]))


def quantiles(values: np.ndarray, spans: Spans, grouping: Grouping, qs: Sequence[float],
              scratch: np.ndarray | None = None) -> np.ndarray:
    """[num_groups, len(qs)] quantiles of the per-token `values` per group of spans, numpy's
    default (linear) method. An empty group gives NaN.

    Each group's values are gathered side by side (into `scratch`, a float64 buffer of at least
    len(values) that the caller may reuse across calls) by a stable counting sort on the group
    codes, and partitioned at the order statistics the quantiles need, never fully sorted.
    """
    counts = grouping.count(spans)
    if grouping.num_groups <= 1:
        by_group = values.copy() if scratch is None else scratch[:len(values)]
        by_group[:] = values
    else:
        token_group = spans.spread(grouping.span_group)
        order = np.argsort(token_group.astype(np.int16 if grouping.num_groups < 2**15 else np.int64), kind="stable")
        by_group = values[order]
    return segment_quantiles(by_group, np.concatenate([[0], np.cumsum(counts)]), qs)


# Above this many segments one sort of all of them beats a partition per segment (per rollout:
# thousands of small segments, each a Python round trip).
_SORT_SEGMENTS = 32


def segment_quantiles(by_group: np.ndarray, bounds: np.ndarray, qs: Sequence[float]) -> np.ndarray:
    """Quantiles of each segment by_group[bounds[g]:bounds[g + 1]] (may reorder it in place)."""
    num_segments = len(bounds) - 1
    if num_segments > _SORT_SEGMENTS:
        return _sorted_segment_quantiles(by_group, np.asarray(bounds, dtype=np.int64), qs)
    out = np.full((num_segments, len(qs)), np.nan)
    for group in range(num_segments):
        lo, hi = bounds[group], bounds[group + 1]
        if hi > lo:
            out[group] = _quantiles_of(by_group[lo:hi], qs)
    return out


def _sorted_segment_quantiles(by_group: np.ndarray, bounds: np.ndarray, qs: Sequence[float]) -> np.ndarray:
    """segment_quantiles by sorting every segment at once: the same order statistics (NaN last,
    as a partition puts it), the same interpolation.

    Segments of about the same length (within 2x) are sorted together as the rows of a matrix,
    each padded with NaN (sorted last, past the segment's own values): numpy's vectorized sort
    along rows, values only, instead of an argsort of the whole chunk and a gather (measured on
    per-rollout ratios, 256k values in ~500 rollouts: about 4x faster). The padding at most
    doubles a bucket's memory."""
    counts = np.diff(bounds)
    out = np.full((len(counts), len(qs)), np.nan)
    bucket = np.ceil(np.log2(np.maximum(counts, 1))).astype(np.int64)
    bucket[counts == 0] = -1
    for size in np.unique(bucket[bucket >= 0]).tolist():
        segments = np.flatnonzero(bucket == size)
        out[segments] = _row_sorted_quantiles(by_group, bounds[segments], counts[segments], qs)
    return out


def _row_sorted_quantiles(values: np.ndarray, starts: np.ndarray, counts: np.ndarray,
                          qs: Sequence[float]) -> np.ndarray:
    """Quantiles of the segments values[start:start + count], each a row of a NaN-padded matrix."""
    width = int(counts.max())
    inside = np.arange(width)[None, :] < counts[:, None]
    # Row by row, left to right: the flat positions of each segment's values in order.
    offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    matrix = np.full((len(counts), width), np.nan)
    matrix[inside] = values[np.repeat(starts, counts) + offsets]
    matrix.sort(axis=1)
    n = counts[:, None]
    virtual = np.asarray(qs, dtype=np.float64)[None, :] * (n - 1)
    lo = np.floor(virtual).astype(np.int64)
    hi = np.minimum(lo + 1, n - 1)
    rows = np.arange(len(counts))[:, None]
    return _lerp_arrays(matrix[rows, lo], matrix[rows, hi], virtual - lo)


def _quantiles_of(values: np.ndarray, qs: Sequence[float]) -> np.ndarray:
    """Quantiles of a 1-D array (may reorder it), as np.quantile(method="linear")."""
    lo, hi, virtual = quantile_ranks(len(values), qs)
    ranks = np.unique(np.concatenate([lo, hi]))
    return lerp_order_statistics(dict(zip(ranks.tolist(), order_statistics(values, ranks))), lo, hi, virtual)


def quantile_ranks(n: int, qs: Sequence[float]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The order statistics (lower, upper) numpy's linear method interpolates between, and where."""
    virtual = np.asarray(qs, dtype=np.float64) * (n - 1)
    lo = np.floor(virtual).astype(np.int64)
    return lo, np.minimum(lo + 1, n - 1), virtual


def lerp_order_statistics(ordered: dict[int, float], lo: np.ndarray, hi: np.ndarray, virtual: np.ndarray) -> np.ndarray:
    """The quantiles at `virtual` from the order statistics they lie between (`ordered`: rank -> value)."""
    return _lerp_arrays(np.array([ordered[k] for k in lo]), np.array([ordered[k] for k in hi]), virtual - lo)


def _lerp_arrays(a: np.ndarray, b: np.ndarray, t: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        diff = b - a
        # numpy's _lerp: from the nearer end, so t = 1 gives b exactly; equal ends (inf too) give a.
        out = np.where(t >= 0.5, b - diff * (1 - t), a + diff * t)
    return np.where(a == b, a, out)


def order_statistics(values: np.ndarray, ranks: np.ndarray) -> np.ndarray:
    """values' order statistics at `ranks` (0-based, sorted), exactly; `values` is reordered.
    (Per rollout or per chunk, partitioning all of a group's values is cheap; the run-wide groups'
    tails are gathered by analysis.tails.Tails.)"""
    values.partition(ranks)
    return values[ranks]
