"""Sample agentic rollouts (calculator tool, a subagent, a compaction summary) from a checkpoint.

Usage: python examples/make_rollouts.py CHECKPOINT OUT.jsonl [--num N] [--seed N] [--dtype bfloat16]
           [--engine hf-decode|vllm] [--temperature T] [--fault rewrite_tool_args] [--fault shift_logprobs]

The sampler is the `hf-decode` path (prompt prefill + KV-cached decode) at temperature 1; each
sampled token's raw log-prob is stored as the rollout worker saw it. `examples/rollouts.jsonl`
was made with: python examples/make_rollouts.py reports/demo/checkpoint examples/rollouts.jsonl \
    --fault rewrite_tool_args   (the harness re-renders one tool call's arguments in its `messages`)
"""

from __future__ import annotations

import argparse
import time

from mismatch.demo.toy_agent import FAULTS, SAMPLERS, HarnessConfig, write_rollouts

DEFAULTS = HarnessConfig()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint")
    parser.add_argument("out", help="rollouts file to write (JSON Lines, format v1)")
    parser.add_argument("--num", type=int, default=DEFAULTS.num_rollouts)
    parser.add_argument("--seed", type=int, default=DEFAULTS.seed)
    parser.add_argument("--dtype", default=DEFAULTS.dtype, choices=("bfloat16", "float32"))
    parser.add_argument("--engine", default=DEFAULTS.engine, choices=tuple(SAMPLERS),
                        help="the sampler: the torch hf-decode path, or vLLM itself")
    parser.add_argument("--temperature", type=float, default=DEFAULTS.temperature)
    parser.add_argument("--fault", action="append", default=[], choices=FAULTS,
                        help="inject a harness bug (repeatable)")
    args = parser.parse_args()

    started = time.perf_counter()
    config = HarnessConfig(num_rollouts=args.num, seed=args.seed, dtype=args.dtype, engine=args.engine,
                           temperature=args.temperature, faults=tuple(args.fault))
    count = write_rollouts(args.checkpoint, args.out, config)
    print(f"wrote {count} rollouts to {args.out} in {time.perf_counter() - started:.1f} s")


if __name__ == "__main__":
    main()
