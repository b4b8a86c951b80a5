"""`mismatch merge`: the results dirs of N shards (`--shard I/N`) combined into one, exactly.

Shards replay disjoint blocks of rollouts with identical batching, so concatenating their token
tables in file order gives the table one run would have made, and every metric is recomputed from it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pandas as pd

from mismatch.audit import analyze_audit, audit_pairs, publish
from mismatch.clip import ClipRange
from mismatch.diff import DIFF_PAIRS, analyze_diff
from mismatch.errors import ResultsError
from mismatch.results import check_out_dir, read_summary, read_tokens

CATEGORICAL = ("rollout", "branch", "branch_kind", "role")


def merge(dirs: Sequence[str | Path], out: str | Path, *, force: bool = False) -> dict[str, Any]:
    """Check the shards belong together and cover every block once; write the merged results dir."""
    paths = [Path(d) for d in dirs]
    out_dir = Path(out)
    check_out_dir(out_dir, force=force)
    summaries = [read_summary(path) for path in paths]
    first = _check_compatible(paths, summaries)
    tables = [read_tokens(path) for path in paths]
    table = pd.concat([t.astype({c: object for c in CATEGORICAL}) for t in tables], ignore_index=True)
    # Rows of one rollout stay in their order; rollouts go back to file order.
    table = table.sort_values("rollout_index", kind="stable").reset_index(drop=True)
    for column in CATEGORICAL:
        table[column] = table[column].astype("category")
    engines = {role: {**engine, "shards": [s["engines"][role] for s in summaries]}
               for role, engine in first["engines"].items()}
    common = {"engines": engines, "checkpoint": first["checkpoint"], "rollouts_file": first["rollouts_file"]}
    if first["command"] == "audit":
        drift = None
        if any("drift" in s for s in summaries):
            spans = [span for s in summaries for span in (s.get("drift") or {}).get("spans", [])]
            drift = {"spans": spans, "merged_from_shards": True}
        clip = first.get("clip") or {}  # the shards' clip range (one run's, as every shard had it)
        clip_range = ClipRange(low=clip.get("eps_low", 0.2), high=clip.get("eps_high", 0.2))
        summary, pairs = analyze_audit(table, **common, drift=drift, clip=clip_range), audit_pairs(table)
    else:
        summary, pairs = analyze_diff(table, **common), DIFF_PAIRS
    summary["shard"] = {"index": 0, "count": 1, "block_size": first["shard"]["block_size"],
                        "merged_from": [str(path) for path in paths]}
    publish(out_dir, table, summary, pairs, force=force, work=None)
    return summary


def _check_compatible(paths: list[Path], summaries: list[dict[str, Any]]) -> dict[str, Any]:
    first = summaries[0]
    same = ("command", "checkpoint", "rollouts_file")
    for path, summary in zip(paths, summaries):
        if "shard" not in summary:
            raise ResultsError(f"{path}: not a sharded run (no shard info in summary.json)")
        for key in same:
            if summary.get(key) != first.get(key):
                raise ResultsError(f"{path}: {key} {summary.get(key)!r} differs from "
                                   f"{paths[0]}'s {first.get(key)!r}")
        specs = {role: e.get("spec") for role, e in summary["engines"].items()}
        if specs != {role: e.get("spec") for role, e in first["engines"].items()}:
            raise ResultsError(f"{path}: engine specs {specs} differ from {paths[0]}'s")
        if summary["shard"]["block_size"] != first["shard"]["block_size"]:
            raise ResultsError(f"{path}: block size differs from {paths[0]}'s")
    count = first["shard"]["count"]
    indices = sorted(s["shard"]["index"] for s in summaries)
    if any(s["shard"]["count"] != count for s in summaries) or indices != list(range(count)):
        raise ResultsError(f"shards {indices} of {count}: need each of 0..{count - 1} exactly once")
    return first
