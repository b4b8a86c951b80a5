"""PAIR_METRICS of each pair per group of a breakdown (overall, per turn, per role...) over a
table's chunks: pass 0 sums each chunk's group totals (span_sums.GroupTotals), pass 1 gathers what
totals cannot give (the ratio quantiles' tails, the rescaled ESS of far-out groups). summary.json's
`pairs` and breakdowns, the clip summary and the turn metrics are its results.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from mismatch.analysis import terms
from mismatch.analysis.chunked import Chunk, Chunks, run_passes
from mismatch.analysis.groups import Grouping
from mismatch.analysis.metrics import PAIR_METRICS, RATIO_QUANTILES, totals_metrics
from mismatch.analysis.pair_tokens import PairTokens
from mismatch.analysis.span_sums import GroupTotals, pair_span_sums
from mismatch.analysis.tails import Tails

OVERALL = ""  # the breakdown name of the one group of all tokens


_MISSING = object()  # the key of a NaN key value (NaN is not equal to itself: no dict key)
_NO_KEYS = pd.DataFrame()  # a chunk's grouping by ids needs no key frame (GroupTotals.of reads none): one, not one a call


class _GroupIds:
    """Ids of one breakdown's key values, in order of first appearance; `order` sorts them like
    groupby(sort=True, dropna=False): by value (categories are sorted), missing last."""

    def __init__(self) -> None:
        self.ids: dict[Any, int] = {}
        self.values: list[Any] = []

    def of(self, keys: pd.Series) -> np.ndarray:
        """The id of each key value (new values get the next ids)."""
        codes, uniques = pd.factorize(keys, use_na_sentinel=False)
        return np.array([self._id(value) for value in uniques.tolist()], dtype=np.int64)[codes] \
            if len(uniques) else np.zeros(len(keys), dtype=np.int64)

    def _id(self, value: Any) -> int:
        key = _MISSING if pd.isna(value) else value
        if key not in self.ids:
            self.ids[key] = len(self.values)
            self.values.append(value)
        return self.ids[key]

    def taken_in(self, other: _GroupIds) -> np.ndarray:
        """This one's id of each of `other`'s values (new values get the next ids)."""
        return np.array([self._id(value) for value in other.values], dtype=np.int64)

    def order(self) -> np.ndarray:
        missing = [bool(pd.isna(value)) for value in self.values]
        return np.array(sorted(range(len(self.values)), key=lambda i: (missing[i], 0 if missing[i] else self.values[i])),
                        dtype=np.int64)


@dataclass(slots=True)
class _Breakdown:
    """One pair's totals per group of one breakdown, summed chunk by chunk, and what pass 1
    gathers for them: each group's ratio tails and, where its ESS needs them, far sums."""

    ids: _GroupIds
    totals: GroupTotals
    tails: Tails | None = None
    far: np.ndarray | None = None
    far_sums: tuple[np.ndarray, np.ndarray] | None = None


