"""A token table read in chunks of whole rollouts: every analysis in the memory of a chunk, not of the run.

Flow: tokens.parquet (or a table in memory) -> rollout-aligned chunks (`ChunkSource`: numbered,
re-iterable) -> `run_passes`: pass after pass, each chunk once for every `Analysis` that wants it,
through views they share (`Chunk`); each pass's chunks in two halves, the second half's states
merged into the first's (`Analysis.merge`), so two processes share every pass -> each analysis's
`result()`. `GroupedPairMetrics` adds each chunk's totals per group (metrics.GroupTotals); what
totals cannot give comes from a second pass: the ratio quantiles from each group's tails
(`Tails`), the rescaled ESS of far-out groups. Medians take an exact radix selection
(`RadixSelect`), spreads and correlations Chan-merged moments (`Moments`).

A rollout is never cut, so a sequence (a branch of a rollout) and a rollout lie in one chunk:
whatever is per sequence or per rollout is complete in its chunk. A table whose rollouts are not
each one contiguous stretch is read as one chunk (correct, just not bounded).
"""

from __future__ import annotations

import itertools
import pickle
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import numpy as np
import pandas as pd

from mismatch.analysis import terms
from mismatch.analysis.groups import (
    Grouping,
    _lerp,
    _ranks,
    key_codes,
)
from mismatch.analysis.metrics import (
    _QUANTILES,
    PAIR_METRICS,
    GroupTotals,
    PairTokens,
    grouped_view_metrics,
    pair_span_sums,
    pair_tokens,
    totals_metrics,
)
from mismatch.analysis.tokenview import TokenView
from mismatch.workers import fork_jobs

# Rows per chunk: every per-token array of a chunk stays near 2 MB, and a chunk with its views
# near 100 MB.
DEFAULT_CHUNK_ROWS = 1 << 18
OVERALL = ""  # the breakdown name of the one group of all tokens

Chunks = Callable[[], Iterable[pd.DataFrame]]  # a fresh pass over the same chunks, each call


@dataclass(frozen=True, slots=True)
class ChunkSource:
    """Chunks of whole rollouts by number: `count()` of them, `read(number)` one alone, so a
    process reads only its part of a pass. Called, a whole pass (it is a `Chunks`)."""

    count: Callable[[], int]
    read: Callable[[int], pd.DataFrame]

    def __call__(self) -> Iterator[pd.DataFrame]:
        return self.part(0, self.count())

    def part(self, start: int, stop: int) -> Iterator[pd.DataFrame]:
        return (self.read(number) for number in range(start, stop))


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
    return ChunkSource(count=lambda: len(bounds), read=lambda number: table.iloc[slice(*bounds[number])])


class Chunk:
    """One chunk of whole rollouts and what every analysis of it shares: its token views and pair
    tokens, made once per pass and dropped with it (`release`: the views' memos hold reference
    cycles that would otherwise keep each chunk alive until a full garbage collection)."""

    def __init__(self, table: pd.DataFrame, index: int) -> None:
        self.table, self.index = table, index
        self._views: dict[bool, TokenView] = {}
        self._memo: dict[Any, Any] = {}

    def view(self, trainable_only: bool = True) -> TokenView:
        if trainable_only not in self._views:
            self._views[trainable_only] = TokenView(self.table, trainable_only=trainable_only)
        return self._views[trainable_only]

    def pair(self, a: str, b: str, trainable_only: bool = True) -> PairTokens:
        """Columns `a` against `b` (log_ratio = a - b) on the view."""
        return pair_tokens(self.view(trainable_only), a, b)

    def memo(self, key: Any, compute: Callable[[], Any]) -> Any:
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    def release(self) -> None:
        for view in self._views.values():
            view.release()
        self._views.clear()
        self._memo.clear()


class Analysis(Protocol):
    """Something computed over a table's chunks in one or more passes (run_passes)."""

    def wants(self, index: int) -> bool:
        """Whether it reads pass `index` (asked before the pass, after the one before it)."""
        ...

    def add(self, chunk: Chunk, index: int) -> None:
        ...

    def merge(self, other: Any, index: int) -> None:
        """Take in `other`: a copy of this analysis as it was before pass `index`, given the
        chunks of that pass that come after this one's (what pass `index` found, merged as if
        one analysis had read them all in order)."""
        ...


