"""verl: compose the release's own trainer config, merge a snippet into it the way a user's override YAML
is applied, convert it to the release's dataclasses the way its workers do, run the release's own
checks of the rollout-correction settings, and report the effective values the workers read.

Payload: {"snippet": "<YAML text>", "config_name": "ppo_trainer" | "ppo_megatron_trainer" | ...,
          "overrides": ["key=value", ...]}   (config_name and overrides optional)

Steps, each the release's own code:
  1. hydra's compose API on the release's verl/trainer/config (what main_ppo's
     @hydra.main(config_path="config", config_name="ppo_trainer") composes), with `overrides` passed as
     command-line overrides would be (an unknown key: hydra's own "not in struct" refusal).
  2. OmegaConf.merge of the snippet into that struct-mode config: an unknown key raises OmegaConf's
     ConfigKeyError, as a pasted override YAML would.
  3. verl.utils.config.validate_config, as main_ppo.main runs it (ActorConfig.__post_init__/validate,
     and in 0.9.1 the router-replay R2 + bypass_mode check).
  4. verl.utils.config.omega_conf_to_dataclass: algorithm.rollout_correction -> RolloutCorrectionConfig,
     actor_rollout_ref.actor -> its _target_ (FSDPActorConfig / McoreActorConfig ...), as
     engine_workers.py does for actor and rollout.
  5. compute_rollout_correction_and_add_to_batch (rollout_corr_helper.py), which the trainer calls with
     the DictConfig algorithm.rollout_correction, on a tiny batch: verl's own parsing of
     rollout_is / rollout_is_threshold / rollout_rs / rollout_rs_threshold refuses a bad value.

Stand-in: `ray` (a compiled package, not installed for the tests): verl/__init__.py imports
verl.protocol, which does `import ray` at module level; nothing on these paths calls it.
"""

from __future__ import annotations

import functools
import os
from typing import Any

from _driver import main, stand_in

stand_in("ray")

# What verl's quickstart command line sets besides the data and model paths (docs/start/quickstart.rst:
# "python3 -m verl.trainer.main_ppo ... actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 ..."):
# the default config leaves the micro batch sizes None and validate_config refuses that.
BASE_OVERRIDES = (
    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8",
    "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
    # no critic: its HFModelConfig would load critic.model.path (a hub id) from the network
    "critic.enable=false",
    # mandatory (???) in rollout.yaml; the quickstart passes it
    "actor_rollout_ref.rollout.name=vllm",
)

CORRECTION_FIELDS = ("rollout_is", "rollout_is_threshold", "rollout_is_batch_normalize", "rollout_rs",
                     "rollout_rs_threshold", "bypass_mode", "loss_type")


def _plain(value: Any) -> Any:
    from omegaconf import DictConfig, ListConfig, OmegaConf

    if isinstance(value, DictConfig | ListConfig):
        return OmegaConf.to_container(value, resolve=True)
    return value


def _select(cfg: Any, key: str) -> Any:
    from omegaconf import OmegaConf

    return _plain(OmegaConf.select(cfg, key, default=None))


@functools.cache
def _composed(config_name: str, overrides: tuple[str, ...]) -> Any:
    """Step 1, once per (config_name, overrides) in this process: hydra composes the same config
    from the same files every time, and composing (about 22 YAML files parsed and merged) took
    three-quarters of a payload's time (measured: 52 payloads, 224 of 377 s under cProfile)."""
    import verl
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        cfg = compose(config_name=config_name, overrides=list(overrides))
    OmegaConf.set_struct(cfg, True)  # compose returns it so already; explicit: unknown keys are refused
    return cfg


def handle(payload: dict[str, Any]) -> dict[str, Any]:
    import torch
    from omegaconf import OmegaConf

    from verl.protocol import DataProto
    from verl.trainer.config import RolloutCorrectionConfig
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    cfg = _composed(payload.get("config_name", "ppo_trainer"), (*BASE_OVERRIDES, *payload.get("overrides", [])))
    snippet = OmegaConf.create(payload.get("snippet") or "{}")
    # OmegaConf.merge deep-copies its first argument (omegaconf.py `merge`: `target =
    # copy.deepcopy(configs[0])`), so the composed config shared by the payloads is never changed.
    cfg = OmegaConf.merge(cfg, snippet)

    validate_config(config=cfg, use_reference_policy=need_reference_policy(cfg), use_critic=need_critic(cfg))

    arr = cfg.actor_rollout_ref
    correction_cfg = cfg.algorithm.get("rollout_correction", None)
    correction = omega_conf_to_dataclass(correction_cfg, dataclass_type=RolloutCorrectionConfig)
    actor = omega_conf_to_dataclass(arr.actor)  # engine_workers.py: omega_conf_to_dataclass(self.config.actor)
    rollout = omega_conf_to_dataclass(arr.rollout)  # engine_workers.py: ... (self.config.rollout)

    # The trainer's own call on a tiny batch (2 sequences, one padded token), with the DictConfig it passes.
    old = torch.tensor([[-1.0, -0.5, -0.2], [-0.3, -2.0, 0.0]])
    # Ratios near 1, so an IcePop band keeps some weights: a batch whose every weight it zeroes makes
    # the release's own ESS metric divide by zero (rollout_corr_helper.py:754-758, 0.9.1 and 0.8.0).
    roll = torch.tensor([[-1.05, -0.45, -0.25], [-0.28, -1.98, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    batch = DataProto.from_dict(tensors={"old_log_probs": old, "rollout_log_probs": roll, "response_mask": mask})
    if correction_cfg is not None:
        compute_rollout_correction_and_add_to_batch(batch, correction_cfg)

    strategy = arr.actor.strategy
    result: dict[str, Any] = {
        "config_name": payload.get("config_name", "ppo_trainer"),
        "actor.strategy": strategy,
        # What the trainer reads (DictConfig .get with the helper's defaults, rollout_corr_helper.py).
        **{f"algorithm.rollout_correction.{k}": _select(cfg, f"algorithm.rollout_correction.{k}")
           for k in CORRECTION_FIELDS},
        # The dataclass the worker-side config holds.
        "RolloutCorrectionConfig": {k: getattr(correction, k) for k in CORRECTION_FIELDS},
        "rollout.calculate_log_probs": rollout.calculate_log_probs,
        "rollout.dtype": rollout.dtype,
        "rollout.enable_rollout_routing_replay": rollout.enable_rollout_routing_replay,
        "actor.policy_loss.loss_mode": _select(cfg, "actor_rollout_ref.actor.policy_loss.loss_mode"),
    }
    # Router replay: engine_workers.py reads actor.megatron.router_replay.mode (strategy megatron) or
    # actor.veomni.router_replay.mode (veomni), else "disabled".
    if strategy == "megatron":
        result["router_replay.mode (worker)"] = actor.megatron.router_replay.mode
    elif strategy == "veomni":
        result["router_replay.mode (worker)"] = actor.veomni.router_replay.mode
    else:
        result["router_replay.mode (worker)"] = "disabled"
    if hasattr(actor, "router_replay"):  # 0.8.0's ActorConfig.router_replay (no worker reads it)
        result["actor.router_replay.mode"] = actor.router_replay.mode
    for engine in ("fsdp_config", "megatron", "veomni"):
        engine_cfg = getattr(actor, engine, None)
        if engine_cfg is None:
            continue
        for k in ("dtype", "model_dtype", "mixed_precision"):
            if hasattr(engine_cfg, k):
                result[f"actor.{engine}.{k}"] = _plain(getattr(engine_cfg, k))
    return result


if __name__ == "__main__":
    main(handle)
