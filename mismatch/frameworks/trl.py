"""TRL: GRPOConfig's vllm_importance_sampling_* keys (snippets) and its sampling/ metrics, read from
the released wheels trl 1.14.2 and 1.16.0 (the same keys and code in both)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from mismatch.analysis import terms
from mismatch.frameworks._common import one_of, optional_float, parse_bool, yaml_scalar
from mismatch.frameworks.pair_arrays import PairArrays
from mismatch.frameworks.protocol import FrameworkMetric, Recommendation, Release, Target

NAME = "trl"
PACKAGE = "trl"
RELEASES = (Release("1.14.2", "trl 1.14.2 wheel (PyPI)"), Release("1.16.0", "trl 1.16.0 wheel (PyPI)"))

# trl 1.16.0 trl/trainer/grpo_config.py:925-960 (1.14.2: :924-959): the IS correction's fields.
MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
SETTINGS = {"vllm_importance_sampling_correction": parse_bool, "vllm_importance_sampling_mode": one_of(*MODES),
            "vllm_importance_sampling_clip_max": optional_float, "vllm_importance_sampling_clip_min": optional_float}
DEFAULTS: dict[str, Any] = {"vllm_importance_sampling_correction": True,
                            "vllm_importance_sampling_mode": "sequence_mask",
                            "vllm_importance_sampling_clip_max": 3.0, "vllm_importance_sampling_clip_min": None}

# Our simulated mode -> (TRL mode, whether it takes clip_min): grpo_trainer.py:2680-2702 clamps a
# *_truncate ratio to [clip_min, clip_max] and zeroes a *_mask ratio outside it.
_EXACT = {"token_truncate": ("token_truncate", False), "sequence_truncate": ("sequence_truncate", False),
          "token_mask": ("token_mask", False), "sequence_mask": ("sequence_mask", False),
          "token_clip": ("token_truncate", True), "sequence_clip": ("sequence_truncate", True),
          "token_icepop": ("token_mask", True), "sequence_icepop": ("sequence_mask", True)}


def express(mode: str, params: Mapping[str, Any], release: Release) -> dict[str, Any] | None:
    found = _EXACT.get(mode)
    if found is None:
        return None
    trl_mode, two_sided = found
    return {"vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": trl_mode,
            "vllm_importance_sampling_clip_max": float(params["high"] if two_sided else params["cap"]),
            "vllm_importance_sampling_clip_min": float(params["low"]) if two_sided else None}


def _processed_ratio(settings: Mapping[str, Any]):
    """The ratio TRL logs (grpo_trainer.py:2659-2702, :2874-2895): per token, or one per sequence
    (exp of the summed log-ratio), after the mode's truncation or mask."""
    mode = settings["vllm_importance_sampling_mode"]
    low = settings["vllm_importance_sampling_clip_min"]
    high = settings["vllm_importance_sampling_clip_max"]
    if mode not in MODES:
        raise ValueError(f"vllm_importance_sampling_mode {mode!r} is not one of {', '.join(MODES)}")

    def values(p: PairArrays) -> np.ndarray:
        ratio = terms.ratio(p.seq_log_ratio) if mode.startswith("sequence") else p.ratio
        if mode.endswith("truncate"):
            return np.clip(ratio, low, high)
        outside = (ratio < (-math.inf if low is None else low)) | (ratio > (math.inf if high is None else high))
        return np.where(outside, 0.0, ratio)
    return values


def metrics(settings: Mapping[str, Any]) -> list[FrameworkMetric]:
    # trl 1.16.0 grpo_trainer.py:2860-2896 (1.14.2 the same): logged only with use_vllm and
    # vllm_importance_sampling_correction; |old - sampling| over the completion (and tool) mask; the
    # ratio over the mask (token modes) or one per sequence (sequence modes). One process: the
    # gathered mean/min/max of one value is that value.
    out = [FrameworkMetric("trl", "sampling/sampling_logp_difference/mean", lambda p: p.abs_log_ratio,
                           ours="log_ratio_abs_mean"),
           FrameworkMetric("trl", "sampling/sampling_logp_difference/max", lambda p: p.abs_log_ratio, reduce="max",
                           ours="log_ratio_abs_max")]
    if not settings["vllm_importance_sampling_correction"]:
        return out
    ratio = _processed_ratio(settings)
    words = (f"{settings['vllm_importance_sampling_mode']} ratio, clip_min "
             f"{settings['vllm_importance_sampling_clip_min']}, clip_max {settings['vllm_importance_sampling_clip_max']}"
             " (masked ones count 0)")
    return out + [FrameworkMetric("trl", f"sampling/importance_sampling_ratio/{how}", ratio, reduce=how, note=words)
                  for how in ("mean", "min", "max")]


def render(by_kind: dict[str, Recommendation], target: Target) -> list[str]:
    # trl 1.16.0 grpo_config.py:925-960 (the fields), :1143-1171 (clip_min < clip_max; a *_truncate
    # mode needs a bound; _cap deprecated since 1.6.0); grpo_trainer.py:2641-2657: with use_vllm and
    # the correction on, the trainer recomputes old log-probs itself.
    lines = [f"# keys: trl/trainer/grpo_config.py (GRPOConfig), {target.release.read_from}"]
    correction = by_kind.get("correction")
    if correction is not None:
        settings = express(correction.params["mode"], correction.params, target.release)
        assert settings is not None  # render_config drops a correction the release cannot express
        lines += ["use_vllm: true", *(f"{key}: {yaml_scalar(value)}" for key, value in settings.items())]
    if "recompute_old_logprobs" in by_kind:
        lines.append("# old log-probs: TRL recomputes them with the trainer whenever use_vllm and "
                     "vllm_importance_sampling_correction are on (grpo_trainer.py:2641-2657)")
    if "routing_replay" in by_kind:  # no router-replay field in GRPOConfig 1.14.2 or 1.16.0
        lines.append("# routing replay (R3): TRL has no such option; verl, slime and prime-rl do")
    if "fp16" in by_kind:
        lines += ["bf16: false", "fp16: true"]
    if "batch_invariant" in by_kind:
        lines.append("# batch-invariant vLLM: export VLLM_BATCH_INVARIANT=1 before starting vLLM")
    return lines

