"""Rollout format v1 as data: a rollout is a tree of branches, a branch a list of segments.

What the decoders (`decode`) build once the rules (`rules`) hold, and what the replay walks:
a branch's context, its whole sequence, its stored MoE routing, its segments' turns.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from mismatch.streams import KeptSets

ROLES = ("system", "user", "assistant", "tool", "summary")
MODEL_ROLES = frozenset({"assistant", "summary"})
BRANCH_KINDS = ("main", "subagent", "summary", "subagent_summary")
# The fields format v1 names at each level (docs/format.md); `meta` and `messages` are free-form.
ROLLOUT_FIELDS = ("id", "branches", "meta", "messages")
BRANCH_FIELDS = ("id", "kind", "parent", "fork_at", "segments")
SEGMENT_FIELDS = ("role", "tokens", "logprobs", "trainable", "extra_logprobs", "routed_experts", "sampling_mask",
                  "indexer_topk")
# pandas writes a DataFrame's index beside its columns (DataFrame.to_parquet): a row's key, not a field.
_PANDAS_INDEX = re.compile(r"__index_level_\d+__")


def is_index_column(key: object) -> bool:
    return isinstance(key, str) and _PANDAS_INDEX.fullmatch(key) is not None


# eq=False everywhere: the generated __eq__ would compare numpy arrays, whose truth value is ambiguous.
@dataclass(kw_only=True, slots=True, frozen=True, eq=False)
class Segment:
    role: str
    tokens: np.ndarray  # int64, shape (num_tokens,)
    logprobs: np.ndarray | None  # float64, the sampler's log-prob of each token as stored at rollout time
    trainable: bool
    extra_logprobs: dict[str, np.ndarray] = field(default_factory=dict)
    # The experts the sampler routed each token to (MoE), int16 [num_tokens, moe_layers, top_k];
    # a row of -1 where it routed none (see rules.check_routed_experts).
    routed_experts: np.ndarray | None = None
    # The token ids the sampler's truncation kept at each token (CSR; rules.check_sampling_mask).
    sampling_mask: KeptSets | None = None
    # The key positions the sampler's DSA indexer selected at each token, int32 [num_tokens,
    # sparse_layers, top_k]; -1 in an empty slot, a row of -1 where it recorded none
    # (index_rules.check_indexer_topk).
    indexer_topk: np.ndarray | None = None

    @property
    def generated(self) -> bool:
        """Sampled by the model (whether or not the trainer trains on it)."""
        return self.role in MODEL_ROLES

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


@dataclass(kw_only=True, slots=True, frozen=True, eq=False)
class Branch:
    id: str
    kind: str
    parent: str | None
    fork_at: int | None  # token offset in the parent's own stream
    segments: tuple[Segment, ...]
    # Its own tokens, counted once: the checks, the plan and the tree weights each ask.
    num_tokens: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_tokens", sum(len(s.tokens) for s in self.segments))

    def stream(self) -> np.ndarray:
        """This branch's own tokens (without the context it forks from)."""
        return np.concatenate([s.tokens for s in self.segments])


@dataclass(kw_only=True, slots=True, frozen=True, eq=False)
class Rollout:
    id: str
    meta: dict
    branches: tuple[Branch, ...]
    messages: list | None
    file: str
    line: int  # 1-based line (JSONL) or row (Parquet)
    # id -> branch, so walking a deep or wide tree costs one dict lookup per step, not a scan.
    _by_id: dict[str, Branch] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_id", {b.id: b for b in self.branches})

    def branch(self, branch_id: str) -> Branch:
        try:
            return self._by_id[branch_id]
        except KeyError:
            raise KeyError(f"rollout {self.id!r} has no branch {branch_id!r}") from None


def segment_turns(roles: Sequence[str]) -> list[int]:
    """Turn index of each segment: a model segment closes the turn of the prompts before it."""
    turns, turn = [], 0
    for role in roles:
        turns.append(turn)
        if role in MODEL_ROLES:
            turn += 1
    return turns


def context_tokens(rollout: Rollout, branch_id: str) -> np.ndarray:
    """The tokens a branch is replayed after: its parent's context plus the parent's stream up to fork_at."""
    pieces: list[np.ndarray] = []
    branch = rollout.branch(branch_id)
    # Iterative, not recursive: validation guarantees the parent links end at the root.
    while branch.parent is not None:
        parent = rollout.branch(branch.parent)
        pieces.append(_prefix(parent, branch.fork_at))
        branch = parent
    if not pieces:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate(pieces[::-1])


