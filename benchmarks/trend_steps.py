"""`mismatch trend` over a long run, from the summaries alone: the command users run,
`mismatch trend step_0 … step_N --json`, timed as a subprocess against a floor measured in the same run.

Usage: python benchmarks/trend_steps.py [--steps 100] [--rollouts 10000] [--dir /tmp/mismatch-trend-bench] [--repeat 3]

One real stored-only audit of --rollouts agentic rollouts (audit_stored.py's file and config-only
checkpoint: ~1k tokens a rollout, so 10⁴ rollouts are ~10⁷ tokens) is run once; each step dir then
holds that audit's summary.json and rollouts.parquet (what trend reads; its tokens.parquet is not
copied, and trend never opens it). The series is flat, so no change point is found: this times the
reading and the analysis of --steps summaries, not a detection. The floor: a bare Python process that
json-loads every summary.json and reads the same rollouts.parquet columns with pyarrow. Memory: the
peak of the --steps run against a run of its first 10 steps (what trend keeps per step is a slice of
its summary, so the two should be near). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from audit_stored import best_of, generate, timed, write_checkpoint  # noqa: E402

FLOOR = ("import json,sys,pyarrow.parquet as pq\n"
         "for d in sys.argv[1:]:\n"
         "    json.load(open(d + '/summary.json'))\n"
         "    pq.read_table(d + '/rollouts.parquet', columns=['pair','n_tokens','kl_k3','kl_k1','kl_k2',"
         "'log_ratio_abs_mean','log_ratio_mean','chi2_token','prob_abs_diff_mean','ratio_mean',"
         "'bitwise_equal_frac']).to_pandas()\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--rollouts", type=int, default=10_000)
    parser.add_argument("--dir", type=Path, default=Path("/tmp/mismatch-trend-bench"))
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    checkpoint, rollouts = args.dir / "checkpoint", args.dir / f"rollouts-{args.rollouts}.jsonl"
    write_checkpoint(checkpoint)
    generate(rollouts, args.rollouts)
    command = [sys.executable, "-c", "from mismatch.cli import run; run()"]
    audit = args.dir / "audit"
    if not (audit / "summary.json").is_file():
        shutil.rmtree(audit, ignore_errors=True)
        timed([*command, "audit", str(checkpoint), "--rollouts", str(rollouts), "--train", "stored:trainer",
               "--infer", "stored:engine", "--out", str(audit)])
    steps = []
    for step in range(args.steps):
        step_dir = args.dir / "run" / f"step_{step}"
        if not step_dir.is_dir():
            step_dir.mkdir(parents=True)
            for name in ("summary.json", "rollouts.parquet"):
                shutil.copyfile(audit / name, step_dir / name)
        steps.append(str(step_dir))
    floors, trends, few = [], [], []
    for _ in range(args.repeat):
        floors.append(timed([sys.executable, "-c", FLOOR, *steps]))
        trends.append(timed([*command, "trend", *steps, "--json"]))
        few.append(timed([*command, "trend", *steps[:10], "--json"]))
    summary_kib = (audit / "summary.json").stat().st_size / 1024
    per_rollout_kib = (audit / "rollouts.parquet").stat().st_size / 1024
    floor, trend = best_of(floors), best_of(trends)
    print(json.dumps({"steps": args.steps, "rollouts_per_step": args.rollouts,
                      "summary_kib": round(summary_kib, 1), "rollouts_parquet_kib": round(per_rollout_kib, 1),
                      "floor": floor, "trend": trend, "trend_10_steps": best_of(few),
                      "trend_over_floor": round(float(trend["wall_s"]) / float(floor["wall_s"]), 2)}, indent=1))


if __name__ == "__main__":
    main()
