"""prime-rl: its [trainer.loss] keys (IPO, DPPO; snippets) and its mismatch_kl/ metrics, read from
prime-rl @ 559b44772e47."""

from __future__ import annotations

from typing import TYPE_CHECKING

from mismatch.frameworks._common import FrameworkMetric, correction_params

if TYPE_CHECKING:
    from mismatch.advise.recommend import Recommendation


# prime-rl @ 559b44772e47: src/prime_rl/trainer/rl/loss.py:100-106, train.py:499-520 (mismatch_kl/all/...):
# k3 of every token, gathered across ranks.
METRICS = [
    FrameworkMetric("prime-rl", "mismatch_kl/all/mean", lambda p: p.k3, ours="kl_k3"),
    FrameworkMetric("prime-rl", "mismatch_kl/all/max", lambda p: p.k3, reduce="max", note="the largest token k3"),
    FrameworkMetric("prime-rl", "mismatch_kl/all/median", lambda p: p.k3, reduce="median", note="the median token k3"),
]


def render(by_kind: dict[str, Recommendation]) -> list[str]:
    # prime-rl @ 559b44772e47: packages/prime-rl-configs/src/prime_rl/configs/trainer.py:494-532
    # ([trainer.loss] = DefaultLossConfig (DPPO: dppo_mask_low/high) | IPOLossConfig (ipo_threshold) |
    # CustomLossConfig, by `type`). Ratio-based masks and caps (token_mask_*, geo_mask_*, sequence_mask_*,
    # sequence_clip_high, ratio_type) were removed in 02bdca2e419f (2026-03-03): prime-rl masks by the
    # probability gap p_train - p_infer and never caps the ratio.
    lines = ["# keys: prime-rl configs/trainer.py ([trainer.loss] of an rl config; [loss] in a standalone "
             "trainer config)"]
    loss: list[str] = []
    chosen = correction_params(by_kind)
    if chosen is not None:
        mode, params = chosen
        if mode == "ipo_mask":
            loss += ['type = "ipo"', f"ipo_threshold = {float(params['threshold'])!r}"]
        elif mode in ("dppo_positive", "dppo_negative"):
            loss += ['type = "default"', f"dppo_mask_high = {float(params.get('high', 0.2))!r}",
                     f"dppo_mask_low = {float(params.get('low', 0.2))!r}"]
        else:
            ipo = by_kind["correction"].params.get("prime_rl_ipo")
            lines.append(f"# prime-rl has no ratio-based {mode}: it masks tokens by p_train - p_infer "
                         "(DPPO, its default, or IPO) and never caps the ratio")
            if ipo is not None:
                lines.append(f"# nearest: IPO at ipo_threshold {ipo['threshold']:g}, simulated on these "
                             f"tokens: masks {ipo['frac_tokens_affected']:.2%} of them (ESS {ipo['ess']:.3f})")
                loss += ['type = "ipo"', f"ipo_threshold = {float(ipo['threshold'])!r}"]
            else:
                lines.append("# nearest: the default DPPO loss as it is (no key to set)")
    if "recompute_old_logprobs" in by_kind:
        lines.append("# old log-probs: prime-rl uses the inference log-probs; its mask is the correction")
    if "batch_invariant" in by_kind:
        lines.append("# batch-invariant inference: export VLLM_BATCH_INVARIANT=1 for the inference server")
    if "fp16" in by_kind:
        lines.append("# fp16: set the trainer and inference model dtype to float16 instead of bfloat16")
    if "routing_replay" in by_kind:
        # prime-rl @ 559b44772e47: configs/trainer.py:637 (TrainerConfig.enable_router_replay; model.impl
        # custom or auto, :755-757); configs/inference.py:141 (VllmConfig.enable_return_routed_experts),
        # set for you by configs/rl.py:589-597 when inference runs from the same rl config.
        lines += ["[trainer]", "enable_router_replay = true", "[inference.vllm]",
                  "enable_return_routed_experts = true  # set for you when inference is in this rl config"]
    if loss:
        lines += ["[trainer.loss]", *loss]
    return lines
