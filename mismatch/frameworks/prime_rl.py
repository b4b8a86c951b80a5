"""prime-rl: its [trainer.loss] keys (IPO, DPPO; snippets) and its mismatch_kl/ metrics, read from
prime-rl @ 559b44772e47 (no release on the package index; the newest main on 2026-12-02)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from mismatch.frameworks.protocol import FrameworkMetric, Recommendation, Release, Target

NAME = "prime-rl"
PACKAGE = None
RELEASES = (Release("559b44772e471d1538537b8805cc77f3824a5e64",
                    "prime-rl @ 559b44772e47 (GitHub main, committed 2026-08-21, read 2026-12-02)"),)
# Its metrics read no correction setting: mismatch_kl is logged whatever the loss masks.
SETTINGS: dict[str, Any] = {}
DEFAULTS: dict[str, Any] = {}


def express(mode: str, params: Mapping[str, Any], release: Release) -> dict[str, Any] | None:
    # packages/prime-rl-configs/src/prime_rl/configs/trainer.py:494-532 ([trainer.loss] by `type`:
    # DefaultLossConfig dppo_mask_low/high >= 0, default 0.2; IPOLossConfig ipo_threshold >= 0);
    # src/prime_rl/trainer/rl/loss.py:109-195. prime-rl masks by the probability gap p_train - p_infer
    # and never caps a ratio (ratio masks were removed in 02bdca2e419f, 2026-03-03).
    if mode == "ipo_mask":
        return {"type": "ipo", "ipo_threshold": float(params["threshold"])}
    if mode == "dppo_positive":  # DPPO masks both signs at once; the other side at its default
        return {"type": "default", "dppo_mask_high": float(params["high"]), "dppo_mask_low": 0.2}
    if mode == "dppo_negative":
        return {"type": "default", "dppo_mask_high": 0.2, "dppo_mask_low": float(params["low"])}
    return None


def metrics(settings: Mapping[str, Any]) -> list[FrameworkMetric]:
    # prime-rl @ 559b44772e47: src/prime_rl/trainer/rl/loss.py:100-106, train.py:496-520,
    # trainer/utils.py:264-276 (mismatch_kl/all/...): k3 of every token, gathered across ranks.
    return [
        FrameworkMetric("prime-rl", "mismatch_kl/all/mean", lambda p: p.k3, ours="kl_k3"),
        FrameworkMetric("prime-rl", "mismatch_kl/all/max", lambda p: p.k3, reduce="max", note="the largest token k3"),
        FrameworkMetric("prime-rl", "mismatch_kl/all/median", lambda p: p.k3, reduce="median",
                        note="the median token k3"),
    ]


def render(by_kind: dict[str, Recommendation], target: Target) -> list[str]:
    lines = [f"# keys: prime-rl configs/trainer.py ([trainer.loss] of an rl config; [loss] in a standalone "
             f"trainer config), {target.release.read_from}"]
    loss: list[str] = []
    correction = by_kind.get("correction")
    if correction is not None:
        settings = express(correction.params["mode"], correction.params, target.release)
        assert settings is not None  # render_config drops a correction the release cannot express
        loss += [f'{key} = "{value}"' if isinstance(value, str) else f"{key} = {value!r}"
                 for key, value in settings.items()]
    if "recompute_old_logprobs" in by_kind:
        lines.append("# old log-probs: prime-rl uses the inference log-probs; its mask is the correction")
    if "batch_invariant" in by_kind:
        lines.append("# batch-invariant inference: export VLLM_BATCH_INVARIANT=1 for the inference server")
    if "fp16" in by_kind:
        # configs/trainer.py:233-236: the trainer computes in bfloat16 or float32 only; inference
        # takes vLLM's dtype (configs/inference.py:60).
        lines.append("# fp16: prime-rl's trainer has no float16 (optimization_dtype / reduce_dtype: bfloat16 or "
                     "float32); only inference can run float16 ([inference.vllm] dtype = \"float16\"), which "
                     "widens the gap: keep both sides bfloat16, or the trainer in float32")
    if "routing_replay" in by_kind:
        # configs/trainer.py:637 (TrainerConfig.enable_router_replay; model.impl custom or auto,
        # :754-758); configs/inference.py:141 (VllmConfig.enable_return_routed_experts), set for you by
        # configs/rl.py:588-597 when inference runs from the same rl config.
        lines += ["[trainer]", "enable_router_replay = true", "[inference.vllm]",
                  "enable_return_routed_experts = true  # set for you when inference is in this rl config"]
    if loss:
        lines += ["[trainer.loss]", *loss]
    return lines
