"""Each analysis of an audit alone over an audit's tokens.parquet: where the analysis's time goes.

Usage: python benchmarks/analysis_costs.py [RESULTS_DIR]   (default: the 10k audit that
benchmarks/audit_stored.py leaves in /tmp/mismatch-audit-bench/audit-10000)

Prints, per analysis, its seconds over the file (one process, both halves of each pass read
here), less one reading of the file per pass it takes, per 10^7 rows. Nothing else should run.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq

from mismatch.advise.corrections import CorrectionSimulator
from mismatch.analysis.alignment import AlignmentCheck
from mismatch.analysis.chunked import Analysis, run_passes
from mismatch.analysis.per_rollout import PerRollout
from mismatch.analysis.clip import ClipRange
from mismatch.frameworks.metrics import FrameworkMetrics
from mismatch.pipeline.audit import audit_pairs
from mismatch.pipeline.stages import report_digestion
from mismatch.pipeline.summary import SummaryAnalyses
from mismatch.batch import tune_for_batch
from mismatch.localize.turns import TurnLocalizer
from mismatch.results import TOKENS_FILE, TokenStore, tokens_chunks
from mismatch.analysis.trees import TreeSums


def timed_passes(chunks, analysis: Analysis | None) -> tuple[float, int]:
    """(seconds, passes) of run_passes over the chunks for one analysis (None: a bare reading)."""
    start = time.perf_counter()
    if analysis is None:
        for _ in chunks():
            pass
        return time.perf_counter() - start, 1
    passes = 0
    wants = analysis.wants

    def counted(index: int) -> bool:
        nonlocal passes
        wanted = wants(index)
        passes += wanted
        return wanted

    analysis.wants = counted  # type: ignore[method-assign]
    run_passes(chunks, [analysis])
    return time.perf_counter() - start, passes


def main() -> None:
    tune_for_batch()  # the allocator and collector as the command's own process has them
    results = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/mismatch-audit-bench/audit-10000")
    file = results / TOKENS_FILE
    rows = pq.ParquetFile(file).metadata.num_rows
    columns = pq.ParquetFile(file).schema_arrow.names
    chunks = tokens_chunks([file])
    store = TokenStore(None)
    store.columns, store.num_rows = columns, rows
    pairs = audit_pairs(columns)
    summary = SummaryAnalyses(pairs, ClipRange())
    analyses: list[Analysis] = [*summary.analyses, TreeSums(pairs), FrameworkMetrics(pairs),
                                TurnLocalizer("train", "sampler"), CorrectionSimulator(),
                                AlignmentCheck(sampler_meta={}), PerRollout(pairs), report_digestion(store, pairs)]
    reading, _ = timed_passes(chunks, None)
    found = {"rows": rows, "one_reading_s": round(reading, 2)}
    for analysis in analyses:
        seconds, passes = timed_passes(chunks, analysis)
        name = type(analysis).__name__ + (f"(trainable_only={analysis.trainable_only})"
                                          if hasattr(analysis, "trainable_only") else "")
        found[name] = {"seconds_per_1e7_rows": round(max(seconds - passes * reading, 0.0) * 1e7 / rows, 2),
                       "passes": passes}
    print(json.dumps(found, indent=1))


if __name__ == "__main__":
    main()
