"""TRL: GRPOConfig's vllm_importance_sampling_* keys (snippets) and its sampling/ metrics, read from
TRL @ f2cd57710ae3."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from mismatch.analysis import terms
from mismatch.frameworks._common import (
    FrameworkMetric,
    PairArrays,
    cap,
    correction_params,
    level,
)

if TYPE_CHECKING:
    from mismatch.advise.recommend import Recommendation


def _trl_sequence_mask_ratio(p: PairArrays, clip_max: float = 3.0) -> np.ndarray:
    # grpo_trainer.py:2579-2621, TRL's default mode: per sequence exp(sum log-ratio), 0 above clip_max.
    ratio = terms.ratio(p.seq_log_ratio)
    return np.where(ratio > clip_max, 0.0, ratio)


# TRL @ f2cd57710ae3: trl/trainer/grpo_trainer.py:2780-2812 (sampling/...), with GRPOConfig defaults
# (vllm_importance_sampling_mode sequence_mask, clip_max 3.0): the ratio is logged after masking.
METRICS = [
    FrameworkMetric("trl", "sampling/sampling_logp_difference/mean", lambda p: p.abs_log_ratio,
                    ours="log_ratio_abs_mean"),
    FrameworkMetric("trl", "sampling/sampling_logp_difference/max", lambda p: p.abs_log_ratio, reduce="max",
                    ours="log_ratio_abs_max"),
    FrameworkMetric("trl", "sampling/importance_sampling_ratio/mean", _trl_sequence_mask_ratio,
                    note="sequence ratios after TRL's default sequence_mask at clip_max 3 (masked ones count 0)"),
    FrameworkMetric("trl", "sampling/importance_sampling_ratio/min", _trl_sequence_mask_ratio, reduce="min",
                    note="as the mean, the smallest"),
    FrameworkMetric("trl", "sampling/importance_sampling_ratio/max", _trl_sequence_mask_ratio, reduce="max",
                    note="as the mean, the largest"),
]


def render(by_kind: dict[str, Recommendation]) -> list[str]:
    # TRL @ f2cd57710ae3: trl/trainer/grpo_config.py:915-945 (vllm_importance_sampling_correction, _mode,
    # _clip_max, _clip_min; _cap is deprecated since 1.6.0), :1131-1150 (clip_min < clip_max; a *_truncate
    # mode needs a bound); grpo_trainer.py:2579-2619: truncate clamps to [clip_min, clip_max], mask zeroes
    # ratios outside it (token ratio, or exp of the completion's sum at sequence level).
    lines = ["# keys: trl/trainer/grpo_config.py (GRPOConfig)"]
    chosen = correction_params(by_kind)
    if chosen is not None:
        mode, params = chosen
        trl_mode, low, high = _trl_equivalent(mode, params)
        if trl_mode is None:
            trl_mode = f"{level(mode)}_{'truncate' if 'truncate' in mode else 'mask'}"
            lines.append(f"# TRL has no {mode}; nearest: {trl_mode} at {cap(params):g}")
            low, high = None, float(cap(params))
        lines += ["use_vllm: true", "vllm_importance_sampling_correction: true",
                  f"vllm_importance_sampling_mode: {trl_mode}", f"vllm_importance_sampling_clip_max: {high!r}"]
        lines.append(f"vllm_importance_sampling_clip_min: {'null' if low is None else repr(low)}")
    if "recompute_old_logprobs" in by_kind:
        lines.append("# old log-probs: TRL already recomputes them with the trainer when "
                     "vllm_importance_sampling_correction is on")
    if "routing_replay" in by_kind:  # TRL @ its cited commit: no routing-replay option exists
        lines.append("# routing replay (R3): TRL has no such option; verl, slime and prime-rl do")
    if "fp16" in by_kind:
        lines += ["bf16: false", "fp16: true"]
    if "batch_invariant" in by_kind:
        lines.append("# batch-invariant vLLM: export VLLM_BATCH_INVARIANT=1 before starting vLLM")
    return lines


def _trl_equivalent(mode: str, params: dict[str, float]) -> tuple[str | None, float | None, float | None]:
    """(TRL mode, clip_min, clip_max) that computes exactly `mode`, or (None, ...) when none does."""
    if mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"):
        return mode, None, float(params["cap"])
    exact = {"token_clip": "token_truncate", "sequence_clip": "sequence_truncate", "token_icepop": "token_mask",
             "sequence_icepop": "sequence_mask"}
    if mode in exact:
        return exact[mode], float(params["low"]), float(params["high"])
    return None, None, None
