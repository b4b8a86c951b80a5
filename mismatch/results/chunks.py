"""A token table read back in chunks of whole rollouts: numbered, each read alone.

A rollout is never cut, so whatever is per sequence or per rollout is complete in its chunk. A
table whose rollouts are not each one contiguous stretch is read as one chunk (correct, just not
bounded). The results dir gives them from tokens.parquet (tokens.tokens_chunks) or from a table
in memory (`table_chunks`); the analyses (analysis/chunked.py) pass over them.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import pandas as pd

# Rows per chunk: every per-token array of a chunk stays near 2 MB, and a chunk with its views
# near 100 MB.
DEFAULT_CHUNK_ROWS = 1 << 18


@dataclass(frozen=True, slots=True)
class ChunkSource:
    """Chunks of whole rollouts by number: `count()` of them, `read(number)` one alone, so a
    process reads only its part of a pass. Called, a whole pass (it is a `Chunks`)."""

    count: Callable[[], int]
    read: Callable[[int], pd.DataFrame]
    # The chunks' column names without reading one (a Parquet file's footer), when known.
    columns: Callable[[], list[str]] | None = None

    def __call__(self) -> Iterator[pd.DataFrame]:
        return self.part(0, self.count())

    def part(self, start: int, stop: int) -> Iterator[pd.DataFrame]:
        return (self.read(number) for number in range(start, stop))


def key_codes(column: pd.Series) -> np.ndarray:
    """Per-row values that are equal exactly where the column's are (for finding rollouts, spans).

    Categoricals give their codes and numbers themselves, without a hashing pass; a NaN number
    differs even from itself, which only starts a new span.
    """
    import pandas as pd

    if isinstance(column.dtype, pd.CategoricalDtype):
        return column.cat.codes.to_numpy()
    values = column.to_numpy()
    if values.dtype.kind in "biuf":
        return values
    codes, _ = pd.factorize(values, use_na_sentinel=False)
    return codes


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


def table_chunks(table: pd.DataFrame, rows: int | None = None) -> ChunkSource:
    """The table's rollout-aligned chunks (re-iterable: each call starts a new pass)."""
    bounds = chunk_bounds(table, rows)
    return ChunkSource(count=lambda: len(bounds), read=lambda number: table.iloc[slice(*bounds[number])],
                       columns=lambda: [str(name) for name in table.columns])
