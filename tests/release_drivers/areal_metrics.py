"""AReaL: the behaviour importance weights and every statistic the PPO actor logs about the gap between the
trainer's and the inference engine's log-probs, computed by the release's own actor code on our log-probs.

Payload: {"sequences": [{"logp_train": [...], "logp_rollout": [...], "logp_old": [...] (optional),
                         "versions": [...] (optional, per token), "reward": float (optional, 1.0)}, ...],
          "settings": {PPOActorConfig fields, e.g. use_decoupled_loss, recompute_logprob,
                       rejection_sampling: {level, action, metric, agg, upper, lower}, prox_logp_method,
                       importance_sampling_level, eps_clip, ...},
          "current_version": int (optional; with versions, enables the version/approximation stats)}
Answer: {"weights": per-token behave_imp_weight, flattened in sequence order (null when AReaL applies none:
          rejection_sampling null), "metrics": {key: float} named as AReaL logs them}.

Roles (AReaL's decoupled PPO, areal/utils/functional/functional.py:434-470):
  logp_rollout -> old_logp, pi_behave: the inference engine's log-probs (the trajectory's "logprobs");
  logp_old     -> prox_logp, pi_prox: the trainer's recompute of the rollout policy (compute_logp,
                  rl_trainer.py:680-691); defaults to logp_train;
  logp_train   -> logprobs, pi_theta: the trainer's forward in the update (equal to pi_prox on the
                  first minibatch of a step).
The behaviour weight is pi_prox / pi_behave, so with logp_old absent it is exp(logp_train - logp_rollout).

Steps, each the release's own code except the packing into tensors:
  1. settings merged onto OmegaConf.structured(PPOActorConfig) (an unknown key: ConfigKeyError) and
     OmegaConf.to_object (its __post_init__ checks and RejectionSamplingConfig's), as load_expr_config does.
  2. A padded batch shaped as AReaL's rollout workflows return it: per sequence one prompt token then the
     response; attention_mask on all of it, loss_mask 1 on the response, "logprobs" = [0, logp_rollout...]
     (token-aligned), "prox_logp" = [logp_old..., 0] (next-token aligned, as compute_logp returns it),
     "rewards" the reward.
  3. PPOActor(config, engine=None)._compute_advantages(batch) (trainer/ppo/actor.py:145-246): rolls
     loss_mask and logprobs by -1 and picks old/prox log-probs by use_decoupled_loss / recompute_logprob.
  4. As _ppo_update (actor.py:330-364): drop rewards/tot_rewards/kl_rewards, pack the batch with
     areal.utils.data.pack_tensor_dict (what FSDPEngine._prepare_mb_list does per microbatch), and call
     grpo_loss_fn(logprobs=pi_theta, entropy=0, input_data=packed, <the same keyword arguments from the
     config>) inside stats_tracker scopes "ppo_actor"/"update" (scope_func_wrapper("ppo_actor") on
     ppo_update and stats_tracker.scope("update")). It calls ppo_actor_loss_fn, whose stat dict is read
     through a pass-through wrapper for the per-token weights.
  5. stats_tracker.export(): the keys and reductions the trainer logs (avg/min/max over each stat's
     denominator mask, scalars averaged over calls).
Single process, one microbatch; no torch.distributed.

Stand-ins: as areal_config.py (ray and its submodules: compiled, not installed; imported at module level by
areal/__init__.py -> areal.infra. wandb, swanlab, trackio, tensorboardX: experiment trackers imported at
module level by areal/utils/stats_logger.py, reached via areal.trainer/__init__ -> rl_trainer). None is called.
"""

from __future__ import annotations

from typing import Any

from areal_config import _stand_ins  # noqa: F401  (registers the same import-time stand-ins)
from _driver import main

# The three TrainEngineConfig fields that are MISSING in the dataclass (cli_args.py:1073-1074, 1203);
# examples/math/gsm8k_grpo.yaml sets them. None of them touches the loss.
BASE = {"experiment_name": "mismatch-release-test", "trial_name": "trial0", "backend": "fsdp:d1"}


