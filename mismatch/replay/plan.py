"""From rollouts to replay requests and the token table they fill: the plan step of the flow.

Each branch becomes one request (its context, then its own tokens); the token table has one row
per own token, in request order, so an engine's concatenated results drop straight into a column.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import pandas as pd

from mismatch.errors import MismatchError
from mismatch.rollouts import Branch, Rollout, Segment, context_tokens, full_indexer_topk, segment_turns
from mismatch.streams import KeptSets, ReplayRequest, Sampling

TABLE_KEYS = ("rollout_index", "rollout", "branch", "branch_kind", "turn", "segment", "pos", "role",
              "token_id", "trainable")
# Rollouts per unit of work. Engines see one block at a time, so batch composition (and with it
# every bit of a batch-variant kernel's output) is the same whether a run is whole, sharded or resumed.
DEFAULT_BLOCK = 64


@dataclass(kw_only=True, slots=True, frozen=True)
class ReplayPlan:
    requests: list[ReplayRequest]
    request_block: np.ndarray  # int [num_requests]: the block of each request's rollout
    table: pd.DataFrame  # TABLE_KEYS + logp_sampler (replay_sources adds the weights and engine columns)
    stored: dict[str, np.ndarray]  # "sampler" and every extra_logprobs NAME, aligned with table rows

    @property
    def num_scored(self) -> int:
        return len(self.table)

    def blocks(self) -> list[tuple[int, list[ReplayRequest]]]:
        """(block id, its requests) in table order: rows of a block are contiguous."""
        grouped: dict[int, list[ReplayRequest]] = {}
        for request, block in zip(self.requests, self.request_block.tolist()):
            grouped.setdefault(block, []).append(request)
        return list(grouped.items())


@dataclass(kw_only=True, slots=True, frozen=True)
class Shard:
    """Shard `index` of `count` (0-based) takes blocks index, index+count, index+2·count, …"""

    index: int
    count: int

    @classmethod
    def parse(cls, text: str) -> Shard:
        index, slash, count = text.partition("/")
        if not slash or not index.strip().isdigit() or not count.strip().isdigit():
            raise MismatchError(f"--shard {text!r}: expected I/N with 0 <= I < N, e.g. 0/4")
        shard = cls(index=int(index), count=int(count))
        if not 0 <= shard.index < shard.count:
            raise MismatchError(f"--shard {text!r}: expected I/N with 0 <= I < N, e.g. 0/4")
        return shard

    def takes(self, block: int) -> bool:
        return block % self.count == self.index


@dataclass(kw_only=True, slots=True)
class _Branches:
    """The short per-branch and per-segment vectors every per-token column is made from."""

    requests: list[ReplayRequest] = field(default_factory=list)
    request_block: list[int] = field(default_factory=list)
    branch_rollout: list[int] = field(default_factory=list)  # per branch: position of its rollout
    branch_ids: list[str] = field(default_factory=list)
    branch_kinds: list[str] = field(default_factory=list)
    branch_context: list[int] = field(default_factory=list)  # per branch: tokens of context before its own
    segment_branch: list[int] = field(default_factory=list)  # per segment: its branch
    segments: list[Segment] = field(default_factory=list)
    segment_turn: list[int] = field(default_factory=list)
    segment_index: list[int] = field(default_factory=list)   # per segment: its index in its branch

    def add(self, rollout: Rollout, branch: Branch, *, position: int, block: int, truncation: Sampling | None,
            indexed: bool) -> None:
        """One branch of the rollout at `position` (in the planned rollouts): its request and
        segments. `truncation`: what the rollout's meta.sampler declares (read once a rollout);
        `indexed`: whether any segment of the rollout recorded indexer_topk."""
        context = context_tokens(rollout, branch.id)
        segments = branch.segments
        own = [seg.tokens for seg in segments]
        lengths = [len(tokens) for tokens in own]
        # Context tokens were a prompt when this branch was sampled, whatever produced them.
        generated = np.concatenate([np.zeros(len(context), dtype=bool),
                                    np.repeat([seg.generated for seg in segments], lengths)])
        # The scored positions are the branch's own tokens: their kept sets are its segments'.
        kept = KeptSets.concat([seg.sampling_mask for seg in segments], lengths)
        self.requests.append(ReplayRequest(tokens=np.concatenate([context, *own]).astype(np.int64),
                                           generated=generated, score_from=len(context), kept=kept,
                                           truncation=truncation,
                                           indexer_topk=full_indexer_topk(rollout, branch.id) if indexed else None))
        self.request_block.append(block)
        self.segment_branch.extend([len(self.branch_ids)] * len(own))
        self.segment_turn.extend(segment_turns([seg.role for seg in segments]))
        self.segment_index.extend(range(len(own)))
        self.segments.extend(segments)
        self.branch_rollout.append(position)
        self.branch_ids.append(branch.id)
        self.branch_kinds.append(branch.kind)
        self.branch_context.append(len(context))


def plan_replay(rollouts: Sequence[Rollout], *, indices: Sequence[int] | None = None,
                block_size: int = DEFAULT_BLOCK) -> ReplayPlan:
    """Requests and table rows for `rollouts`; `indices` are their positions in the file.

    Python loops run per branch and per segment only; every per-token column is made by numpy
    from those short vectors (a dump has ~100 tokens a segment and 10^7-10^8 tokens in all).
    """
    indices = list(range(len(rollouts))) if indices is None else list(indices)
    branches = _Branches()
    for position, (file_index, rollout) in enumerate(zip(indices, rollouts, strict=True)):
        declared = rollout.meta.get("sampler")
        sampling = Sampling.from_meta(declared if isinstance(declared, dict) else None)
        truncation = sampling.truncation if sampling.truncates else None
        indexed = any(seg.indexer_topk is not None for branch in rollout.branches for seg in branch.segments)
        for branch in rollout.branches:
            branches.add(rollout, branch, position=position, block=file_index // block_size,
                         truncation=truncation, indexed=indexed)
    segments = branches.segments
    lengths = np.fromiter((len(seg.tokens) for seg in segments), dtype=np.int64, count=len(segments))
    table = _token_table(branches, rollouts, indices, lengths)
    extra_names = sorted({name for seg in segments for name in seg.extra_logprobs})
    stored = {"sampler": table["logp_sampler"].to_numpy()}
    stored.update({name: _stored_column([seg.extra_logprobs.get(name) for seg in segments], lengths)
                   for name in extra_names})
    return ReplayPlan(requests=branches.requests, request_block=np.asarray(branches.request_block, dtype=np.int64),
                      table=table, stored=stored)


def _token_table(branches: _Branches, rollouts: Sequence[Rollout], indices: list[int],
                 lengths: np.ndarray) -> pd.DataFrame:
    """TABLE_KEYS and logp_sampler, one row per own token (`lengths`: tokens per segment)."""
    segments = branches.segments
    seg_branch = np.asarray(branches.segment_branch, dtype=np.int64)
    row_branch = np.repeat(seg_branch, lengths)
    row_rollout = np.asarray(branches.branch_rollout, dtype=np.int64)[row_branch]
    branch_start = np.zeros(len(branches.branch_ids) + 1, dtype=np.int64)  # first row of each branch
    np.add.at(branch_start, seg_branch + 1, lengths)
    branch_start = np.cumsum(branch_start)
    # pos: the row's offset in its request (context first), so own tokens count from the context.
    offset = np.asarray(branches.branch_context, dtype=np.int64) - branch_start[:-1]
    pos = np.arange(int(lengths.sum()), dtype=np.int64) + offset[row_branch]
    # copy=False: the columns are fresh arrays; pandas would copy them again into one 2-D block per dtype.
    return pd.DataFrame({
        "rollout_index": np.asarray(indices, dtype=np.int64)[row_rollout],
        "rollout": _categorical([rollouts[k].id for k in range(len(rollouts))], row_rollout),
        "branch": _categorical(branches.branch_ids, row_branch),
        "branch_kind": _categorical(branches.branch_kinds, row_branch),
        "turn": np.repeat(np.asarray(branches.segment_turn, dtype=np.int32), lengths),
        "segment": np.repeat(np.asarray(branches.segment_index, dtype=np.int32), lengths),
        "pos": pos.astype(np.int32),
        "role": _categorical([seg.role for seg in segments], np.repeat(np.arange(len(segments)), lengths)),
        "token_id": _concat([seg.tokens for seg in segments], np.int64),
        "trainable": np.repeat(np.fromiter((seg.trainable for seg in segments), dtype=bool,
                                           count=len(segments)), lengths),
        "logp_sampler": _stored_column([seg.logprobs for seg in segments], lengths),
    }, copy=False)


def _stored_column(per_segment: list[np.ndarray | None], lengths: np.ndarray) -> np.ndarray:
    """One stored log-prob column over the segments' rows: NaN where a segment stores none (the
    stored values put in at once through a row mask, not a NaN array made per segment)."""
    column = np.full(int(lengths.sum()), np.nan)
    present = [values is not None for values in per_segment]
    if any(present):
        column[np.repeat(present, lengths)] = np.concatenate([values for values in per_segment if values is not None])
    return column


def _categorical(values: list[str], rows: np.ndarray) -> pd.Categorical:
    """values[rows] as a pandas categorical with sorted categories (what astype("category") gives),
    built from the short `values` list, not from a per-row array of Python strings. Its codes are
    valid by construction, so pandas is not asked to check them again (a pass over every row)."""
    categories = sorted(set(values))
    code_of = {value: code for code, value in enumerate(categories)}
    codes = np.fromiter((code_of[value] for value in values), dtype=np.int64, count=len(values))
    dtype = pd.CategoricalDtype(pd.Index(categories))
    return pd.Categorical.from_codes(codes[rows], dtype=dtype, validate=False)


def _concat(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.empty(0, dtype=dtype)
