"""slime (no PyPI release): parse a `train.py` command line with slime's own parser and validation, vendored at
the commit in MISMATCH_RELEASE (tests/data/frameworks/slime/), and report the effective values of the flags
mismatch's config reader maps (mismatch/frameworks/configs/slime.py).

Payload: {"argv": [...] or "path": "<file of one command line>", "ours": bool}.

As slime's parse_args() runs (slime/utils/arguments.py:1600-1643): _pre_parse_mode on the command line, the
flags parsed with parse_known_args (Megatron's ignore_unknown_args; SGLang's known-args parser), bf16 forced
to `not fp16` (backends/megatron_utils/arguments.py:157, in megatron_parse_args), then slime's own
slime_validate_args, in slime's working directory (the vendored tree: a relative --custom-config-path such as
examples/train_infer_mismatch_helper/mis.yaml is read from there), then the Megatron and SGLang validations
of the mapped flags. Megatron-LM and SGLang are not vendored (Megatron-LM is not on PyPI, SGLang pulls
triton and CUDA wheels): the flags of theirs that are mapped are declared below as their parsers declare
them, and their validators' rewrites of those flags replayed (cited). slime_validate_args needs a few
launcher facts that decide no log-prob: where the command line lacks them, --rollout-batch-size and
--num-rollout are 1, and the KL reference checkpoint's existence check is skipped (use_kl_loss/kl_coef
off). With "ours": true the answer also holds what mismatch's reader makes of the file in this process,
where slime is importable: its loader line and values.
"""

from __future__ import annotations

import argparse
import enum
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from _driver import main, release, stand_in

VENDORED = Path(__file__).resolve().parents[1] / "data" / "frameworks" / "slime"
sys.path.insert(0, str(VENDORED))

import slime  # noqa: E402,F401  (the vendored package, so the stand-ins below nest under it)
import slime.utils  # noqa: E402,F401

stand_in("slime.backends.sglang_utils.arguments", "slime.backends.sglang_utils.external",
         "slime.observability.logging_utils")

from slime.utils import arguments as slime_arguments  # noqa: E402


class AttnBackend(enum.Enum):  # megatron (1dcf0daf): megatron/core/transformer/enums.py:60-67
    flash = 1
    fused = 2
    unfused = 3
    local = 4
    auto = 5


SWITCH: dict[str, Any] = {"action": "store_true", "default": False}
# Megatron-LM 1dcf0daf (slime's docker/Dockerfile:7): generated from core/model_parallel_config.py:23, :31, :42,
# :48, :75, :109, :112, :150 and core/transformer/transformer_config.py:112 by training/argument_utils.py
# (an enum parsed by name, :85-94; a False bool as store_true, :165-167).
MEGATRON: dict[str, dict[str, Any]] = {
    "--tensor-model-parallel-size": {"type": int, "default": 1},
    "--pipeline-model-parallel-size": {"type": int, "default": 1},
    "--sequence-parallel": SWITCH, "--context-parallel-size": {"type": int, "default": 1},
    "--expert-model-parallel-size": {"type": int, "default": 1},
    "--fp16": SWITCH, "--bf16": SWITCH, "--deterministic-mode": SWITCH,
    "--attention-backend": {"type": lambda name: AttnBackend[name], "choices": list(AttnBackend),
                            "default": AttnBackend.auto},
}
# SGLang 0.5.15.post1 (slime's docker/Dockerfile:1) python/sglang/srt/server_args.py, under slime's --sglang-
# prefix (backends/sglang_utils/arguments.py:71-120): :521 dtype, :558 kv_cache_dtype, :470 context_length
# (human_readable_int: plain integers here), :635, :655, :755, :573, :6260 (deprecated --disable-cuda-graph),
# :2508, :2512, :1277, :631, :830.
SGLANG: dict[str, dict[str, Any]] = {
    "--sglang-dtype": {"type": str, "default": "auto",
                       "choices": ["auto", "half", "float16", "bfloat16", "float", "float32"]},
    "--sglang-kv-cache-dtype": {"type": str, "default": "auto",
                                "choices": ["auto", "fp8_e5m2", "fp8_e4m3", "bf16", "bfloat16", "fp4_e2m1"]},
    "--sglang-context-length": {"type": int, "default": None},
    "--sglang-max-running-requests": {"type": int, "default": None},
    "--sglang-chunked-prefill-size": {"type": int, "default": None},
    "--sglang-disable-radix-cache": SWITCH, "--sglang-enable-fp32-lm-head": SWITCH,
    "--sglang-disable-cuda-graph": SWITCH, "--sglang-enable-deterministic-inference": SWITCH,
    "--sglang-rl-on-policy-target": {"type": str, "default": None, "choices": ["fsdp"]},
    "--sglang-attention-backend": {"type": str, "default": None},
    "--sglang-mem-fraction-static": {"type": float, "default": None},
    "--sglang-pp-size": {"type": int, "default": 1},
}
SLIME = ("micro_batch_size", "use_dynamic_batch_size", "balance_by_flops", "max_tokens_per_gpu",
         "log_probs_max_tokens_per_gpu", "log_probs_chunk_size", "rollout_temperature", "rollout_top_p",
         "rollout_top_k", "rollout_num_gpus_per_engine", "rollout_external_engine_addrs", "use_rollout_logprobs",
         "use_routing_replay", "use_rollout_routing_replay", "megatron_config_path", "custom_config_path")
