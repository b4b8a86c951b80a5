"""Exact order statistics (medians) of values seen chunk by chunk, in bounded memory: a radix
selection that narrows each wanted rank 16 bits of the value's key per pass (the framework medians).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

# Values a pass of the radix selection keeps in memory at most before it collects them.
_COLLECT = 1 << 20


def _sortable_keys(values: np.ndarray) -> np.ndarray:
    """uint64 keys ordered like the float64 values (negative floats' bits flipped, positive ones'
    sign bit set): the total order the radix selection narrows down 16 bits at a time."""
    bits = np.ascontiguousarray(values, dtype=np.float64).view(np.uint64)
    return np.where(bits >> np.uint64(63), ~bits, bits | np.uint64(1 << 63))


_NO_PREFIX = np.uint64(0)


@dataclass(slots=True)
class _Target:
    rank: int                  # still to skip among the values sharing `prefix`
    prefix: np.uint64 = _NO_PREFIX
    bits: int = 0              # how many leading bits of the key `prefix` fixes
    count: int = 0             # values sharing it (from the last histogram)
    histogram: np.ndarray | None = None
    kept: list[np.ndarray] = field(default_factory=list)
    value: float | None = None


class RadixSelect:
    """Exact order statistics of values seen chunk by chunk, in memory bounded by _COLLECT values:
    each pass histograms the next 16 bits of the keys (_sortable_keys) that share a wanted rank's
    prefix, until few enough share it to be kept and partitioned. The first pass histograms every
    value and counts them, so the ranks may depend on that count (`end_pass`). NaN values are not
    allowed (the callers' values have none)."""

    def __init__(self) -> None:
        self.n = 0
        self.first = np.zeros(1 << 16, dtype=np.int64)  # pass 0: the top 16 bits of every key
        self.targets: list[_Target] | None = None

    def add(self, values: np.ndarray) -> None:
        if self.targets is None:
            self.n += len(values)
            self.first += np.bincount((_sortable_keys(values) >> np.uint64(48)).astype(np.int64), minlength=1 << 16)
            return
        keys = _sortable_keys(values)
        for target in self.targets:
            if target.value is not None:
                continue
            shares = (keys >> np.uint64(64 - target.bits)) == target.prefix
            if target.count <= _COLLECT or target.bits == 64:
                target.kept.append(values[shares][:1] if target.bits == 64 else values[shares])
            else:
                digits = (keys[shares] >> np.uint64(48 - target.bits)) & np.uint64(0xFFFF)
                found = np.bincount(digits.astype(np.int64), minlength=1 << 16)
                target.histogram = found if target.histogram is None else target.histogram + found

    def merge(self, other: RadixSelect) -> None:
        """Take in what the same pass found over more values (the same targets, narrowed alike)."""
        if self.targets is None or other.targets is None:
            self.n += other.n
            self.first += other.first
            return
        for mine, theirs in zip(self.targets, other.targets):
            if mine.value is None:
                mine.kept.extend(theirs.kept)
                if theirs.histogram is not None:
                    mine.histogram = theirs.histogram if mine.histogram is None else mine.histogram + theirs.histogram

    def end_pass(self, ranks: Callable[[int], Sequence[int]]) -> bool:
        """After a pass: narrow each rank (`ranks(n)` after the first pass); whether another pass is needed."""
        if self.targets is None:
            self.targets = [self._narrowed(_Target(rank=int(rank)), self.first) for rank in ranks(self.n)]
        else:
            for target in self.targets:
                if target.value is not None:
                    continue
                if target.kept:
                    kept = np.concatenate(target.kept)
                    target.value = float(kept[0] if target.bits == 64 else np.partition(kept, target.rank)[target.rank])
                elif target.histogram is not None:
                    self._narrowed(target, target.histogram)
        return any(target.value is None for target in self.targets)

    @staticmethod
    def _narrowed(target: _Target, histogram: np.ndarray) -> _Target:
        cumulative = np.cumsum(histogram)
        digit = int(np.searchsorted(cumulative, target.rank, side="right"))
        target.rank -= int(cumulative[digit - 1]) if digit else 0
        target.prefix = (target.prefix << np.uint64(16)) | np.uint64(digit)
        target.bits, target.count, target.histogram = target.bits + 16, int(histogram[digit]), None
        return target

    @property
    def values(self) -> list[float]:
        assert self.targets is not None
        return [float(target.value) for target in self.targets]  # type: ignore[arg-type]