class Beside(Protocol):
    """Work over the whole run that reads no chunk (one query over the files, say): run once,
    in a process of its own beside the first pass, its state brought back."""

    def run(self) -> None:
        ...


# Each pass's chunks are read in two halves, the second on a copy of the analyses, merged into the
# first: with one process or two, the numbers are the same, bit for bit.
HALVES = 2


def run_passes(chunks: Chunks, analyses: Sequence[Analysis], *, workers: int = 1,
               beside: Sequence[Beside] = ()) -> None:
    """Every analysis over the chunks: pass after pass, each chunk read once per pass for all of
    the analyses that want that pass, its views shared by them.

    A pass reads its chunks in HALVES (a ChunkSource's; other chunks are one part): the first on
    the analyses themselves, the second on their copy as the pass began, merged in after it.
    With `workers` > 1 the second half is read by a forked process (the chunks need not be
    picklable, the analyses' states come back pickled), and each `beside` runs in one of its own
    during the first pass (else here, before it)."""
    waiting = list(beside)
    index = 0
    while True:
        active = [analysis for analysis in analyses if analysis.wants(index)]
        if not active and not waiting:
            return
        _one_pass(chunks, active, index, waiting, workers)
        waiting = []
        index += 1


def _one_pass(chunks: Chunks, active: list[Analysis], index: int, beside: list[Beside], workers: int) -> None:
    parts = _halves(chunks)
    if workers > 1 and (len(parts) > 1 or beside):
        jobs: list[Callable[[], Any]] = [partial(_read_part, chunks, active, index, part) for part in parts]
        found = fork_jobs([*jobs, *(partial(_ran, job) for job in beside)])
        copies, done = found[1:len(parts)], found[len(parts):]
    else:
        for job in beside:
            job.run()
        # The copies the second half reads, as a fork would hand them over: pickled, before the first half.
        copies = [pickle.loads(pickle.dumps(active)) for _ in parts[1:]]
        _read_part(chunks, active, index, parts[0])
        for part, copy in zip(parts[1:], copies):
            _read_part(chunks, copy, index, part)
        done = []
    for copy in copies:
        for analysis, other in zip(active, copy):
            analysis.merge(other, index)
    for job, state in zip(beside, done):
        _adopt(job, state)