def _prefix(branch: Branch, num_tokens: int) -> np.ndarray:
    """The first num_tokens of a branch's stream, touching only the segments it needs."""
    parts, left = [], num_tokens
    for segment in branch.segments:
        if left <= 0:
            break
        parts.append(segment.tokens[:left])
        left -= len(segment.tokens)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def full_tokens(rollout: Rollout, branch_id: str) -> np.ndarray:
    """Context plus the branch's own stream: the whole sequence the trainer sees for this branch."""
    return np.concatenate([context_tokens(rollout, branch_id), rollout.branch(branch_id).stream()])


def full_routed_experts(rollout: Rollout, branch_id: str, shape: tuple[int, int]) -> np.ndarray:
    """The stored experts of every token of `full_tokens`, int16 [tokens, layers, k] for a
    (layers, k) `shape`; -1 rows for the tokens whose segment stored none."""
    return _full_rows(rollout, branch_id, shape, "routed_experts", np.int16)


def full_indexer_topk(rollout: Rollout, branch_id: str) -> np.ndarray | None:
    """The recorded DSA selections of every token of `full_tokens`, int32 [tokens, layers, k]; -1
    rows for the tokens whose segment recorded none; None when no segment of the rollout did."""
    shape = next((segment.indexer_topk.shape[1:] for branch in rollout.branches for segment in branch.segments
                  if segment.indexer_topk is not None), None)
    return None if shape is None else _full_rows(rollout, branch_id, shape, "indexer_topk", np.int32)


def _full_rows(rollout: Rollout, branch_id: str, shape: tuple[int, ...], attr: str, dtype: type) -> np.ndarray:
    """A per-token [layers][k] field over the context and own tokens of a branch (-1 rows where absent)."""
    def rows(segments: tuple[Segment, ...], num_tokens: int | None) -> list[np.ndarray]:
        parts, left = [], num_tokens
        for segment in segments:
            if left is not None and left <= 0:
                break
            stored = getattr(segment, attr)
            if stored is None:
                stored = np.full((len(segment.tokens), *shape), -1, dtype=dtype)
            parts.append(stored if left is None else stored[:left])
            left = None if left is None else left - len(segment.tokens)
        return parts

    branch = rollout.branch(branch_id)
    pieces = [rows(branch.segments, None)]
    while branch.parent is not None:  # the context, as context_tokens walks it
        parent = rollout.branch(branch.parent)
        pieces.append(rows(parent.segments, branch.fork_at))
        branch = parent
    parts = [part for piece in pieces[::-1] for part in piece]
    return np.concatenate(parts) if parts else np.zeros((0, *shape), dtype=dtype)


def replayed_tokens(branches: Sequence[Branch]) -> int:
    """Tokens a replay of the whole tree feeds: each branch's context (context_tokens' length: its
    parent's context plus fork_at) and its own tokens, for a sound tree (rules.check_tree).
    Iterative with memo: O(branches) for any shape."""
    by_id = {branch.id: branch for branch in branches}
    context: dict[str, int] = {}
    for start in branches:
        path, node = [], start
        while node.parent is not None and node.id not in context:
            path.append(node)
            node = by_id[node.parent]
        base = context.get(node.id, 0)  # a branch walked before, or the root, whose context is empty
        for branch in reversed(path):
            base += branch.fork_at
            context[branch.id] = base
    return sum(context.values()) + sum(branch.num_tokens for branch in branches)


def deepest_branch(parent_of: dict[str, str], in_cycle: set[str]) -> tuple[str, int] | None:
    """(id, depth) of the branch with the most parent links above it (first such in `parent_of` order).

    Iterative with memo: O(branches) even for a 10k-level chain. Branches that hang off a cycle
    have no depth (the cycle is reported).
    """
    depth: dict[str, int] = {}  # -1: no way up to a root
    deepest: tuple[str, int] | None = None
    for start in parent_of:
        path: list[str] = []
        node = start
        while node in parent_of and node not in depth and node not in in_cycle:
            path.append(node)
            node = parent_of[node]
        base = -1 if node in in_cycle else depth.get(node, 0)
        for k, branch_id in enumerate(reversed(path), start=1):
            depth[branch_id] = -1 if base < 0 else base + k
        if depth.get(start, -1) > (deepest[1] if deepest else 0):
            deepest = (start, depth[start])
    return deepest


def routing_shape(rollout: Rollout) -> tuple[int, int] | None:
    """(MoE layers, top-k) of the rollout's stored routed_experts, or None when it stores none
    (the validator holds every segment of a file to one shape)."""
    first = first_routed(rollout)
    return first[1] if first is not None else None


def first_routed(rollout: Rollout) -> tuple[str, tuple[int, int]] | None:
    """(field path, (layers, k)) of the rollout's first segment with routed_experts."""
    for i, branch in enumerate(rollout.branches):
        for j, segment in enumerate(branch.segments):
            if segment.routed_experts is not None:
                return f"branches[{i}].segments[{j}].routed_experts", segment.routed_experts.shape[1:]
    return None
