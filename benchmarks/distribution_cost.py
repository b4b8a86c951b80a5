"""What --distribution costs per position, and its peak memory, at the 10⁴-rollout benchmark's vocabulary.

Usage: python benchmarks/distribution_cost.py [--repeats 3]

The pass's own work past the two sides' forwards (replay/distribution.py `_compare`): per chunk of
`chunk_rows` positions (CHUNK_ELEMENTS // vocab), each side's lm_head and fp32 log-softmax
(`full_rows`, as HFEngine does it) and `compare_rows`; and the same against a top-20 side (vLLM's
view). Shapes: the tiny demo head (D 64, vocab 1,024) and a Qwen2.5-1.5B-like head (D 1,536,
vocab 151,936: benchmarks/audit_stored.py's 10⁴ rollouts use a 151,000-token vocabulary). Each
shape runs in a fresh subprocess; its peak RSS over the RSS once its inputs exist is the pass's
peak extra memory. Best of --repeats. Prints one JSON object, with the time 9.32M scored positions
(benchmarks/audit_stored.py's 10⁴ rollouts) would take at the measured rate.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

SHAPES = ((64, 1024, 8192), (1536, 151936, 512))  # (hidden, vocab, positions)
POSITIONS_10K = 9_320_000  # scored positions of benchmarks/audit_stored.py --rollouts 10000


def one_shape(hidden: int, vocab: int, positions: int, repeats: int) -> dict:
    import numpy as np
    import torch

    from mismatch.engines.distributions import FullRows, TopRows, compare_rows
    from mismatch.replay.distribution import CHUNK_ELEMENTS

    torch.manual_seed(0)
    head_a = torch.nn.Linear(hidden, vocab, bias=False)
    head_b = torch.nn.Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        head_b.weight.copy_(head_a.weight + 1e-3 * torch.randn_like(head_a.weight))
    states = torch.randn(positions, hidden)
    targets = torch.randint(0, vocab, (positions,)).numpy()
    chunk = max(1, CHUNK_ELEMENTS // vocab)
    base_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss

    def rows(head, h):
        return FullRows(logp_CV=torch.log_softmax(head(h).float(), dim=-1))

    def top(full: FullRows, sampled, k=20):
        values, ids = full.logp_CV.topk(k, dim=-1)
        picked = full.logp_CV.gather(1, torch.from_numpy(sampled)[:, None])
        rank = (full.logp_CV >= picked).sum(-1).numpy()
        return TopRows(ids_CK=np.concatenate([ids.numpy(), sampled[:, None]], 1),
                       logp_CK=np.concatenate([values.double().numpy(), picked.double().numpy()], 1),
                       sampled_logp_C=picked[:, 0].double().numpy(), sampled_rank_C=rank, k=k)

    def run(bounded: bool) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            for s in range(0, positions, chunk):
                h, sampled = states[s:s + chunk], targets[s:s + chunk]
                b = rows(head_b, h)
                compare_rows(rows(head_a, h), top(b, sampled) if bounded else b, sampled, 20, vocab)
        return time.perf_counter() - start

    full_s = min(run(False) for _ in range(repeats))
    bounded_s = min(run(True) for _ in range(repeats))
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # The two lm_heads alone, the floor any whole-distribution comparison pays.
    start = time.perf_counter()
    with torch.inference_mode():
        for s in range(0, positions, chunk):
            head_a(states[s:s + chunk]), head_b(states[s:s + chunk])
    heads_s = time.perf_counter() - start
    return {"hidden": hidden, "vocab": vocab, "positions": positions, "chunk_rows": chunk,
            "full_s": round(full_s, 3), "top20_s": round(bounded_s, 3), "two_lm_heads_s": round(heads_s, 3),
            "us_per_position_full": round(1e6 * full_s / positions, 1),
            "peak_extra_mib": round((peak_kib - base_kib) / 1024, 1),
            "hours_for_10k_rollouts_full": round(full_s / positions * POSITIONS_10K / 3600, 2),
            "threads": torch.get_num_threads()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--shape", type=int, default=None, help=argparse.SUPPRESS)  # the child's
    args = parser.parse_args()
    if args.shape is not None:
        print(json.dumps(one_shape(*SHAPES[args.shape], args.repeats)))
        return
    found = [json.loads(subprocess.run([sys.executable, __file__, "--shape", str(i), "--repeats", str(args.repeats)],
                                       check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1])
             for i in range(len(SHAPES))]
    print(json.dumps({"shapes": found}, indent=1))


if __name__ == "__main__":
    main()