def _halves(chunks: Chunks) -> list[tuple[int, int] | None]:
    """The chunk numbers of each part of a pass: a ChunkSource's in HALVES (fewer when it has fewer
    chunks); None for a whole pass over chunks that cannot be read by number."""
    if not isinstance(chunks, ChunkSource):
        return [None]
    count = chunks.count()
    cuts = sorted({0, *(count * k // HALVES for k in range(1, HALVES)), count})
    return list(itertools.pairwise(cuts)) if count > 1 else [(0, count)]


def _read_part(chunks: Chunks, analyses: list[Analysis], index: int, part: tuple[int, int] | None) -> list[Analysis]:
    start, tables = (0, chunks()) if part is None else (part[0], chunks.part(*part))  # type: ignore[attr-defined]
    for number, table in enumerate(tables, start=start):
        chunk = Chunk(table, number)
        try:
            for analysis in analyses:
                analysis.add(chunk, index)
        finally:
            chunk.release()
    return analyses


def _ran(job: Beside) -> Beside:
    job.run()
    return job


def _adopt(analysis: Any, state: Any) -> None:
    """`analysis` takes every attribute of `state`, its copy from another process."""
    if hasattr(state, "__dict__"):
        vars(analysis).update(vars(state))
    for cls in type(state).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if hasattr(state, name):
                setattr(analysis, name, getattr(state, name))


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
                lo, hi, _ = _ranks(n, self.qs)
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
            lo, hi, virtual = _ranks(n, self.qs)
            first_high = n - len(high)
            ordered = {rank: (low[rank] if rank < len(low) else high[rank - first_high])
                       for rank in np.unique(np.concatenate([lo, hi])).tolist()}
            out[group] = _lerp(ordered, lo, hi, virtual)
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


_MISSING = object()  # the key of a NaN key value (NaN is not equal to itself: no dict key)


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
    each chunk's totals per group (metrics.GroupTotals: memory per group, never per span or
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
                    breakdown.tails = Tails(counts if self.quantiles else np.zeros_like(counts), list(_QUANTILES.values()))
                    breakdown.far = breakdown.totals.far()
                    zeros = np.zeros(len(counts))
                    breakdown.far_sums = (zeros, zeros.copy())
            return self.quantiles or any(b.far.any() for found in self.found for b in found.values())
        return False

    def add(self, chunk: Chunk, index: int) -> None:
        view = chunk.view(self.trainable_only)
        if index == 0:
            for name in self.by:  # the view's groups, tokens of a pair or not
                self.ids[name].of(view.series_at(name, view.spans.starts))
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
                                                   keys=pd.DataFrame()))
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


class PerRollout:
    """rollouts.parquet: `pair`, `rollout`, PAIR_METRICS per pair and rollout, chunk by chunk (a
    rollout lies in one chunk, so each one's metrics, quantiles included, are its chunk's)."""

    def __init__(self, pairs: Sequence[tuple[str, str]]) -> None:
        self.pairs = list(pairs)
        self.frames: list[pd.DataFrame] = []

    def wants(self, index: int) -> bool:
        return index == 0

    def add(self, chunk: Chunk, index: int) -> None:
        for a, b in self.pairs:
            frame = grouped_view_metrics(chunk.view(), f"logp_{a}", f"logp_{b}", ["rollout"])
            frame.insert(0, "pair", f"{a}/{b}")
            self.frames.append(frame)

    def merge(self, other: PerRollout, index: int) -> None:
        self.frames.extend(other.frames)

    def result(self) -> pd.DataFrame:
        if not self.frames:
            return pd.DataFrame(columns=["pair", "rollout", *PAIR_METRICS])
        out = pd.concat(self.frames, ignore_index=True)
        # metrics_by's order: pair by pair, rollouts sorted by key.
        pair_order = {f"{a}/{b}": index for index, (a, b) in enumerate(self.pairs)}
        rollout_codes, _ = pd.factorize(out["rollout"].astype(str), sort=True, use_na_sentinel=False)
        order = np.lexsort((rollout_codes, out["pair"].map(pair_order).to_numpy()))
        return out.iloc[order].reset_index(drop=True)


def per_rollout_metrics(chunks: Chunks, pairs: Sequence[tuple[str, str]]) -> pd.DataFrame:
    """PerRollout of a table's chunks."""
    found = PerRollout(pairs)
    run_passes(chunks, [found])
    return found.result()


class Counts:
    """summary.json `counts` of rows: rollouts, branches, tokens, trainable tokens."""

    def __init__(self) -> None:
        self.counts = {"rollouts": 0, "branches": 0, "tokens": 0, "trainable_tokens": 0}

    def wants(self, index: int) -> bool:
        return index == 0

    def add(self, chunk: Chunk, index: int) -> None:
        every_row = chunk.view(trainable_only=False)  # its sequences are the (rollout, branch) pairs
        self.counts["rollouts"] += every_row.num_rollouts
        self.counts["branches"] += every_row.num_seqs
        self.counts["tokens"] += len(chunk.table)
        self.counts["trainable_tokens"] += chunk.view().num_tokens

    def merge(self, other: Counts, index: int) -> None:
        for name, count in other.counts.items():
            self.counts[name] += count


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


def run(chunks: Chunks, accumulators: Sequence[GroupedPairMetrics]) -> list[dict[str, dict[str, pd.DataFrame]]]:
    """The accumulators' results over the chunks."""
    run_passes(chunks, accumulators)
    return [accumulator.result() for accumulator in accumulators]


# Values a pass of the radix selection below keeps in memory at most before it collects them.
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
