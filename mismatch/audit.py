"""The audit: stored rollouts replayed through a trainer and an engine, gaps measured, results written.

rollouts → plan_replay → replay(train), replay(infer) → token table → metrics → results dir.
Everything that can be wrong with the input is checked before the first forward pass.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from mismatch import __version__
from mismatch.checkpoint import checkpoint_info
from mismatch.engines import EngineSpec, load_engine, parse_spec
from mismatch.errors import SpecError
from mismatch.metrics import PAIR_METRICS, metrics_by, summarize_pairs
from mismatch.replay import ProgressFactory, ReplayPlan, plan_replay, replay_column
from mismatch.results import SUMMARY_SCHEMA, check_out_dir, write_results
from mismatch.rollouts import load_rollouts
from mismatch.verdicts import verdicts

AUDIT_PAIRS = (("train", "sampler"), ("train", "infer"), ("infer", "sampler"))


@dataclass(kw_only=True, slots=True, frozen=True)
class AuditResult:
    summary: dict[str, Any]
    tokens: pd.DataFrame
    out: Path | None


def audit(checkpoint: str | Path, rollouts: str | Path, *, train: str = "hf",
          infer: str = "hf-decode", out: str | Path | None = None, force: bool = False,
          progress: ProgressFactory | None = None) -> AuditResult:
    """Replay `rollouts` through `train` and `infer` engines and measure every pair's gap."""
    info = checkpoint_info(checkpoint)
    specs = {"train": parse_spec(train), "infer": parse_spec(infer)}
    out_dir = Path(out) if out is not None else None
    if out_dir is not None:
        check_out_dir(out_dir, force=force)
    loaded = load_rollouts(rollouts, vocab_size=info.vocab_size)
    plan = plan_replay(loaded)
    for role, spec in specs.items():  # a missing stored name is bad input: say so before replaying
        if spec.kind == "stored" and spec.options["name"] not in plan.stored:
            raise SpecError(f"--{role} {spec.text}: no segment of the rollouts carries "
                            f"extra_logprobs[{spec.options['name']!r}] (found: {', '.join(plan.stored)})")
    table = plan.table
    engines: dict[str, Any] = {"sampler": {"kind": "stored", "spec": "sampler",
                                           "meta": _sampler_meta(loaded)}}
    for role, spec in specs.items():
        table[f"logp_{role}"], engines[role] = _replay_role(role, spec, plan, str(checkpoint), progress)
    summary = build_summary(table, engines=engines, checkpoint=str(checkpoint),
                            rollouts_file=str(rollouts), pairs=AUDIT_PAIRS, command="audit")
    if out_dir is not None:
        per_rollout = metrics_by(table, list(AUDIT_PAIRS), "rollout")
        write_results(out_dir, tokens=table, summary=summary, force=force,
                      extra={"rollouts.parquet": lambda path: per_rollout.to_parquet(path, index=False)})
    return AuditResult(summary=summary, tokens=table, out=out_dir)


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


def build_summary(table: pd.DataFrame, *, engines: dict[str, Any], checkpoint: str,
                  rollouts_file: str, pairs: tuple[tuple[str, str], ...], command: str) -> dict[str, Any]:
    """summary.json (contract `mismatch.summary/v1`) from a filled token table."""
    trainable = table[table["trainable"]]
    pair_metrics = summarize_pairs(table, list(pairs))
    return {
        "schema": SUMMARY_SCHEMA,
        "command": command,
        "mismatch_version": __version__,
        "created_unix": time.time(),
        "checkpoint": checkpoint,
        "rollouts_file": rollouts_file,
        "counts": {"rollouts": int(table["rollout"].nunique()),
                   "branches": int(table.groupby(["rollout", "branch"], observed=True).ngroups),
                   "tokens": len(table), "trainable_tokens": len(trainable)},
        "engines": engines,
        "pairs": pair_metrics,
        "verdicts": verdicts(pair_metrics),
        "turns": _breakdown(table, pairs, "turn"),
        "roles": _breakdown(table, pairs, "role", trainable_only=False),
        "branch_kinds": _breakdown(table, pairs, "branch_kind"),
        # Filled by the localizers and the correction simulator (issues 4 and 5).
        "localization": {},
        "corrections": [],
        "recommendations": [],
    }


def _breakdown(table: pd.DataFrame, pairs: tuple[tuple[str, str], ...], by: str, *,
               trainable_only: bool = True) -> list[dict[str, Any]]:
    """[{by: key, "pairs": {"A/B": {metric: value}}}] in key order, for summary.json."""
    long = metrics_by(table, list(pairs), by, trainable_only=trainable_only)
    rows: dict[Any, dict[str, Any]] = {}
    for record in long.to_dict("records"):
        key = record[by]
        key = key.item() if hasattr(key, "item") else key
        entry = rows.setdefault(key, {by: key, "pairs": {}})
        entry["pairs"][record["pair"]] = {name: record[name] for name in PAIR_METRICS}
    return [rows[key] for key in sorted(rows, key=lambda k: (str(type(k)), k))]


def _sampler_meta(rollouts: list) -> dict[str, Any]:
    """The sampler settings the rollouts declare (the first rollout's; differing ones are counted)."""
    metas = [r.meta.get("sampler") for r in rollouts if isinstance(r.meta.get("sampler"), dict)]
    if not metas:
        return {}
    first = metas[0]
    return {**first, "num_rollouts_differing": sum(meta != first for meta in metas)}
