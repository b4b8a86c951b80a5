"""`mismatch merge`: the results dirs of N shards (`--shard I/N`) combined into one, exactly.

Shards replay disjoint blocks of rollouts with identical batching, so concatenating their token
tables in file order gives the table one run would have made, and every metric is recomputed from it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from mismatch.analysis.chunked import table_chunks
from mismatch.analysis.clip import ClipRange
from mismatch.analysis.routing import merged_routing
from mismatch.audit import analyze_audit, audit_pairs, merge_drift, publish
from mismatch.diff import DIFF_PAIRS, analyze_diff
from mismatch.errors import ResultsError
from mismatch.results import check_out_dir, read_summary, read_tokens, results_lock

CATEGORICAL = ("rollout", "branch", "branch_kind", "role")


def merge(dirs: Sequence[str | Path], out: str | Path, *, force: bool = False) -> dict[str, Any]:
    """Check the shards belong together and cover every block once; write the merged results dir."""
    out_dir = Path(out)
    with results_lock(out_dir):
        return _merge([Path(d) for d in dirs], out_dir, force=force)


def _merge(paths: list[Path], out_dir: Path, *, force: bool) -> dict[str, Any]:
    check_out_dir(out_dir, force=force)
    summaries = [read_summary(path) for path in paths]
    first = _check_compatible(paths, summaries)
    tables = [read_tokens(path) for path in paths]
    table = pd.concat([t.astype({c: object for c in CATEGORICAL}) for t in tables], ignore_index=True)
    # Rows of one rollout stay in their order; rollouts go back to file order.
    table = table.sort_values("rollout_index", kind="stable").reset_index(drop=True)
    for column in CATEGORICAL:
        table[column] = table[column].astype("category")
    engines = {source: _merged_engine([s["engines"][source] for s in summaries]) for source in first["engines"]}
    common = {"engines": engines, "checkpoint": first["checkpoint"], "rollouts_file": first["rollouts_file"]}
    if first["command"] == "audit":
        drift = _merged_drift(summaries, table)
        clip = first.get("clip") or {}  # the shards' clip range (one run's, as every shard had it)
        clip_range = ClipRange(low=clip.get("eps_low", 0.2), high=clip.get("eps_high", 0.2))
        # A prefix two shards share is in neither shard's table twice: not comparable after the fact.
        prefixes = ({"not_merged": "shared prefixes are compared within one run; audit without --shard"}
                    if any("prefix_consistency" in s for s in summaries) else None)
        summary = analyze_audit(table_chunks(table), **common, drift=drift, clip=clip_range, routing=merged_routing(summaries),
                                prefixes=prefixes)
        pairs = audit_pairs(table.columns)
    else:
        summary, pairs = analyze_diff(table, **common), DIFF_PAIRS
    summary["shard"] = {"index": 0, "count": 1, "block_size": first["shard"]["block_size"],
                        "merged_from": [str(path) for path in paths]}
    summary["inputs"] = first["inputs"]
    publish(out_dir, table, summary, pairs, force=force, work=None)
    return summary


def _merged_engine(described: list[dict[str, Any]]) -> dict[str, Any]:
    """One engine as one run would describe it: the first shard's facts, its counters summed over
    the shards (every shard loaded the same config), and each shard's own description kept."""
    merged = dict(described[0])
    for key, value in described[0].items():
        if (key.startswith("num_") or key in ("seconds", "resumed_blocks")) and isinstance(value, (int, float)) \
                and not isinstance(value, bool):
            merged[key] = sum(d.get(key) or 0 for d in described)
    if "padding_frac" in merged and "num_tokens_padded" in merged:
        slots = merged["num_tokens_fed"] + merged["num_tokens_padded"]
        merged["padding_frac"] = merged["num_tokens_padded"] / max(slots, 1)
    if "tokens_per_s" in merged:
        seconds, scored = merged.get("seconds"), merged.get("num_tokens_scored")
        merged["tokens_per_s"] = scored / seconds if seconds and scored is not None else None
    merged["shards"] = described
    return merged


def _merged_drift(summaries: list[dict[str, Any]], table: pd.DataFrame) -> dict[str, Any] | None:
    """The shards' drift findings as one run's: counters summed, spans back in file order. A shard
    without any `messages` has no drift block; its rollouts count as without messages."""
    if not any("drift" in s for s in summaries):
        return None
    blocks = [s.get("drift") or {"num_rollouts_without_messages": s["counts"]["rollouts"]} for s in summaries]
    merged = merge_drift(blocks)
    order = dict(zip(table["rollout"].astype(str), table["rollout_index"]))
    merged["spans"] = sorted(merged.get("spans", []),  # stable: a rollout's own order kept
                             key=lambda span: order.get(str(span["rollout"]), -1))
    return merged


_DIFFERS = {"command": "its command differs", "rollouts": "its rollouts file's content differs",
            "checkpoint": "its checkpoint files differ", "engines": "its engine options differ",
            "block_size": "its block size differs", "mismatch_version": "its mismatch version differs"}


def _check_compatible(paths: list[Path], summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """Shards of one run: the same inputs by content (rollouts digest, checkpoint files, each
    engine's parsed options) and each shard index exactly once."""
    first = summaries[0]
    for path, summary in zip(paths, summaries):
        if "shard" not in summary:
            raise ResultsError(f"{path}: not a sharded run (no shard info in summary.json)")
        if not summary.get("inputs"):
            raise ResultsError(f"{path}: summary.json has no `inputs` identity (written by an older "
                               "mismatch); rerun the shard to merge it")
        for key in ("command", "rollouts", "checkpoint", "engines", "block_size", "mismatch_version"):
            if summary["inputs"].get(key) != first["inputs"].get(key):
                raise ResultsError(f"{path}: {_DIFFERS[key]} from {paths[0]}'s; shards must come "
                                   "from one run's inputs")
    count = first["shard"]["count"]
    indices = sorted(s["shard"]["index"] for s in summaries)
    if any(s["shard"]["count"] != count for s in summaries) or indices != list(range(count)):
        raise ResultsError(f"shards {indices} of {count}: need each of 0..{count - 1} exactly once")
    return first