REPORTED = (*SLIME, *(flag[2:].replace("-", "_") for flag in (*MEGATRON, *SGLANG)), "sglang_tp_size")


def parser() -> argparse.ArgumentParser:
    """Megatron's parser (megatron: training/arguments.py:89-90, no abbreviations) with slime's flags by slime's
    own provider, and SGLang's separate parser's flags beside them."""
    built = argparse.ArgumentParser(prog="train.py", add_help=False, allow_abbrev=False, exit_on_error=False)
    for flag, kwargs in MEGATRON.items():
        built.add_argument(flag, **kwargs)
    built = slime_arguments.get_slime_extra_args_provider()(built)
    for flag, kwargs in SGLANG.items():  # --pp-size's alias: server_args.py:834
        built.add_argument(flag, *(("--sglang-pipeline-parallel-size",) if flag == "--sglang-pp-size" else ()),
                           **kwargs)
    for action in built._actions:  # the launcher's required flags (--rollout-batch-size) decide no log-prob
        action.required = False
    return built


def parse(argv: list[str]) -> argparse.Namespace:
    sys.argv = ["train.py", *argv]
    pre = slime_arguments._pre_parse_mode()  # arguments.py:1584-1597, on sys.argv as slime runs it
    args, _ = parser().parse_known_args(argv)
    for key, value in vars(pre).items():  # :1630-1632
        setattr(args, key, value)
    args.bf16 = not args.fp16  # backends/megatron_utils/arguments.py:157
    kl_flags = (args.use_kl_loss, args.kl_coef)
    args.use_kl_loss, args.kl_coef = False, 0.0  # the ref checkpoint's existence: :1776-1777
    args.rollout_batch_size = 1 if args.rollout_batch_size is None else args.rollout_batch_size
    args.num_rollout = 1 if args.num_rollout is None and args.num_epoch is None else args.num_rollout
    here = os.getcwd()
    os.chdir(VENDORED)  # slime runs from its repository root
    try:
        slime_arguments.slime_validate_args(args)
    finally:
        os.chdir(here)
    args.use_kl_loss, args.kl_coef = kl_flags
    if args.fp16:  # megatron: training/arguments.py:701-702
        assert not args.bf16, "fp16 with bf16"
    if args.tensor_model_parallel_size == 1:  # megatron: training/arguments.py:903-911
        args.sequence_parallel = False
    # SGLang's TP: sglang_utils/arguments.py:173-181 (validate_args, not vendored)
    assert args.rollout_num_gpus_per_engine % args.sglang_pp_size == 0, "rollout_num_gpus_per_engine % pp"
    args.sglang_tp_size = args.rollout_num_gpus_per_engine // args.sglang_pp_size
    return args


def _argv(payload: dict[str, Any]) -> list[str]:
    if "argv" in payload:
        return list(payload["argv"])
    tokens = shlex.split(Path(payload["path"]).read_text().replace("\\\n", " "), comments=True)
    return tokens[tokens.index("train.py") + 1:] if "train.py" in tokens else tokens


def handle(payload: dict[str, Any]) -> dict[str, Any]:
    framework, _ = release()
    assert framework == "slime", framework
    args = parse(_argv(payload))
    values = {name: getattr(args, name) for name in REPORTED}
    values["attention_backend"] = values["attention_backend"].name
    answer: dict[str, Any] = {"values": values}
    if payload.get("ours"):
        from mismatch.frameworks.configs import slime as reader

        read = reader.read_config(Path(payload["path"]))
        answer["ours"] = {"loader": read.loader, "argv": list(read.argv), "values": read.values}
    return answer


REFUSALS = (argparse.ArgumentError, AssertionError, ValueError, TypeError, FileNotFoundError, KeyError)

if __name__ == "__main__":
    main(handle, refusals=REFUSALS)
