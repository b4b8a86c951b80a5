"""The rollouts file as a replay reads it: block by block as it streams (one block in memory at a
time), and once whole before any engine loads, for what the checks across the file need.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mismatch.checkpoint import CheckpointInfo
from mismatch.replay.plan import ReplayPlan, Shard, plan_replay
from mismatch.rollouts import Rollout, context_tokens, iter_rollouts, routing_shape
from mismatch.rollouts.pinned import Pinned, pinned_pass

FoundBlock = tuple[int, list[int], list[Rollout]]  # (block, file indices, rollouts) of a block a shard takes


def pinned_rollouts(rollouts: str | Path, info: CheckpointInfo, pinned: Pinned | None,
                    skip_invalid: bool = False) -> Iterator[Rollout]:
    """Every rollout of the file, validated against the checkpoint as it streams; with `pinned`,
    within the pinned size, and the file checked unchanged once the pass is done. `skip_invalid`:
    the valid ones only (every pass skips the same ones: the file is pinned)."""
    limit = pinned.size if pinned is not None else None
    return pinned_pass(rollouts, pinned, lambda: iter_rollouts(
        rollouts, vocab_size=info.vocab_size, num_experts=info.num_experts, limit=limit, skip_invalid=skip_invalid))


def file_blocks(rollouts: str | Path, info: CheckpointInfo, *, shard: Shard | None, block_size: int,
                seen: Callable[[Rollout], None] | None = None, pinned: Pinned | None = None,
                skip_invalid: bool = False) -> Iterator[FoundBlock]:
    """(block, file indices, rollouts) of the blocks a shard takes, read and validated from the file
    as it streams: one block in memory at a time. `seen` is called with every rollout of the file,
    taken or not; `pinned`: the file as the run found it (pinned_rollouts)."""
    current, indices, selected = -1, [], []
    for index, rollout in enumerate(pinned_rollouts(rollouts, info, pinned, skip_invalid)):
        if seen is not None:
            seen(rollout)
        block = index // block_size
        if block != current and selected:
            yield current, indices, selected
            indices, selected = [], []
        current = block
        if shard is None or shard.takes(block):
            indices.append(index)
            selected.append(rollout)
    if selected:
        yield current, indices, selected


@dataclass(kw_only=True, slots=True, frozen=True)
class FileBlocks:
    """The blocks of a rollouts file one replay reads: the file, the checkpoint it is read against
    (token ids below its vocabulary, experts below its count), the shard that selects the blocks,
    the block size, and the file's size and digest as the run found them (every pass reads that
    many bytes and checks them unchanged at its end)."""

    rollouts: str | Path
    info: CheckpointInfo
    shard: Shard | None
    block_size: int
    pinned: Pinned | None = None
    skip_invalid: bool = False  # --skip-invalid: the valid rollouts only, numbered among themselves

    @property
    def path(self) -> str:
        """The rollouts file as errors name it."""
        return str(self.rollouts)

    def read(self, seen: Callable[[Rollout], None] | None = None) -> Iterator[FoundBlock]:
        """The blocks the shard takes, streamed from the file (`file_blocks`)."""
        return file_blocks(self.rollouts, self.info, shard=self.shard, block_size=self.block_size, seen=seen,
                           pinned=self.pinned, skip_invalid=self.skip_invalid)

    def plan(self, indices: list[int], selected: list[Rollout]) -> ReplayPlan:
        return plan_replay(selected, indices=indices, block_size=self.block_size)

    def planned(self) -> Iterator[tuple[int, ReplayPlan]]:
        """(block, its plan) of every block the shard takes: what one engine pass feeds."""
        for block, indices, selected in self.read():
            yield block, self.plan(indices, selected)

    def streams(self) -> Iterator[tuple[Rollout, str]]:
        """(rollout, branch id) of every selected stream, in plan order."""
        for _, _, selected in self.read():
            for rollout in selected:
                for branch in rollout.branches:
                    yield rollout, branch.id


@dataclass(kw_only=True, slots=True)
class FileScan:
    """What the checks across the whole file need, gathered in one pass before any engine loads."""

    names: set[str]                 # "sampler" and every extra_logprobs name in the file
    metas: list[dict[str, Any]]     # meta.sampler of the selected rollouts, where declared
    checkpoints: list[Any]          # meta.checkpoint of each selected rollout (None: undeclared)
    longest: tuple[int, str, str]   # (stream length, rollout, branch) of the longest stream
    stream_lengths: list[int]       # every selected stream's length (context included)
    routing: tuple[int, str, tuple[int, ...]] | None  # (line, rollout, [layers, top-k]) of the first routed_experts
    num_scored: int                 # own tokens of the selected streams: the token table's rows


def scan_file(blocks: FileBlocks) -> FileScan:
    """The file read once, validated as it streams: names over the whole file, the rest over the
    streams the shard takes."""
    info, shard = blocks.info, blocks.shard
    names, metas, lengths, longest, routing, scored = {"sampler"}, [], [], (0, "", ""), None, 0
    checkpoints: list[Any] = []
    for index, rollout in enumerate(pinned_rollouts(blocks.rollouts, info, blocks.pinned, blocks.skip_invalid)):
        names.update(extra_names([rollout]))
        shape = routing_shape(rollout) if routing is None else None
        if shape is not None:  # the file's first (the loader holds every rollout of a file to one shape)
            routing = (rollout.line, rollout.id, tuple(shape))
        if shard is not None and not shard.takes(index // blocks.block_size):
            continue
        metas.extend(sampler_metas([rollout]))
        checkpoints.extend(declared_checkpoints([rollout]))
        for branch in rollout.branches:
            length = len(context_tokens(rollout, branch.id)) + branch.num_tokens
            lengths.append(length)
            scored += branch.num_tokens
            if length > longest[0]:
                longest = (length, rollout.id, branch.id)
    return FileScan(names=names, metas=metas, checkpoints=checkpoints, longest=longest, stream_lengths=lengths,
                    routing=routing, num_scored=scored)


def extra_names(rollouts: list[Rollout]) -> set[str]:
    """Every extra_logprobs name a segment of these rollouts carries."""
    return {name for rollout in rollouts for branch in rollout.branches for segment in branch.segments
            for name in segment.extra_logprobs}


def sampler_metas(rollouts: list[Rollout]) -> list[dict[str, Any]]:
    """meta.sampler of these rollouts, where declared."""
    return [r.meta["sampler"] for r in rollouts if isinstance(r.meta.get("sampler"), dict)]


def declared_checkpoints(rollouts: list[Rollout]) -> list[Any]:
    """meta.checkpoint of each of these rollouts (the checkpoint it declares it was sampled by), None
    where undeclared (pipeline/declared_checkpoint.py compares them with the audited one)."""
    return [r.meta.get("checkpoint") for r in rollouts]


def sampler_meta(metas: list[dict[str, Any]]) -> dict[str, Any]:
    """The sampler settings the rollouts declare (the first rollout's; differing ones are counted)."""
    if not metas:
        return {}
    first = metas[0]
    return {**first, "num_rollouts_differing": sum(meta != first for meta in metas)}


@dataclass(kw_only=True, slots=True, frozen=True)
class Block:
    """One block of rollouts as the analysis reads it: its requests and its token table rows
    (TABLE_KEYS, logp_sampler, weight_tree/gyre, a logp_<source> column per source)."""

    index: int
    rollouts: list[Rollout]
    plan: ReplayPlan

