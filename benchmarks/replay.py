"""Replay overhead: the `hf` engine vs a bare batched `model(input_ids)` forward on the same tokens.

Usage: python benchmarks/replay.py [CHECKPOINT] [ROLLOUTS] [--repeats N] [--dtype float32]

Both sides see identical batches (the engine's own length-sorted packing) and the same threads;
the bare side stops at `model(ids).logits`, the engine goes on to the chunked fp32 log-softmax and
the gather. Reported: best-of-N seconds for each and their ratio (target <= 1.15).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from mismatch.demo.tinymodel import ensure_tiny_checkpoint
from mismatch.engines import load_engine
from mismatch.engines.micro_batches import padded_by_budget
from mismatch.replay import plan_replay
from mismatch.rollouts import load_rollouts

REPO = Path(__file__).resolve().parents[1]


def best_of(repeats: int, run) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return min(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", nargs="?", default=str(REPO / "reports/demo/checkpoint"))
    parser.add_argument("rollouts", nargs="?", default=str(REPO / "examples/rollouts.jsonl"))
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--copies", type=int, default=8,
                        help="replay the rollouts this many times over (a bigger, steadier workload)")
    args = parser.parse_args()

    ensure_tiny_checkpoint(args.checkpoint)
    plan = plan_replay(load_rollouts(args.rollouts))
    requests = plan.requests * args.copies
    engine = load_engine(f"hf:dtype={args.dtype}", args.checkpoint)
    model = engine.model
    batches = padded_by_budget([len(r.tokens) for r in requests], engine.options.batch_tokens)
    padded = []
    for batch in batches:
        ids_BL = torch.zeros((len(batch), len(requests[batch[0]].tokens)), dtype=torch.long)
        for row, index in enumerate(batch):
            ids_BL[row, : len(requests[index].tokens)] = torch.from_numpy(requests[index].tokens)
        padded.append(ids_BL)

    def bare() -> None:
        with torch.inference_mode():
            for ids_BL in padded:
                model(input_ids=ids_BL).logits

    def replay() -> None:
        engine.replay(requests)

    bare(), replay()  # warm up allocator and kernels
    bare_s, replay_s = best_of(args.repeats, bare), best_of(args.repeats, replay)
    tokens = sum(len(r.tokens) for r in requests)
    # For the record, the inference path's speed on the same tokens (no bare baseline: the
    # decode loop is the thing measured). One pass: it is slow and steady.
    decode = load_engine(f"hf-decode:dtype={args.dtype}", args.checkpoint)
    decode_s = best_of(1, lambda: decode.replay(plan.requests))
    result = {"tokens": tokens, "batches": len(batches), "threads": torch.get_num_threads(),
              "dtype": args.dtype, "bare_s": bare_s, "replay_s": replay_s,
              "ratio": replay_s / bare_s, "replay_tokens_per_s": tokens / replay_s,
              "hf_decode_tokens_per_s": plan.num_scored / decode_s}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
