"""DuckDB or Polars for the one analysis that must group a whole run's rows: prefix consistency.

Usage: python benchmarks/groupby_engines.py [--rollouts FILE] [--dir /tmp/mismatch-groupby-bench]
(needs `pip install polars` for the comparison; mismatch itself uses DuckDB only)

Every other analysis reduces chunks of whole rollouts with numpy (mismatch/analysis/chunked.py);
prefix consistency groups the tokens of every rollout by a 64-bit hash of their prefix, so its
groups span the run and need an engine that can group out of core. This writes the audit's
tokens.parquet and its prefix-key side file for FILE (default: benchmarks/audit_stored.py's 10k
rollouts), then runs the same query in each engine, each in a fresh subprocess (wall time and
peak RSS from wait4): rows sharing a key with another row, and per log-prob column the groups
whose values differ (the numbers summary.json `prefix_consistency` is made of).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

MIB = 2**20

DUCKDB = """
import duckdb, sys
tokens, keys = sys.argv[1], sys.argv[2]
con = duckdb.connect(config={"memory_limit": "512MB"})
con.execute(f"CREATE VIEW rows AS SELECT k.key, t.logp_train AS v FROM read_parquet('{tokens}') t "
            f"POSITIONAL JOIN read_parquet('{keys}') k")
print(con.execute("WITH g AS (SELECT key, count(*) AS n, min(v) AS lo, max(v) AS hi FROM rows "
                  "WHERE NOT isnan(v) GROUP BY key HAVING count(*) > 1) "
                  "SELECT sum(n), count(*), sum(CASE WHEN lo = hi THEN 1 ELSE 0 END) FROM g").fetchone())
"""

POLARS = """
import polars as pl, sys
tokens, keys = sys.argv[1], sys.argv[2]
rows = pl.concat([pl.scan_parquet(tokens).select(pl.col("logp_train").alias("v")), pl.scan_parquet(keys)],
                 how="horizontal")
g = (rows.filter(pl.col("v").is_not_nan()).group_by("key")
     .agg(pl.len().alias("n"), pl.col("v").min().alias("lo"), pl.col("v").max().alias("hi"))
     .filter(pl.col("n") > 1))
out = g.select(pl.col("n").sum(), pl.len(), (pl.col("lo") == pl.col("hi")).sum()).collect(engine="streaming")
print(out.row(0))
"""


def timed(code: str, *args: str) -> dict:
    """Wall seconds, peak RSS (MiB) and printed answer of the code run in a fresh interpreter."""
    start = time.perf_counter()
    child = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    out = child.stdout.read().decode() if child.stdout else ""
    if os.waitstatus_to_exitcode(status) != 0:
        err = child.stderr.read().decode(errors="replace") if child.stderr else ""
        sys.exit(f"failed: {code[:60]!r}...\n{err[-2000:]}")
    return {"wall_s": round(wall, 2), "peak_rss_mib": round(usage.ru_maxrss / 1024), "answer": out.strip()}


def write_inputs(rollouts: Path, directory: Path) -> tuple[Path, Path]:
    """tokens.parquet and the prefix keys, as an audit of stored log-probs writes them."""
    from mismatch.analysis.prefixes import PrefixKeys, prefix_keys
    from mismatch.checkpoint import checkpoint_info
    from mismatch.replay import file_blocks, plan_replay
    from mismatch.results import TokensWriter

    directory.mkdir(parents=True, exist_ok=True)
    tokens, keys_file = directory / "tokens.parquet", directory / "keys.parquet"
    checkpoint = rollouts.parent / "checkpoint"
    writer, keys = TokensWriter(tokens), PrefixKeys(keys_file)
    for _, indices, selected in file_blocks(rollouts, checkpoint_info(checkpoint), shard=None, block_size=64):
        plan = plan_replay(selected, indices=indices)
        table = plan.table
        table["logp_train"] = plan.stored["trainer"]
        writer.write(table)
        keys.add(prefix_keys(plan.requests))
    writer.close()
    keys.close()
    return tokens, keys_file


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=Path, default=Path("/tmp/mismatch-audit-bench/rollouts-10000.jsonl"))
    parser.add_argument("--dir", type=Path, default=Path("/tmp/mismatch-groupby-bench"))
    args = parser.parse_args()
    if not args.rollouts.is_file():
        sys.exit(f"{args.rollouts}: run benchmarks/audit_stored.py first (it generates the rollouts)")
    tokens, keys = write_inputs(args.rollouts, args.dir)
    import pyarrow.parquet as pq

    rows = pq.ParquetFile(tokens).metadata.num_rows
    result = {"rows": rows, "duckdb": timed(DUCKDB, str(tokens), str(keys)),
              "polars": timed(POLARS, str(tokens), str(keys))}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
