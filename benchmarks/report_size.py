"""HTML report size and build time for a large synthetic audit (issue 6: ≤ ~10 MB for 10,000 rollouts).

Usage: python benchmarks/report_size.py [--rollouts 10000] [--out DIR] [--seed 0]

Writes a synthetic results dir (tokens.parquet + summary.json from mismatch's own summary builder:
agentic rollouts of 2–8 turns, a subagent in every 4th, a summary in every 10th, bf16-like noise
that grows at low probability, a few drifting rollouts and outliers), then times `build_report` in
a fresh process (imports included, as `mismatch report DIR` would run) and reports the page size.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd

REPO = Path(__file__).resolve().parents[1]
SYSTEM_TOKENS = 48


def rollout_segments(rng: np.random.Generator, branch_kind: str) -> list[tuple[str, int, int]]:
    """(role, turn, length) of one branch: a system prompt, then prompt/answer turns."""
    num_turns = int(rng.integers(2, 9)) if branch_kind == "main" else int(rng.integers(1, 4))
    segments = [("system", 0, SYSTEM_TOKENS)] if branch_kind == "main" else []
    for turn in range(num_turns):
        segments.append(("user" if turn == 0 else "tool", turn, int(rng.integers(20, 200))))
        segments.append(("assistant" if branch_kind != "summary" else "summary", turn, int(rng.integers(20, 200))))
    return segments


def synthetic_tokens(num_rollouts: int, seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    rows: dict[str, list] = {k: [] for k in ("rollout", "branch", "branch_kind", "turn", "segment", "pos",
                                              "role", "length")}
    for r in range(num_rollouts):
        kinds = ["main"] + (["subagent"] if r % 4 == 0 else []) + (["summary"] if r % 10 == 0 else [])
        for b, kind in enumerate(kinds):
            pos = 0 if kind == "main" else 200  # a child branch's context is its parent's prefix
            for s, (role, turn, length) in enumerate(rollout_segments(rng, kind)):
                for key, value in (("rollout", f"r-{r}"), ("branch", "main" if b == 0 else f"{kind}-{b}"),
                                   ("branch_kind", kind), ("turn", turn), ("segment", s), ("pos", pos),
                                   ("role", role), ("length", length)):
                    rows[key].append(value)
                pos += length
    lengths = np.asarray(rows.pop("length"))
    table = pd.DataFrame({k: np.repeat(np.asarray(v), lengths) for k, v in rows.items()})
    # Positions count up inside each segment from the segment's start.
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    table["pos"] = (table["pos"].to_numpy() + np.arange(len(table)) - starts).astype(np.int32)
    num = len(table)
    for column in ("rollout", "branch", "branch_kind", "role"):
        table[column] = table[column].astype("category")
    table["turn"] = table["turn"].astype(np.int32)
    table["segment"] = table["segment"].astype(np.int32)
    table["token_id"] = rng.integers(0, 32_000, num)
    table["trainable"] = table["role"].isin(["assistant", "summary"]).to_numpy()
    confident = rng.random(num) < 0.7
    logp_train = np.where(confident, -rng.exponential(0.02, num), -rng.exponential(3.0, num))
    # bf16-like engine noise, larger where the token is unlikely.
    noise = rng.normal(0.0, 1.0, num) * (0.002 + 0.02 * (1.0 - np.exp(logp_train)))
    logp_infer = np.minimum(logp_train + noise, 0.0)
    logp_sampler = logp_infer.copy()
    drifting = np.isin(table["rollout"].cat.codes.to_numpy(), rng.choice(num_rollouts, max(1, num_rollouts // 50)))
    late = drifting & (table["turn"].to_numpy() >= 3)
    logp_sampler[late] += rng.normal(0.0, 0.2, int(late.sum()))
    outliers = rng.random(num) < 1e-5
    logp_sampler[outliers] += rng.choice([-3.0, 3.0], int(outliers.sum()))
    logp_sampler = np.minimum(logp_sampler, 0.0)  # a log-prob is <= 0: the report refuses a table with more
    logp_sampler[~table["trainable"].to_numpy()] = np.nan  # the sampler stores only what it sampled
    table["logp_sampler"] = logp_sampler
    table["logp_train"] = logp_train
    table["logp_infer"] = logp_infer
    return table


def write_synthetic(out: Path, num_rollouts: int, seed: int) -> dict[str, int]:
    from mismatch.results.chunks import table_chunks
    from mismatch.pipeline.audit import AUDIT_PAIRS
    from mismatch.pipeline.summary import build_summary
    from mismatch.results import write_results

    table = synthetic_tokens(num_rollouts, seed)
    engines = {"sampler": {"kind": "stored", "spec": "sampler"},
               "train": {"kind": "synthetic", "spec": "hf"},
               "infer": {"kind": "synthetic", "spec": "hf-decode:dtype=bfloat16"}}
    summary = build_summary(table_chunks(table), engines=engines, checkpoint="synthetic", rollouts_file="synthetic",
                            pairs=AUDIT_PAIRS, command="audit")
    write_results(out, tokens=table, summary=summary, force=out.exists())
    return {"rows": len(table), "tokens_parquet_bytes": (out / "tokens.parquet").stat().st_size}


def time_build(out: Path) -> dict[str, float]:
    """Build in a fresh interpreter, timed inside (build only) and outside (imports included)."""
    code = ("import json, time, resource\nstarted = time.perf_counter()\n"
            "from mismatch.reports.build import build_report\nimported = time.perf_counter()\n"
            f"build_report(__import__('pathlib').Path({str(out)!r}))\ndone = time.perf_counter()\n"
            "print(json.dumps({'import_s': imported - started, 'build_s': done - imported,"
            " 'peak_rss_mb': resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))")
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["process_s"] = time.perf_counter() - started
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rollouts", type=int, default=10_000)
    parser.add_argument("--out", type=Path, default=REPO / ".cache/bench/report_size")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    started = time.perf_counter()
    made = write_synthetic(args.out, args.rollouts, args.seed)
    print(f"synthetic results dir: {args.rollouts:,} rollouts, {made['rows']:,} tokens, "
          f"tokens.parquet {made['tokens_parquet_bytes'] / 1e6:.1f} MB ({time.perf_counter() - started:.0f} s)")
    timing = time_build(args.out)
    size = (args.out / "index.html").stat().st_size
    print(f"index.html: {size / 1e6:.2f} MB ({size:,} bytes); build {timing['build_s']:.2f} s + imports "
          f"{timing['import_s']:.2f} s; whole process {timing['process_s']:.2f} s; "
          f"peak RSS {timing['peak_rss_mb']:.0f} MB")


if __name__ == "__main__":
    main()
