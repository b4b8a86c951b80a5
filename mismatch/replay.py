"""From rollouts to replay requests and the token table they fill.

Each branch becomes one request (its context, then its own tokens); the token table has one row
per own token, in request order, so an engine's concatenated results drop straight into a column.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from mismatch.checkpoint import checkpoint_info
from mismatch.engines import Engine, EngineSpec, ProgressFn, ReplayRequest, load_engine, parse_spec
from mismatch.errors import SpecError
from mismatch.rollouts import Rollout, context_tokens, load_rollouts

TABLE_KEYS = ("rollout", "branch", "branch_kind", "turn", "segment", "pos", "role", "token_id",
              "trainable")


@dataclass(kw_only=True, slots=True, frozen=True)
class ReplayPlan:
    requests: list[ReplayRequest]
    table: pd.DataFrame  # TABLE_KEYS + logp_sampler
    stored: dict[str, np.ndarray]  # "sampler" and every extra_logprobs NAME, aligned with table rows

    @property
    def num_scored(self) -> int:
        return len(self.table)


def segment_turns(roles: Sequence[str]) -> list[int]:
    """Turn index of each segment: a model segment closes the turn of the prompts before it."""
    turns, turn = [], 0
    for role in roles:
        turns.append(turn)
        if role in ("assistant", "summary"):
            turn += 1
    return turns


def _stored(segment_logprobs: np.ndarray | None, length: int) -> np.ndarray:
    return segment_logprobs if segment_logprobs is not None else np.full(length, np.nan)


def plan_replay(rollouts: Sequence[Rollout]) -> ReplayPlan:
    requests: list[ReplayRequest] = []
    columns: dict[str, list[np.ndarray]] = {key: [] for key in TABLE_KEYS}
    columns["logp_sampler"] = []
    extra_names = sorted({name for rollout in rollouts for branch in rollout.branches
                          for segment in branch.segments for name in segment.extra_logprobs})
    extra: dict[str, list[np.ndarray]] = {name: [] for name in extra_names}
    for rollout in rollouts:
        for branch in rollout.branches:
            context = context_tokens(rollout, branch.id)
            own = [seg.tokens for seg in branch.segments]
            generated = [np.full(len(seg.tokens), seg.generated) for seg in branch.segments]
            # Context tokens were a prompt when this branch was sampled, whatever produced them.
            requests.append(ReplayRequest(
                tokens=np.concatenate([context, *own]).astype(np.int64),
                generated=np.concatenate([np.zeros(len(context), bool), *generated]),
                score_from=len(context)))
            lengths = [len(tokens) for tokens in own]
            num_own = sum(lengths)
            columns["rollout"].append(np.full(num_own, rollout.id, dtype=object))
            columns["branch"].append(np.full(num_own, branch.id, dtype=object))
            columns["branch_kind"].append(np.full(num_own, branch.kind, dtype=object))
            turns = segment_turns([seg.role for seg in branch.segments])
            columns["turn"].append(np.repeat(np.asarray(turns, np.int32), lengths))
            columns["segment"].append(np.repeat(np.arange(len(own), dtype=np.int32), lengths))
            columns["pos"].append(np.arange(len(context), len(context) + num_own, dtype=np.int32))
            columns["role"].append(np.repeat(np.asarray([s.role for s in branch.segments], object), lengths))
            columns["token_id"].append(np.concatenate(own).astype(np.int64))
            columns["trainable"].append(np.repeat([s.trainable for s in branch.segments], lengths))
            columns["logp_sampler"].append(np.concatenate(
                [_stored(s.logprobs, len(s.tokens)) for s in branch.segments]).astype(np.float64))
            for name, parts in extra.items():
                parts.append(np.concatenate([_stored(s.extra_logprobs.get(name), len(s.tokens))
                                             for s in branch.segments]).astype(np.float64))
    table = pd.DataFrame({key: np.concatenate(parts) if parts else np.empty(0)
                          for key, parts in columns.items()})
    for key in ("rollout", "branch", "branch_kind", "role"):
        table[key] = table[key].astype("category")
    table["trainable"] = table["trainable"].astype(bool)
    stored = {"sampler": table["logp_sampler"].to_numpy()}
    stored.update({name: np.concatenate(parts) for name, parts in extra.items()})
    return ReplayPlan(requests=requests, table=table, stored=stored)


def replay_column(plan: ReplayPlan, engine: Engine, *, progress: ProgressFn | None = None) -> np.ndarray:
    """One engine's log-probs for every table row (float64, NaN where undefined)."""
    results = engine.replay(plan.requests, progress=progress)
    for request, logp in zip(plan.requests, results, strict=True):
        assert len(logp) == request.num_scored, "engine returned the wrong number of log-probs"
    # Built-in engines are trusted by this assert; user engines are checked in engines/user.py.
    return np.concatenate(results).astype(np.float64) if results else np.empty(0)


ProgressFactory = Callable[[str, int], ProgressFn | None]


@dataclass(kw_only=True, slots=True, frozen=True)
class Replayed:
    rollouts: list[Rollout]
    requests: list[ReplayRequest]  # one per branch, in table order
    table: pd.DataFrame           # TABLE_KEYS + logp_sampler + logp_<role> per replayed role
    engines: dict[str, Any]       # role -> describe() (the sampler's declared settings too)


def replay_roles(checkpoint: str | Path, rollouts: str | Path, roles: dict[str, str], *,
                 progress: ProgressFactory | None = None) -> Replayed:
    """Load and validate everything, then fill one `logp_<role>` column per role's spec.

    All input checks (checkpoint, specs, rollouts, stored names) come before the first forward.
    """
    info = checkpoint_info(checkpoint)
    specs = {role: parse_spec(text) for role, text in roles.items()}
    loaded = load_rollouts(rollouts, vocab_size=info.vocab_size)
    plan = plan_replay(loaded)
    for role, spec in specs.items():
        if spec.kind == "stored" and spec.options["name"] not in plan.stored:
            raise SpecError(f"--{role} {spec.text}: no segment of the rollouts carries "
                            f"extra_logprobs[{spec.options['name']!r}] (found: {', '.join(plan.stored)})")
    table = plan.table
    engines: dict[str, Any] = {"sampler": {"kind": "stored", "spec": "sampler",
                                           "meta": _sampler_meta(loaded)}}
    for role, spec in specs.items():
        table[f"logp_{role}"], engines[role] = _replay_role(role, spec, plan, str(checkpoint), progress)
    return Replayed(rollouts=loaded, requests=plan.requests, table=table, engines=engines)


def _replay_role(role: str, spec: EngineSpec, plan: ReplayPlan, checkpoint: str,
                 progress: ProgressFactory | None) -> tuple[np.ndarray, dict[str, Any]]:
    """One role's log-prob column: replayed by an engine, or read from the rollouts (`stored:`)."""
    if spec.kind == "stored":
        name = spec.options["name"]
        return plan.stored[name], {"kind": "stored", "spec": spec.text, "name": name}
    engine = load_engine(spec, checkpoint)
    try:
        callback = progress(f"replay {role}: {spec.text}", plan.num_scored) if progress else None
        return replay_column(plan, engine, progress=callback), engine.describe()
    finally:
        engine.close()


def _sampler_meta(rollouts: list[Rollout]) -> dict[str, Any]:
    """The sampler settings the rollouts declare (the first rollout's; differing ones are counted)."""
    metas = [r.meta.get("sampler") for r in rollouts if isinstance(r.meta.get("sampler"), dict)]
    if not metas:
        return {}
    first = metas[0]
    return {**first, "num_rollouts_differing": sum(meta != first for meta in metas)}
