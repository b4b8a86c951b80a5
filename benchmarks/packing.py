"""The trainer replay as trainers batch it: padded vs packed (`packing=varlen`), micro-batch 1 vs 64,
temperature scaling; and the packed replay's speed against a bare packed forward.

Usage: python benchmarks/packing.py [CHECKPOINT] [ROLLOUTS] [--repeats N] [--copies N]

On the same requests (the rollouts' replay plan, --copies times over), each in one run:
- log-probs of `hf:packing=varlen` against `hf` (padded), `micro_batch=1` against `micro_batch=64`
  (packed, verl's `log_prob_micro_batch_size_per_gpu`), and `temperature=0.7` against 1, in fp32
  and bf16: the share of tokens bitwise equal and the largest |Δ|;
- seconds (best of --repeats) of the packed replay and of a bare `model(input_ids, position_ids)`
  forward over the very same packed micro-batches (the target: ≤ 1.10×), and the padded replay's
  padding share. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

from mismatch.demo.tinymodel import ensure_tiny_checkpoint
from mismatch.engines import load_engine
from mismatch.engines.hf import micro_batches
from mismatch.replay import plan_replay
from mismatch.rollouts import load_rollouts

sys.path.insert(0, str(Path(__file__).parent))
from replay import REPO, best_of  # noqa: E402  (benchmarks/replay.py: the same timing)


def compared(a: list[np.ndarray], b: list[np.ndarray]) -> dict[str, float]:
    x, y = np.concatenate(a), np.concatenate(b)
    keep = ~np.isnan(x) & ~np.isnan(y)
    return {"bitwise_equal_frac": float(np.mean(x[keep] == y[keep])),
            "max_abs_diff": float(np.max(np.abs(x[keep] - y[keep])))}


def log_prob_gaps(checkpoint: str, requests: list, dtype: str) -> dict[str, dict[str, float]]:
    def replay(options: str) -> list[np.ndarray]:
        return load_engine(f"hf:dtype={dtype}{options}", checkpoint).replay(requests)

    packed = replay(",packing=varlen")
    return {"packed_vs_padded": compared(packed, replay("")),
            "micro_batch_1_vs_64": compared(replay(",packing=varlen,micro_batch=1"),
                                            replay(",packing=varlen,micro_batch=64")),
            "temperature_0.7_vs_1": compared(replay(",packing=varlen,temperature=0.7"), packed)}


def speed(checkpoint: str, requests: list, repeats: int) -> dict[str, float]:
    engine = load_engine("hf:dtype=float32,packing=varlen", checkpoint)
    model = engine.model
    packed = []
    for batch in micro_batches([len(r.tokens) for r in requests], engine.options):
        ids = torch.from_numpy(np.concatenate([requests[i].tokens for i in batch]))[None]
        positions = torch.from_numpy(np.concatenate([np.arange(len(requests[i].tokens)) for i in batch]))[None]
        packed.append((ids, positions))

    def bare() -> None:
        with torch.inference_mode():
            for ids, positions in packed:
                model(input_ids=ids, position_ids=positions, use_cache=False).logits

    bare(), engine.replay(requests)  # warm up allocator and kernels
    bare_s = best_of(repeats, bare)
    replay_s = best_of(repeats, lambda: engine.replay(requests))
    padded = load_engine("hf:dtype=float32", checkpoint)
    padded_s = best_of(repeats, lambda: padded.replay(requests))
    tokens = sum(len(r.tokens) for r in requests)
    return {"tokens": tokens, "micro_batches": len(packed), "bare_packed_s": bare_s, "packed_replay_s": replay_s,
            "packed_over_bare": replay_s / bare_s, "padded_replay_s": padded_s,
            "packed_padding_frac": engine.describe()["padding_frac"],
            "padded_padding_frac": padded.describe()["padding_frac"], "threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", nargs="?", default=str(REPO / "reports/demo/checkpoint"))
    parser.add_argument("rollouts", nargs="?", default=str(REPO / "examples/rollouts.jsonl"))
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--copies", type=int, default=4, help="replay the rollouts this many times over")
    args = parser.parse_args()
    ensure_tiny_checkpoint(args.checkpoint)
    requests = plan_replay(load_rollouts(args.rollouts)).requests * args.copies
    result = {dtype: log_prob_gaps(args.checkpoint, requests, dtype) for dtype in ("float32", "bfloat16")}
    result["speed_fp32"] = speed(args.checkpoint, requests, args.repeats)
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
