"""A pair of log-prob columns on a token view: the tokens where both are defined, and their
log-ratio and ratio, made once per view. Every pair metric, sum and correction starts here.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property

import numpy as np

from mismatch.analysis import terms
from mismatch.analysis.tokenview import TokenView


class PairTokens:
    """The tokens of a view where both log-probs are defined; their log-ratio and ratio on demand.

    Each per-token array (the selected log-probs, log-ratio, ratio) is made only when a metric
    asks for it, which spares several ~40 MB arrays per pair when none does.
    """

    def __init__(self, view: TokenView, columns: tuple[str, str], keep: np.ndarray | None,
                 table_a: np.ndarray, table_b: np.ndarray, same: PairTokens | None = None) -> None:
        self.view = view          # exactly those tokens
        self.columns = columns    # the two log-prob columns, A then B
        self.keep = keep          # which of the parent view's tokens they are (None: all of them)
        self.table_a = table_a    # float64 over every table row (float32 is upcast first)
        self.table_b = table_b
        # The same columns' pair on `view` itself (keep None), when this one was cut from a parent
        # view: the same tokens, so it holds the per-token arrays of both (`terms_of`).
        self.same = same

    @property
    def terms_of(self) -> PairTokens:
        """The pair whose per-token arrays these are (itself, or `same`)."""
        return self if self.same is None else self.same

    @cached_property
    def logp_a(self) -> np.ndarray:
        if self.same is not None:
            return self.same.logp_a
        return _view_column(self.view, self.columns[0], self.table_a)

    @cached_property
    def logp_b(self) -> np.ndarray:
        if self.same is not None:
            return self.same.logp_b
        return _view_column(self.view, self.columns[1], self.table_b)

    @cached_property
    def log_ratio(self) -> np.ndarray:
        return self.same.log_ratio if self.same is not None else self.logp_a - self.logp_b

    @cached_property
    def ratio(self) -> np.ndarray:
        return self.same.ratio if self.same is not None else terms.ratio(self.log_ratio)

    # Terms several analyses of a chunk read (the span sums, strata, trees, the frameworks' metrics): made
    # once per pair and view, the same bits as each computing its own.
    @cached_property
    def k3(self) -> np.ndarray:
        return self.same.k3 if self.same is not None else terms.k3(self.log_ratio)

    @cached_property
    def abs_log_ratio(self) -> np.ndarray:
        return self.same.abs_log_ratio if self.same is not None else np.abs(self.log_ratio)

    @cached_property
    def prob_abs_diff(self) -> np.ndarray:
        return self.same.prob_abs_diff if self.same is not None else terms.prob_gap(self.prob_a, self.prob_b)

    # Each side's probabilities, kept on the view by column: the pairs of a chunk share their
    # columns (train/sampler, train/infer and infer/sampler exp three columns, not six), and so do
    # strata's probability buckets and the frameworks' probabilities. exp is most of these terms' cost.
    @property
    def prob_a(self) -> np.ndarray:
        return self.view.memo(("prob", self.columns[0]), lambda: terms.prob(self.terms_of.logp_a))

    @property
    def prob_b(self) -> np.ndarray:
        return self.view.memo(("prob", self.columns[1]), lambda: terms.prob(self.terms_of.logp_b))

    def ratio_into(self, buffer: np.ndarray) -> np.ndarray:
        """`ratio`, the kept array if there is one, else computed into `buffer` (same bits)."""
        if "ratio" in self.__dict__ or "ratio" in self.terms_of.__dict__:
            return self.ratio
        out = buffer[:self.view.num_tokens]
        np.subtract(self.logp_a, self.logp_b, out=out)
        return terms.ratio(out, out=out)


def pair_tokens(view: TokenView, a: str, b: str) -> PairTokens:
    """Columns `a` against `b` on the view (log_ratio = a - b), computed once per view."""
    return pairs_tokens(view, [(a, b)])[0]


def pairs_tokens(view: TokenView, pairs: Sequence[tuple[str, str]]) -> list[PairTokens]:
    """`pair_tokens` of each (a, b)."""
    return [view.memo(("pair", a, b), lambda a=a, b=b: _make_pair(view, a, b)) for a, b in pairs]


def _make_pair(view: TokenView, a: str, b: str) -> PairTokens:
    """The pair's tokens: those of the view where log_ratio = a - b is defined."""
    table_a, table_b = _float64_column(view, a), _float64_column(view, b)
    # Undefined: a missing log-prob (NaN), or both engines at -inf (probability 0 twice). Found on
    # the table's rows once for every view of the chunk (the trainable one and every row's).
    undefined = view.shared(("undefined", a, b), lambda: _undefined(table_a, table_b))
    if view.mask is not None:
        undefined = undefined & view.mask
    if not undefined.any():  # the common case: no copy, no new view
        return PairTokens(view, (a, b), None, table_a, table_b)
    # Tokens without a defined log-ratio are dropped before anything else. On the subset view the
    # pair is defined everywhere: its pair there (keep None) is this one's tokens, made once for both.
    keep = ~(undefined if view.mask is None else undefined[view.mask])
    subset = view.subset(keep)
    return PairTokens(subset, (a, b), keep, table_a, table_b, same=pair_tokens(subset, a, b))


def _undefined(table_a: np.ndarray, table_b: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore"):
        return np.isnan(table_a - table_b)


def _view_column(view: TokenView, name: str, table_values: np.ndarray) -> np.ndarray:
    """A log-prob column (float64) on the view's rows, selected once per view: the pairs of a chunk
    share their columns (train/sampler and train/infer select the train column once)."""
    if view.mask is None:
        return table_values
    return view.memo(("float64 rows", name), lambda: table_values[view.mask])


def _float64_column(view: TokenView, name: str) -> np.ndarray:
    """The table column as float64, upcast once per view (a column two pairs share is one copy)."""
    return view.shared(("float64", name), lambda: view.table_column(name).astype(np.float64, copy=False))
