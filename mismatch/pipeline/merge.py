"""`mismatch merge`: the results dirs of N shards (`--shard I/N`) combined into one, exactly.

Shards replay disjoint blocks of rollouts with identical batching, so their token tables' blocks in
file order are the table one run would have made: they are streamed into the merged tokens.parquet
a block at a time, and every metric is recomputed from it in chunks, as the command (audit or
diff) did.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from mismatch.analysis.per_rollout import PerRollout
from mismatch.analysis.clip import ClipRange
from mismatch.analysis.routing import merged_routing
from mismatch.errors import ResultsError
from mismatch.pipeline import stages
from mismatch.pipeline.audit import FoundBesideTheTable, analyze_audit, audit_pairs, audit_summary
from mismatch.pipeline.diff import DIFF_PAIRS, analyze_diff
from mismatch.pipeline.summary import Provenance
from mismatch.results import TOKENS_FILE, TokenStore, check_out_dir, read_summary, results_lock, staged_tokens, tokens_chunks
from mismatch.workers import analysis_workers


def merge(dirs: Sequence[str | Path], out: str | Path, *, force: bool = False) -> dict[str, Any]:
    """Check the shards belong together and cover every block once; write the merged results dir."""
    out_dir = Path(out)
    analysis_workers(0)  # a bad MISMATCH_WORKERS is refused before any work
    with results_lock(out_dir):
        return _merge([Path(d) for d in dirs], out_dir, force=force)


def _merge(paths: list[Path], out_dir: Path, *, force: bool) -> dict[str, Any]:
    check_out_dir(out_dir, force=force)
    summaries = [read_summary(path) for path in paths]
    first = _check_compatible(paths, summaries)
    provenance = Provenance(
        command=first["command"], checkpoint=first["checkpoint"], rollouts_file=first["rollouts_file"],
        engines={source: _merged_engine([s["engines"][source] for s in summaries]) for source in first["engines"]},
        shard={"index": 0, "count": 1, "block_size": first["shard"]["block_size"],
               "merged_from": [str(path) for path in paths]},
        inputs=first["inputs"])
    with staged_tokens(out_dir, force=force) as store:
        order = _store_merged(paths, store, first["shard"]["block_size"])
        workers = analysis_workers(store.num_rows)
        if first["command"] != "audit":
            per_rollout = PerRollout(DIFF_PAIRS)
            summary = analyze_diff(store.chunks, provenance, extra=[per_rollout], workers=workers)
            stages.write_results_files(store, summary, per_rollout.result())
            return summary
        pairs = audit_pairs(store.columns)
        per_rollout, digestion = PerRollout(pairs), stages.report_digestion(store, pairs)
        measured, findings = analyze_audit(store.chunks, _merged_evidence(provenance, summaries, order),
                                           clip=_clip_range(first), extra=[per_rollout, digestion], workers=workers)
        summary = audit_summary(provenance, measured, findings)
        stages.write_results_files(store, summary, per_rollout.result(), digestion)
    return summary


def _store_merged(paths: list[Path], store: TokenStore, block_size: int) -> dict[str, int]:
    """The shards' blocks into the merged token store in file order; returns each rollout's index
    in the file (for the drift spans)."""
    order: dict[str, int] = {}
    for block in _merged_blocks(paths, block_size):
        store.write(block)
        firsts = block.drop_duplicates("rollout")
        order.update(zip(firsts["rollout"].astype(str), firsts["rollout_index"].tolist()))
    store.close(empty=_empty_table(paths[0]))
    return order


def _merged_evidence(provenance: Provenance, summaries: list[dict[str, Any]], order: dict[str, int]) -> FoundBesideTheTable:
    """What the shards found beside their tables, as one run's: drift and routing merged; a prefix
    two shards share is in neither shard's table twice, so it is not comparable after the fact."""
    prefixes = ({"not_merged": "shared prefixes are compared within one run; audit without --shard"}
                if any("prefix_consistency" in s for s in summaries) else None)
    return FoundBesideTheTable(engines=provenance.engines, drift=_merged_drift(summaries, order),
                    routing=merged_routing(summaries), prefixes=prefixes)


def _clip_range(summary: dict[str, Any]) -> ClipRange:
    """The shards' clip range (one run's, as every shard had it)."""
    clip = summary.get("clip") or {}
    return ClipRange(low=clip.get("eps_low", 0.2), high=clip.get("eps_high", 0.2))


def _merged_blocks(paths: list[Path], block_size: int) -> Iterator[pd.DataFrame]:
    """Every shard's blocks in file order (shard i holds blocks i, i + N, ...), read a chunk at a
    time from each: the rows one run would have written, in its order."""
    def blocks(path: Path) -> Iterator[tuple[int, pd.DataFrame]]:
        for chunk in tokens_chunks([path / TOKENS_FILE])():
            if not len(chunk):  # an empty shard's file
                continue
            block = chunk["rollout_index"].to_numpy() // block_size
            edges = np.flatnonzero(np.r_[True, block[1:] != block[:-1], True])
            for lo, hi in itertools.pairwise(edges.tolist()):
                yield int(block[lo]), chunk.iloc[lo:hi].reset_index(drop=True)
    # A block is in one shard: the merge never compares two tables.
    for _, block in heapq.merge(*(blocks(path) for path in paths), key=lambda item: item[0]):
        yield block


def _empty_table(path: Path) -> pd.DataFrame:
    """A shard's token table without its rows (the columns of an empty merge)."""
    import pyarrow.parquet as pq

    return pq.read_schema(path / TOKENS_FILE).empty_table().to_pandas()


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


def _merged_drift(summaries: list[dict[str, Any]], order: dict[str, int]) -> dict[str, Any] | None:
    """The shards' drift findings as one run's: counters summed, spans back in file order. A shard
    without any `messages` has no drift block; its rollouts count as without messages."""
    if not any("drift" in s for s in summaries):
        return None
    blocks = [s.get("drift") or {"num_rollouts_without_messages": s["counts"]["rollouts"]} for s in summaries]
    merged = stages.merge_drift(blocks)
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
