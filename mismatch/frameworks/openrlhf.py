"""OpenRLHF: its --algo.advantage.is_correction_* flags (snippets) and its train/vllm_kl metric, read
from OpenRLHF @ 3c3be6234e0c."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mismatch.frameworks._common import FrameworkMetric, cap, correction_params

if TYPE_CHECKING:
    from mismatch.advise.recommend import Recommendation


# OpenRLHF @ 3c3be6234e0c: openrlhf/models/loss.py:218, trainer/ray/ppo_actor.py:316-388 (a global token mean).
METRICS = [
    FrameworkMetric("openrlhf", "train/vllm_kl", lambda p: p.k1, ours="kl_k1"),
]


def render(by_kind: dict[str, Recommendation]) -> list[str]:
    # Flags: openrlhf/cli/train_ppo_ray.py (--algo.advantage.is_correction_enable / _type / _threshold LOW HIGH);
    # semantics: openrlhf/models/loss.py PolicyLoss: tis = clamp(ratio, low, high), icepop = zero outside
    # [low, high], seq-mask-tis = drop sequences whose geometric-mean ratio leaves [low, high].
    # Older releases: --enable_vllm_is_correction --vllm_is_correction_type T --vllm_is_truncated_threshold LOW HIGH.
    lines = ["# flags: openrlhf/cli/train_ppo_ray.py; before the --algo.* names: --enable_vllm_is_correction "
             "--vllm_is_correction_type --vllm_is_truncated_threshold"]
    flags: list[str] = []
    chosen = correction_params(by_kind)
    if chosen is not None:
        mode, params = chosen
        if mode in ("token_truncate", "token_clip"):
            low = params.get("low", 0.0)  # tis clamps from below too; 0 leaves small ratios alone
            kind, bounds = "tis", (low, cap(params))
        elif mode in ("token_icepop", "token_mask"):
            kind, bounds = "icepop", (params.get("low", 0.0), cap(params))
        elif mode in ("seq_mask_tis", "geometric_icepop"):
            kind, bounds = "seq-mask-tis", (params["low"], params["high"])
        else:
            lines.append(f"# OpenRLHF has no {mode}; nearest: token-level tis at {cap(params):g}")
            kind, bounds = "tis", (0.0, cap(params))
        flags += ["--algo.advantage.is_correction_enable", f"--algo.advantage.is_correction_type {kind}",
                  f"--algo.advantage.is_correction_threshold {bounds[0]!r} {bounds[1]!r}"]
    if "recompute_old_logprobs" in by_kind:
        lines.append("# old log-probs: OpenRLHF recomputes them with the actor unless --train.force_on_policy")
    if "batch_invariant" in by_kind:
        lines.append("# batch-invariant vLLM: export VLLM_BATCH_INVARIANT=1 for the vLLM engines")
    if "routing_replay" in by_kind:  # OpenRLHF @ its cited commit: no routing-replay option exists
        lines.append("# routing replay (R3): OpenRLHF has no such option; verl, slime and prime-rl do")
    if "fp16" in by_kind:
        lines.append("# fp16: run the actor and vLLM in float16 instead of bfloat16")
    lines += [" \\\n".join(flags)] if flags else []
    return lines
