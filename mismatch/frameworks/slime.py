"""slime: its TIS/MIS flags (snippets) and its train/ metrics reduced per rollout, read from
slime @ 624b824a898a (no release on the package index; the newest main on 2026-12-02)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from mismatch.frameworks._common import non_negative, number, parse_bool
from mismatch.frameworks.pair_arrays import PairArrays
from mismatch.frameworks.protocol import FrameworkMetric, Recommendation, Release, Target

NAME = "slime"
PACKAGE = None
RELEASES = (Release("624b824a898ab0ec1fcb4d373004c7f3852bf515",
                    "slime @ 624b824a898a (GitHub main, committed 2026-08-21, read 2026-12-02)"),)

# slime/utils/arguments.py:1061-1079: --use-tis (store_true), --tis-clip (2.0), --tis-clip-low (0).
SETTINGS = {"use_tis": parse_bool, "tis_clip": number, "tis_clip_low": non_negative}
DEFAULTS: dict[str, Any] = {"use_tis": False, "tis_clip": 2.0, "tis_clip_low": 0.0}

# Our simulated modes that examples/train_infer_mismatch_helper/mis.py computes (:193-237: tis_level
# token | sequence | geometric, tis_mode truncate | clip | mask; the lower bound 1/upper when unset, :174).
_MIS = {"sequence_truncate": ("sequence", "truncate"), "geometric_truncate": ("geometric", "truncate"),
        "sequence_clip": ("sequence", "clip"), "sequence_icepop": ("sequence", "mask"),
        "geometric_icepop": ("geometric", "mask"), "token_mask": ("token", "mask"),
        "sequence_mask": ("sequence", "mask")}


def express(mode: str, params: Mapping[str, Any], release: Release) -> dict[str, Any] | None:
    # loss.py:884-930: vanilla_tis_function clamps the ratio to [tis_clip_low, tis_clip];
    # icepop_function zeroes it outside.
    if mode == "token_truncate":
        return {"use_tis": True, "tis_clip": float(params["cap"]), "tis_clip_low": 0.0}
    if mode in ("token_clip", "token_icepop"):
        found = {"use_tis": True, "tis_clip": float(params["high"]), "tis_clip_low": float(params["low"])}
        return found | ({"custom_tis_function_path": _SLIME_ICEPOP} if mode == "token_icepop" else {})
    if mode in _MIS:
        tis_level, tis_mode = _MIS[mode]
        upper = float(params["cap"] if "cap" in params else params["high"])
        # a one-sided mask keeps every small ratio: lower bound 0 (mis.py's mask zeroes ratio < lower)
        lower = float(params["low"]) if "low" in params else 0.0 if tis_mode == "mask" else None
        return {"use_tis": True, "custom_tis_function_path": _SLIME_MIS, "tis_level": tis_level,
                "tis_mode": tis_mode, "tis_upper_bound": upper, "tis_lower_bound": lower}
    return None


def _clipfrac(settings: Mapping[str, Any]):
    low, high = settings["tis_clip_low"], settings["tis_clip"]

    def values(p: PairArrays) -> np.ndarray:
        return p.per(p.rollout, ((p.ratio < low) | (p.ratio > high)).astype(np.float64))
    return values


def metrics(settings: Mapping[str, Any]) -> list[FrameworkMetric]:
    # slime @ 624b824a898a: slime/backends/megatron_utils/loss.py:884-930 (tis, tis_abs, tis_clipfrac),
    # 1136-1151 (train_rollout_logprob_abs_diff), reduced per rollout (tokens of a rollout averaged,
    # then the mean over rollouts; cp_utils.py:47-124); examples/train_infer_mismatch_helper/mis.py:383-451
    # (train/mis_..., the same reduction; logged with the MIS function).
    clip = f"[{settings['tis_clip_low']:g}, {settings['tis_clip']:g}]"
    return [
        FrameworkMetric("slime", "train/train_rollout_logprob_abs_diff", lambda p: p.per(p.rollout, p.abs_log_ratio),
                        note="per rollout mean |log-ratio|, then the mean over rollouts"),
        FrameworkMetric("slime", "train/tis", lambda p: p.per(p.rollout, p.ratio),
                        note="raw ratio, per rollout then over rollouts"),
        FrameworkMetric("slime", "train/tis_abs", lambda p: p.per(p.rollout, np.abs(p.ratio - 1.0)),
                        note="|ratio - 1|, per rollout then over rollouts"),
        FrameworkMetric("slime", "train/tis_clipfrac", _clipfrac(settings),
                        note=f"share outside {clip} (--tis-clip-low, --tis-clip), per rollout then over rollouts"),
        FrameworkMetric("slime", "train/mis_kl", lambda p: p.per(p.rollout, p.k1),
                        note="k1, per rollout then over rollouts"),
        FrameworkMetric("slime", "train/mis_k3_kl", lambda p: p.per(p.rollout, p.k3),
                        note="k3, per rollout then over rollouts"),
        FrameworkMetric("slime", "train/mis_chi2_token", lambda p: p.per(p.rollout, p.clamped_ratio_sq), offset=-1.0,
                        note="per rollout mean of exp(clamped log-ratio)^2 - 1, then the mean"),
    ]


# slime's --custom-tis-function-path takes a dotted import path.
_SLIME_MIS = "examples.train_infer_mismatch_helper.mis.compute_mis_weights_with_cp"
_SLIME_ICEPOP = "slime.backends.megatron_utils.loss.icepop_function"


def render(by_kind: dict[str, Recommendation], target: Target) -> list[str]:
    # slime @ 624b824a898a: slime/utils/arguments.py:1061-1079 (--use-tis, --tis-clip, --tis-clip-low,
    # --custom-tis-function-path, a dotted path: slime/utils/misc.py:39-47), :1570-1576 and :2013-2019
    # (--custom-config-path: a YAML whose keys are set on args, unchecked); MIS: mis.py reads
    # rs_lower_bound / rs_upper_bound on every call (:175-176), so the YAML sets them (null) too.
    lines = [f"# flags: slime/utils/arguments.py; MIS: examples/train_infer_mismatch_helper/ ({target.release.read_from})"]
    flags: list[str] = []
    mis_yaml: list[str] = []
    correction = by_kind.get("correction")
    if correction is not None:
        settings = express(correction.params["mode"], correction.params, target.release)
        assert settings is not None  # render_config drops a correction the release cannot express
        flags.append("--use-tis")
        if "tis_level" in settings:
            flags += [f"--custom-tis-function-path {_SLIME_MIS}", "--custom-config-path mis.yaml"]
            lower = settings["tis_lower_bound"]
            mis_yaml += ["use_tis: true", "use_rs: false", f"tis_level: {settings['tis_level']}",
                         f"tis_mode: {settings['tis_mode']}", f"tis_upper_bound: {settings['tis_upper_bound']!r}",
                         "tis_lower_bound: null  # unused by truncate" if lower is None
                         else f"tis_lower_bound: {lower!r}",
                         "rs_lower_bound: null", "rs_upper_bound: null", "tis_batch_normalize: false"]
        else:
            flags += [f"--tis-clip {settings['tis_clip']!r}", f"--tis-clip-low {settings['tis_clip_low']!r}"]
            if "custom_tis_function_path" in settings:
                flags.append(f"--custom-tis-function-path {settings['custom_tis_function_path']}")
    if "recompute_old_logprobs" in by_kind:
        lines.append("# old log-probs: do not pass --use-rollout-logprobs (it skips the trainer's recompute, "
                     "and arguments.py:1854-1855 refuses it beside --use-tis)")
    if "routing_replay" in by_kind:
        # arguments.py:1098 (--use-rollout-routing-replay, R3; it turns on --use-routing-replay,
        # :2010-2011); sglang_engine.py:569-570 asks SGLang for the experts.
        flags.append("--use-rollout-routing-replay")
    if "batch_invariant" in by_kind:  # sglang's own flag under slime's --sglang- prefix
        flags.append("--sglang-enable-deterministic-inference")
    if "fp16" in by_kind:  # Megatron-LM's --fp16 (slime sets bf16 = not fp16), SGLang's --dtype
        flags += ["--fp16", "--sglang-dtype float16"]
    lines += [" \\\n".join(flags)] if flags else []
    if mis_yaml:
        lines += ["# --- mis.yaml ---", *(f"# {line}" for line in mis_yaml)]
    return lines
