"""The gap hf vs hf-decode of each issue-#47 architecture (hybrid linear attention, DSA, sinks),
in bfloat16 and float32, split by layer type, as users run it.

Usage: python benchmarks/architectures_gap.py [--dir /tmp/mismatch-arch] [--names qwen3_5,glm_moe_dsa]

Builds the tiny checkpoints offline (mismatch.demo.architectures.NEW_ARCHITECTURES, the demo
tokenizer), cuts two rollouts of the example into a 70-token prompt and 12 sampled tokens (the
linear-attention fallbacks decode slowly on CPU), then for each architecture and dtype runs
  mismatch audit CKPT --train hf:dtype=D --infer hf-decode:dtype=D --localize
(and for the hybrids, hf-decode with state_dtype=bfloat16 in bf16) and prints one JSON object:
the pair's k3 / max |log-ratio| / bitwise share, localization.layer_types (share per type, lead,
mechanism), index flips where the model has an indexer, and the diagnosis' first cause.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def short_rollouts(source: Path, path: Path) -> Path:
    lines = []
    for line in source.read_text().splitlines():
        rollout = json.loads(line)
        flat = [t for segment in rollout["branches"][0]["segments"] for t in segment["tokens"]]
        if len(flat) >= 82:
            lines.append(json.dumps({"id": rollout["id"], "branches": [{
                "id": "main", "kind": "main", "parent": None, "fork_at": None,
                "segments": [{"role": "user", "tokens": flat[:70]}, {"role": "assistant", "tokens": flat[70:82]}]}]}))
        if len(lines) == 2:
            break
    path.write_text("\n".join(lines) + "\n")
    return path


def one(checkpoint: Path, rollouts: Path, out: Path, train: str, infer: str) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    subprocess.run([sys.executable, "-m", "mismatch", "audit", str(checkpoint), "--rollouts", str(rollouts),
                    "--train", train, "--infer", infer, "--localize", "--out", str(out), "--json"],
                   check=True, capture_output=True)
    return read(out)


def read(out: Path) -> dict:
    """One audit's row from its results dir (also for dirs a run left: --read DIR...)."""
    summary = json.loads((out / "summary.json").read_text())
    train, infer = summary["engines"]["train"]["spec"], summary["engines"]["infer"]["spec"]
    pair, localization = summary["pairs"]["train/infer"], summary["localization"]
    split = localization["layer_types"]
    causes = summary["diagnosis"]["causes"]
    return {"train": train, "infer": infer,
            **{k: pair[k] for k in ("n_tokens", "kl_k3", "log_ratio_abs_max", "bitwise_equal_frac")},
            "lead_type": split["lead_type"], "mechanism": split["mechanism"],
            "share": {t["layer_type"]: t["share"] for t in split["by_type"]},
            "index_flips": {k: v for k, v in localization.get("index_flips", {}).items() if k != "method"} or None,
            "first_cause": (causes[0]["title"], causes[0]["minor"]) if causes else None,
            "refused": [(r["kind"], r["why"]) for r in summary["diagnosis"]["refused"]]}


def main() -> None:
    from mismatch.demo.architectures import NEW_ARCHITECTURES, build_architecture
    from mismatch.demo.tinymodel import ensure_tiny_checkpoint

    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, default=Path("/tmp/mismatch-arch"))
    parser.add_argument("--names", default=",".join(NEW_ARCHITECTURES))
    parser.add_argument("--read", type=Path, nargs="*", help="print the rows of these results dirs, run nothing")
    args = parser.parse_args()
    if args.read:
        print(json.dumps({str(out): read(out) for out in args.read if (out / "summary.json").is_file()}, indent=1))
        return
    args.dir.mkdir(parents=True, exist_ok=True)
    tokenizer = ensure_tiny_checkpoint(args.dir / "tiny").path
    rollouts = short_rollouts(REPO / "examples" / "rollouts.jsonl", args.dir / "short.jsonl")
    report = {}
    for name in args.names.split(","):
        checkpoint = build_architecture(name, args.dir / name, tokenizer_from=tokenizer)
        for dtype in ("bfloat16", "float32"):
            report[f"{name}/{dtype}"] = one(checkpoint, rollouts, args.dir / f"{name}-{dtype}",
                                            f"hf:dtype={dtype}", f"hf-decode:dtype={dtype}")
            print(json.dumps({f"{name}/{dtype}": report[f"{name}/{dtype}"]}), file=sys.stderr, flush=True)
        if name in ("qwen3_5", "qwen3_next", "qwen3_5_moe", "kimi_linear", "olmo_hybrid"):
            report[f"{name}/bfloat16 state"] = one(checkpoint, rollouts, args.dir / f"{name}-state",
                                                   "hf:dtype=bfloat16", "hf-decode:dtype=bfloat16,state_dtype=bfloat16")
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
