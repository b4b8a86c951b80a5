"""AReaL: load a snippet the way AReaL loads a user's experiment YAML, into the release's own PPO/GRPO
experiment dataclass, and report the effective values of every field the train/inference mismatch
depends on.

Payload: {"snippet": "<YAML text>", "config_cls": "GRPOConfig" | "PPOConfig"}   (config_cls optional)

Steps, each the release's own code except the first:
  1. The user's YAML file is BASE (below) with the snippet pasted over it: both are plain YAML, merged
     with OmegaConf.merge before AReaL sees them (a plain merge never refuses a key), and written, with
     interpolations unresolved, to a temporary config.yaml.
  2. areal.api.cli_args.load_expr_config(["--config", path], GRPOConfig), which is what every AReaL
     entry point runs (examples/math/gsm8k_rl.py: `config, _ = load_expr_config(args, GRPOConfig)`):
       parse_cli_args      hydra initialize + compose of that file (cli_args.py:3020-3044);
       to_structured_cfg   _migrate_legacy_rejection_sampling refuses the removed
                           actor/teacher.behave_imp_weight_cap / behave_imp_weight_mode with a ValueError
                           (cli_args.py:3062-3077), then OmegaConf.merge onto OmegaConf.structured(GRPOConfig):
                           an unknown key raises OmegaConf's ConfigKeyError, a wrong type a ValidationError
                           (cli_args.py:3080-3087);
       OmegaConf.to_object the dataclasses' __post_init__ checks: RejectionSamplingConfig (level, action,
                           metric, agg, bounds; cli_args.py:1386-1449), PPOActorConfig (SAPO vs decoupled;
                           cli_args.py:1611-1649), TrainEngineConfig (dtype / optimizer_dtype; :1227-1284);
       name_resolve.reconfigure and save_config (config.yaml under the temporary fileroot).
     Every path it writes lies under a TemporaryDirectory (cluster.fileroot, name_resolve.nfs_record_root).

Stand-ins (import-time only; nothing on these paths calls them):
  - ray, ray.actor, ray.exceptions, ray.runtime_env, ray.util, ray.util.placement_group,
    ray.util.scheduling_strategies: a compiled package, not installed for the tests. `import areal` runs
    areal/__init__.py -> areal.infra -> areal/infra/launcher/ray.py and areal/utils/name_resolve.py,
    which import them at module level (ray.actor.ActorHandle is read in a class annotation).
  - wandb, swanlab, trackio, tensorboardX: experiment trackers (wandb ships a compiled core, swanlab and
    trackio pull dashboards and compiled deps). areal/utils/stats_logger.py imports them at module level
    and is reached from load_expr_config (StatsLogger.get_log_path) and areal.trainer; they are only
    called when a StatsLogger is constructed.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import tempfile
from typing import Any

from _driver import main, stand_in

_RAY = ("ray", "ray.actor", "ray.exceptions", "ray.runtime_env", "ray.util", "ray.util.placement_group",
        "ray.util.scheduling_strategies")
_TRACKERS = ("wandb", "swanlab", "trackio", "tensorboardX")


def _stand_ins() -> None:
    stand_in(*_RAY, *_TRACKERS)
    # stand_in registers each submodule in sys.modules; `ray.actor.ActorHandle` is read as an attribute
    # of the parent, so bind each stand-in submodule onto its stand-in parent too.
    for name in _RAY:
        parent, _, child = name.rpartition(".")
        stood_in = getattr(sys.modules[name], "__file__", None) is None  # a real ray has a __file__
        if parent and stood_in and getattr(sys.modules[parent], "__file__", None) is None:
            sys.modules[parent].__dict__.setdefault(child, sys.modules[name])


_stand_ins()

# The fields AReaL's own example configs set because the dataclasses leave them MISSING
# (examples/math/gsm8k_grpo.yaml: experiment_name, trial_name, per-section experiment_name /
# trial_name / fileroot interpolations, actor.backend and rollout.backend, train_dataset path and
# type). Nothing here touches a correction, dtype or routing field: those stay the release defaults.
BASE = """
experiment_name: mismatch-release-test
trial_name: trial0
cluster:
  fileroot: {root}/experiments
  name_resolve:
    type: nfs
    nfs_record_root: {root}/name_resolve
