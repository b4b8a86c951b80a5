"""The trainer replay as the trainers configure it: packed sequences, micro-batches, temperature.

A packed replay (`packing=varlen`) feeds each micro-batch's sequences as one row with positions
restarting per sequence; attention must stay within each sequence, so every sequence's log-probs
equal its own replay alone up to the rounding of other matmul shapes. verl's micro-batch
assignment is checked against verl's own function, loaded from the installed release.
"""

from __future__ import annotations

import ast
import heapq
import random
from pathlib import Path

import numpy as np
import pytest

from mismatch.checkpoint import checkpoint_info
from mismatch.engines import ReplayRequest, check_spec, load_engine
from mismatch.engines.micro_batches import balanced_by_tokens, in_order, karmarkar_karp, workload
from mismatch.errors import SpecError

RELEASES = Path(__file__).resolve().parents[1] / ".cache" / "releases"
# fp32 attention and matmuls over a packed row vs a row of its own: reassociation, a few ULPs of
# the hidden states, ~1e-6 in a log-prob at this model's scale (measured 8e-7 .. 1.4e-6, sdpa).
FP32_BOUND = 2e-5


def _requests(vocab: int, lengths: list[int], seed: int = 0) -> list[ReplayRequest]:
    rng = np.random.default_rng(seed)
    return [ReplayRequest(tokens=rng.integers(0, vocab, n), generated=rng.random(n) < 0.5, score_from=min(2, n - 1))
            for n in lengths]


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_a_packed_replay_gives_each_sequence_its_own_log_probs(tiny_checkpoint, attn) -> None:
    requests = _requests(checkpoint_info(tiny_checkpoint).vocab_size, [17, 60, 5, 33, 2, 48])
    alone = [load_engine(f"hf:dtype=float32,attn={attn},micro_batch=1", str(tiny_checkpoint)).replay([r])[0]
             for r in requests]
    engine = load_engine(f"hf:dtype=float32,attn={attn},packing=varlen", str(tiny_checkpoint))
    packed = engine.replay(requests)
    facts = engine.describe()
    assert facts["num_forward_calls"] == 1 and facts["padding_frac"] == 0.0  # one packed row, no padding
    for own, got in zip(alone, packed):
        assert own.shape == got.shape
        np.testing.assert_allclose(got, own, rtol=0, atol=FP32_BOUND, equal_nan=True)
    # Whether the kernels give the same bits is this machine's fact: said, not asserted.
    print(f"{attn}: bitwise equal for {sum(np.array_equal(a, b, equal_nan=True) for a, b in zip(alone, packed))}"
          f" of {len(requests)} sequences")


def test_micro_batches_and_temperature_are_the_trainers(tiny_checkpoint) -> None:
    requests = _requests(checkpoint_info(tiny_checkpoint).vocab_size, [12, 30, 7, 21, 9])
    one = load_engine("hf:dtype=float32,micro_batch=1", str(tiny_checkpoint))
    raw = one.replay(requests)
    assert one.describe()["num_forward_calls"] == len(requests) and one.describe()["padding_frac"] == 0.0
    two = load_engine("hf:dtype=float32,micro_batch=2", str(tiny_checkpoint))
    two.replay(requests)
    assert two.describe()["num_forward_calls"] == 3  # [0, 1], [2, 3], [4], padded to each one's longest
    hot = load_engine("hf:dtype=float32,micro_batch=1,temperature=0.5", str(tiny_checkpoint)).replay(requests)
    # log_softmax(logits / T) sharpens the distribution: a token's log-prob moves, NaN stays NaN.
    assert all(np.array_equal(np.isnan(a), np.isnan(b)) for a, b in zip(raw, hot))
    assert not any(np.allclose(a[~np.isnan(a)], b[~np.isnan(b)]) for a, b in zip(raw, hot))


def test_bad_packing_options_are_refused_before_a_model_loads() -> None:
    for spec in ("hf:packing=thd", "hf:micro_batch=-1", "hf:temperature=0"):
        with pytest.raises(SpecError, match="packing|micro_batch|temperature"):
            check_spec(spec)


