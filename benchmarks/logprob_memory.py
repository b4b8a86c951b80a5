"""Peak memory of log-prob extraction: `mismatch.engines.logprobs.token_logprobs` (chunked) vs the naive
full `log_softmax(lm_head(h).float())`, for one long sequence, in one run.

Usage: python benchmarks/logprob_memory.py [--tokens 32768] [--vocab 32768] [--hidden 256]
                                           [--chunks 128,512,2048,8192] [--dtype float32]

Each case runs in a fresh subprocess: it builds the hidden states, targets and a random
`nn.Linear(hidden, vocab)` head, touches them, then resets the kernel's peak-RSS mark
(`/proc/self/clear_refs` = 5, Linux) and calls the extractor once. Reported: peak RSS above the
RSS just before the call (`VmHWM - VmRSS`, the same figure as `getrusage().ru_maxrss` after the
reset), the wall time, and `chunk x vocab x 4 bytes` (one fp32 logits chunk) for scale. torch's
CPU allocator hands big blocks straight back to the OS, so RSS is what the extractor really holds
(tracemalloc would not see torch's allocations at all). The naive path's figure is what an
unchunked `log_softmax` needs: fp32 [tokens, vocab] logits and log-probs.
"""

from __future__ import annotations

import argparse
import json
import re
import resource
import subprocess
import sys
import time

MIB = 2**20


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        return int(re.search(rf"^{field}:\s+(\d+) kB", f.read(), re.M).group(1))


def child(case: str, tokens: int, vocab: int, hidden: int, dtype_name: str, seed: int) -> dict:
    import torch
    from torch import nn

    from mismatch.engines.logprobs import token_logprobs

    torch.manual_seed(seed)
    dtype = getattr(torch, dtype_name)
    lm_head = nn.Linear(hidden, vocab, bias=False).to(dtype).requires_grad_(False)
    hidden_ND = torch.randn(tokens, hidden, dtype=dtype)
    target_N = torch.randint(0, vocab, (tokens,))
    # Warm up kernels and the allocator on a small slice so first-call costs are not counted.
    token_logprobs(hidden_ND[:64], target_N[:64], lm_head, chunk=64)
    torch.log_softmax(lm_head(hidden_ND[:64]).float(), dim=-1)

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM (and ru_maxrss) to the current RSS
    rss_before = _status_kib("VmRSS")
    started = time.perf_counter()
    with torch.inference_mode():
        if case == "naive":
            logp_NV = torch.log_softmax(lm_head(hidden_ND).float(), dim=-1)
            logp_N = logp_NV.gather(1, target_N[:, None]).squeeze(1).double()
            del logp_NV
        else:
            logp_N = token_logprobs(hidden_ND, target_N, lm_head, chunk=int(case))
    seconds = time.perf_counter() - started
    peak = _status_kib("VmHWM")
    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return {"case": case, "peak_extra_mib": (peak - rss_before) / 1024,
            "ru_maxrss_extra_mib": (maxrss - rss_before) / 1024, "seconds": seconds,
            "rss_before_mib": rss_before / 1024, "checksum": float(logp_N.sum())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32_768)
    parser.add_argument("--vocab", type=int, default=32_768)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--chunks", default="128,512,2048,8192")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    shape = (args.tokens, args.vocab, args.hidden, args.dtype, args.seed)
    if args.child:
        print(json.dumps(child(args.child, *shape)))
        return

    cases = [*args.chunks.split(","), "naive"]
    rows = []
    for case in cases:
        done = subprocess.run([sys.executable, __file__, "--child", case, "--tokens", str(args.tokens),
                               "--vocab", str(args.vocab), "--hidden", str(args.hidden), "--dtype", args.dtype,
                               "--seed", str(args.seed)], capture_output=True, text=True, check=True)
        row = json.loads(done.stdout.strip().splitlines()[-1])
        if case != "naive":
            row["chunk_x_vocab_fp32_mib"] = int(case) * args.vocab * 4 / MIB
            row["peak_over_chunk_x_vocab"] = row["peak_extra_mib"] / row["chunk_x_vocab_fp32_mib"]
        rows.append(row)
    naive = rows[-1]
    checksums = {row["checksum"] for row in rows}
    result = {
        "tokens": args.tokens, "vocab": args.vocab, "hidden": args.hidden, "dtype": args.dtype,
        "sequence_x_vocab_fp32_mib": args.tokens * args.vocab * 4 / MIB,
        "cases": rows,
        "naive_peak_over_default_chunk": naive["peak_extra_mib"] / next(
            r["peak_extra_mib"] for r in rows if r["case"] == "512"),
        # Same log-probs from every path (sum over the sequence, to fp32-reduction noise).
        "checksum_spread": max(checksums) - min(checksums),
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
