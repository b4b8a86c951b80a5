"""Faithful copies of the config schemas our snippets are pasted into, transcribed from each
framework's source (only the fields we emit, with the source's types and checks), so a test can
load a snippet the way the framework would and fail where the framework would.

Each `load_*` takes the snippet text and returns the parsed config, or raises `SchemaError` with
the framework's reason. Sources and commits are named per framework.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import shlex
import sys
from typing import Any

import yaml

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class SchemaError(ValueError):
    """What the framework would refuse (or silently ignore, which is as bad for a pasted config)."""


def _fields(cls: type, given: dict[str, Any], where: str) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(given) - names)
    if unknown:
        raise SchemaError(f"{where}: unknown key(s) {', '.join(unknown)}")
    return given


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


# ---------------------------------------------------------------------------------------------
# verl @ b178a3cd56f58b2d502255daba591e92833930a7
# verl/trainer/config/algorithm.py:60-179 (RolloutCorrectionConfig, no validators of its own);
# checks at use: verl/trainer/ppo/rollout_corr_helper.py:77-153 (rollout_rs options and thresholds),
# :523-526 (rollout_is level, `rollout_is_threshold <= 0`: a str raises TypeError there).

VERL_RS_OPTIONS = {"token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
                   "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3"}


@dataclasses.dataclass
class VerlRolloutCorrection:
    rollout_is: str | None = None
    rollout_is_threshold: float = 2.0
    rollout_is_batch_normalize: bool = False
    rollout_rs: str | None = None
    rollout_rs_threshold: str | float | None = None
    bypass_mode: bool = False
    loss_type: str = "ppo_clip"

    def check(self) -> None:
        if self.rollout_is is not None:
            if self.rollout_is not in ("token", "sequence"):
                raise SchemaError(f"verl: rollout_is {self.rollout_is!r} not in token, sequence")
            if not _is_number(self.rollout_is_threshold):  # `threshold <= 0` on a str: TypeError
                raise SchemaError(f"verl: rollout_is_threshold must be a float, got {self.rollout_is_threshold!r}")
            if self.rollout_is_threshold <= 0:
                raise SchemaError("verl: rollout_is_threshold must be positive")
        if self.rollout_rs is not None:
            options = list(dict.fromkeys(o.strip() for o in self.rollout_rs.split(",")))
            for option in options:
                if option not in VERL_RS_OPTIONS:
                    raise SchemaError(f"verl: rollout_rs option {option!r} is not supported")
            self._check_rs_thresholds(options)

    def _check_rs_thresholds(self, options: list[str]) -> None:
        threshold = self.rollout_rs_threshold
        if threshold is None:
            raise SchemaError("verl: rollout_rs_threshold is required when rollout_rs is set")
        if _is_number(threshold):
            specs = [str(threshold)]
        elif isinstance(threshold, str):
            specs = [s.strip() for s in threshold.split(",")]
        else:
            raise SchemaError(f"verl: rollout_rs_threshold of type {type(threshold).__name__}")
        if len(specs) not in (1, len(options)):
            raise SchemaError("verl: one rollout_rs_threshold, or one per rollout_rs option")
        for option, spec in zip(options, specs * len(options) if len(specs) == 1 else specs):
            if option.endswith("k1"):
                lower, _, upper = spec.partition("_") if "_" in spec else ("", "", spec)
                bounds = [float(upper)] + ([float(lower)] if lower else [])
            elif "_" in spec:
                raise SchemaError(f"verl: {option} must provide a single upper bound without '_'")
            else:
                bounds = [float(spec)]
            if not all(b > 0 and math.isfinite(b) for b in bounds):
                raise SchemaError(f"verl: {option} bounds must be positive")


@dataclasses.dataclass
class VerlRollout:  # verl/workers/config/rollout.py:156, :189, :235 (the keys our snippets set)
    calculate_log_probs: bool = False
    dtype: str = "bfloat16"
    enable_rollout_routing_replay: bool = False


@dataclasses.dataclass
class VerlRouterReplay:  # verl/workers/config/actor.py:32-55 (RouterReplayConfig; __post_init__ checks mode)
    mode: str = "disabled"
    record_file: str | None = None
    replay_file: str | None = None

    def check(self) -> None:
        if self.mode not in ("disabled", "R2", "R3"):
            raise SchemaError(f"verl: router_replay.mode {self.mode!r} not in disabled, R2, R3")


@dataclasses.dataclass
class VerlActor:  # verl/workers/config/actor.py:166 (the key our snippets set)
    router_replay: dict | None = None


def load_verl(text: str) -> dict[str, Any]:
    config = yaml.safe_load(text) or {}
    unknown = sorted(set(config) - {"algorithm", "actor_rollout_ref"})
    if unknown:
        raise SchemaError(f"verl: unknown top-level key(s) {', '.join(unknown)}")
    correction = (config.get("algorithm") or {}).get("rollout_correction")
    if correction is not None:
        where = "verl algorithm.rollout_correction"
        VerlRolloutCorrection(**_fields(VerlRolloutCorrection, correction, where)).check()
    rollout = (config.get("actor_rollout_ref") or {}).get("rollout")
    if rollout is not None:
        parsed = VerlRollout(**_fields(VerlRollout, rollout, "verl actor_rollout_ref.rollout"))
        if not isinstance(parsed.calculate_log_probs, bool) or not isinstance(parsed.enable_rollout_routing_replay, bool):
            raise SchemaError("verl: calculate_log_probs and enable_rollout_routing_replay must be bools")
    actor = (config.get("actor_rollout_ref") or {}).get("actor")
    if actor is not None:
        replay = VerlActor(**_fields(VerlActor, actor, "verl actor_rollout_ref.actor")).router_replay
        if replay is not None:
            VerlRouterReplay(**_fields(VerlRouterReplay, replay, "verl actor.router_replay")).check()
    return config


# ---------------------------------------------------------------------------------------------
# TRL @ f2cd57710ae345ea6428ae95363267fcf38a3dc8 (1.10.0.dev0)
# trl/trainer/grpo_config.py:915-945 (fields), :1026 (vllm_importance_sampling_cap, deprecated since
# 1.6.0: a FutureWarning, then copied to clip_max), :1122-1150 (__post_init__ checks);
# trl/trainer/grpo_trainer.py:2579-2623 (the four modes; another string raises ValueError).

TRL_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


@dataclasses.dataclass
class TrlGRPO:
    use_vllm: bool = False
    vllm_importance_sampling_correction: bool = True
    vllm_importance_sampling_mode: str = "sequence_mask"
    vllm_importance_sampling_clip_max: float | None = 3.0
    vllm_importance_sampling_clip_min: float | None = None
    bf16: bool | None = None
    fp16: bool = False

    def check(self) -> None:
        if self.vllm_importance_sampling_mode not in TRL_MODES:
            raise SchemaError(f"trl: unknown vllm_importance_sampling_mode {self.vllm_importance_sampling_mode!r}")
        low, high = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        for value in (low, high):
            if value is not None and not _is_number(value):
                raise SchemaError(f"trl: clip bounds must be floats, got {value!r}")
        if low is not None and high is not None and low >= high:
            raise SchemaError("trl: vllm_importance_sampling_clip_min must be < clip_max")
        if (self.vllm_importance_sampling_correction and self.vllm_importance_sampling_mode.endswith("_truncate")
                and low is None and high is None):
            raise SchemaError("trl: a *_truncate mode needs clip_min or clip_max")


def load_trl(text: str) -> TrlGRPO:
    config = yaml.safe_load(text) or {}
    if "vllm_importance_sampling_cap" in config:
        raise SchemaError("trl: vllm_importance_sampling_cap is deprecated (use vllm_importance_sampling_clip_max)")
    parsed = TrlGRPO(**_fields(TrlGRPO, config, "trl GRPOConfig"))
    parsed.check()
    return parsed


# ---------------------------------------------------------------------------------------------
# slime @ 624b824a898ab0ec1fcb4d373004c7f3852bf515
# slime/utils/arguments.py:1027-1079 (flags), :1572 (--custom-config-path), :2013-2019 (the YAML's keys
# set on args, unchecked); the IS function is a dotted import path; MIS keys and checks:
# examples/train_infer_mismatch_helper/mis.py:90-142, 174-176, 192-237, 273-288.

SLIME_TIS_FUNCTIONS = {"examples.train_infer_mismatch_helper.mis.compute_mis_weights_with_cp",
                       "slime.backends.megatron_utils.loss.icepop_function"}


def _slime_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slime", add_help=False, exit_on_error=False)
    # --use-rollout-routing-replay: slime/utils/arguments.py:1098 (store_true).
    for flag in ("--use-tis", "--get-mismatch-metrics", "--use-rollout-logprobs",
                 "--sglang-enable-deterministic-inference", "--use-rollout-routing-replay"):
        parser.add_argument(flag, action="store_true")
    parser.add_argument("--tis-clip", type=float, default=2.0)
    parser.add_argument("--tis-clip-low", type=float, default=0.0)
    parser.add_argument("--custom-tis-function-path", type=str, default=None)
    parser.add_argument("--custom-config-path", type=str, default=None)
    return parser


def _mis_config(mis: dict[str, Any]) -> None:
    known = {"use_tis", "use_rs", "tis_level", "rs_level", "tis_mode", "tis_lower_bound", "tis_upper_bound",
             "rs_lower_bound", "rs_upper_bound", "rs_veto_threshold", "tis_batch_normalize"}
    unknown = sorted(set(mis) - known)
    if unknown:
        raise SchemaError(f"slime mis.yaml: unknown key(s) {', '.join(unknown)}")
    if mis.get("tis_level") not in ("token", "sequence", "geometric"):
        raise SchemaError(f"slime mis.yaml: tis_level {mis.get('tis_level')!r}")
    if mis.get("tis_mode") not in ("truncate", "clip", "mask"):
        raise SchemaError(f"slime mis.yaml: tis_mode {mis.get('tis_mode')!r}")
    upper, lower = mis.get("tis_upper_bound"), mis.get("tis_lower_bound")
    if not _is_number(upper):
        raise SchemaError("slime mis.yaml: tis_upper_bound is required (a float)")
    lower = 1.0 / upper if lower is None else lower
    if mis["tis_mode"] in ("clip", "mask") and not lower < upper:
        raise SchemaError("slime mis.yaml: tis_lower_bound must be < tis_upper_bound")
    if mis.get("tis_batch_normalize") and mis["tis_level"] == "geometric":
        raise SchemaError("slime mis.yaml: tis_batch_normalize does not support tis_level geometric")


def load_slime(text: str) -> argparse.Namespace:
    flags, _, mis_text = text.partition("# --- mis.yaml ---")
    try:
        args = _slime_parser().parse_args(shlex.split(flags.replace("\\\n", " "), comments=True))
    except (argparse.ArgumentError, SystemExit) as e:
        raise SchemaError(f"slime: {e}") from None
    if args.custom_tis_function_path is not None and args.custom_tis_function_path not in SLIME_TIS_FUNCTIONS:
        raise SchemaError(f"slime: --custom-tis-function-path {args.custom_tis_function_path!r} is not an "
                          "importable dotted path of a TIS function")
    if args.custom_config_path is not None:
        mis = yaml.safe_load("\n".join(line.removeprefix("# ") for line in mis_text.splitlines())) or {}
        _mis_config(mis)
    return args


# ---------------------------------------------------------------------------------------------
# prime-rl @ 559b44772e471d1538537b8805cc77f3824a5e64
# packages/prime-rl-configs/src/prime_rl/configs/trainer.py:494-532 (LossConfig = DefaultLossConfig |
# IPOLossConfig | CustomLossConfig, discriminated by `type`; Field(ge=0) bounds), under [trainer.loss]
# of an rl config. token_mask_*, geo_mask_*, sequence_mask_*, sequence_clip_high and ratio_type were
# removed in 02bdca2e419f ("change default rl algo to ipo", 2026-03-03).

PRIME_LOSS_FIELDS = {"default": {"type", "dppo_mask_low", "dppo_mask_high", "adv_tau", "kl_tau"},
                     "ipo": {"type", "ipo_threshold", "adv_tau", "kl_tau"},
                     "custom": {"type", "import_path", "kwargs"}}


# configs/trainer.py:637 (TrainerConfig.enable_router_replay: bool), configs/inference.py:141
# (VllmConfig.enable_return_routed_experts: bool): the non-loss keys our snippets set.
PRIME_BOOLS = {("trainer", "enable_router_replay"), ("inference", "vllm", "enable_return_routed_experts")}


def load_prime_rl(text: str) -> dict[str, Any]:
    config = tomllib.loads(text)
    for path in PRIME_BOOLS:
        node: Any = config
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        if node is not None and not isinstance(node, bool):
            raise SchemaError(f"prime-rl: {'.'.join(path)} must be a bool")
    unknown = sorted(set(config.get("trainer") or {}) - {"loss", "enable_router_replay"})
    if unknown:
        raise SchemaError(f"prime-rl: [trainer] has no field(s) our snippets may set: {', '.join(unknown)}")
    loss = (config.get("trainer") or {}).get("loss")
    if loss is None:
        return config
    kind = loss.get("type", "default")
    if kind not in PRIME_LOSS_FIELDS:
        raise SchemaError(f"prime-rl: [trainer.loss] type {kind!r} not in default, ipo, custom")
    unknown = sorted(set(loss) - PRIME_LOSS_FIELDS[kind])
    if unknown:
        raise SchemaError(f"prime-rl: [trainer.loss] ({kind}) has no field(s) {', '.join(unknown)}")
    for name, value in loss.items():
        if name not in ("type", "import_path", "kwargs") and not (_is_number(value) and value >= 0):
            raise SchemaError(f"prime-rl: [trainer.loss] {name} must be a number >= 0, got {value!r}")
    return config


# ---------------------------------------------------------------------------------------------
# OpenRLHF @ 3c3be6234e0cb353e76bb8019947db9dfe99fca7
# openrlhf/cli/train_ppo_ray.py:257-271 (argparse: store_true; float nargs=2 default [0.5, 5.0];
# choices tis, icepop, seq-mask-tis).

def load_openrlhf(text: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="openrlhf", add_help=False, exit_on_error=False)
    parser.add_argument("--algo.advantage.is_correction_enable", action="store_true")
    parser.add_argument("--algo.advantage.is_correction_threshold", type=float, nargs=2, default=[0.5, 5.0])
    parser.add_argument("--algo.advantage.is_correction_type", type=str, default="tis",
                        choices=["tis", "icepop", "seq-mask-tis"])
    try:
        return parser.parse_args(shlex.split(text.replace("\\\n", " "), comments=True))
    except (argparse.ArgumentError, SystemExit) as e:
        raise SchemaError(f"openrlhf: {e}") from None


LOADERS = {"verl": load_verl, "trl": load_trl, "slime": load_slime, "prime-rl": load_prime_rl,
           "openrlhf": load_openrlhf}
