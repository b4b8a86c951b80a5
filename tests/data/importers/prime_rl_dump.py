"""prime-rl's own packing and filesystem layout, writing per-step rollout files the way its
orchestrator does; run by tests/test_importers.py in a subprocess with the vendored prime-rl
(tests/data/frameworks/prime_rl, PrimeIntellect-ai/prime-rl@559b44772e47) on the path.

Payload (stdin, JSON): {"out": DIR, "seq_len": N, "num_train_workers": W, "pad_to_multiple_of": M,
"steps": {STEP: [sample, ...]}}, a sample {"token_ids", "mask", "logprobs", "temperature",
"env_name", "advantage", "routed_experts" ([tokens][layers][top-k] or null)}.

Each step, prime-rl's own code: TrainingSample (src/prime_rl/transports/rollouts/types.py:23-70;
routed experts as orchestrator/trajectories.py `_encode_routed_experts` makes them: uint8 bytes,
zero-padded to the token count) -> trainer/batch.py `prepare_batch` (:796-836: prepare_sample,
first-fit packing, pad_micro_batch, dummy batches to even out the ranks) -> per rank,
msgspec.msgpack.Encoder().encode(grid[rank]) written to OUT/rollouts/step_{STEP}/rank_{R}.bin
(transports/rollouts/filesystem.py:29-35 and utils/pathing.py:101-114, not vendored: they import
zmq through transports/rollouts/__init__.py; the two lines they run are repeated here).
Answer: {"ranks": {STEP: number of rank files}}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import msgspec
import numpy as np
from prime_rl.trainer.batch import prepare_batch
from prime_rl.transports.rollouts.types import RoutedExperts, TrainingSample


def _routed(rows: list | None, num_tokens: int) -> RoutedExperts | None:
    if rows is None:
        return None
    arr = np.array(rows, dtype=np.uint8)
    arr = np.concatenate([arr, np.zeros((num_tokens - arr.shape[0], *arr.shape[1:]), dtype=arr.dtype)], axis=0)
    return RoutedExperts(data=arr.tobytes(), shape=list(arr.shape), dtype=str(arr.dtype))


def _sample(sample: dict[str, Any]) -> TrainingSample:
    n = len(sample["token_ids"])
    return TrainingSample(token_ids=sample["token_ids"], mask=[bool(m) for m in sample["mask"]],
                          logprobs=sample["logprobs"], temperatures=[sample["temperature"]] * n,
                          env_name=sample["env_name"], routed_experts=_routed(sample["routed_experts"], n),
                          advantages=[sample["advantage"] if m else 0.0 for m in sample["mask"]])


def main() -> None:
    payload = json.loads(sys.stdin.read())
    rollout_dir = Path(payload["out"]) / "rollouts"
    encoder = msgspec.msgpack.Encoder()
    ranks = {}
    for step, samples in payload["steps"].items():
        grid = prepare_batch([_sample(s) for s in samples], payload["seq_len"], payload["num_train_workers"],
                             lambda lengths: sum(lengths), payload["pad_to_multiple_of"])
        step_path = rollout_dir / f"step_{step}"
        step_path.mkdir(parents=True, exist_ok=True)
        for rank, micro_batches in enumerate(grid):
            (step_path / f"rank_{rank}.bin").write_bytes(encoder.encode(micro_batches))
        ranks[step] = len(grid)
    print(json.dumps({"ranks": ranks}))


if __name__ == "__main__":
    main()
