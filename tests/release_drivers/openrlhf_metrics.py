"""OpenRLHF: the per-token IS weights its PolicyLoss applies and the metrics the actor logs about the
vLLM-rollout / trainer log-prob gap, computed by the release's own PolicyLoss on our log-probs.

Payload: {"sequences": [{"logp_train": [...], "logp_rollout": [...], "logp_old": [...] (optional)}, ...],
          "settings": {train_ppo_ray flag name: value}}
  settings are the release's CLI dests, with or without the "algo.advantage." prefix:
    0.11.2: is_correction_level (off/token/seq), is_correction_mode (mask/clip),
            is_correction_gating (ratio/binary_kl/tv), is_correction_threshold ([LOW, HIGH] or [HIGH] or HIGH)
    0.10.4: is_correction_enable (bool), is_correction_type (tis/icepop/seq-mask-tis),
            is_correction_threshold ([LOW, HIGH])
  and any other dest given in full (e.g. "actor.policy_loss_type", "actor.eps_clip_low_high").
Answer: {"weights": [the IS coefficient on each valid token, sequences in order], "metrics": {key: float}}.

How:
1. settings become flags (True -> "--name", False -> omitted, a list -> its items) and go through the
   release's own CLI parse + validation, then ActorPPOTrainer.__init__ builds the PolicyLoss from the args
   (both as in openrlhf_config.py: parse() and policy_loss(); same stand-ins). An unknown or
   out-of-choice setting is refused by argparse, a bad combination by PolicyLoss.__init__.
2. The sequences become right-padded float64 (n, width) tensors with a bool action_mask, as the actor's
   training_step passes them (trainer/ray/ppo_actor.py, `self.actor_loss_fn(action_log_probs,
   old_action_log_probs, advantages, action_mask=..., rollout_log_probs=experience.rollout_log_probs)`):
     rollout_log_probs = logp_rollout   (vLLM's processed logprobs)
     old_log_probs     = logp_old if given, else logp_train   (OpenRLHF's "old" log-probs are always the
                         actor's own recompute in make_experience; logp_old is for when the policy being
                         trained has moved on from the one that recomputed them)
     log_probs         = logp_train     (the actor's forward in training_step)
   One call, all sequences in one micro-batch; no loss_batch_info, so aggregate_loss is a masked mean.
3. weights: a second call with log_probs = old_log_probs and advantages = -1, so the PPO surrogate
   -min(r A, clip(r) A) is exactly 1 on every token (r = 1) and the per-token matrix PolicyLoss hands to
   aggregate_loss is the IS coefficient itself. That matrix is read by wrapping openrlhf.models.loss's
   module-level aggregate_loss for the call (it still runs; only its first argument is recorded).
   Defined for policy_loss_type "ppo" (the only type the correction block applies to, loss.py); "gspo"
   answers weights null.
4. metrics, named as logged: training_step stores the loss's vllm_kl / is_filter_ratio / ppo_kl in
   experience.info (0-D tensors -> weighted "token"), ppo_train reduces micro-batches by action-token count
   and all-reduces, and the wandb / tensorboard loggers prefix "train/" (utils/logging_utils.py). With a
   single micro-batch and a single rank that reduction is the value itself.
     train/vllm_kl          only when the correction is on (PolicyLoss returns None otherwise)
     train/is_filter_ratio  0.11.2 only, only when the correction is on
     train/ppo_kl           always logged; masked mean of old_log_probs - log_probs (0 without logp_old)
   ppo_clip_ratio is left out: it depends on the advantages' signs, not on the log-prob gap.
"""

from __future__ import annotations

from typing import Any

from _driver import main
from openrlhf_config import parse, policy_loss


def _flags(settings: dict[str, Any]) -> list[str]:
    argv: list[str] = []
    for key, value in settings.items():
        name = key if "." in key else f"algo.advantage.{key}"
        if value is True:
            argv.append(f"--{name}")
        elif value is False or value is None:
            continue
        elif isinstance(value, (list, tuple)):
            argv += [f"--{name}", *(str(v) for v in value)]
        else:
            argv += [f"--{name}", str(value)]
    return argv


def handle(payload: dict[str, Any]) -> dict[str, Any]:
    import torch

    from openrlhf.models import loss as loss_module

    args, _ = parse(_flags(payload.get("settings", {})))
    loss_fn = policy_loss(args)

    sequences = payload["sequences"]
    with_old = any(s.get("logp_old") is not None for s in sequences)
    for s in sequences:
        lengths = {len(s["logp_train"]), len(s["logp_rollout"])}
        if with_old:
            if s.get("logp_old") is None:
                raise ValueError("logp_old given for some sequences but not all")
            lengths.add(len(s["logp_old"]))
        if len(lengths) != 1:
            raise ValueError("logp_train, logp_rollout (and logp_old) differ in length")
    n, width = len(sequences), max(len(s["logp_train"]) for s in sequences)
    train = torch.zeros(n, width, dtype=torch.float64)
    rollout = torch.zeros(n, width, dtype=torch.float64)
    old = torch.zeros(n, width, dtype=torch.float64)
    mask = torch.zeros(n, width, dtype=torch.bool)
    for i, s in enumerate(sequences):
        k = len(s["logp_train"])
        train[i, :k] = torch.tensor(s["logp_train"], dtype=torch.float64)
        rollout[i, :k] = torch.tensor(s["logp_rollout"], dtype=torch.float64)
        old[i, :k] = torch.tensor(s["logp_old"] if with_old else s["logp_train"], dtype=torch.float64)
        mask[i, :k] = True
    advantages = -torch.ones(n, width, dtype=torch.float64)

    # The metrics call, as training_step makes it.
    _, _, ppo_kl, vllm_kl, *rest = loss_fn(train, old, advantages, action_mask=mask, rollout_log_probs=rollout)
    is_filter_ratio = rest[0] if rest else None
    metrics = {"train/ppo_kl": float(ppo_kl)}
    if vllm_kl is not None:
        metrics["train/vllm_kl"] = float(vllm_kl)
    if is_filter_ratio is not None:
        metrics["train/is_filter_ratio"] = float(is_filter_ratio)

    # The weights call: surrogate 1 on every token, so the matrix aggregate_loss receives is the coefficient.
    weights = None
    if loss_fn.policy_loss_type == "ppo":
        recorded: list[torch.Tensor] = []
        original = loss_module.aggregate_loss

        def recording(loss: torch.Tensor, *a: Any, **k: Any) -> torch.Tensor:
            recorded.append(loss.detach().clone())
            return original(loss, *a, **k)

        loss_module.aggregate_loss = recording
        try:
            loss_fn(old, old, advantages, action_mask=mask, rollout_log_probs=rollout)
        finally:
            loss_module.aggregate_loss = original
        (per_token,) = recorded
        weights = [float(v) for v in per_token[mask]]  # row-major: sequence by sequence, valid tokens only
    return {"weights": weights, "metrics": metrics}


if __name__ == "__main__":
    main(handle)