def _verl_function(name: str, version: str = "0.9.1"):
    """A function of verl's seqlen_balancing.py as the release ships it (the module imports torch
    and tensordict at the top; the function needs only heapq)."""
    file = RELEASES / f"verl-{version}" / "verl" / "utils" / "seqlen_balancing.py"
    if not file.is_file():
        pytest.skip(f"verl {version} is not installed into .cache/releases (tests/releases.py)")
    namespace = {"heapq": heapq}
    for node in ast.parse(file.read_text()).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            exec(compile(ast.Module([node], []), str(file), "exec"), namespace)
    return namespace[name]


def test_the_balanced_partition_is_verls_own() -> None:
    verl_kk = _verl_function("karmarkar_karp")
    rng = random.Random(0)
    for trial in range(200):
        n = rng.randint(1, 50)
        k = rng.randint(1, n)
        lengths = ([rng.choice([10, 20, 30]) for _ in range(n)] if trial % 4 == 0  # ties
                   else [rng.randint(1, 3000) for _ in range(n)])
        values = [workload(length) for length in lengths]
        assert karmarkar_karp(values, k) == verl_kk(values, k, False)


def test_balanced_micro_batches_fit_the_budget_with_the_fewest_forwards() -> None:
    rng = random.Random(1)
    lengths = [rng.randint(50, 900) for _ in range(40)]
    parts = balanced_by_tokens(lengths, 2048)
    assert sorted(i for part in parts for i in part) == list(range(40))
    assert all(sum(lengths[i] for i in part) <= 2048 for part in parts)
    assert len(parts) >= -(-sum(lengths) // 2048)
    assert balanced_by_tokens([5000, 10], 2048) == [[0], [1]]  # too long for the budget: alone
    assert in_order(5, 2) == [[0, 1], [2, 3], [4]]


PRIME_RL = Path(__file__).parent / "data" / "frameworks" / "prime_rl"
_PRIME_RL_PACKER = """
import json, sys
from prime_rl.trainer.batch import packed_samples_into_micro_bs
from prime_rl.transports.rollouts.types import MicroBatch
lengths, budget = json.loads(sys.argv[1]), int(sys.argv[2])
samples = [MicroBatch(input_ids=[i] * n, loss_mask=[True] * n, advantages=[0.0] * n, inference_logprobs=[0.0] * n,
                      position_ids=list(range(n)), sequence_lengths=[n], temperatures=[1.0] * n,
                      env_names=["e"] * n, seq_lens=[n]) for i, n in enumerate(lengths)]
rows = packed_samples_into_micro_bs(samples, budget, 1, lambda lens: sum(lens))
out = []
for row in rows:  # each packed sample's index, from its tokens, in row order
    ids, start = [], 0
    for n in row.sequence_lengths:
        ids.append(row.input_ids[start]); start += n
    out.append(ids)
print(json.dumps(out))
"""


def test_first_fit_rows_are_prime_rls_own() -> None:
    """balance=first_fit against prime-rl's packer itself (vendored unmodified, run on one rank)."""
    import json
    import os
    import subprocess
    import sys

    from mismatch.engines.micro_batches import first_fit_decreasing

    rng = random.Random(3)
    cases = [([5, 9, 3, 7, 2], 10), ([4, 4, 4, 4], 8), ([12, 1, 1], 10), ([rng.randint(1, 300) for _ in range(200)], 1024)]
    for lengths, budget in cases:
        done = subprocess.run([sys.executable, "-c", _PRIME_RL_PACKER, json.dumps(lengths), str(budget)],
                              capture_output=True, text=True, check=True, timeout=60,
                              env={**os.environ, "PYTHONPATH": str(PRIME_RL)})
        assert first_fit_decreasing(lengths, budget) == json.loads(done.stdout), (lengths, budget)
    assert first_fit_decreasing([5, 9, 3, 7, 2], 10) == [[1], [3, 2], [0, 4]]
