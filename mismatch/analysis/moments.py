"""Means and co-moments of values seen chunk by chunk, merged by Chan's rule: the spreads, slopes
and correlations the turn, alignment and framework analyses report, in one pass.
"""

from __future__ import annotations

import numpy as np


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
        self._merge(count, mean, np.einsum("in,jn->ij", centered, centered))  # not BLAS (groups.dot)

    def merge(self, other: Moments) -> None:
        if other.mean is not None and other.comoment is not None:
            self._merge(other.n, other.mean, other.comoment)

    def _merge(self, count: int, mean: np.ndarray, comoment: np.ndarray) -> None:
        if self.mean is None or self.comoment is None:
            self.n, self.mean, self.comoment = count, mean, comoment
            return
        total = self.n + count
        delta = mean - self.mean
        self.comoment = self.comoment + comoment + np.outer(delta, delta) * (self.n * count / total)
        self.mean = self.mean + delta * (count / total)
        self.n = total
