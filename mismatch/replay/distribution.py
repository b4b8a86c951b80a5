"""The distribution pass (--distribution K): beside each pair's sampled-token log-probs, its two
sides' whole next-token distributions compared at every scored position, block by block.

After the replay, the pair's two engines are loaded together and fed each block's requests: a
torch engine gives the final hidden states of a request and its log-softmax over the vocabulary a
chunk of rows at a time (never [T, vocab] past a chunk), vLLM its top-K per position
(prompt_logprobs=K). `engines/distributions.compare_rows` turns each chunk into the per-position
terms, saved per block like a log-prob column (`dist-A-B`), filled into tokens.parquet as
`dist_A_B_<term>`. Resumable like the replay: a saved block is not computed again.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd

from mismatch.engines import EngineSpec, engine_capabilities, load_engine, probe_top_logprobs
from mismatch.engines.contract import capabilities_of
from mismatch.engines.distributions import TERMS, FullRows, TopRows, compare_rows
from mismatch.errors import SpecError
from mismatch.replay.plan import ReplayPlan
from mismatch.streams import StreamRouting

# Elements of one side's [rows, vocab] fp32 log-softmax per comparison: 2^21 (8 MiB); the
# comparison makes a few more of that size (benchmarks/distribution_cost.py measures the peak).
# 2,048 rows of a 1,024-token vocabulary, 13 of a 151,936-token one.
CHUNK_ELEMENTS = 1 << 21


@dataclass(kw_only=True, slots=True, frozen=True)
class DistributionAsk:
    """What --distribution asked: `k`, the top-K size (overlap, tails; vLLM's prompt_logprobs);
    `full`: every side must give its whole distribution (torch engines), so every number is exact;
    `pairs`: the (A, B) sources compared; `chunk`: positions per comparison (0: by CHUNK_ELEMENTS)."""

    k: int
    full: bool = False
    pairs: tuple[tuple[str, str], ...] = ()
    chunk: int = 0

    @property
    def label(self) -> str:
        return "full" if self.full else str(self.k)


FULL_K = 20  # the top-K set of --distribution full (its overlap and tails): the KL and TV are whole-vocabulary


def parse_distribution(text: str) -> tuple[int, bool]:
    """`--distribution K` (a top-K size ≥ 1) or `full`, as (k, full)."""
    if text.strip().lower() == "full":
        return FULL_K, True
    try:
        k = int(text)
    except ValueError:
        raise SpecError(f"--distribution {text!r}: expected a top-K size (an integer ≥ 1) or 'full'") from None
    if k < 1:
        raise SpecError(f"--distribution {text!r}: the top-K size must be at least 1")
    return k, False


def column_name(a: str, b: str, ask: DistributionAsk) -> str:
    """The saved block column of the pair's terms (work dir), named by K too: a rerun asking
    another K computes its own."""
    return f"dist-{a}-{b}-{ask.label}"


def table_columns(a: str, b: str) -> list[str]:
    """tokens.parquet's columns of the pair's terms, in TERMS order."""
    return [f"dist_{a}_{b}_{term}" for term in TERMS]


def check_distribution(ask: DistributionAsk, specs: dict[str, EngineSpec]) -> None:
    """Before any replay: each side of each pair is an engine that can give its distribution (its
    whole one under `full`); a server is asked once for its top-K (`probe_top_logprobs`)."""
    for pair in ask.pairs:
        for source in pair:
            spec = specs[source]
            capabilities = engine_capabilities(spec)
            if capabilities.full_distribution:
                continue
            if capabilities.top_logprobs and not ask.full:
                probe_top_logprobs(spec, ask.k)
                continue
            if capabilities.top_logprobs:
                raise SpecError(f"--distribution full: --{source} {spec.text} gives only its top-K "
                                "(prompt_logprobs), not its whole distribution; pass --distribution K "
                                "(bounded, not exact) or a torch engine (hf, hf-decode)")
            raise SpecError(f"--distribution: --{source} {spec.text} cannot give its next-token distribution "
                            "(engines that can: hf, hf-decode (whole), vllm and http servers (top-K))")


def distribution_damage(values: np.ndarray, table: pd.DataFrame) -> str | None:
    """What makes a saved block of terms unfit for these rows, or None."""
    if values.shape != (len(table), len(TERMS)):
        return f"{values.shape} terms for the block's {len(table)} rows of {len(TERMS)}"
    return None


class DistributionPass:
    """One pair's terms over every block: both engines loaded once, together."""

    def __init__(self, a: str, b: str, *, specs: dict[str, EngineSpec], checkpoint: str, ask: DistributionAsk,
                 vocab_size: int, forced: dict[str, list[StreamRouting]] | None = None) -> None:
        self.sources = (a, b)
        # routing=replay: a side's forced experts (one per request, plan order), as its replay followed them.
        self.forced = forced or {}
        self.specs, self.checkpoint, self.ask, self.vocab_size = specs, checkpoint, ask, vocab_size
        self.engines: list[Any] = []
        self.seconds = 0.0
        self.num_positions = 0

    def block_terms(self, plan: ReplayPlan, first_request: int = 0) -> np.ndarray:
        """The block's terms, one row per table row (NaN where a position predicts nothing);
        `first_request`: the block's first request in the run's plan (its forced experts).

        Positions are compared in chunks of `chunk_rows` that may span requests (a small vocabulary
        makes many rows cheap): a torch side's hidden states [rows, D] wait in `pending` until a
        chunk is full, so at most one chunk's [rows, vocab] per side exists at a time."""
        if not self.engines:
            self.engines = [load_engine(self.specs[source], self.checkpoint) for source in self.sources]
        started = time.perf_counter()
        terms = np.full((plan.num_scored, len(TERMS)), np.nan)
        tops = [engine.top_rows(plan.requests, self.ask.k) if not _full(engine) else None
                for engine in self.engines]
        pending: list[tuple[int, list[Any], np.ndarray]] = []  # (first table row, each side's rows, targets)
        offset = 0
        for index, request in enumerate(plan.requests):
            first = max(request.score_from, 1)
            row = offset + (first - request.score_from)  # score_from 0: position 0's row stays NaN
            offset += request.num_scored
            if len(request.tokens) <= first:
                continue
            sides = [engine.scored_hidden(request, self._forced(source, first_request + index))
                     if _full(engine) else top[index]
                     for source, engine, top in zip(self.sources, self.engines, tops)]
            pending.append((row, sides, request.tokens[first:]))
            self.num_positions += len(request.tokens) - first
            if sum(len(targets) for _, _, targets in pending) >= self.chunk_rows:
                self._compare(pending, terms)
                pending = []
        if pending:
            self._compare(pending, terms)
        self.seconds += time.perf_counter() - started
        return terms

    def _forced(self, source: str, request: int) -> np.ndarray | None:
        forced = self.forced.get(source)
        return forced[request].experts if forced is not None else None

    @property
    def chunk_rows(self) -> int:
        """Positions per comparison: `ask.chunk`, else as many as CHUNK_ELEMENTS of [rows, vocab] hold."""
        return self.ask.chunk or max(1, CHUNK_ELEMENTS // self.vocab_size)

    def _compare(self, pending: list[tuple[int, list[Any], np.ndarray]], terms: np.ndarray) -> None:
        """The pending requests' positions compared, chunk by chunk, into their rows of `terms`."""
        import torch

        rows = np.concatenate([np.arange(row, row + len(targets)) for row, _, targets in pending])
        targets = np.concatenate([targets for _, _, targets in pending])
        joined = [torch.cat([sides[k] for _, sides, _ in pending]) if _full(engine)
                  else _joined([sides[k] for _, sides, _ in pending])
                  for k, engine in enumerate(self.engines)]
        step = self.chunk_rows
        for start in range(0, len(targets), step):
            stop = min(start + step, len(targets))
            views = [engine.full_rows(side[start:stop]) if _full(engine) else _slice(side, start, stop)
                     for engine, side in zip(self.engines, joined)]
            terms[rows[start:stop]] = compare_rows(views[0], views[1], targets[start:stop], self.ask.k,
                                                   _vocab(views, self.vocab_size))

    def described(self) -> dict[str, Any]:
        """summary.json's account of the pass: each side's kind of view, its time."""
        views = {source: ("full" if engine_capabilities(self.specs[source]).full_distribution else "top_k")
                 for source in self.sources}
        return {"k": self.ask.k, "full": self.ask.full, "views": views, "seconds": self.seconds,
                "num_positions": self.num_positions, "chunk_rows": self.chunk_rows}

    def run(self, blocks: Any, columns: Any) -> dict[str, Any]:
        """Every block's terms into `columns` (a SavedColumns), resumed where saved; the pass's account."""
        name = column_name(*self.sources, self.ask)
        resumed = first_request = 0
        try:
            for block, plan in blocks:
                first, first_request = first_request, first_request + len(plan.requests)
                saved = columns.work.load(name, block) if columns.work is not None else None
                if saved is not None and distribution_damage(saved, plan.table) is None:
                    resumed += 1
                    continue
                columns.keep(name, block, self.block_terms(plan, first), {"seconds": 0.0})
        finally:
            self.close()
        return {**self.described(), "resumed_blocks": resumed}

    def close(self) -> None:
        for engine in self.engines:
            engine.close()
        self.engines = []


def _full(engine: Any) -> bool:
    return capabilities_of(engine).full_distribution


def _slice(top: TopRows, start: int, stop: int) -> TopRows:
    return TopRows(ids_CK=top.ids_CK[start:stop], logp_CK=top.logp_CK[start:stop],
                   sampled_logp_C=top.sampled_logp_C[start:stop], sampled_rank_C=top.sampled_rank_C[start:stop],
                   k=top.k)


def _joined(tops: list[TopRows]) -> TopRows:
    return TopRows(ids_CK=np.concatenate([t.ids_CK for t in tops]), logp_CK=np.concatenate([t.logp_CK for t in tops]),
                   sampled_logp_C=np.concatenate([t.sampled_logp_C for t in tops]),
                   sampled_rank_C=np.concatenate([t.sampled_rank_C for t in tops]), k=tops[0].k)


def _vocab(sides: list[FullRows | TopRows], vocab_size: int) -> int:
    """The width both sides are compared over: a full side's (lm_head may pad the vocabulary), else
    the checkpoint's vocabulary."""
    widths = {side.logp_CV.shape[1] for side in sides if isinstance(side, FullRows)}
    if len(widths) > 1:
        raise SpecError(f"--distribution: the two sides' vocabularies differ ({sorted(widths)} tokens)")
    return widths.pop() if widths else vocab_size
