"""A replay's results, block by block: the columns each engine pass saved, and the blocks of the
file read back and filled from them (what the audit stores, analyzes and localizes).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import pandas as pd

from mismatch.engines import EngineSpec, engine_capabilities
from mismatch.errors import ResultsError
from mismatch.replay.blocks import (
    Block,
    FileBlocks,
    FoundBlock,
    declared_checkpoints,
    extra_names,
    sampler_meta,
    sampler_metas,
)
from mismatch.replay.checks import ENTROPY_SUFFIX, check_stored_names, column_damage, entropy_damage
from mismatch.engines.distributions import TERMS
from mismatch.replay.distribution import DistributionAsk, column_name, distribution_damage, table_columns
from mismatch.replay.plan import ReplayPlan
from mismatch.results import WorkDir, concat_tables
from mismatch.rollouts import Rollout
from mismatch.rollouts.forked import forked_blocks
from mismatch.rollouts.pinned import pinned_pass
from mismatch.rollouts.trees import add_tree_weights
from mismatch.streams import StreamRouting

T = TypeVar("T")


Counts = dict[str, float]  # an engine's counters of the work one (column, block) took (passes.engine_counts)


class SavedColumns:
    """Each (column, block) an engine pass finished: in the work dir, saved as it finishes and
    reused by a rerun, or without one in this process's memory. A column is checked as the engine's
    answers are (checks.column_damage) whenever it is read back, resumed or published."""

    def __init__(self, work: WorkDir | None) -> None:
        self.work = work
        self._memory: dict[tuple[str, int], np.ndarray] = {}

    def resumed(self, name: str, block: int, table: pd.DataFrame) -> tuple[np.ndarray, Counts] | None:
        """What an earlier run saved of this column and block for these rows, with its engine
        counters (None without a work dir, or where either is missing: replayed again)."""
        if self.work is None:
            return None
        values, counts = self.work.load(name, block), self.work.load_counts(name, block)
        if values is None or counts is None:
            return None
        damage = column_damage(values, table)
        if damage is None:
            return values, counts
        if not self.work.force:
            raise self._damaged(name, block, damage)
        self.work.discard(name, block)  # the user said so: replayed, and the other blocks trusted
        return None

    def keep(self, name: str, block: int, values: np.ndarray, counts: Counts) -> None:
        """A column just replayed (and checked), kept for `load` (and, in the work dir, with its
        engine counters, for a rerun)."""
        if self.work is not None:
            self.work.save(name, block, values, counts)
        else:
            self._memory[(name, block)] = values

    def load(self, name: str, block: int, table: pd.DataFrame,
             damage_of: Callable[[np.ndarray, pd.DataFrame], str | None] = column_damage) -> np.ndarray | None:
        """The column of the block's rows, to publish. One read back from the work dir is checked
        again (in memory it is the checked replay itself; `damage_of`: a log-prob column's check, or
        an entropy column's); a damaged one is refused even with --force: its engine is closed by
        now, and the rerun replays it."""
        if self.work is None:
            return self._memory.get((name, block))
        values = self.work.load(name, block)
        damage = damage_of(values, table) if values is not None else None
        if damage is not None:
            raise self._damaged(name, block, damage)
        return values

    def _damaged(self, name: str, block: int, damage: str) -> ResultsError:
        """Every column was checked before it was saved, so a damaged one was changed by something
        outside this tool, which may as well have left wrong values that look right: the user
        decides (--force replays it), not a silent replay that would vouch for the rest."""
        assert self.work is not None
        return ResultsError(f"{self.work.block_file(name, block)}: damaged: {damage}: not what the engine returned "
                            "(the work dir changed after the block was saved); nothing published; pass --force "
                            "to replay it")


class FilledBlocks:
    """The replayed blocks read back: each block of the file planned again, with its tree weights
    and every source's column (saved by its engine pass, or stored in the rollouts). A stored-only
    replay reads the file only here, once: its stored names are checked, and the sampler's
    settings learnt, at the end of that pass (`finish`)."""

    def __init__(self, *, file: FileBlocks, specs: dict[str, EngineSpec], columns: SavedColumns,
                 engines: dict[str, Any], stored_only: bool,
                 distribution: DistributionAsk | None = None) -> None:
        self.file, self.specs, self.columns = file, specs, columns
        self.distribution = distribution
        self.engines = engines  # the Replayed's: the sampler's settings are filled in by `finish`
        self.stored_only = stored_only
        self.checkpoints: list[Any] = []  # each selected rollout's meta.checkpoint: by the scan, else `finish`

    @property
    def forkable(self) -> bool:
        """Forked readers decode JSON Lines only, and replay no engine (an engine stays in this
        process); like this process, they read only the whole lines within the pinned size. They
        number every line, so a file read with --skip-invalid is read here, in one process."""
        return (self.stored_only and Path(self.file.rollouts).suffix.lower() != ".parquet"
                and not self.file.skip_invalid)

    def filled(self, block: int, indices: list[int], selected: list[Rollout]) -> Block:
        """The block planned, with its tree weights and every source's column."""
        plan = self.file.plan(indices, selected)
        # Tree weights are per rollout, so shards compute exactly the weights one run would.
        table = add_tree_weights(plan.table, selected, inplace=True, planned=True)
        for source, spec in self.specs.items():
            if spec.kind == "stored":
                # A name no segment of this block carries is NaN on its rows.
                table[f"logp_{source}"] = plan.stored.get(spec.options["name"], np.full(plan.num_scored, np.nan))
                continue
            for column in (source, f"{source}_processed"):
                values = self.columns.load(column, block, table)
                if values is not None or (column == source and not selected):
                    table[f"logp_{column}"] = values if values is not None else np.empty(0)
            if engine_capabilities(spec).records_entropy:  # every block has the column: NaN where unsaved
                values = self.columns.load(source + ENTROPY_SUFFIX, block, table, entropy_damage)
                table[f"entropy_{source}"] = values if values is not None else np.full(len(table), np.nan)
        for a, b in self.distribution.pairs if self.distribution is not None else ():
            terms = self.columns.load(column_name(a, b, self.distribution), block, table, distribution_damage)
            if terms is None:
                terms = np.full((len(table), len(TERMS)), np.nan)
            for name, values in zip(table_columns(a, b), terms.T):
                table[name] = values
        return Block(index=block, rollouts=selected, plan=plan)

    def blocks(self) -> Iterator[Block]:
        """One pass over the file: each block the shard takes, filled."""
        names: set[str] = {"sampler"}
        metas: list[dict[str, Any]] = []
        checkpoints: list[Any] = []

        def seen(rollout: Rollout) -> None:  # names over the whole file, not the shard's blocks
            names.update(extra_names([rollout]))

        for block, indices, selected in _or_empty(self.file.read(seen=seen)):
            metas.extend(sampler_metas(selected))
            checkpoints.extend(declared_checkpoints(selected))
            yield self.filled(block, indices, selected)
        if self.stored_only:
            self.finish(names, metas, checkpoints)

    def forked(self, fn: Callable[[Block], T], workers: int) -> Iterator[T]:
        """fn of each filled block, in file order, read and mapped by `workers` forked readers."""
        file = self.file
        names, metas, checkpoints, any_taken = {"sampler"}, [], [], False
        for found, taken, (block_metas, block_checkpoints), result in pinned_pass(file.rollouts, file.pinned, lambda: forked_blocks(
                file.rollouts, vocab_size=file.info.vocab_size, num_experts=file.info.num_experts,
                block_size=file.block_size, workers=workers, work=self._mapped(fn),
                limit=file.pinned.size if file.pinned else None)):
            names |= found
            if taken:
                metas.extend(block_metas)
                checkpoints.extend(block_checkpoints)
                any_taken = True
                yield result
        if not any_taken:  # a shard that takes no block: one empty block, every column of it
            yield fn(self.filled(-1, [], []))
        self.finish(names, metas, checkpoints)

    def _mapped(self, fn: Callable[[Block], T]) -> Callable[[int, list[int], list[Rollout]], tuple]:
        """What a forked reader does with each block: its names and sampler settings for the
        checks across the file, and fn of it filled when the shard takes it."""
        shard = self.file.shard

        def mapped(block: int, indices: list[int], selected: list[Rollout]) -> tuple[set[str], bool, list, Any]:
            taken = shard is None or shard.takes(block)  # every block is read; a shard maps its own
            declared = (sampler_metas(selected), declared_checkpoints(selected)) if taken else ([], [])
            return extra_names(selected), taken, declared, fn(self.filled(block, indices, selected)) if taken else None
        return mapped

    def finish(self, names: set[str], metas: list[dict[str, Any]], checkpoints: list[Any]) -> None:
        """After the one pass of a stored-only replay: its names checked, the sampler's settings,
        the checkpoints the rollouts declare."""
        check_stored_names(self.specs, names)
        self.engines["sampler"]["meta"] = sampler_meta(metas)
        self.checkpoints = checkpoints


def _or_empty(blocks: Iterator[FoundBlock]) -> Iterator[FoundBlock]:
    """The blocks, or one empty block when the shard takes none: its table has every column."""
    empty = True
    for found in blocks:
        empty = False
        yield found
    if empty:
        yield -1, [], []


class Replayed:
    """A replay's results, block by block: `blocks()` is one pass over the selected blocks, each
    planned from the rollouts file again and filled from the engines' saved columns, so a pass holds
    one block in memory, not the run. `table`, `plan` and `rollouts` put every block together, for
    the callers that need them all at once (the routing agreement, the layer localizer, the
    processed pass found only in the data, the library)."""

    def __init__(self, *, engines: dict[str, Any], routing: dict[str, list[StreamRouting]],
                 filled: FilledBlocks, distribution: dict[str, Any] | None = None) -> None:
        self.engines = engines   # source -> describe() (the sampler's declared settings too)
        self.distribution = distribution or {}  # "A/B" -> the distribution pass's account (--distribution)
        self.routing = routing   # source -> each request's MoE routing, where recorded
        self._filled = filled
        self._whole: tuple[list[Rollout], ReplayPlan] | None = None

    def blocks(self) -> Iterator[Block]:
        return self._filled.blocks()

    @property
    def declared_checkpoints(self) -> list[Any]:
        """Each selected rollout's meta.checkpoint (None: undeclared); a stored-only replay knows
        them once its one pass (`blocks()` or `map_blocks`) has ended."""
        return self._filled.checkpoints

    def map_blocks(self, fn: Callable[[Block], T], workers: int = 1) -> Iterator[T]:
        """fn of each block, in order. With `workers` > 1, a replay of stored log-probs from a JSONL
        file reads, checks, plans and maps its blocks in that many forked readers (fn's results
        travel back pickled); the same results, the same first error."""
        if workers > 1 and self._filled.forkable:
            yield from self._filled.forked(fn, workers)
            return
        for block in self.blocks():
            yield fn(block)

    def _gathered(self) -> tuple[list[Rollout], ReplayPlan]:
        if self._whole is None:
            blocks = list(self.blocks())
            rollouts = [rollout for block in blocks for rollout in block.rollouts]
            self._whole = (rollouts, _whole_plan([block.plan for block in blocks]))
        return self._whole

    @property
    def rollouts(self) -> list[Rollout]:
        return self._gathered()[0]

    @property
    def plan(self) -> ReplayPlan:
        return self._gathered()[1]

    @property
    def table(self) -> pd.DataFrame:
        return self._gathered()[1].table


def _whole_plan(plans: list[ReplayPlan]) -> ReplayPlan:
    """The blocks' plans as one (a stored name a block lacks is NaN on its rows)."""
    table = concat_tables([plan.table for plan in plans])
    names = {name for plan in plans for name in plan.stored}
    stored = {name: np.concatenate([plan.stored.get(name, np.full(plan.num_scored, np.nan))
                                    for plan in plans]) if plans else np.empty(0) for name in names}
    return ReplayPlan(requests=[request for plan in plans for request in plan.requests],
                      request_block=np.concatenate([plan.request_block for plan in plans])
                      if plans else np.empty(0, dtype=np.int64), table=table, stored=stored)
