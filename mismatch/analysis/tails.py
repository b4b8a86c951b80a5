"""Each group's smallest and largest values, gathered chunk by chunk: the exact ratio quantiles of
groups too large to sort whole (a group's tails are ~1% of it), for the grouped metrics' second pass
and the report's |log-ratio| tail.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from mismatch.analysis.groups import lerp_order_statistics, quantile_ranks


class Tails:
    """Per group: the smallest and the largest values, as many as its quantiles' order statistics
    need (about 1% of the group on each side for ratio_q01/q99), gathered chunk by chunk.

    Each side keeps a buffer of at least those k values and trims it back to k (a partition) only
    once it holds k + slack (_slack): a partition of the whole buffer for each chunk was most of the
    second pass's time. Values at or past the bound the last trim found cannot enter."""

    def __init__(self, counts: np.ndarray, qs: Sequence[float]) -> None:
        self.counts, self.qs = counts, list(qs)
        self.k_low = np.zeros(len(counts), dtype=np.int64)
        self.k_high = np.zeros(len(counts), dtype=np.int64)
        for group, n in enumerate(counts.tolist()):
            if n:
                lo, hi, _ = quantile_ranks(n, self.qs)
                ranks = np.concatenate([lo, hi])
                low, high = ranks[2 * ranks < n - 1], ranks[2 * ranks >= n - 1]
                self.k_low[group] = low.max() + 1 if len(low) else 0
                self.k_high[group] = n - high.min() if len(high) else 0
        self.low: list[np.ndarray] = [np.zeros(0)] * len(counts)
        self.high: list[np.ndarray] = [np.zeros(0)] * len(counts)
        # The k-th smallest and the k-th largest at the last trim (NaN: none yet, every value enters).
        self.low_bound = np.full(len(counts), np.nan)
        self.high_bound = np.full(len(counts), np.nan)

    def add(self, values: np.ndarray, token_group: np.ndarray) -> None:
        if len(self.counts) == 1:
            self._add_group(0, values)
            return
        present = np.bincount(token_group, minlength=len(self.counts))
        if np.count_nonzero(present) == 1:  # a chunk of one group: no sort
            self._add_group(int(np.flatnonzero(present)[0]), values)
            return
        # Only the values that can enter a tail go on to the sort: past their group's bound on
        # either side, or any of a group with a side not yet bounded. A group's bounds change only
        # while its own values are taken in, so each group keeps exactly the values it kept before.
        with np.errstate(invalid="ignore"):
            unbounded = (np.isnan(self.low_bound) & (self.k_low > 0)) | (np.isnan(self.high_bound) & (self.k_high > 0))
            enter = values < self.low_bound[token_group]
            enter |= values > self.high_bound[token_group]
            enter |= unbounded[token_group]
        values, token_group = values[enter], token_group[enter]
        present = np.bincount(token_group, minlength=len(self.counts))
        # A stable sort of small integers is a radix sort in numpy.
        codes = token_group.astype(np.int16 if len(self.counts) < 2**15 else np.int64, copy=False)
        by_group = values[np.argsort(codes, kind="stable")]
        bounds = np.concatenate([[0], np.cumsum(present)])
        for group in np.flatnonzero(present).tolist():
            self._add_group(group, by_group[bounds[group]:bounds[group + 1]])

    def _add_group(self, group: int, values: np.ndarray) -> None:
        self._keep_low(group, values)
        self._keep_high(group, values)

    def _keep_low(self, group: int, values: np.ndarray) -> None:
        k = int(self.k_low[group])
        if not k:
            return
        bound = self.low_bound[group]
        candidates = values if np.isnan(bound) else values[values < bound]
        if len(candidates):
            self.low[group] = np.concatenate([self.low[group], candidates])
            if len(self.low[group]) > k + _slack(k):
                self._trim_low(group)

    def _keep_high(self, group: int, values: np.ndarray) -> None:
        k = int(self.k_high[group])
        if not k:
            return
        bound = self.high_bound[group]
        candidates = values if np.isnan(bound) else values[values > bound]
        if len(candidates):
            self.high[group] = np.concatenate([self.high[group], candidates])
            if len(self.high[group]) > k + _slack(k):
                self._trim_high(group)

    def _trim_low(self, group: int) -> None:
        """The low side back to its k smallest, whose largest bounds what can enter after."""
        k = int(self.k_low[group])
        self.low[group] = _smallest(self.low[group], k)
        self.low_bound[group] = self.low[group][k - 1]

    def _trim_high(self, group: int) -> None:
        k = int(self.k_high[group])
        self.high[group] = _largest(self.high[group], k)
        self.high_bound[group] = self.high[group][0]

    def merge(self, other: Tails) -> None:
        """Take in the tails of more values of the same groups (each side apart: a group with
        fewer values than its two sides keeps all of them on both)."""
        for group in range(len(self.counts)):
            self._keep_low(group, other.low[group])
            self._keep_high(group, other.high[group])

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (a fork's tails sent back to be merged) with each buffer trimmed to its k values."""
        for group, (k_low, k_high) in enumerate(zip(self.k_low.tolist(), self.k_high.tolist())):
            if len(self.low[group]) > k_low > 0:
                self._trim_low(group)
            if len(self.high[group]) > k_high > 0:
                self._trim_high(group)
        return self.__dict__

    def quantiles(self) -> np.ndarray:
        """[num_groups, len(qs)], numpy's linear method; NaN for an empty group."""
        out = np.full((len(self.counts), len(self.qs)), np.nan)
        for group, n in enumerate(self.counts.tolist()):
            if not n:
                continue
            # Exactly the k smallest and the k largest (the buffers may hold more).
            low = np.sort(self.low[group])[:int(self.k_low[group])]
            high = np.sort(self.high[group])[len(self.high[group]) - int(self.k_high[group]):]
            lo, hi, virtual = quantile_ranks(n, self.qs)
            first_high = n - len(high)
            ordered = {rank: (low[rank] if rank < len(low) else high[rank - first_high])
                       for rank in np.unique(np.concatenate([lo, hi])).tolist()}
            out[group] = lerp_order_statistics(ordered, lo, hi, virtual)
        return out


def _smallest(values: np.ndarray, k: int) -> np.ndarray:
    """The k smallest values (the k-th last), in an array of their own: a slice of the partition
    would keep the whole buffer alive."""
    return np.partition(values, k - 1)[:k].copy()


def _largest(values: np.ndarray, k: int) -> np.ndarray:
    """The k largest values (the k-th first), in an array of their own."""
    return np.partition(values, len(values) - k)[len(values) - k:].copy()


def _slack(k: int) -> int:
    """How many values past k a tail's buffer takes before it is trimmed back to k (a quarter
    more: the tails are the analysis's one state that grows with the run, ~1% of the values)."""
    return max(k // 4, 1024)
