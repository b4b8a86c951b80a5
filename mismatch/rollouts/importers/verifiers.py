"""verifiers trajectories → format v1: a rollout's steps (or a v1 trace's message graph) as a tree of branches.

Two layouts, read at PrimeIntellect-ai/verifiers@a60a606ecc4d:
- v1 (`verifiers.v1`): `traces.jsonl` of Episode records, converted by `verifiers_trace`.
- v0, now `verifiers/legacy/` and still importable as `verifiers.types` (the alias finder in
  `verifiers/__init__.py`), field names unchanged: `State.trajectory` (`verifiers/legacy/types.py:
  464`), a list of `TrajectoryStep` (:300-309: prompt, completion, tokens, reward, trajectory_id)
  whose `TrajectoryStepTokens` (:256-272) hold prompt_ids, prompt_mask, completion_ids,
  completion_mask, completion_logprobs, overlong_prompt, is_truncated, and now routed_experts
  (raw bytes: no JSON dump keeps them), as saved per rollout (one JSON object per line,
  `trajectory` among its columns).
A step whose prompt extends the previous step's whole sequence continues its branch (the new
prompt tokens are the environment's turn); one that does not — compaction, stripped thinking,
a subagent — starts a new branch at the longest common prefix, as prime-rl's best-effort
interleaving does (`docs/training/trajectories.md`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mismatch.rollouts.importers._common import (Where, branch, floats, get, ints, masked_segments,
                                                 same_length, source_meta)
from mismatch.rollouts.importers.verifiers_trace import convert_episode, convert_trace, is_episode, is_trace


@dataclass(kw_only=True, slots=True)
class _Branch:
    id: str
    parent: str | None
    fork_at: int | None
    context: int  # tokens before this branch's own stream
    tokens: list[int] = field(default_factory=list)  # context + own stream
    segments: list[dict[str, Any]] = field(default_factory=list)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def convert(record: Any, where: Where) -> list[dict[str, Any]]:
    """A v1 Episode (or Trace) record, or one saved v0 rollout (an object with `trajectory`, or a
    State with it under `state`)."""
    if is_episode(record):
        return convert_episode(record, where)
    if is_trace(record):
        return [convert_trace(record, where)]
    if isinstance(record, dict) and "trajectory" not in record and isinstance(record.get("state"), dict):
        record = record["state"]
    steps = get(record, "trajectory", where)
    if not isinstance(steps, list) or not steps:
        raise where.error("trajectory", "must be a non-empty array of TrajectoryStep")
    branches: list[_Branch] = []
    for i, step in enumerate(steps):
        _add_step(branches, step, where, f"trajectory[{i}].")
    rollout: dict[str, Any] = {
        "id": f"verifiers-{where.index}",
        "meta": source_meta("verifiers", where, example_id=record.get("example_id"), task=record.get("task"),
                            reward=record.get("reward"), num_steps=len(steps)),
        "branches": [branch(b.id, b.segments, kind="main" if b.parent is None else "subagent",
                            parent=b.parent, fork_at=b.fork_at) for b in branches],
    }
    messages = _messages(steps[-1]) if len(branches) == 1 else None
    if messages is not None:
        rollout["messages"] = messages
    return [rollout]


def _add_step(branches: list[_Branch], step: Any, where: Where, prefix: str) -> None:
    tokens = get(step, "tokens", where, prefix=prefix)
    p = prefix + "tokens."
    prompt = ints(get(tokens, "prompt_ids", where, prefix=p), p + "prompt_ids", where)
    completion = ints(get(tokens, "completion_ids", where, prefix=p), p + "completion_ids", where)
    mask = ints(get(tokens, "completion_mask", where, prefix=p), p + "completion_mask", where)
    logprobs = floats(get(tokens, "completion_logprobs", where, prefix=p), p + "completion_logprobs", where)
    same_length(p + "completion_mask", mask, "completion_ids", completion, where)
    same_length(p + "completion_logprobs", logprobs, "completion_ids", completion, where)
    # Every completion token was sampled; mask 0 only leaves it out of the loss.
    completion_segments = masked_segments(completion, mask, logprobs, off_role="assistant")
    if not branches:
        branches.append(_Branch(id="main", parent=None, fork_at=None, context=0, tokens=prompt + completion,
                                segments=[{"role": "user", "tokens": prompt}, *completion_segments]))
        return
    # Continue the branch (or fork from the one) that shares the most of this prompt. A fork must
    # land in the parent's own stream: its context is taken whole by the new branch.
    shared = [(_common_prefix(b.tokens, prompt), b) for b in branches]
    length, parent = max(((n, b) for n, b in shared if n >= b.context), key=lambda item: item[0])
    new_prompt = prompt[length:]
    if length == len(parent.tokens):  # the extension property holds: same training sample
        parent.segments.append({"role": "tool", "tokens": new_prompt})
        parent.segments.extend(completion_segments)
        parent.tokens += new_prompt + completion
        return
    branches.append(_Branch(id=f"step-{len(branches)}", parent=parent.id, fork_at=length - parent.context,
                            context=length, tokens=prompt + completion,
                            segments=[{"role": "user", "tokens": new_prompt}, *completion_segments]))


def _messages(step: dict[str, Any]) -> list | None:
    """The chat of a single-branch rollout (last step's prompt + completion), for drift checks."""
    prompt, completion = step.get("prompt"), step.get("completion")
    if isinstance(prompt, list) and isinstance(completion, list):
        return [*prompt, *completion]
    return None
