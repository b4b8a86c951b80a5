"""`mismatch diff`: two engine configs replayed on the same rollouts, each against a reference.

prepare → replay(a, b, reference) → store → analyze in chunks (pairs a/reference, b/reference, a/b;
per-metric deltas with bootstrap CIs over rollouts, where the configs differ most) → publish. Like
the audit, it holds one block or one chunk of the token table at a time, never the table.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mismatch.analysis.chunked import Analysis, Chunks, run_passes
from mismatch.analysis.comparison import ConfigComparison
from mismatch.analysis.distribution import DistributionSummary, closer_on_distribution
from mismatch.analysis.per_rollout import PerRollout
from mismatch.pipeline import stages
from mismatch.pipeline.configured import resolve_options
from mismatch.pipeline.options import DiffOptions
from mismatch.pipeline.summary import Provenance, SummaryAnalyses, summary_json
from mismatch.results.summary_model import EngineEntry, Summary, present
from mismatch.results import results_lock, staged_tokens
from mismatch.workers import analysis_workers, reading_workers

DIFF_PAIRS = (("a", "reference"), ("b", "reference"), ("a", "b"))


class DiffResult(stages.CommandResult):
    """A diff's summary.json, results dir, and token table when it wrote no results dir."""

    __slots__ = ()


def diff(checkpoint: str | Path, rollouts: str | Path, *, a: str, b: str, reference: str = "hf",
         out: str | Path | None = None, **options: Any) -> DiffResult:
    """Which of configs `a` and `b` is closer to `reference`, by how much, and where. The other
    keywords are DiffOptions' (force, seed, shard, block_size, progress)."""
    return run_diff(checkpoint, rollouts, DiffOptions(a=a, b=b, reference=reference,
                                                      out=Path(out) if out is not None else None, **options))


def run_diff(checkpoint: str | Path, rollouts: str | Path, options: DiffOptions) -> DiffResult:
    analysis_workers(0)  # a bad MISMATCH_WORKERS is refused before any replay
    options = resolve_options(checkpoint, options)  # nothing to do when the edge resolved them
    with results_lock(options.out):
        return _diff(checkpoint, rollouts, options)


def _diff(checkpoint: str | Path, rollouts: str | Path, options: DiffOptions) -> DiffResult:
    prepared = stages.prepare(checkpoint, rollouts, options, command="diff")
    replayed = stages.replay(checkpoint, rollouts, options, prepared, processed_source=None, routing_from="reference")
    with staged_tokens(options.out, force=options.force) as store:
        stages.store_rows(replayed, store, workers=reading_workers(Path(rollouts).stat().st_size))
        provenance = Provenance(command="diff", checkpoint=str(checkpoint), rollouts_file=str(rollouts),
                                engines=replayed.engines, shard=stages.shard_info(options), inputs=prepared.inputs)
        distribution = (DistributionSummary(options.distribution_pairs, replayed.distribution)
                        if options.distribution is not None else None)
        del replayed
        per_rollout = PerRollout(DIFF_PAIRS)
        digestion = stages.report_digestion(store, DIFF_PAIRS, command="diff") if options.out is not None else None
        summary = analyze_diff(store.chunks, provenance, seed=options.seed,
                               extra=[per_rollout, *([digestion] if digestion is not None else [])],
                               workers=analysis_workers(store.num_rows), distribution=distribution)
        if options.out is None:
            return DiffResult(record=summary, out=None, table=store.table)
        summary = stages.write_results_files(store, summary, per_rollout.result(), digestion)
    if prepared.work is not None:
        prepared.work.remove()
    return DiffResult(record=summary, out=options.out)


def analyze_diff(chunks: Chunks, provenance: Provenance, *, seed: int = 0, extra: Sequence[Analysis] = (),
                 workers: int = 1, distribution: DistributionSummary | None = None) -> Summary:
    """summary.json of a diff (or a merge of its shards) from its token table's chunks; with
    `distribution` (--distribution), which config is closer on the whole next-token distribution too."""
    measured, comparison = SummaryAnalyses(DIFF_PAIRS, None), ConfigComparison(seed=seed)
    run_passes(chunks, [*measured.analyses, comparison, *([distribution] if distribution is not None else []),
                        *extra], workers=workers)
    speeds = {source: present(EngineEntry.of(provenance.engines[source]).tokens_per_s) for source in ("a", "b")}
    found = distribution.result() if distribution is not None else None
    compared = {**comparison.result(), "throughput_tokens_per_s": speeds}
    if found is not None:
        compared["distribution"] = closer_on_distribution(found)
    return summary_json(provenance, measured.result(),
                        {"diff": compared, **({"distribution": found} if found is not None else {})})
