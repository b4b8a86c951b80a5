"""The tokens an analysis reads: a token table's (trainable) rows as arrays, keyed and cut into spans once.

Flow: token table (or one chunk of it, analysis/chunked.Chunk) -> TokenView -> metrics / localize /
corrections. The analyses of a chunk share its views, so the rows are filtered, the spans found
and each pair's per-token terms computed once per chunk, not once per analysis.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import weakref
from typing import Any, TypeVar

import numpy as np
import pandas as pd

from mismatch.analysis.groups import Grouping, Spans, find_spans, group_spans
from mismatch.results.chunks import key_codes
from mismatch.errors import MismatchError

DEFAULT_SEQ = ("rollout", "branch")
# Keys that change only at turn, role or branch boundaries: cutting spans on them too keeps the spans
# long and lets every breakdown by them reuse the same per-span sums.
SPAN_KEYS = ("turn", "role", "branch_kind")

T = TypeVar("T")
_VIEWS = ("views",)  # the shared memo's key of the table's views


class TokenView:
    """Rows of a token table (the trainable ones by default) with their spans, sequences and rollouts.

    A sequence is a distinct `seq` tuple (one branch of one rollout); spans never cross a change
    of sequence, rollout or any SPAN_KEYS column the table has, nor a row the view leaves out, so
    every span is contiguous in the table too (`Spans.rows`). Selected column values are read
    lazily and kept, as is whatever the analyses `memo`ize on the view (per-pair sums, groupings).
    """

    def __init__(self, table: pd.DataFrame, *, trainable_only: bool = True,
                 seq: Sequence[str] = DEFAULT_SEQ, rollout: str = "rollout",
                 mask: np.ndarray | None = None, shared: dict[Any, Any] | None = None) -> None:
        needed = [*seq, rollout, *(["trainable"] if trainable_only and mask is None else [])]
        missing = [name for name in needed if name not in table.columns]
        if missing:
            raise MismatchError(f"token table has no column {missing[0]!r} "
                                f"(columns: {', '.join(map(str, table.columns))})")
        if mask is None and trainable_only:
            # Only trainable tokens enter the PPO loss, so only their ratio matters (contract).
            mask = table["trainable"].to_numpy(dtype=bool)
        self.table = table
        self.trainable_only = trainable_only
        self.seq_columns = tuple(seq)
        self.rollout_column = rollout
        self.mask = mask  # which rows of `table` the view holds, or None for every row
        self._columns: dict[str, np.ndarray] = {}
        self._memo: dict[Any, Any] = {}
        # What depends on the table alone (its columns, key codes), shared by every view of it: the
        # views of one chunk (every row, trainable, a pair's defined tokens) compute it once.
        self._shared: dict[Any, Any] = {} if shared is None else shared
        # Every view of the table by its rows, so a subset with the rows of a view already made is
        # that view (weak: a view lives as long as its chunk or its parent's memo holds it).
        self._shared.setdefault(_VIEWS, []).append(weakref.ref(self))
        self.base_keys = tuple(dict.fromkeys([*seq, rollout, *(c for c in SPAN_KEYS if c in table.columns)]))
        self.spans = self.spans_for(())
        self.num_tokens = self.spans.num_tokens
        self.span_seq, self.num_seqs = self._span_codes(self.seq_columns, self.spans)
        self.span_rollout, self.num_rollouts = self._span_codes((rollout,), self.spans)

    @classmethod
    def of(cls, table: pd.DataFrame | TokenView, *, trainable_only: bool = True) -> TokenView:
        """`table` itself when it is already a view with the same row selection, else a new view."""
        if isinstance(table, TokenView):
            if table.trainable_only != trainable_only:
                return cls(table.table, trainable_only=trainable_only, seq=table.seq_columns,
                           rollout=table.rollout_column, shared=table._shared)
            return table
        return cls(table, trainable_only=trainable_only)

    @property
    def columns(self) -> pd.Index:
        return self.table.columns

    def has(self, name: str) -> bool:
        return name in self.table.columns

    def table_column(self, name: str) -> np.ndarray:
        """The column's values on every row of the table (no copy where pandas can avoid one)."""
        if name not in self.table.columns:
            raise MismatchError(f"token table has no column {name!r} "
                                f"(columns: {', '.join(map(str, self.table.columns))})")
        return self.shared(("table_column", name), lambda: self.table[name].to_numpy())

    def column(self, name: str) -> np.ndarray:
        """The column's values on the view's rows (selected once)."""
        if name not in self._columns:
            values = self.table_column(name)
            self._columns[name] = values if self.mask is None else values[self.mask]
        return self._columns[name]

    def rows_of(self, positions: np.ndarray) -> np.ndarray:
        """Table rows of view positions (through the spans, without a row index of every token)."""
        if self.mask is None:
            return positions
        spans = self.spans
        span = np.searchsorted(spans.starts, positions, side="right") - 1
        return spans.rows[span] + (positions - spans.starts[span])

    def series_at(self, name: str, positions: np.ndarray) -> pd.Series:
        """The column's values (dtype kept: categoricals stay categorical) at view positions."""
        return self.table[name].iloc[self.rows_of(positions)].reset_index(drop=True)

    def scratch(self, index: int = 0) -> np.ndarray:
        """Float64 buffer `index` (0 or 1) of one value per token, reused by whoever needs one for
        the length of a call (fresh ~40 MB arrays cost more in page faults than the work in them)."""
        return self.memo(("scratch", index), lambda: np.empty(self.num_tokens))

    def release(self) -> None:
        """Drop what the view holds (its memo keeps pair tokens that point back at it: a cycle)."""
        self._memo.clear()
        self._columns.clear()
        self._shared.clear()

    def memo(self, key: Any, compute: Callable[[], T]) -> T:
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    def shared(self, key: Any, compute: Callable[[], T]) -> T:
        """`memo` for a value of the table alone, whatever the rows: kept for every view of the table."""
        if key not in self._shared:
            self._shared[key] = compute()
        return self._shared[key]

    def spans_for(self, by: Sequence[str]) -> Spans:
        """Spans cut on the base keys and on `by` (the base spans when `by` adds nothing)."""
        keys = tuple(dict.fromkeys([*self.base_keys, *by]))
        return self.memo(("spans", keys), lambda: find_spans([self._key(name) for name in keys], len(self.table),
                                                           self.mask))

    def grouping(self, by: Sequence[str]) -> tuple[Spans, Grouping]:
        """The spans for `by` and their groups, sorted by key."""
        spans = self.spans_for(by)
        return spans, self.memo(("grouping", tuple(by), id(spans)), lambda: group_spans(
            {name: self.series_at(name, spans.starts) for name in by}, spans))

    def subset(self, keep: np.ndarray) -> TokenView:
        """A view of the tokens where `keep` (aligned with this view) is True: a view of the table
        with these very rows when there is one (the pairs of log-prob columns defined on the same
        tokens share it, and a pair defined on exactly the trainable rows of the every-row view is
        on the trainable view: their spans, groupings and per-token terms are made once)."""
        mask = np.zeros(len(self.table), dtype=bool)
        mask[self.rows_of(np.flatnonzero(keep))] = True
        for ref in self._shared[_VIEWS]:
            view = ref()
            if view is not None and view.mask is not None and view.seq_columns == self.seq_columns \
                    and view.rollout_column == self.rollout_column and np.array_equal(view.mask, mask):
                return view
        view = TokenView(self.table, trainable_only=self.trainable_only, seq=self.seq_columns,
                         rollout=self.rollout_column, mask=mask, shared=self._shared)
        self.memo(("subsets",), list).append(view)  # kept alive with this view
        return view

    def _key(self, name: str) -> np.ndarray:
        """Per table row: values equal exactly where the key is (results.chunks.key_codes)."""
        return self.shared(("key", name), lambda: key_codes(self.table[name]))

    def _span_codes(self, names: Sequence[str], spans: Spans) -> tuple[np.ndarray, int]:
        """Compact codes (0..k-1) of the `names` tuple at each span, and k."""
        if spans.num_spans == 0:
            return np.zeros(0, dtype=np.int64), 0
        combined = np.zeros(spans.num_spans, dtype=np.int64)
        for name in names:
            # Each key's own compact codes, then mixed radix: one integer per tuple, sorted like it.
            codes, uniques = pd.factorize(self._key(name)[spans.rows], sort=True, use_na_sentinel=False)
            combined = combined * len(uniques) + codes
        unique, inverse = np.unique(combined, return_inverse=True)
        return inverse.reshape(-1).astype(np.int64), len(unique)
