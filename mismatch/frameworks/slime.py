"""slime: its TIS/MIS flags (snippets) and its train/ metrics reduced per rollout, read from
slime @ 624b824a898a."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from mismatch.frameworks._common import FrameworkMetric, cap, correction_params, level

if TYPE_CHECKING:
    from mismatch.advise.recommend import Recommendation


# slime @ 624b824a898a: slime/backends/megatron_utils/loss.py:895-927, 1136-1151 (train/...), reduced
# per rollout (tokens of a rollout averaged, then the mean over rollouts; cp_utils.py:47-124);
# examples/train_infer_mismatch_helper/mis.py:391-451 (train/mis_..., the same reduction).
METRICS = [
    FrameworkMetric("slime", "train/train_rollout_logprob_abs_diff", lambda p: p.per(p.rollout, p.abs_log_ratio),
                    note="per rollout mean |log-ratio|, then the mean over rollouts"),
    FrameworkMetric("slime", "train/tis", lambda p: p.per(p.rollout, p.ratio),
                    note="raw ratio, per rollout then over rollouts"),
    FrameworkMetric("slime", "train/tis_abs", lambda p: p.per(p.rollout, np.abs(p.ratio - 1.0)),
                    note="|ratio - 1|, per rollout then over rollouts"),
    FrameworkMetric("slime", "train/tis_clipfrac", lambda p: p.per(p.rollout, (p.ratio > 2.0).astype(np.float64)),
                    note="share clipped by --tis-clip 2 (--tis-clip-low 0 clips nothing below)"),
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


def render(by_kind: dict[str, Recommendation]) -> list[str]:
    # slime @ 624b824a898a: slime/utils/arguments.py:1027-1079 (--use-tis, --tis-clip, --tis-clip-low,
    # --custom-tis-function-path), :1572 and :2013-2019 (--custom-config-path: a YAML whose keys are set
    # on args); slime/backends/megatron_utils/loss.py:895-931 (vanilla_tis_function clamps the ratio to
    # [tis_clip_low, tis_clip]; icepop_function zeroes it outside); MIS: examples/train_infer_mismatch_helper
    # mis.py + mis.yaml (tis_level token|sequence|geometric, tis_mode truncate|clip|mask, tis_*_bound).
    lines = ["# flags: slime/utils/arguments.py; MIS: examples/train_infer_mismatch_helper/"]
    flags: list[str] = []
    mis_yaml: list[str] = []
    chosen = correction_params(by_kind)
    if chosen is not None:
        mode, params = chosen
        if mode == "token_truncate":
            flags += ["--use-tis", f"--tis-clip {float(params['cap'])!r}"]
        elif mode == "token_clip":
            flags += ["--use-tis", f"--tis-clip {params['high']!r}", f"--tis-clip-low {params['low']!r}"]
        elif mode == "token_icepop":
            flags += ["--use-tis", f"--custom-tis-function-path {_SLIME_ICEPOP}",
                      f"--tis-clip {params['high']!r}", f"--tis-clip-low {params['low']!r}"]
        else:
            geometric = mode.startswith("geometric") or mode in ("seq_mask_tis", "rs_seq_mean_k1")
            tis_level = "geometric" if geometric else level(mode)
            tis_mode = "truncate" if mode.endswith("truncate") else "clip" if mode.endswith("clip") else "mask"
            flags += ["--use-tis", f"--custom-tis-function-path {_SLIME_MIS}", "--custom-config-path mis.yaml"]
            mis_yaml += ["use_tis: true", "use_rs: false", f"tis_level: {tis_level}", f"tis_mode: {tis_mode}",
                         f"tis_upper_bound: {float(cap(params))!r}"]
            if "low" in params:
                mis_yaml.append(f"tis_lower_bound: {params['low']!r}")
            else:
                mis_yaml.append("tis_lower_bound: null  # unused by truncate; mask defaults it to 1/upper")
            mis_yaml.append("tis_batch_normalize: false")
    if "recompute_old_logprobs" in by_kind:
        lines.append("# old log-probs: do not pass --use-rollout-logprobs (it skips the trainer's recompute)")
    if "routing_replay" in by_kind:
        # slime @ 624b824a898a: slime/utils/arguments.py:1098 (--use-rollout-routing-replay, R3; it
        # turns on --use-routing-replay, :2010-2011); sglang_engine.py:569-570 asks SGLang for experts.
        flags.append("--use-rollout-routing-replay")
    if "batch_invariant" in by_kind:
        flags.append("--sglang-enable-deterministic-inference")
    if "fp16" in by_kind:
        lines.append("# fp16: run the Megatron actor and the SGLang rollout in float16 instead of bfloat16")
    lines += [" \\\n".join(flags)] if flags else []
    if mis_yaml:
        lines += ["# --- mis.yaml ---", *(f"# {line}" for line in mis_yaml)]
    return lines
