"""Truncated sampling on the tiny checkpoint, as users meet it (issue 46).

Usage: python benchmarks/truncation.py [--dir /tmp/mismatch-truncation] [--rollouts 12]
       [--engine hf-decode|vllm] [--checkpoint DIR]

Samples replies for real (the toy agent, fp32) with top-p 0.8, top-k 5 and min-p 0.1, storing the
sampler's processed log-probs (hf-decode: log-softmax over the kept set; vLLM: processed_logprobs)
and, where the sampler has them, the kept sets. Then, each as users run it:
  mismatch audit CKPT --rollouts UNDECLARED --train hf:dtype=float32        (meta.sampler silent)
  mismatch audit CKPT --rollouts DECLARED   --train hf:dtype=float32,sampling=replay
and prints one JSON object: per truncation, the lead cause, the estimate, and the token ratio's
mean and share outside [0.9, 1.1] without and with the kept-set replay (alignment.truncation.ratios),
and the sampling=replay run's train/sampler kl_k3 and max |log-ratio|.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

CASES = {"top_p": 0.8, "top_k": 5, "min_p": 0.1}


def _undeclared(path: Path, out: Path) -> Path:
    lines = []
    for line in path.read_text().splitlines():
        rollout = json.loads(line)
        for key in ("top_p", "top_k", "min_p", "logprobs"):
            rollout["meta"]["sampler"].pop(key, None)
        for branch in rollout["branches"]:
            for segment in branch["segments"]:
                segment.pop("sampling_mask", None)
        lines.append(json.dumps(rollout))
    out.write_text("\n".join(lines) + "\n")
    return out


def _audit(checkpoint: Path, rollouts: Path, out: Path, train: str, infer: str) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "mismatch", "audit", str(checkpoint), "--rollouts", str(rollouts),
                    "--train", train, "--infer", infer, "--out", str(out), "--json"],
                   check=True, capture_output=True, text=True)
    return json.loads((out / "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, default=Path("/tmp/mismatch-truncation"))
    parser.add_argument("--rollouts", type=int, default=12)
    parser.add_argument("--engine", default="hf-decode", choices=("hf-decode", "vllm"))
    parser.add_argument("--checkpoint", type=Path, help="a tiny checkpoint already built (default: build one)")
    args = parser.parse_args()
    from mismatch.demo.tinymodel import ensure_tiny_checkpoint
    from mismatch.demo.toy_agent import HarnessConfig, write_rollouts

    args.dir.mkdir(parents=True, exist_ok=True)
    checkpoint = args.checkpoint or ensure_tiny_checkpoint(args.dir / "tiny").path
    infer = "hf-decode:dtype=float32" if args.engine == "hf-decode" else "vllm:dtype=float32"
    report = {}
    for kind, value in CASES.items():
        declared = args.dir / f"{args.engine}-{kind}.jsonl"
        write_rollouts(checkpoint, declared, HarnessConfig(
            num_rollouts=args.rollouts, engine=args.engine, dtype="float32", sampling_mask=args.engine == "hf-decode",
            vllm_logprobs="processed_logprobs", **{kind: value}))
        found = _audit(checkpoint, _undeclared(declared, args.dir / f"{args.engine}-{kind}-undeclared.jsonl"),
                       args.dir / f"{kind}-undeclared", "hf:dtype=float32", infer)
        replayed = _audit(checkpoint, declared, args.dir / f"{kind}-replayed", "hf:dtype=float32,sampling=replay",
                          infer)
        lead = (found.get("diagnosis") or {}).get("causes", [{}])[0]
        truncation = found["alignment"].get("truncation") or {}
        pair = replayed["pairs"]["train/sampler"]
        report[f"{kind}={value}"] = {
            "lead": lead.get("kind"), "estimate": truncation.get("estimate"), "ratios": truncation.get("ratios"),
            "sampling_replay": {"sources": replayed["engines"]["train"].get("sampling_replay"),
                                "kl_k3": pair["kl_k3"], "log_ratio_abs_max": pair["log_ratio_abs_max"],
                                "ratio_mean": pair["ratio_mean"]}}
    print(json.dumps({"engine": args.engine, "rollouts": args.rollouts, "cases": report}, indent=1))


if __name__ == "__main__":
    main()
