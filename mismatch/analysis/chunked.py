"""A token table read in chunks of whole rollouts: every analysis in the memory of a chunk, not of the run.

Flow: tokens.parquet (or a table in memory) -> rollout-aligned chunks (results.chunks.ChunkSource:
numbered, re-iterable) -> `run_passes`: pass after pass, each chunk once for every `Analysis` that
wants it, through views they share (`Chunk`); each pass's chunks in PARTS_PER_PASS parts, the later
parts' states merged into the first's (`Analysis.merge`), so two processes share every pass -> each
analysis's `result()`. A `WholeRunJob` (a query over the whole run's files) runs beside the first pass.
The analyses themselves live beside this module: grouped_metrics, per_rollout, counts, and the
mergeable reductions they are made of (tails, radix_select, moments).

A rollout is never cut, so a sequence (a branch of a rollout) and a rollout lie in one chunk:
whatever is per sequence or per rollout is complete in its chunk. A table whose rollouts are not
each one contiguous stretch is read as one chunk (correct, just not bounded).
"""

from __future__ import annotations

import itertools
import pickle
from collections.abc import Callable, Iterable, Sequence
from functools import partial
from typing import Any, Protocol

import pandas as pd

from mismatch.analysis.pair_tokens import PairTokens, pair_tokens
from mismatch.analysis.tokenview import TokenView
from mismatch.results.chunks import ChunkSource
from mismatch.workers import fork_jobs

Chunks = Callable[[], Iterable[pd.DataFrame]]  # a fresh pass over the same chunks, each call


class Chunk:
    """One chunk of whole rollouts and what every analysis of it shares: its token views and pair
    tokens, made once per pass and dropped with it (`release`: the views' memos hold reference
    cycles that would otherwise keep each chunk alive until a full garbage collection)."""

    def __init__(self, table: pd.DataFrame, index: int) -> None:
        self.table, self.index = table, index
        self._views: dict[bool, TokenView] = {}
        self._memo: dict[Any, Any] = {}
        self._shared: dict[Any, Any] = {}  # what the views compute from the table alone (TokenView.shared)

    def view(self, trainable_only: bool = True) -> TokenView:
        if trainable_only not in self._views:
            self._views[trainable_only] = TokenView(self.table, trainable_only=trainable_only, shared=self._shared)
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
        self._shared.clear()


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


class WholeRunJob(Protocol):
    """Work over the whole run that reads no chunk (one query over the files, say): run once,
    in a process of its own beside the first pass, its state brought back."""

    def compute(self) -> None:
        ...


# A pass reads its chunks in this many parts, each later part on a copy of the analyses as the pass
# began, merged into the first after it. The parts, and so the order every sum is merged in, follow
# from the chunk count alone, never from how many processes read them: one process reading every
# part gives the numbers a process per part gives, bit for bit. A fixed part of the analysis, not a
# tuning: another count would merge the sums in another order (the last bits of summary.json).
PARTS_PER_PASS = 2


def run_passes(chunks: Chunks, analyses: Sequence[Analysis], *, workers: int = 1,
               side_jobs: Sequence[WholeRunJob] = ()) -> None:
    """Every analysis over the chunks: pass after pass, each chunk read once per pass for all of
    the analyses that want that pass, its views shared by them.

    A pass reads its chunks in PARTS_PER_PASS parts (a ChunkSource's; other chunks are one part):
    the first on the analyses themselves, each later one on their copy as the pass began, merged in
    after it. With `workers` > 1 each later part is read by a forked process (the chunks need not
    be picklable, the analyses' states come back pickled), and each of the `side_jobs` runs in one
    of its own during the first pass (else here, before it)."""
    waiting = list(side_jobs)
    index = 0
    while True:
        active = [analysis for analysis in analyses if analysis.wants(index)]
        if not active and not waiting:
            return
        _one_pass(chunks, active, index, waiting, workers)
        waiting = []
        index += 1


def _one_pass(chunks: Chunks, active: list[Analysis], index: int, side_jobs: list[WholeRunJob], workers: int) -> None:
    parts = _pass_parts(chunks)
    if workers > 1 and (len(parts) > 1 or side_jobs):
        jobs: list[Callable[[], Any]] = [partial(_read_part, chunks, active, index, part) for part in parts]
        found = fork_jobs([*jobs, *(partial(_run_side_job, job) for job in side_jobs)])
        copies, done = found[1:len(parts)], found[len(parts):]
    else:
        for job in side_jobs:
            job.compute()
        # The copies the later parts read, as a fork would hand them over: pickled, before the first part.
        copies = [pickle.loads(pickle.dumps(active)) for _ in parts[1:]]
        _read_part(chunks, active, index, parts[0])
        for part, copy in zip(parts[1:], copies):
            _read_part(chunks, copy, index, part)
        done = []
    for copy in copies:
        for analysis, other in zip(active, copy):
            analysis.merge(other, index)
    for job, state in zip(side_jobs, done):
        _adopt(job, state)


def _pass_parts(chunks: Chunks) -> list[tuple[int, int] | None]:
    """The chunk numbers of each part of a pass: a ChunkSource's in PARTS_PER_PASS (fewer when it
    has fewer chunks); None for a whole pass over chunks that cannot be read by number."""
    if not isinstance(chunks, ChunkSource):
        return [None]
    count = chunks.count()
    cuts = sorted({0, *(count * k // PARTS_PER_PASS for k in range(1, PARTS_PER_PASS)), count})
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


def _run_side_job(job: WholeRunJob) -> WholeRunJob:
    """The job, run (in a fork: sent back to the parent, which adopts its state)."""
    job.compute()
    return job


def _adopt(analysis: Any, state: Any) -> None:
    """`analysis` takes every attribute of `state`, its copy from another process."""
    if hasattr(state, "__dict__"):
        vars(analysis).update(vars(state))
    for cls in type(state).__mro__:
        for name in getattr(cls, "__slots__", ()):
            if hasattr(state, name):
                setattr(analysis, name, getattr(state, name))
