"""verifiers v1 traces → format v1: each `Trace` of an `Episode` is one rollout, its message graph a tree.

Read at PrimeIntellect-ai/verifiers@a60a606ecc4d. On disk an Episode is one line of
`traces.jsonl`, `Episode.to_record()` = `model_dump(mode="json", exclude_none=True)` without the
nodes' raw tensors (routed_experts, kept_tokens, multi_modal_data: `verifiers/v1/episode.py:149-155`,
`verifiers/v1/trace.py:41-50`), from `vf eval` (`verifiers/v1/cli/output.py:28`) or prime-rl's
file monitor, `rollouts/step_{step}/{kind}/{subset}/traces.jsonl` (PrimeIntellect-ai/prime-rl@559b4477
`src/prime_rl/monitors/file.py:43-59`). `Episode` (episode.py:86-104): id, run.work.step (the
training step it was dispatched at, :47-60), traces. `Trace` (trace.py:363-405): id, agent
(name, trainable), nodes, rewards ({name: {score, weight}}, value = score * weight, :135-141).
`MessageNode` (`verifiers/v1/graph.py:64-112`): parent (absent on a root), message.role, sampled,
token_ids (the message's delta to the sequence: template scaffold, then its tokens), mask (true
on sampled completion tokens only), logprobs (one per true mask entry). A branch is a root-to-leaf
path (`Trace.branches`, trace.py:450-468; leaves: graph.py:647-651); each is one training sample.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from mismatch.rollouts.importers._common import Where, branch, source_meta, typed

PROMPT_ROLES = ("system", "user", "tool")


class _Message(msgspec.Struct, frozen=True):
    role: str


class _Node(msgspec.Struct, frozen=True):
    """`MessageNode` (graph.py:64-112), as `model_dump(exclude_none=True)` writes it."""

    message: _Message
    parent: int | None = None          # absent on a root
    sampled: bool = False
    token_ids: list[int] = []
    mask: list[bool | int] = []        # true (1) on sampled completion tokens only
    logprobs: list[float] = []         # one per true mask entry


class _Agent(msgspec.Struct, frozen=True):
    name: str | None = None
    trainable: bool | None = True


class _Reward(msgspec.Struct, frozen=True):
    score: float | None = None
    weight: float = 1.0


class _Trace(msgspec.Struct, frozen=True):
    nodes: list[_Node]
    id: str | None = None
    agent: _Agent | None = None        # null as absent (verifiers writes the agent's defaults)
    rewards: dict[str, _Reward] | None = None   # name -> {score, weight}; value = score * weight


class _Work(msgspec.Struct, frozen=True):
    step: int | None = None            # the training step the episode was dispatched at


class _Run(msgspec.Struct, frozen=True):
    work: _Work | None = None


class _Episode(msgspec.Struct, frozen=True):
    traces: list[Any]                  # each read as a _Trace, its errors named traces[i]
    id: str | None = None
    run: _Run | None = None


@dataclass(kw_only=True, slots=True)
class _Branch:
    id: str
    parent: str | None
    fork_at: int | None
    context: int      # tokens before this branch's own stream
    path: list[int]   # node ids, root to leaf


def is_episode(record: Any) -> bool:
    """Sniffed on a record of an unknown verifiers shape (one of three), before any is decoded."""
    return isinstance(record, dict) and isinstance(record.get("traces"), list)


def is_trace(record: Any) -> bool:
    return isinstance(record, dict) and isinstance(record.get("nodes"), list) and "agent" in record


def convert_episode(record: dict[str, Any], where: Where) -> list[dict[str, Any]]:
    """Every trace of one Episode record, tagged with the step its run dispatched it at."""
    episode = typed(record, _Episode, where)
    work = (episode.run or _Run()).work or _Work()
    return [convert_trace(trace, where, f"traces[{i}].", step=work.step, episode=episode.id)
            for i, trace in enumerate(episode.traces)]


def convert_trace(trace: Any, where: Where, prefix: str = "", *, step: Any = None,
                  episode: Any = None) -> dict[str, Any]:
    read = typed(trace, _Trace, where, prefix=prefix)
    nodes = read.nodes
    if not nodes:
        raise where.error(prefix + "nodes", "must be a non-empty array of MessageNode")
    agent, rewards = read.agent or _Agent(), read.rewards or {}
    trainable = agent.trainable is not False
    segments = [_node_segments(node, where, f"{prefix}nodes[{i}].", trainable) for i, node in enumerate(nodes)]
    branches = _tree(_paths(nodes, where, prefix), [sum(len(s["tokens"]) for s in node) for node in segments])
    reward = sum(r.score * r.weight for r in rewards.values() if r.score is not None)
    meta = source_meta("verifiers", where, step=step, episode=episode, agent=agent.name,
                       reward=reward if rewards else None, num_turns=sum(1 for n in nodes if n.sampled))
    rollout_id = str(read.id or f"verifiers-{where.index}")
    own = [_merged(segments, b.path[_shared_nodes(b, branches)], forked=b.parent is not None) for b in branches]
    return {"id": rollout_id, "meta": meta,
            "branches": [branch(b.id, stream, kind="main" if b.parent is None else "subagent", parent=b.parent,
                                fork_at=b.fork_at) for b, stream in zip(branches, own)]}


def _node_segments(node: _Node, where: Where, prefix: str, trainable: bool) -> list[dict[str, Any]]:
    """One node's tokens as segments: a prompt message whole under its role; an assistant node's
    scaffold (mask false: the generation prompt, or context the model never generated) as a
    prompt run, its sampled completion as an assistant segment with its log-probs."""
    role, tokens, mask, logprobs = node.message.role, node.token_ids, node.mask, node.logprobs
    if len(mask) != len(tokens) or not all(v in (0, 1) for v in mask):
        raise where.error(prefix + "mask", f"must be {len(tokens)} booleans, one per token_ids entry")
    if any(mask) and len(logprobs) != sum(mask):
        raise where.error(prefix + "logprobs", f"has {len(logprobs)} entries for {sum(mask)} sampled tokens")
    if role in PROMPT_ROLES or not any(mask):
        return [{"role": role if role in PROMPT_ROLES else "context", "tokens": tokens}]
    out: list[dict[str, Any]] = []
    used = 0
    for start in range(len(tokens)):
        on = bool(mask[start])
        if out and out[-1]["_on"] == on:
            out[-1]["tokens"].append(tokens[start])
        else:
            out.append({"_on": on, "tokens": [tokens[start]]})
        if on:
            out[-1].setdefault("logprobs", []).append(logprobs[used])
            used += 1
    return [{"role": "assistant", "tokens": s["tokens"], "logprobs": s["logprobs"],
             **({} if trainable else {"trainable": False})} if s["_on"] else {"role": "context", "tokens": s["tokens"]}
            for s in out]


def _merged(segments: list[list[dict[str, Any]]], path: list[int], *, forked: bool) -> list[dict[str, Any]]:
    """A path's node segments in order; "context" runs (an assistant node's scaffold) join the
    prompt run before them, or open one: "user" at a rollout's start, else "tool" (the
    environment's side between sampled turns, as the other importers name it)."""
    out: list[dict[str, Any]] = []
    for node_id in path:
        for segment in segments[node_id]:
            if segment["role"] != "context":
                out.append({**segment, "tokens": list(segment["tokens"])})
            elif out and out[-1]["role"] in PROMPT_ROLES:
                out[-1]["tokens"] += segment["tokens"]
            else:
                out.append({"role": "tool" if out or forked else "user", "tokens": list(segment["tokens"])})
    return out


