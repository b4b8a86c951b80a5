"""OpenRLHF: parse a `train_ppo_ray` command line with the release's own parser and validation, and report the
effective values of the flags mismatch's config reader maps (mismatch/frameworks/configs/openrlhf.py).

Payload: {"argv": [...], "path": "<the file the argv came from>", "ours": bool}.

The command line goes through openrlhf_config.py's `parse`: openrlhf/cli/train_ppo_ray.py run as __main__, its
parser, hierarchize and its validation unchanged, stopped where train(args) begins (the two model paths it
prepends are not mapped flags). Then get_strategy(args) (utils/utils.py:25-37) builds the DeepspeedStrategy
train() builds next (cli/train_ppo_ray.py:35), whose __init__ refuses DeepSpeed TP without bf16
(utils/deepspeed/deepspeed.py:76-78); the deepspeed stand-in is given a version string for the comparison beside
it (:77), nothing else of DeepSpeed runs.

Answer: {"values": {dest: value}} for each mapped dest, as train() would read it (args.ds.param_dtype is
"ds.param_dtype"), and "missing": the mapped dests this release lacks (0.10.4: is_correction_level). With
"ours": true it also holds what mismatch's reader makes of the file in this process, where openrlhf is
importable: its loader line, argv and values.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from _driver import main, release
from openrlhf_config import lookup, parse  # its import sets up the stand-ins

# The dests the reader maps, by the release's names (cli/train_ppo_ray.py, 0.11.2).
REPORTED = (
    "actor.num_nodes", "actor.num_gpus_per_node", "vllm.num_engines", "vllm.tensor_parallel_size",
    "vllm.enable_prefix_caching", "vllm.enforce_eager", "vllm.gpu_memory_utilization",
    "algo.advantage.is_correction_level", "ds.param_dtype", "ds.attn_implementation", "ds.experts_implementation",
    "ds.use_liger_kernel", "ds.tensor_parallel_size", "ds.packing_samples", "train.dynamic_batch_enable",
    "rollout.max_tokens_per_gpu", "train.max_tokens_per_gpu", "ds.load_in_4bit", "ds.lora.rank",
    "rollout.micro_batch_size", "data.max_len", "train.micro_batch_size", "rollout.top_p", "rollout.temperature",
    "train.seed", "train.full_determinism_enable", "ds.ring_attn_size",
)


def handle(payload: dict[str, Any]) -> dict[str, Any]:
    framework, _ = release()
    assert framework == "openrlhf", framework
    args, _printed = parse(list(payload["argv"]))
    sys.modules["deepspeed"].version = "0.18.0"  # only compared, ds.tensor_parallel_size > 1 (deepspeed.py:77)
    from openrlhf.utils import get_strategy

    get_strategy(args)
    values, missing = {}, []
    for dest in REPORTED:
        present, value = lookup(args, dest)
        if present:
            values[dest] = value
        else:
            missing.append(dest)
    answer: dict[str, Any] = {"values": values, "missing": missing}
    if payload.get("ours"):
        from mismatch.frameworks.configs import openrlhf as reader

        read = reader.read_config(Path(payload["path"]))
        answer["ours"] = {"loader": read.loader, "argv": list(read.argv), "values": read.values}
    return answer


if __name__ == "__main__":
    main(handle)
