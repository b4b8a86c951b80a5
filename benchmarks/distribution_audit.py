"""What `--distribution full` adds to a real audit at the 10⁴-rollout benchmark's vocabulary.

Usage: python benchmarks/distribution_audit.py [--rollouts 2] [--repeat 1] [--dir /tmp/mismatch-dist-bench]

benchmarks/audit_stored.py audits stored log-probs against a config-only checkpoint of a
151,000-token vocabulary: it has no model. The pass needs one, so this writes (once) a random-init
Llama of that vocabulary with a small body (2 layers, hidden 128, 4 heads of 32, 2 KV heads), and
the same rollouts as audit_stored.py (its generator: ~940 tokens a rollout, ids over the whole
vocabulary). Then, in one run, each in a fresh subprocess, one after the other in turn:
- the floor: `mismatch audit CKPT --rollouts F --train hf --infer hf:dtype=bfloat16 --out D`;
- the same audit with `--distribution full` (hf fp32 against hf bf16, both whole: every term exact).
Wall, CPU and peak RSS of each (audit_stored.timed), the pass's own `seconds` from summary.json,
and the ratio. The largest --rollouts that fits the time at hand is what it measures: nothing is
extrapolated here.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from audit_stored import VOCAB, generate, timed, warm  # noqa: E402


def write_model(root: Path) -> None:
    """A Llama of the benchmark's vocabulary, random weights (N(0, 0.02), transformers' init), fp32."""
    if (root / "config.json").is_file():
        return
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(root, safe_serialization=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rollouts", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=1, help="runs of each, taken in turn; the fastest kept")
    parser.add_argument("--dir", type=Path, default=Path("/tmp/mismatch-dist-bench"))
    args = parser.parse_args()
    mismatch = str(Path(sys.executable).with_name("mismatch"))
    args.dir.mkdir(parents=True, exist_ok=True)
    checkpoint, rollouts = args.dir / "checkpoint", args.dir / f"rollouts-{args.rollouts}.jsonl"
    write_model(checkpoint)
    generate(rollouts, args.rollouts)

    def audit(name: str, *extra: str) -> dict[str, object]:
        out = args.dir / name
        shutil.rmtree(out, ignore_errors=True)
        warm(rollouts)
        found: dict[str, object] = timed([mismatch, "audit", str(checkpoint), "--rollouts", str(rollouts),
                                          "--train", "hf", "--infer", "hf:dtype=bfloat16", *extra, "--out", str(out)])
        summary = json.loads((out / "summary.json").read_text())
        found["tokens"] = summary["counts"]["tokens"]
        entry = (summary.get("distribution") or {}).get("train/infer")
        if entry is not None:
            found["pass_seconds"] = round(entry["seconds"], 3)
            found["n_positions"] = entry["n_positions"]
            found["kl"], found["exact"] = entry["kl"], entry["exact"]
        return found

    floors, passes = [], []
    for _ in range(args.repeat):
        floors.append(audit("floor"))
        passes.append(audit("pass", "--distribution", "full"))
    floor, with_pass = min(floors, key=lambda r: r["wall_s"]), min(passes, key=lambda r: r["wall_s"])
    import torch

    print(json.dumps({
        "python": sys.version.split()[0], "torch_threads": torch.get_num_threads(), "rollouts": args.rollouts,
        "model": {"vocab": VOCAB, "hidden": 128, "layers": 2}, "floor": floor, "with_distribution_full": with_pass,
        "runs_wall_s": {"floor": [r["wall_s"] for r in floors], "pass": [r["wall_s"] for r in passes]},
        "wall_ratio": round(with_pass["wall_s"] / floor["wall_s"], 2),
        "peak_rss_ratio": round(with_pass["peak_rss_mib"] / floor["peak_rss_mib"], 2),
        "pass_ms_per_position": round(1e3 * with_pass["pass_seconds"] / max(with_pass["tokens"], 1), 1),
    }, indent=1))


if __name__ == "__main__":
    main()
