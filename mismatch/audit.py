"""The audit: stored rollouts replayed through a trainer and an engine, gaps measured, results written.

rollouts → replay_roles(train, infer) → token table → metrics → results dir.
Everything that can be wrong with the input is checked before the first forward pass.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from mismatch import __version__
from mismatch.corrections import summary_corrections
from mismatch.localize import localize_models as run_model_localizers
from mismatch.localize.turns import localize_turns
from mismatch.metrics import PAIR_METRICS, metrics_by, summarize_pairs
from mismatch.replay import ProgressFactory, replay_roles
from mismatch.recommend import recommend, recommendations_dicts
from mismatch.results import SUMMARY_SCHEMA, check_out_dir, write_results
from mismatch.verdicts import verdicts

AUDIT_PAIRS = (("train", "sampler"), ("train", "infer"), ("infer", "sampler"))


@dataclass(kw_only=True, slots=True, frozen=True)
class AuditResult:
    summary: dict[str, Any]
    tokens: pd.DataFrame
    out: Path | None


def audit(checkpoint: str | Path, rollouts: str | Path, *, train: str = "hf",
          infer: str = "hf-decode", out: str | Path | None = None, force: bool = False,
          localize_models: bool = False, progress: ProgressFactory | None = None) -> AuditResult:
    """Replay `rollouts` through `train` and `infer` engines and measure every pair's gap.

    The turn localizer always runs (it reads the table); `localize_models=True` also reruns the
    two configs with hooks for the layer and kernel localizers (train vs infer as reference).
    """
    out_dir = Path(out) if out is not None else None
    if out_dir is not None:
        check_out_dir(out_dir, force=force)
    replayed = replay_roles(checkpoint, rollouts, {"train": train, "infer": infer}, progress=progress)
    table = replayed.table
    summary = build_summary(table, engines=replayed.engines, checkpoint=str(checkpoint),
                            rollouts_file=str(rollouts), pairs=AUDIT_PAIRS, command="audit")
    summary["localization"]["turns"] = localize_turns(table, "train", "sampler")
    if localize_models:
        summary["localization"].update(run_model_localizers(
            checkpoint, replayed.requests, a=train, b=infer))
    summary["corrections"] = summary_corrections(table)
    summary["recommendations"] = recommendations_dicts(recommend(summary))
    if out_dir is not None:
        per_rollout = metrics_by(table, list(AUDIT_PAIRS), "rollout")
        write_results(out_dir, tokens=table, summary=summary, force=force,
                      extra={"rollouts.parquet": lambda path: per_rollout.to_parquet(path, index=False)})
    return AuditResult(summary=summary, tokens=table, out=out_dir)


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
        # Filled by the callers that have the inputs: localizers, corrections, recommendations.
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