class GroupedPairMetrics:
    """PAIR_METRICS of each pair, overall and per `by` column, over a table's chunks (an Analysis).

    Groups are the view's (every key with a row in the view), as `metrics.metrics_by` gives them:
    a pair with no defined log-ratio in a group keeps the group's row, with zero counts.
    `clip` also counts the tokens outside [1 - low, 1 + high] (the `clip` summary). Pass 0 adds
    each chunk's totals per group (span_sums.GroupTotals: memory per group, never per span or
    token); pass 1 gathers the ratio quantiles' tails (and the far groups' ESS sums). Without
    `quantiles` the ratio_q* columns are left out, and so is pass 1 unless a group's ESS needs it.
    """

    def __init__(self, pairs: Sequence[tuple[str, str]], by: Sequence[str], *, trainable_only: bool,
                 overall: bool = True, clip: tuple[float, float] | None = None, quantiles: bool = True) -> None:
        self.pairs = [(f"logp_{a}", f"logp_{b}") for a, b in pairs]
        self.names = [f"{a}/{b}" for a, b in pairs]
        self.by, self.trainable_only, self.clip, self.quantiles = list(by), trainable_only, clip, quantiles
        self.breakdowns = [list(self.by) + ([OVERALL] if overall else []) for _ in pairs]
        # One set of ids per breakdown, shared by the pairs: a group of the view is every pair's.
        self.ids = {by: _GroupIds() for by in [*self.by, OVERALL]}
        self.ids[OVERALL].of(pd.Series([OVERALL]))  # the one group of all tokens: id 0
        self.found = [{by: _Breakdown(self.ids[by], GroupTotals.empty(0)) for by in names}
                      for names in self.breakdowns]

    def wants(self, index: int) -> bool:
        if index == 0:
            return True
        if index == 1:
            for found in self.found:
                for breakdown in found.values():
                    breakdown.totals = breakdown.totals.grown(len(breakdown.ids.values))
                    counts = breakdown.totals.values["n"].astype(np.int64)
                    breakdown.tails = Tails(counts if self.quantiles else np.zeros_like(counts),
                                            list(RATIO_QUANTILES.values()))
                    breakdown.far = breakdown.totals.far()
                    zeros = np.zeros(len(counts))
                    breakdown.far_sums = (zeros, zeros.copy())
            return self.quantiles or any(b.far.any() for found in self.found for b in found.values())
        return False

    def add(self, chunk: Chunk, index: int) -> None:
        view = chunk.view(self.trainable_only)
        if index == 0:
            for name in self.by:  # the view's groups, tokens of a pair or not
                ids = self.ids[name].of(view.series_at(name, view.spans.starts))
                # The ids of the view's own spans: what _span_ids finds for a pair on the whole view.
                chunk.memo(("span_ids", id(self), id(view), name), lambda ids=ids: ids)
        for number, (a, b) in enumerate(self.pairs):
            pair = chunk.pair(a, b, self.trainable_only)
            span_ids = {by: self._span_ids(chunk, pair, by) for by in self.breakdowns[number]}
            if index == 0:
                self._add_totals(number, pair, span_ids)
            else:
                self._add_tokens(number, pair, span_ids)

    def merge(self, other: GroupedPairMetrics, index: int) -> None:
        """Pass 0: the other's groups taken in, their totals merged; pass 1: their tails and far sums."""
        into = {by: self.ids[by].taken_in(other.ids[by]) for by in self.ids} if index == 0 else {}
        for found, theirs in zip(self.found, other.found):
            for by, breakdown in found.items():
                their = theirs[by]
                if index == 0:
                    breakdown.totals = breakdown.totals.grown(len(breakdown.ids.values))
                    breakdown.totals.merge(their.totals.grown(len(their.ids.values)), into[by])
                    continue
                if breakdown.tails is not None and their.tails is not None:
                    breakdown.tails.merge(their.tails)
                if breakdown.far_sums is not None and their.far_sums is not None:
                    breakdown.far_sums[0][:] += their.far_sums[0]
                    breakdown.far_sums[1][:] += their.far_sums[1]

    def _span_ids(self, chunk: Chunk, pair: PairTokens, by: str) -> np.ndarray:
        """The group of each of the pair's spans; pairs with every log-prob defined share the
        view's spans, so their ids are looked up once per chunk and pass."""
        spans = pair.view.spans
        if by == OVERALL:
            return np.zeros(spans.num_spans, dtype=np.int64)
        return chunk.memo(("span_ids", id(self), id(pair.view), by),
                          lambda: self.ids[by].of(pair.view.series_at(by, spans.starts)))

    def _add_totals(self, number: int, pair: PairTokens, span_ids: dict[str, np.ndarray]) -> None:
        spans = pair.view.spans
        data = pair_span_sums(pair, spans)
        if self.clip is not None:
            data.sums["outside_clip"] = spans.sum(terms.outside_clip(pair.ratio, *self.clip), dtype=np.int64)
        for by, ids in span_ids.items():
            into, local = np.unique(ids, return_inverse=True)
            totals = GroupTotals.of(data, Grouping(span_group=local.reshape(-1), num_groups=len(into),
                                                   keys=_NO_KEYS))
            breakdown = self.found[number][by]
            breakdown.totals = breakdown.totals.grown(len(breakdown.ids.values))
            breakdown.totals.merge(totals, into)

    def _add_tokens(self, number: int, pair: PairTokens, span_ids: dict[str, np.ndarray]) -> None:
        spans = pair.view.spans
        for by, ids in span_ids.items():
            breakdown = self.found[number][by]
            token_group = spans.spread(ids)
            if self.quantiles and breakdown.tails is not None:
                breakdown.tails.add(pair.ratio, token_group)
            if breakdown.far is not None and breakdown.far.any():
                _add_far(breakdown, pair.log_ratio, token_group)

    def result(self) -> dict[str, dict[str, pd.DataFrame]]:
        """{breakdown (OVERALL or a `by` column): {pair name: by keys + PAIR_METRICS (+ n_outside_clip)}}."""
        out: dict[str, dict[str, pd.DataFrame]] = {}
        for name, found in zip(self.names, self.found):
            for by, breakdown in found.items():
                order = breakdown.ids.order()
                totals = breakdown.totals.grown(len(breakdown.ids.values))
                ordered = GroupTotals({key: values[order] for key, values in totals.values.items()})
                far_sums = (None if breakdown.far_sums is None or breakdown.far is None or not breakdown.far.any()
                            else (breakdown.far_sums[0][order], breakdown.far_sums[1][order]))
                table = breakdown.tails.quantiles()[order] if self.quantiles and breakdown.tails is not None else None
                frame = totals_metrics(ordered, far_sums, table)
                if "outside_clip" in ordered.values:
                    frame["n_outside_clip"] = ordered.values["outside_clip"].astype(np.int64)
                if by != OVERALL:
                    keys = pd.DataFrame({by: pd.Series([breakdown.ids.values[i] for i in order], dtype=object)})
                    frame = pd.concat([keys, frame], axis=1)
                out.setdefault(by, {})[name] = frame
        return out


def _add_far(breakdown: _Breakdown, log_ratio: np.ndarray, token_group: np.ndarray) -> None:
    """The far groups' sums of w and w^2, w = exp(log_ratio - group max)."""
    assert breakdown.far is not None and breakdown.far_sums is not None
    lr_max = breakdown.totals.values["log_ratio_max"]
    picked = breakdown.far[token_group]
    group = token_group[picked]
    weight = np.exp(log_ratio[picked] - lr_max[group])
    size = len(breakdown.far)
    breakdown.far_sums[0][:] += np.bincount(group, weights=weight, minlength=size)
    breakdown.far_sums[1][:] += np.bincount(group, weights=np.square(weight), minlength=size)


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


def run_grouped_metrics(chunks: Chunks,
                        accumulators: Sequence[GroupedPairMetrics]) -> list[dict[str, dict[str, pd.DataFrame]]]:
    """Each GroupedPairMetrics' result over the chunks (read together, in the passes they want)."""
    run_passes(chunks, accumulators)
    return [accumulator.result() for accumulator in accumulators]
