"""OpenRLHF: its --algo.advantage.is_correction_* flags (snippets) and its train/ mismatch metrics,
read from the released wheels openrlhf 0.10.4 and 0.11.2 (their flags differ)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from mismatch.frameworks._common import number, one_of, parse_bool
from mismatch.frameworks.pair_arrays import PairArrays
from mismatch.frameworks.protocol import FrameworkMetric, Recommendation, Release, Target

NAME = "openrlhf"
PACKAGE = "openrlhf"
# The dotted --algo.advantage.* names start in 0.10.2; 0.9.x-0.10.1 spell them
# --enable_vllm_is_correction / --vllm_is_correction_type / --vllm_is_truncated_threshold (read at
# the v0.9.10 tag, openrlhf/cli/train_ppo_ray.py:254-268): `--for openrlhf==0.9.x` gets those names.
RELEASES = (Release("0.9.10", "OpenRLHF v0.9.10 (GitHub tag, openrlhf/cli/train_ppo_ray.py:254-268)"),
            Release("0.10.4", "openrlhf 0.10.4 wheel (PyPI)"), Release("0.11.2", "openrlhf 0.11.2 wheel (PyPI)"))
# 0.9.x's undotted names of 0.10.4's enable/type/threshold flags (v0.9.10 cli/train_ppo_ray.py:254-268;
# models/loss.py:88-109 computes the same three types).
_UNDOTTED = {"is_correction_enable": "--enable_vllm_is_correction", "is_correction_type": "--vllm_is_correction_type",
             "is_correction_threshold": "--vllm_is_truncated_threshold"}
_PREFIX = "--algo.advantage."


def _threshold(text: str) -> list[float]:
    """is_correction_threshold as --for takes it: HIGH, or LOW_HIGH."""
    parts = text.split("_")
    if len(parts) not in (1, 2):
        raise ValueError(f"{text!r}: HIGH or LOW_HIGH")
    bounds = [number(part, positive=len(parts) == 1 or i == 1) for i, part in enumerate(parts)]
    if len(bounds) == 2 and bounds[0] > bounds[1]:
        raise ValueError(f"{text!r}: LOW must not exceed HIGH")
    return [0.0, *bounds] if len(bounds) == 1 else bounds  # train_ppo_ray.py:639-642 (0.11.2)


# 0.11.2 openrlhf/cli/train_ppo_ray.py:261-291 (level off|token|seq, mode mask|clip, gating
# ratio|binary_kl|tv, threshold HIGH or LOW HIGH); 0.10.4 :257-271 (enable, type tis|icepop|seq-mask-tis,
# threshold LOW HIGH).
SETTINGS: dict[str, Callable[[str], Any]] = {
    "is_correction_level": one_of("off", "token", "seq"), "is_correction_mode": one_of("mask", "clip"),
    "is_correction_gating": one_of("ratio", "binary_kl", "tv"),
    "is_correction_threshold": _threshold, "is_correction_enable": parse_bool,
    "is_correction_type": one_of("tis", "icepop", "seq-mask-tis")}
# 0.11.2's defaults leave the level off (no correction, and train/vllm_kl is not logged): the metrics'
# defaults are its other defaults at token level, which is IcePop on [0.5, 5.0].
DEFAULTS: dict[str, Any] = {"is_correction_level": "token", "is_correction_mode": "mask",
                            "is_correction_gating": "ratio", "is_correction_threshold": [0.5, 5.0]}

# Our simulated mode -> (0.11.2 level, mode; 0.10.4 type). openrlhf/models/loss.py (0.11.2 :216-246):
# clip clamps the ratio into [low, high]; mask keeps the token's ratio where the gated statistic (the
# token ratio, or at seq level the geometric mean of the sequence's) lies in [low, high], else 0.
# 0.10.4 :198-219: tis = clamp, icepop = token mask, seq-mask-tis = the sequence mask.
_MODES = {"token_truncate": ("token", "clip", "tis"), "token_clip": ("token", "clip", "tis"),
          "token_icepop": ("token", "mask", "icepop"), "token_mask": ("token", "mask", "icepop"),
          "seq_mask_tis": ("seq", "mask", "seq-mask-tis")}


def _dotted(release: Release) -> bool:
    """0.11.2's level/mode/gating flags; 0.10.4's enable/type (the two releases read)."""
    return release.version not in ("0.9.10", "0.10.4")


def express(mode: str, params: Mapping[str, Any], release: Release) -> dict[str, Any] | None:
    found = _MODES.get(mode)
    if found is None:
        return None
    level, how, kind = found
    # a one-sided cap is [0, cap]: no ratio is below 0
    bounds = [float(params.get("low", 0.0)), float(params["cap"] if "cap" in params else params["high"])]
    if _dotted(release):
        return {"is_correction_level": level, "is_correction_mode": how, "is_correction_gating": "ratio",
                "is_correction_threshold": bounds}
    return {"is_correction_enable": True, "is_correction_type": kind, "is_correction_threshold": bounds}


def _filtered(settings: Mapping[str, Any]) -> Callable[[PairArrays], np.ndarray]:
    """0.11.2 loss.py:238-246: the share of units outside the band, per token or per sequence."""
    low, high = settings["is_correction_threshold"]
    seq = settings["is_correction_level"] == "seq"

    def values(p: PairArrays) -> np.ndarray:
        stat = np.exp(p.per(p.seq, p.log_ratio)) if seq else p.ratio
        return ((stat < low) | (stat > high)).astype(np.float64)
    return values


def metrics(settings: Mapping[str, Any]) -> list[FrameworkMetric]:
    # 0.11.2 loss.py:247, ppo_actor.py:316-389 (0.10.4 loss.py:219): logged only with the correction on,
    # a token mean over the micro-batch, micro-batches weighted by their tokens (a global token mean).
    legacy = "is_correction_enable" in settings or "is_correction_type" in settings  # 0.10.4's names
    on = settings.get("is_correction_enable", False) if legacy else settings["is_correction_level"] != "off"
    if not on:
        return []
    out = [FrameworkMetric("openrlhf", "train/vllm_kl", lambda p: p.k1, ours="kl_k1")]
    if not legacy and settings["is_correction_gating"] == "ratio":  # 0.10.4 logs no filter ratio
        where = (f"{settings['is_correction_level']} {settings['is_correction_mode']} "
                 f"{settings['is_correction_threshold']}")
        out.append(FrameworkMetric("openrlhf", "train/is_filter_ratio", _filtered(settings),
                                   note=f"share of tokens (sequences at seq level) outside the band ({where})"))
    return out


def render(by_kind: dict[str, Recommendation], target: Target) -> list[str]:
    lines = [f"# flags: openrlhf/cli/train_ppo_ray.py, {target.release.read_from}"]
    flags: list[str] = []
    correction = by_kind.get("correction")
    if correction is not None:
        settings = express(correction.params["mode"], correction.params, target.release)
        assert settings is not None  # render_config drops a correction the release cannot express
        for key, value in settings.items():
            flag = _UNDOTTED[key] if target.release.version.startswith("0.9.") else _PREFIX + key
            if value is True:
                flags.append(flag)
            elif isinstance(value, list):
                flags.append(f"{flag} " + " ".join(repr(v) for v in value))
            else:
                flags.append(f"{flag} {value}")
    if "recompute_old_logprobs" in by_kind:  # experience_maker.py:154-158, :222 (both releases)
        lines.append("# old log-probs: OpenRLHF always recomputes them with the actor (make_experience); "
                     "nothing to set")
    if "batch_invariant" in by_kind:
        lines.append("# batch-invariant vLLM: export VLLM_BATCH_INVARIANT=1 for the vLLM engines")
    if "routing_replay" in by_kind:  # no router-replay flag in 0.10.4 or 0.11.2
        lines.append("# routing replay (R3): OpenRLHF has no such option; verl, slime and prime-rl do")
    if "fp16" in by_kind:
        # --ds.param_dtype bf16|fp16 (0.11.2 :331, 0.10.4 :312); vLLM's dtype is fixed to bfloat16
        # (trainer/ray/vllm_engine.py:273, both releases): no flag reaches it.
        lines.append("# fp16: not settable on both sides: OpenRLHF starts vLLM in bfloat16 whatever you pass "
                     "(vllm_engine.py:273), so --ds.param_dtype fp16 alone would set an fp16 actor against a "
                     "bf16 engine and widen the gap")
    lines += [" \\\n".join(flags)] if flags else []
    return lines
