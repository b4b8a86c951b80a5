"""MoE routing and Rollout Routing Replay (R3) on a tiny random-init Qwen3-MoE, as users run it.

Usage: python benchmarks/routing.py [--dir /tmp/mismatch-routing] [--rollouts examples/rollouts.jsonl]

Builds the checkpoint offline (mismatch.demo.architectures; the demo tokenizer from the tiny
trained checkpoint), then runs, each as a subprocess:
  mismatch audit MOE --train hf:dtype=bfloat16                 --infer hf:dtype=float32
  mismatch audit MOE --train hf:dtype=bfloat16,routing=replay  --infer hf:dtype=float32
and prints one JSON object: per run, the routing flip rate per layer, the share of tokens with a
flip, and kl_k3 / mean |log-ratio| on tokens with and without a flip (summary.json["routing"]).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, default=Path("/tmp/mismatch-routing"))
    parser.add_argument("--rollouts", type=Path, default=REPO / "examples" / "rollouts.jsonl")
    args = parser.parse_args()
    from mismatch.demo.architectures import build_architecture
    from mismatch.demo.tinymodel import ensure_tiny_checkpoint

    tokenizer = ensure_tiny_checkpoint(args.dir / "tiny").path
    moe = build_architecture("qwen3_moe", args.dir / "qwen3_moe", tokenizer_from=tokenizer)
    report = {}
    for name, train in (("own routing", "hf:dtype=bfloat16"), ("routing=replay", "hf:dtype=bfloat16,routing=replay")):
        out = args.dir / name.replace(" ", "-").replace("=", "-")
        shutil.rmtree(out, ignore_errors=True)
        subprocess.run([sys.executable, "-m", "mismatch", "audit", str(moe), "--rollouts", str(args.rollouts),
                        "--train", train, "--infer", "hf:dtype=float32", "--out", str(out), "--json"],
                       check=True, capture_output=True)
        summary = json.loads((out / "summary.json").read_text())
        routing = summary["routing"]["train/infer"]
        report[name] = {
            "flip_rate_by_layer": routing["flip_rate_by_layer"],
            "frac_tokens_with_flip": routing["frac_tokens_with_flip"],
            "with_flip": {k: routing["with_flip"][k] for k in ("n_tokens", "kl_k3", "log_ratio_abs_mean")},
            "without_flip": {k: routing["without_flip"][k] for k in ("n_tokens", "kl_k3", "log_ratio_abs_mean")},
            "pair_kl_k3": summary["pairs"]["train/infer"]["kl_k3"],
            "pair_log_ratio_abs_max": summary["pairs"]["train/infer"]["log_ratio_abs_max"],
            "recommendations": [r["kind"] for r in summary["recommendations"]],
        }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