def handle(payload: dict[str, Any]) -> dict[str, Any]:
    import torch
    from omegaconf import OmegaConf

    import areal.trainer.ppo.actor as actor_mod
    from areal.api.cli_args import PPOActorConfig
    from areal.utils import stats_tracker
    from areal.utils.data import pack_tensor_dict

    config = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(PPOActorConfig), BASE,
                                                 OmegaConf.create(payload.get("settings", {}))))
    assert isinstance(config, PPOActorConfig)

    sequences = payload["sequences"]
    lengths = []
    for s in sequences:
        n = len(s["logp_train"])
        if n == 0 or len(s["logp_rollout"]) != n or len(s.get("logp_old") or s["logp_train"]) != n:
            raise ValueError("logp_train, logp_rollout (and logp_old) must be non-empty and of one length")
        lengths.append(n)
    with_versions = all("versions" in s for s in sequences)
    bs, width = len(sequences), max(lengths) + 1
    f32 = dict(dtype=torch.float32)
    batch = {
        "input_ids": torch.zeros(bs, width, dtype=torch.long),
        "attention_mask": torch.zeros(bs, width, dtype=torch.bool),
        "loss_mask": torch.zeros(bs, width, dtype=torch.int32),
        "logprobs": torch.zeros(bs, width, **f32),
        "prox_logp": torch.zeros(bs, width, **f32),
        "rewards": torch.tensor([float(s.get("reward", 1.0)) for s in sequences], **f32),
    }
    theta = torch.zeros(bs, width, **f32)  # next-token aligned, like prox_logp
    if with_versions:
        batch["versions"] = torch.full((bs, width), -1, dtype=torch.int32)  # prompt tokens: version -1
    for i, (s, n) in enumerate(zip(sequences, lengths)):
        batch["attention_mask"][i, : n + 1] = True
        batch["loss_mask"][i, 1 : n + 1] = 1
        batch["logprobs"][i, 1 : n + 1] = torch.tensor(s["logp_rollout"], **f32)
        batch["prox_logp"][i, :n] = torch.tensor(s.get("logp_old") or s["logp_train"], **f32)
        theta[i, :n] = torch.tensor(s["logp_train"], **f32)
        if with_versions:
            batch["versions"][i, 1 : n + 1] = torch.tensor(s["versions"], dtype=torch.int32)
    # AReaL's workflows only attach prox_logp when the trainer recomputes it (rl_trainer.py:680-691).
    if not config.should_compute_prox_logp():
        batch["prox_logp"] = None

    actor = actor_mod.PPOActor(config, engine=None)  # __init__ reads only the config
    data = actor._compute_advantages(batch)
    for key in ["rewards", "tot_rewards", "kl_rewards"]:
        data.pop(key, None)
    data["_theta"] = theta
    mb = pack_tensor_dict(data)
    logprobs = mb.pop("_theta")

    captured: dict[str, Any] = {}
    original = actor_mod.ppo_actor_loss_fn

    def recording(*args: Any, **kwargs: Any) -> Any:  # pass-through: keeps the stat dict for the weights
        loss, stat = original(*args, **kwargs)
        captured.update(stat)
        return loss, stat

    actor_mod.ppo_actor_loss_fn = recording
    stats_tracker.DEFAULT_TRACKER.export(reset=True)  # start clean
    try:
        with stats_tracker.scope("ppo_actor"), stats_tracker.scope("update"):
            actor_mod.grpo_loss_fn(
                logprobs, torch.zeros_like(logprobs), mb,
                eps_clip=config.eps_clip,
                eps_clip_higher=config.eps_clip_higher,
                c_clip=config.c_clip,
                rejection_sampling=config.rejection_sampling,
                m2_threshold=config.m2_threshold,
                importance_sampling_level=config.importance_sampling_level,
                current_version=payload.get("current_version"),
                prox_logp_method=config.prox_logp_method,
                use_sapo_loss=config.use_sapo_loss,
                sapo_tau_pos=config.sapo_tau_pos,
                sapo_tau_neg=config.sapo_tau_neg,
                use_decoupled_loss=config.use_decoupled_loss,
            )
    finally:
        actor_mod.ppo_actor_loss_fn = original
    metrics = stats_tracker.DEFAULT_TRACKER.export(reset=True)

    weights = None
    if "behave_imp_weight" in captured:
        w = captured["behave_imp_weight"]
        cu = mb["cu_seqlens"].tolist()
        # per sequence the first n packed positions are its response tokens (the last is the rolled pad)
        weights = [float(x) for i, n in enumerate(lengths) for x in w[cu[i] : cu[i] + n].tolist()]
    return {"weights": weights, "metrics": {k: float(v) for k, v in metrics.items()}}


if __name__ == "__main__":
    main(handle)
