"""TRL: load a whole `trl grpo --config FILE` YAML/JSON the way the `trl grpo` command does, and report
the effective values of the keys mismatch's config reader maps (mismatch/frameworks/configs/trl.py).

Payload: {"path": "<config file>", "ours": bool}.

The file is parsed by the release's own `trl grpo` parser (trl/scripts/grpo.py make_parser: the
TrlParser over GRPOScriptArguments, GRPOConfig, ModelConfig and DatasetMixtureConfig) the way the CLI
calls it (trl/cli/commands/training.py: return_remaining_strings, separate_remaining_strings), so the
keys outside the four dataclasses come back as the strings `trl grpo` hands to `accelerate launch`.
GRPOConfig.__post_init__ and TrainingArguments' run as in training. model_init_kwargs are then merged
as trl/scripts/grpo.py main() merges them before building the trainer.

Two flags are added, each only where the file does not set that key, as trl_config.py does:
`--use_cpu true` (TrainingArguments refuses bf16 on a machine without a GPU otherwise) and
`--output_dir TMP`. With "ours": true the answer also holds what mismatch's reader makes of the file in
this process, where TRL is importable: its loader line and values (the reader's installed path).
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import yaml
from _driver import main

# GRPOConfig / TrainingArguments fields the reader maps, read off the parsed config as they are
# (generation_batch_size is left out: post-init fills it at this process's world size of 1).
TRAINING = (
    "bf16", "fp16", "per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation",
    "temperature", "top_p", "top_k", "min_p", "generation_kwargs", "repetition_penalty", "cache_implementation",
    "use_vllm", "vllm_mode", "vllm_model_impl", "vllm_enable_sleep_mode", "vllm_gpu_memory_utilization",
    "vllm_max_model_length", "vllm_tensor_parallel_size", "cast_lm_head_to_fp32",
    "use_transformers_continuous_batching", "use_liger_kernel", "pad_to_multiple_of",
)


def _remaining(strings: list[str]) -> dict[str, str]:
    """`["--num_processes", "8", ...]` (TrlParser.set_defaults_with_config's leftovers) as a dict."""
    return {strings[i].removeprefix("--"): strings[i + 1] for i in range(0, len(strings) - 1, 2)}


def handle(payload: dict[str, Any]) -> dict[str, Any]:
    from trl.scripts.grpo import make_parser

    path = payload["path"]
    with open(path) as f:
        given = yaml.safe_load(f) or {}  # only to see which keys the file sets; TRL parses it itself
    with tempfile.TemporaryDirectory() as tmp:
        args = ["--config", path]
        if "use_cpu" not in given:
            args += ["--use_cpu", "true"]
        if "output_dir" not in given:
            args += ["--output_dir", os.path.join(tmp, "out")]
        _, training, model, _, config_rest, _ = make_parser().parse_args_and_config(
            args, return_remaining_strings=True, separate_remaining_strings=True)
    # trl/scripts/grpo.py main(): ModelConfig's values first, GRPOConfig.model_init_kwargs over them
    init = {"attn_implementation": model.attn_implementation, "dtype": model.dtype}
    init.update(training.model_init_kwargs or {})
    rest = _remaining(config_rest)
    values = {name: getattr(training, name) for name in TRAINING}
    values.update(dtype=init.get("dtype"), attn_implementation=init.get("attn_implementation"),
                  use_kernels=bool(init.get("use_kernels", False)), init_torch_dtype=init.get("torch_dtype"),
                  num_processes=int(rest.get("num_processes", 1)), torch_dtype=rest.get("torch_dtype"))
    answer: dict[str, Any] = {"trl": values, "accelerate_args": sorted(rest)}
    if payload.get("ours"):
        from mismatch.frameworks.configs import trl as reader

        read = reader.read_config(Path(path))
        answer["ours"] = {"loader": read.loader, "values": read.values}
    return answer


if __name__ == "__main__":
    main(handle)
