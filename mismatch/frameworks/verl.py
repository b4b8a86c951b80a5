"""verl: the keys of its RolloutCorrectionConfig (snippets) and its rollout_corr/ and training/
metrics, read from verl @ b178a3cd56f5."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from mismatch.frameworks._common import (
    SAFETY_BOUND,
    FrameworkMetric,
    PairArrays,
    cap,
    clamped,
    correction_params,
    level,
    probs,
)

if TYPE_CHECKING:
    from mismatch.advise.recommend import Recommendation


def _log_ppl_diff(p: PairArrays) -> np.ndarray:
    """Per sequence: mean logp_rollout - mean logp_train (verl's d_s)."""
    return p.per(p.seq, p.logp_b) - p.per(p.seq, p.logp_a)


def _verl_is_weights(p: PairArrays, threshold: float = 2.0) -> np.ndarray:
    # rollout_corr_helper.py:677-694: token-level weights exp(clamped log-ratio), truncated to
    # [1/T, T] for the statistic, ESS = 1 / mean((w / mean w)^2) = (sum w)^2 / (n sum w^2).
    return np.clip(np.exp(clamped(p)), 1.0 / threshold, threshold)


# verl @ b178a3cd56f5: verl/trainer/ppo/rollout_corr_helper.py:822-938 (keys prefixed rollout_corr/),
# verl/utils/debug/metrics.py:48-107 (training/...). Token means over all tokens unless said.
METRICS = [
    FrameworkMetric("verl", "rollout_corr/kl", lambda p: p.k1, ours="kl_k1"),
    FrameworkMetric("verl", "rollout_corr/k3_kl", lambda p: p.k3, ours="kl_k3"),
    FrameworkMetric("verl", "rollout_corr/training_ppl", lambda p: np.exp(-p.per(p.seq, p.logp_a)),
                    note="per sequence exp(-mean logp_train), then the mean over sequences"),
    FrameworkMetric("verl", "rollout_corr/rollout_ppl", lambda p: np.exp(-p.per(p.seq, p.logp_b)),
                    note="per sequence exp(-mean logp_rollout), then the mean over sequences"),
    FrameworkMetric("verl", "rollout_corr/log_ppl_diff", _log_ppl_diff,
                    note="per sequence mean logp_rollout - mean logp_train, then the mean"),
    FrameworkMetric("verl", "rollout_corr/log_ppl_abs_diff", lambda p: np.abs(_log_ppl_diff(p)),
                    note="the mean over sequences of |log_ppl_diff|"),
    FrameworkMetric("verl", "rollout_corr/ppl_ratio", lambda p: np.exp(_log_ppl_diff(p)), ours="ppl_ratio"),
    FrameworkMetric("verl", "rollout_corr/chi2_token", lambda p: p.clamped_ratio_sq, offset=-1.0,
                    ours="chi2_token", note="log-ratio clamped to +-20 before exp (ours is not clamped)"),
    FrameworkMetric("verl", "rollout_corr/chi2_seq",
                    lambda p: np.exp(2.0 * np.clip(np.bincount(p.seq, weights=p.log_ratio), -SAFETY_BOUND, SAFETY_BOUND)),
                    offset=-1.0, ours="chi2_seq", note="sequence log-ratio sum clamped to +-20 (ours is not clamped)"),
    FrameworkMetric("verl", "rollout_corr/rollout_is_eff_sample_size", _verl_is_weights, reduce="ess",
                    note="token weights truncated to [1/2, 2] (rollout_is_threshold 2.0) before the ESS"),
    FrameworkMetric("verl", "training/rollout_probs_diff_mean", lambda p: p.prob_abs_diff, ours="prob_abs_diff_mean"),
    FrameworkMetric("verl", "training/rollout_probs_diff_max", lambda p: p.prob_abs_diff, reduce="max",
                    ours="prob_abs_diff_max"),
    FrameworkMetric("verl", "training/rollout_probs_diff_std", lambda p: p.prob_abs_diff, reduce="std",
                    note="sample std (ddof 1) of |p_train - p_rollout|"),
    FrameworkMetric("verl", "training/rollout_actor_probs_pearson_corr", probs, reduce="pearson",
                    note="Pearson correlation of the probabilities"),
]


def render(by_kind: dict[str, Recommendation]) -> list[str]:
    # verl @ b178a3cd56f5: verl/trainer/config/algorithm.py:60-179 (RolloutCorrectionConfig: rollout_is
    # "token" | "sequence" | null, rollout_is_threshold a float > 0 (a string raises TypeError at
    # rollout_corr_helper.py:526), rollout_rs options, rollout_rs_threshold, bypass_mode); rollout_rs
    # thresholds: rollout_corr_helper.py:93-153 ("low_high" for *_k1 options only, on k1 = -log ratio,
    # so a ratio band [low, high] is "1/high_1/low"); verl/workers/config/rollout.py:156, :189.
    lines = ["# keys: verl/trainer/config/algorithm.py (RolloutCorrectionConfig)"]
    algo: list[str] = []
    actor: list[str] = []
    rollout: list[str] = []
    chosen = correction_params(by_kind)
    if chosen is not None:
        mode, params = chosen
        if mode in ("token_truncate", "sequence_truncate"):
            algo += [f"rollout_is: {level(mode)}", f"rollout_is_threshold: {float(params['cap'])!r}",
                     "rollout_rs: null"]
        elif mode in ("token_icepop", "sequence_icepop"):
            # IcePop = drop outside [low, high] (rollout_rs on k1), keep the raw ratio inside: rollout_is
            # truncates at high, which a surviving ratio never exceeds.
            option = "token_k1" if level(mode) == "token" else "seq_sum_k1"
            algo += [f"rollout_is: {level(mode)}", f"rollout_is_threshold: {float(params['high'])!r}",
                     f"rollout_rs: {option}", f"rollout_rs_threshold: \"{_verl_k1_band(params)}\""]
        elif mode.startswith("rs_"):
            threshold = (f"\"{params['low']!r}_{params['high']!r}\"" if "low" in params
                         else repr(float(params["high"])))
            algo += ["rollout_is: null", f"rollout_rs: {mode[3:]}", f"rollout_rs_threshold: {threshold}"]
        elif mode == "geometric_icepop":
            algo += ["rollout_is: null", "rollout_rs: seq_mean_k1",
                     f"rollout_rs_threshold: \"{_verl_k1_band(params)}\""]
        else:
            lines.append(f"# verl has no {mode}; nearest: {level(mode)}-level TIS at {cap(params):g}")
            algo += [f"rollout_is: {level(mode)}", f"rollout_is_threshold: {float(cap(params))!r}",
                     "rollout_rs: null"]
        rollout.append("calculate_log_probs: true  # the sampler's log-probs feed rollout_is / rollout_rs")
    if "recompute_old_logprobs" in by_kind:
        algo.append("bypass_mode: false  # decoupled mode: the trainer recomputes old log-probs")
    if "fp16" in by_kind:
        rollout.append("dtype: float16  # and train the actor in fp16 (fsdp mixed_precision.param_dtype: fp16)")
    if "routing_replay" in by_kind:
        # verl @ b178a3cd56f5: verl/workers/config/actor.py:32-55 (RouterReplayConfig.mode
        # "disabled" | "R2" | "R3"), verl/workers/config/rollout.py:235 (enable_rollout_routing_replay,
        # which passes enable_return_routed_experts to vLLM / SGLang); Megatron actor only.
        actor += ["router_replay:", "  mode: R3  # Megatron actor; with the rollout flag below"]
        rollout.append("enable_rollout_routing_replay: true  # the engine returns each token's experts")
    if "batch_invariant" in by_kind:
        lines.append("# batch-invariant rollouts: export VLLM_BATCH_INVARIANT=1 (vLLM), or SGLang "
                     "--enable-deterministic-inference")
    if algo:
        lines += ["algorithm:", "  rollout_correction:", *(f"    {line}" for line in algo)]
    if actor or rollout:
        lines.append("actor_rollout_ref:")
        lines += ["  actor:", *(f"    {line}" for line in actor)] if actor else []
        lines += ["  rollout:", *(f"    {line}" for line in rollout)] if rollout else []
    return lines


def _verl_k1_band(params: dict[str, float]) -> str:
    """verl's "lower_upper" for a ratio band [low, high]: its k1 is -log ratio, so the bounds invert."""
    return f"{1 / params['high']!r}_{1 / params['low']!r}"