def _paths(nodes: list[_Node], where: Where, prefix: str) -> list[list[int]]:
    """Root-to-leaf node paths, one per leaf in node order (graph.leaves, Trace.branches)."""
    parents = [node.parent for node in nodes]
    for i, parent in enumerate(parents):
        if parent is not None and not 0 <= parent < i:
            raise where.error(f"{prefix}nodes[{i}].parent", f"must be an earlier node's index, got {parent!r}")
    has_child = {p for p in parents if p is not None}
    paths = []
    for leaf in (i for i in range(len(nodes)) if i not in has_child):
        path, node = [], leaf
        while node is not None:
            path.append(node)
            node = parents[node]
        paths.append(path[::-1])
    return paths


def _tree(paths: list[list[int]], num_tokens: list[int]) -> list[_Branch]:
    """The first path is main; each later one forks from the earlier branch it shares the most
    nodes with, at the end of the shared nodes (within that branch's own stream)."""
    branches: list[_Branch] = []
    for i, path in enumerate(paths):
        if not branches:
            branches.append(_Branch(id="main", parent=None, fork_at=None, context=0, path=path))
            continue
        shared = []
        for b in branches:
            n = 0
            while n < min(len(path), len(b.path)) and path[n] == b.path[n]:
                n += 1
            length = sum(num_tokens[node] for node in path[:n])
            if length >= b.context:
                shared.append((length, b))
        length, parent = max(shared, key=lambda item: item[0])
        branches.append(_Branch(id=f"branch-{i}", parent=parent.id, fork_at=length - parent.context,
                                context=length, path=path))
    return branches


def _shared_nodes(b: _Branch, branches: list[_Branch]) -> slice:
    """The nodes of `b`'s own stream: those after its fork point (all of main's)."""
    if b.parent is None:
        return slice(0, None)
    parent = next(p for p in branches if p.id == b.parent)
    n = 0
    while n < min(len(b.path), len(parent.path)) and b.path[n] == parent.path[n]:
        n += 1
    return slice(n, None)
