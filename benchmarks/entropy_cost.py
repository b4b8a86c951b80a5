"""What recording the trainer's entropy costs the `hf` engine's log-prob extraction.

Usage: python benchmarks/entropy_cost.py [--repeats 7]

`mismatch.engines.logprobs.token_logprobs` (the lm_head in chunks, the fp32 log-softmax, the
gather) with and without `entropy_N`, on random hidden states: the tiny demo's shapes (D 64, vocab
1,024, the 14,592 rows of benchmarks/replay.py) and a Qwen2.5-1.5B-like head (D 2,048, vocab
151,936, 2,048 rows). Best of --repeats each, in one process. Prints one JSON object.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from mismatch.engines.logprobs import token_logprobs

SHAPES = ((64, 1024, 14592), (2048, 151936, 2048))  # (hidden, vocab, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    torch.manual_seed(0)
    found = []
    for hidden, vocab, rows in SHAPES:
        head = torch.nn.Linear(hidden, vocab, bias=False)
        states, targets = torch.randn(rows, hidden), torch.randint(0, vocab, (rows,))

        def seconds(entropy: bool) -> float:
            out = torch.empty(rows, dtype=torch.float64) if entropy else None
            start = time.perf_counter()
            token_logprobs(states, targets, head, entropy_N=out)
            return time.perf_counter() - start

        with torch.inference_mode():
            plain = min(seconds(False) for _ in range(args.repeats))
            with_entropy = min(seconds(True) for _ in range(args.repeats))
        found.append({"hidden": hidden, "vocab": vocab, "rows": rows, "logprobs_s": round(plain, 4),
                      "with_entropy_s": round(with_entropy, 4), "ratio": round(with_entropy / plain, 3)})
    print(json.dumps({"threads": torch.get_num_threads(), "shapes": found}, indent=1))


if __name__ == "__main__":
    main()
