"""AReaL: its decoupled-PPO keys and actor.rejection_sampling (snippets) and its ppo_actor/ behave
metrics, read from the released wheel areal 1.0.4 (its only release on the package index)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from mismatch.frameworks._common import number, one_of, optional_float, optional_str, yaml_scalar
from mismatch.frameworks.pair_arrays import PairArrays
from mismatch.frameworks.protocol import FrameworkMetric, Recommendation, Release, Target

NAME = "areal"
PACKAGE = "areal"
RELEASES = (Release("1.0.4", "areal 1.0.4 wheel (PyPI)"),)

# areal 1.0.4 areal/api/cli_args.py:1288-1449 (RejectionSamplingConfig: level token|sequence, action
# mask|clamp, metric ratio|kl_k1|kl_k2|kl_k3, agg sum|mean|max, upper 5.0, lower None), :1555
# (actor.rejection_sampling, None by default: no behaviour weight at all), :1549 (use_decoupled_loss).
SETTINGS: dict[str, Callable[[str], Any]] = {"level": one_of("token", "sequence"), "action": one_of("mask", "clamp"),
                                             "upper": number, "lower": optional_float,
                                             "rejection_sampling": optional_str}
# With rejection_sampling null AReaL logs no behave_* metric: the metrics' defaults are the
# config's own field defaults (token, mask, ratio, upper 5.0), with the section set.
DEFAULTS: dict[str, Any] = {"level": "token", "action": "mask", "upper": 5.0, "lower": None}

# Our simulated mode -> (level, action): utils/functional/functional.py:185-420 (apply_rejection_sampling).
# clamp: the token ratio clamped to [lower or 0, upper]; mask: the ratio where it lies in [lower, upper]
# (<= upper without a lower), else 0, and the token leaves the loss mask. At sequence level with the
# ratio metric every token's weight is the sequence's geometric-mean ratio (:288-297, :353-357),
# clamped or masked by the same bounds.
_MODES = {"token_truncate": ("token", "clamp"), "token_clip": ("token", "clamp"),
          "token_icepop": ("token", "mask"), "token_mask": ("token", "mask"),
          "geometric_truncate": ("sequence", "clamp"), "geometric_icepop": ("sequence", "mask")}


def express(mode: str, params: Mapping[str, Any], release: Release) -> dict[str, Any] | None:
    found = _MODES.get(mode)
    if found is None:
        return None
    level, action = found
    upper = float(params["cap"] if "cap" in params else params["high"])
    # unset, a clamp's lower bound becomes 0 (cli_args.py:1436-1437), a mask's stays none; an explicit
    # 0 is refused for the ratio metric (:1422-1425)
    lower = float(params["low"]) if "low" in params else None
    if upper <= 1.0:  # cli_args.py:1416-1421: the ratio metric needs upper > 1
        return None
    return {"level": level, "action": action, "metric": "ratio", "upper": upper, "lower": lower}


class _RejectionSamplingWeights:
    """AReaL's actor.rejection_sampling at one setting (level, action, bounds) and the behaviour
    importance weight it gives each token (functional.py:229-420)."""

    def __init__(self, settings: Mapping[str, Any]) -> None:
        self.level, self.action = settings["level"], settings["action"]
        self.upper, self.lower = settings["upper"], settings["lower"]
        if self.action == "clamp" and self.lower is None:  # cli_args.py:1436-1437
            self.lower = 0.0

    def _ratio(self, p: PairArrays) -> np.ndarray:
        if self.level == "sequence":
            return np.exp(p.per(p.seq, p.log_ratio))[p.seq]
        return p.ratio

    def _in_bounds(self, values: np.ndarray) -> np.ndarray:
        high = values <= self.upper
        return high & (values >= self.lower) if self.lower is not None else high

    def weights(self, p: PairArrays) -> np.ndarray:
        ratio = self._ratio(p)
        if self.action == "clamp":
            low = self.lower if self.lower is not None else 0.0
            return np.clip(ratio, low, self.upper)
        return np.where(self._in_bounds(ratio), ratio, 0.0)

    def filtered(self, p: PairArrays) -> np.ndarray:
        ratio = self._ratio(p)
        changed = self.weights(p) != ratio if self.action == "clamp" else ~self._in_bounds(ratio)
        return changed.astype(np.float64)


def metrics(settings: Mapping[str, Any]) -> list[FrameworkMetric]:
    # areal 1.0.4 utils/functional/functional.py:420-560 (ppo_actor_loss_fn's stats), exported under
    # ppo_actor/update/ (utils/stats_tracker.py:186-290: a token stat's avg over its denominator
    # mask, and its min and max): behave_imp_weight and behave_approx_kl (log pi_prox - log pi_behave)
    # over the tokens whose weight is > 0; rs_filtered_fraction, the share masked or clamped.
    # Logged only with actor.rejection_sampling set. AReaL upcasts the log-ratio to float32 (:231).
    if settings.get("rejection_sampling", "set") is None:
        return []
    rejection = _RejectionSamplingWeights(settings)
    where = f"{rejection.level} {rejection.action} [{rejection.lower}, {rejection.upper}]"

    def kept(values: Callable[[PairArrays], np.ndarray]) -> Callable[[PairArrays], np.ndarray]:
        return lambda p: values(p)[rejection.weights(p) > 0]

    key = "ppo_actor/update/"
    weight = kept(rejection.weights)
    approx_kl = kept(lambda p: p.log_ratio)
    return [
        FrameworkMetric("areal", key + "behave_imp_weight/avg", weight, note=f"over tokens kept ({where})"),
        FrameworkMetric("areal", key + "behave_imp_weight/min", weight, reduce="min", note=where),
        FrameworkMetric("areal", key + "behave_imp_weight/max", weight, reduce="max", note=where),
        FrameworkMetric("areal", key + "behave_approx_kl/avg", approx_kl,
                        note=f"log-ratio (k1 with the sign of ours) over tokens kept ({where})"),
        FrameworkMetric("areal", key + "rs_filtered_fraction", rejection.filtered,
                        note=f"share of tokens masked or clamped ({where})"),
    ]


def render(by_kind: dict[str, Recommendation], target: Target) -> list[str]:
    # areal 1.0.4 areal/api/cli_args.py: actor.use_decoupled_loss (:1549; it recomputes the proximal
    # log-probs, should_compute_prox_logp :1598), actor.recompute_logprob (:1543), actor.dtype (:1120),
    # sglang.dtype (:1854), vllm.dtype (:1698); rollout.return_routed_experts (:2206) returns the
    # experts but nothing in 1.0.4's engines replays them.
    lines = [f"# keys: areal/api/cli_args.py (the experiment config), {target.release.read_from}"]
    actor: list[str] = []
    engines: list[str] = []
    correction = by_kind.get("correction")
    if correction is not None:
        settings = express(correction.params["mode"], correction.params, target.release)
        assert settings is not None  # render_config drops a correction the release cannot express
        actor += ["use_decoupled_loss: true  # the trainer recomputes the proximal log-probs; the weight "
                  "corrects the rollout's", "rejection_sampling:"]
        actor += [f"  {key}: {yaml_scalar(value)}" for key, value in settings.items()]
    elif "recompute_old_logprobs" in by_kind:
        actor.append("recompute_logprob: true")
    if "recompute_old_logprobs" in by_kind and correction is not None:
        lines.append("# old log-probs: use_decoupled_loss recomputes them with the trainer")
    if "fp16" in by_kind:
        actor.append("dtype: float16")
        engines += ["sglang:", "  dtype: float16", "vllm:", "  dtype: float16"]
    if "routing_replay" in by_kind:
        lines.append("# routing replay (R3): AReaL 1.0.4 can return the experts (rollout.return_routed_experts, "
                     "SGLang only) but its trainer does not replay them; verl, slime and prime-rl do")
    if "batch_invariant" in by_kind:
        lines.append("# batch-invariant rollouts: SGLang --enable-deterministic-inference, or "
                     "VLLM_BATCH_INVARIANT=1 for vLLM")
    lines += ["actor:", *(f"  {line}" for line in actor)] if actor else []
    return lines + engines