rollout:
  backend: "sglang:d1"
  experiment_name: ${{experiment_name}}
  trial_name: ${{trial_name}}
  fileroot: ${{cluster.fileroot}}
actor:
  backend: "fsdp:d1"
  experiment_name: ${{experiment_name}}
  trial_name: ${{trial_name}}
  path: Qwen/Qwen2.5-1.5B-Instruct
train_dataset:
  path: openai/gsm8k
  type: rl
saver:
  experiment_name: ${{experiment_name}}
  trial_name: ${{trial_name}}
  fileroot: ${{cluster.fileroot}}
recover:
  experiment_name: ${{experiment_name}}
  trial_name: ${{trial_name}}
  fileroot: ${{cluster.fileroot}}
evaluator:
  experiment_name: ${{experiment_name}}
  trial_name: ${{trial_name}}
  fileroot: ${{cluster.fileroot}}
stats_logger:
  experiment_name: ${{experiment_name}}
  trial_name: ${{trial_name}}
  fileroot: ${{cluster.fileroot}}
"""

ACTOR_FIELDS = (
    # decoupled PPO / behaviour importance weight (cli_args.py:1543-1582)
    "use_decoupled_loss", "recompute_logprob", "prox_logp_method", "importance_sampling_level",
    # PPO ratio clipping and other filters applied on the same loss (cli_args.py:1457-1478, 1515-1527)
    "eps_clip", "eps_clip_higher", "c_clip", "m2_threshold", "use_sapo_loss",
    # precision and the logits temperature of the trainer's forward (cli_args.py:1098-1146)
    "dtype", "grad_reduce_dtype", "optimizer_dtype", "temperature", "backend",
)


def _plain(value: Any) -> Any:
    if dataclasses.is_dataclass(value):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def handle(payload: dict[str, Any]) -> dict[str, Any]:
    from omegaconf import OmegaConf

    from areal.api import cli_args

    config_cls = getattr(cli_args, payload.get("config_cls", "GRPOConfig"))
    with tempfile.TemporaryDirectory() as root:
        user = OmegaConf.merge(OmegaConf.create(BASE.format(root=root)),
                               OmegaConf.create(payload.get("snippet") or "{}"))
        path = os.path.join(root, "config.yaml")
        OmegaConf.save(user, path, resolve=False)
        cwd = os.getcwd()
        try:
            cfg, _ = cli_args.load_expr_config(["--config", path], config_cls)
        finally:
            os.chdir(cwd)  # hydra may chdir; the driver's cwd is the drivers folder
    assert isinstance(cfg, config_cls)

    actor = cfg.actor
    result: dict[str, Any] = {"config_cls": config_cls.__name__}
    result.update({f"actor.{k}": _plain(getattr(actor, k)) for k in ACTOR_FIELDS})
    result["actor.rejection_sampling"] = _plain(actor.rejection_sampling)
    # What rl_trainer.py:680 asks before running the trainer's forward pass for prox_logp.
    result["actor.should_compute_prox_logp()"] = actor.should_compute_prox_logp()
    result["actor.megatron.moe_router_dtype"] = actor.megatron.moe_router_dtype
    result["actor.megatron.use_deterministic_algorithms"] = actor.megatron.use_deterministic_algorithms
    result["actor.megatron.fp8_config"] = _plain(actor.megatron.fp8_config)
    result["rollout.backend"] = cfg.rollout.backend
    result["rollout.max_head_offpolicyness"] = cfg.rollout.max_head_offpolicyness
    result["rollout.return_routed_experts"] = cfg.rollout.return_routed_experts
    result["sglang.dtype"] = cfg.sglang.dtype
    result["sglang.kv_cache_dtype"] = cfg.sglang.kv_cache_dtype
    result["sglang.enable_return_routed_experts"] = cfg.sglang.enable_return_routed_experts
    result["vllm.dtype"] = cfg.vllm.dtype
    result["gconfig.temperature"] = cfg.gconfig.temperature
    return result


if __name__ == "__main__":
    main(handle)
