"""verl: the `rollout_corr/*` and `training/rollout_*` metrics the PPO trainer logs about the rollout /
trainer log-prob gap, computed by the release's own functions on our log-probs.

Payload: {"sequences": [{"logp_train": [...], "logp_rollout": [...]}, ...],
          "settings": {RolloutCorrectionConfig fields, e.g. rollout_is / rollout_is_threshold / rollout_rs}}.
Answer: {metric_key: float} for every key the two functions return, named as verl logs them.

The settings are merged over the release's own algorithm/rollout_correction.yaml (the defaults
ppo_trainer.yaml composes, e.g. rollout_is: null there) and converted with
verl.utils.config.omega_conf_to_dataclass to RolloutCorrectionConfig (an unknown field is refused).
Then, as the trainer does in decoupled mode (ray_trainer.py / v1 trainer_base.py):
  compute_rollout_correction_and_add_to_batch(batch, config)   -> rollout_corr/* (IS weights, rejection
      mask, their metrics, and compute_offpolicy_metrics), rollout_corr_helper.py
  calculate_debug_metrics(batch)                               -> training/rollout_probs_diff_*,
      training/rollout_actor_probs_pearson_corr, verl/utils/debug/metrics.py
on a DataProto of right-padded tensors: old_log_probs = logp_train, rollout_log_probs = logp_rollout,
response_mask 1 on real tokens, responses (token ids, only its width is read) zeros.

Stand-in: `ray` (compiled, not installed for the tests): verl/__init__.py -> verl.protocol does
`import ray` at module level; nothing here calls it.
"""

from __future__ import annotations

import os
from typing import Any

from _driver import main, stand_in

stand_in("ray")


def handle(payload: dict[str, Any]) -> dict[str, float]:
    import torch
    import verl
    from omegaconf import OmegaConf

    from verl.protocol import DataProto
    from verl.trainer.config import RolloutCorrectionConfig
    from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_and_add_to_batch
    from verl.utils.config import omega_conf_to_dataclass
    from verl.utils.debug.metrics import calculate_debug_metrics

    # float64 throughout (verl makes some tensors at torch's default dtype), so the release's
    # arithmetic is compared with ours to 1e-9, not to float32 rounding.
    torch.set_default_dtype(torch.float64)
    sequences = payload["sequences"]
    for s in sequences:
        if len(s["logp_train"]) != len(s["logp_rollout"]):
            raise ValueError("logp_train and logp_rollout differ in length")
    n, width = len(sequences), max(len(s["logp_train"]) for s in sequences)
    train = torch.zeros(n, width, dtype=torch.float64)
    rollout = torch.zeros(n, width, dtype=torch.float64)
    mask = torch.zeros(n, width, dtype=torch.float64)
    for i, s in enumerate(sequences):
        k = len(s["logp_train"])
        train[i, :k] = torch.tensor(s["logp_train"], dtype=torch.float64)
        rollout[i, :k] = torch.tensor(s["logp_rollout"], dtype=torch.float64)
        mask[i, :k] = 1.0

    defaults = OmegaConf.load(os.path.join(os.path.dirname(verl.__file__), "trainer", "config", "algorithm",
                                           "rollout_correction.yaml"))
    merged = OmegaConf.merge(defaults, OmegaConf.create(payload.get("settings", {})))
    config = omega_conf_to_dataclass(merged, dataclass_type=RolloutCorrectionConfig)

    batch = DataProto.from_dict(tensors={"old_log_probs": train, "rollout_log_probs": rollout,
                                         "response_mask": mask, "responses": torch.zeros(n, width, dtype=torch.long)})
    debug = calculate_debug_metrics(batch)  # before the rejection mask rewrites response_mask, as the trainer
    _, corr = compute_rollout_correction_and_add_to_batch(batch, config)
    return {key: float(value) for key, value in {**corr, **debug}.items()}


if __name__ == "__main__":
    main(handle)
