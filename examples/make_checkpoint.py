"""Build the tiny offline chat checkpoint that tests and the demo replay rollouts through.

Usage: python examples/make_checkpoint.py OUT_DIR [--seed N] [--steps N] [--arch llama|qwen2]
"""

from __future__ import annotations

import argparse
import time

from mismatch.demo.tinymodel import build_tiny_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir", help="directory to create; an earlier build there is replaced")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--arch", choices=("llama", "qwen2"), default="llama")
    args = parser.parse_args()

    started = time.perf_counter()
    checkpoint = build_tiny_checkpoint(args.out_dir, seed=args.seed, steps=args.steps,
                                       arch=args.arch)
    print(f"path:       {checkpoint.path}")
    print(f"params:     {checkpoint.num_params:,} (vocab {checkpoint.vocab_size})")
    print(f"final loss: {checkpoint.final_loss:.4f} nats/token (mean of the last steps)")
    print(f"build time: {time.perf_counter() - started:.1f} s for {checkpoint.steps} steps")


if __name__ == "__main__":
    main()
