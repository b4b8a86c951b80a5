"""verl: the keys of its RolloutCorrectionConfig (snippets) and its rollout_corr/ and training/
metrics, read from the released wheels verl 0.8.0 and 0.9.1 (verl now lives in the verl-project
organization)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from mismatch.frameworks._common import number, one_of, yaml_scalar
from mismatch.frameworks.pair_arrays import SAFETY_BOUND, PairArrays, probs
from mismatch.frameworks.protocol import FrameworkMetric, Recommendation, Release, Target

NAME = "verl"
PACKAGE = "verl"
# 0.7.1 has RolloutCorrectionConfig too, but rollout_is_threshold is a float there (TIS only, no
# IcePop band): not a release the snippets target; an older version gets 0.8.0's keys and a note.
RELEASES = (Release("0.8.0", "verl 0.8.0 wheel (PyPI)"), Release("0.9.1", "verl 0.9.1 wheel (PyPI)"))


def _threshold(text: str) -> float | str:
    """rollout_is_threshold as verl takes it: a positive number (TIS cap) or "lower_upper" (IcePop band),
    each bound a plain number ("1_2" is the band [1, 2], never twelve)."""
    if "_" not in text:
        return number(text)
    low, _, high = text.strip().partition("_")
    if low.isdigit() and high.isdigit():  # "1_2": YAML 1.1 and Hydra's override grammar read an unquoted 1_2 as 12
        raise ValueError(f"{text!r} is ambiguous: verl reads it as the integer {int(low + high)} unquoted (YAML and "
                         f"Hydra take _ in integers) and as the band [{low}, {high}] quoted; write the band "
                         f"{low}.0_{high}.0 or the cap {low}{high}")
    number(low), number(high)
    _bounds(text)  # refuse what verl would refuse, here
    return text.strip()


def _bounds(threshold: float | str) -> tuple[float, float | None]:
    """(upper, lower or None): verl 0.9.1 trainer/ppo/rollout_corr_helper.py:93-129 (0.8.0 the same)."""
    if isinstance(threshold, str) and "_" in threshold:
        low, _, high = threshold.partition("_")
        lower, upper = float(low), float(high)
        if not (0 < lower <= upper):
            raise ValueError(f"{threshold!r}: verl needs 0 < lower <= upper")
        return upper, lower
    upper = float(threshold)
    if upper <= 0:
        raise ValueError(f"{threshold!r}: verl needs a positive threshold")
    return upper, None


# verl 0.9.1 trainer/config/algorithm.py:179-185 (RolloutCorrectionConfig; 0.8.0 :175-181). The
# composed YAML (trainer/config/algorithm/rollout_correction.yaml) leaves rollout_is null: no IS
# weights, and none of the rollout_is_* metrics. The metrics' defaults are therefore its
# decoupled_token_is preset (algorithm.py:188: rollout_is token, threshold 2.0), said in the summary.
# rollout_is: null, "token" or "sequence" (algorithm.py RolloutCorrectionConfig; rollout_corr_helper.py)
SETTINGS: dict[str, Callable[[str], Any]] = {"rollout_is": one_of("token", "sequence", optional=True),
                                             "rollout_is_threshold": _threshold}
DEFAULTS: dict[str, Any] = {"rollout_is": "token", "rollout_is_threshold": 2.0}

_RS_OPTIONS = frozenset({"token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3",
                         "seq_mean_k1", "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3"})


def express(mode: str, params: Mapping[str, Any], release: Release) -> dict[str, Any] | None:
    # rollout_corr_helper.py:566-605: rollout_is token | sequence (the summed log-ratio), a float
    # threshold clamps from above (TIS), "lower_upper" zeroes weights outside the band and keeps the
    # raw ratio inside (IcePop; response_mask unchanged). rollout_rs only keeps or drops (:197-415).
    if mode in ("token_truncate", "sequence_truncate"):
        return {"rollout_is": mode.split("_")[0], "rollout_is_threshold": float(params["cap"]), "rollout_rs": None}
    if mode in ("token_icepop", "sequence_icepop"):
        return {"rollout_is": mode.split("_")[0], "rollout_is_threshold": f"{params['low']!r}_{params['high']!r}",
                "rollout_rs": None}
    if mode.startswith("rs_") and mode[3:] in _RS_OPTIONS:
        threshold = (f"{params['low']!r}_{params['high']!r}" if "low" in params else float(params["high"]))
        return {"rollout_is": None, "rollout_rs": mode[3:], "rollout_rs_threshold": threshold}
    return None


# --- metrics ---

EPS = 1e-8  # verl/utils/torch_functional.py:294-308: masked_mean divides by the mask's sum + 1e-8

def _log_ppl_diff(p: PairArrays) -> np.ndarray:
    """Per sequence: mean logp_rollout - mean logp_train (verl's d_s)."""
    return p.per(p.seq, p.logp_b, EPS) - p.per(p.seq, p.logp_a, EPS)


class _RolloutIsWeights:
    """verl's rollout_is at one setting (level, threshold) and the IS weights it gives
    (rollout_corr_helper.py:566-605): raw = exp(log-ratio, or the sequence's summed log-ratio,
    clamped to +-20), then TIS (min with the upper bound) or IcePop (0 outside [lower, upper]); per
    token, a sequence's weight on each of its tokens."""

    def __init__(self, settings: Mapping[str, Any]) -> None:
        self.level = settings["rollout_is"]
        if self.level not in ("token", "sequence"):
            raise ValueError(f"rollout_is {self.level!r} is not token or sequence")
        self.upper, self.lower = _bounds(settings["rollout_is_threshold"])
        self.icepop = self.lower is not None
        self.low = self.lower if self.lower is not None else 1.0 / self.upper  # compute_is_metrics' default

    def log_ratio(self, p: PairArrays) -> np.ndarray:
        """Per token, or per sequence (unclamped: the metrics' log_ratio_for_metrics)."""
        return p.log_ratio if self.level == "token" else p.seq_log_ratio

    def raw(self, p: PairArrays) -> np.ndarray:
        return p.memo(("verl_raw", self.level), lambda: self._raw(p))

    def _raw(self, p: PairArrays) -> np.ndarray:
        if self.level == "token":
            return p.clamped_ratio  # exp(clip(log-ratio)), made once with the chi-square term
        return np.exp(np.clip(self.log_ratio(p), -SAFETY_BOUND, SAFETY_BOUND))[p.seq]

    def applied(self, p: PairArrays) -> np.ndarray:
        # Made once per pair and setting: the mean, ESS, extremes and five per-sequence keys read it.
        return p.memo(("verl_applied", self.level, self.upper, self.lower), lambda: self._applied(p))

    def _applied(self, p: PairArrays) -> np.ndarray:
        raw = self.raw(p)
        if self.icepop:
            return np.where((raw >= self.lower) & (raw <= self.upper), raw, 0.0)
        return np.minimum(raw, self.upper)


def _is_metrics(settings: Mapping[str, Any]) -> list[FrameworkMetric]:
    """rollout_corr/rollout_is_* (compute_is_metrics, 0.9.1 rollout_corr_helper.py:660-783, 0.8.0
    :658-781): logged only when rollout_is is set; over every valid token, a sequence's weight on
    each of its tokens; the high/low fractions from the raw weights (per sequence, in log space, at
    sequence level); the ESS from the applied weights clamped to [0, upper], +1e-8 in the mean."""
    rollout_is = _RolloutIsWeights(settings)
    where = f"rollout_is {rollout_is.level}, rollout_is_threshold {settings['rollout_is_threshold']}"
    log_upper, log_low = math.log(rollout_is.upper), math.log(rollout_is.low)

    def fraction(above: bool) -> Callable[[PairArrays], np.ndarray]:
        def values(p: PairArrays) -> np.ndarray:
            if rollout_is.level == "sequence":
                log_ratio = p.seq_log_ratio
                return (log_ratio > log_upper if above else log_ratio < log_low).astype(np.float64)
            raw = rollout_is.raw(p)
            return (raw > rollout_is.upper if above else raw < rollout_is.low).astype(np.float64)
        return values

    def extreme(p: PairArrays, high: bool) -> np.ndarray:
        if rollout_is.level == "token":
            return rollout_is.applied(p)
        log_ratio = p.seq_log_ratio  # the unclamped sequence log-ratio, exp'd (the max clamped to 20)
        return np.exp(np.minimum(log_ratio, SAFETY_BOUND)) if high else np.exp(log_ratio)

    def seq_means(p: PairArrays) -> np.ndarray:
        return p.per(p.seq, rollout_is.applied(p), EPS)

    key = "rollout_corr/rollout_is_"
    out = [
        FrameworkMetric("verl", key + "mean", rollout_is.applied, note=f"applied weights ({where})"),
        FrameworkMetric("verl", key + "eff_sample_size",
                        lambda p: np.clip(rollout_is.applied(p), 0.0, rollout_is.upper),
                        reduce="ess_eps", note=f"applied weights clamped to [0, upper] ({where})"),
        FrameworkMetric("verl", key + "ratio_fraction_high", fraction(True), note=f"raw weight > upper ({where})"),
        FrameworkMetric("verl", key + "ratio_fraction_low", fraction(False),
                        note=f"raw weight < lower (1/upper for TIS; {where})"),
        FrameworkMetric("verl", key + "max", lambda p: extreme(p, True), reduce="max", note=where),
        FrameworkMetric("verl", key + "min", lambda p: extreme(p, False), reduce="min", note=where),
        FrameworkMetric("verl", key + "seq_mean", seq_means, note=f"per-sequence mean weight, then the mean ({where})"),
        FrameworkMetric("verl", key + "seq_std", seq_means, reduce="std", note=f"of the per-sequence means ({where})"),
        FrameworkMetric("verl", key + "seq_max", seq_means, reduce="max", note=where),
        FrameworkMetric("verl", key + "seq_min", seq_means, reduce="min", note=where),
        FrameworkMetric("verl", key + "seq_max_deviation", lambda p: np.abs(seq_means(p) - 1.0), reduce="max",
                        note=f"max |per-sequence mean weight - 1| ({where})"),
    ]
    if rollout_is.icepop:  # :617-622
        def outside(p: PairArrays) -> np.ndarray:
            raw = rollout_is.raw(p)
            return ((raw < rollout_is.lower) | (raw > rollout_is.upper)).astype(np.float64)
        out.append(FrameworkMetric("verl", key + "oob_ratio", outside, note=f"share of tokens outside the band ({where})"))
    return out


def metrics(settings: Mapping[str, Any]) -> list[FrameworkMetric]:
    # verl 0.9.1: trainer/ppo/rollout_corr_helper.py:904-1010 (compute_offpolicy_metrics, keys
    # prefixed rollout_corr/, always logged), :660-783 (the IS weights' metrics), verl/utils/debug/
    # metrics.py:63-121 (training/...). 0.8.0 the same formulas. Token means over all valid tokens.
    out = [
        FrameworkMetric("verl", "rollout_corr/kl", lambda p: p.k1, ours="kl_k1"),
        FrameworkMetric("verl", "rollout_corr/k3_kl", lambda p: p.k3, ours="kl_k3"),
        FrameworkMetric("verl", "rollout_corr/training_ppl", lambda p: np.exp(-p.per(p.seq, p.logp_a, EPS)),
                        note="per sequence exp(-mean logp_train), then the mean over sequences"),
        FrameworkMetric("verl", "rollout_corr/training_log_ppl", lambda p: -p.per(p.seq, p.logp_a, EPS),
                        note="per sequence -mean logp_train, then the mean over sequences"),
        FrameworkMetric("verl", "rollout_corr/rollout_ppl", lambda p: np.exp(-p.per(p.seq, p.logp_b, EPS)),
                        note="per sequence exp(-mean logp_rollout), then the mean over sequences"),
        FrameworkMetric("verl", "rollout_corr/rollout_log_ppl", lambda p: -p.per(p.seq, p.logp_b, EPS),
                        note="per sequence -mean logp_rollout, then the mean over sequences"),
        FrameworkMetric("verl", "rollout_corr/log_ppl_diff", _log_ppl_diff,
                        note="per sequence mean logp_rollout - mean logp_train, then the mean"),
        FrameworkMetric("verl", "rollout_corr/log_ppl_abs_diff", lambda p: np.abs(_log_ppl_diff(p)),
                        note="the mean over sequences of |log_ppl_diff|"),
        FrameworkMetric("verl", "rollout_corr/log_ppl_diff_max", _log_ppl_diff, reduce="max",
                        note="the largest sequence log_ppl_diff"),
        FrameworkMetric("verl", "rollout_corr/log_ppl_diff_min", _log_ppl_diff, reduce="min",
                        note="the smallest sequence log_ppl_diff"),
        FrameworkMetric("verl", "rollout_corr/ppl_ratio", lambda p: np.exp(_log_ppl_diff(p)), ours="ppl_ratio"),
        FrameworkMetric("verl", "rollout_corr/chi2_token", lambda p: p.clamped_ratio_sq, offset=-1.0,
                        ours="chi2_token", note="log-ratio clamped to +-20 before exp (ours is not clamped)"),
        FrameworkMetric("verl", "rollout_corr/chi2_seq",
                        lambda p: np.exp(2.0 * np.clip(p.seq_log_ratio, -SAFETY_BOUND, SAFETY_BOUND)),
                        offset=-1.0, ours="chi2_seq", note="sequence log-ratio sum clamped to +-20 (ours is not clamped)"),
        FrameworkMetric("verl", "training/rollout_probs_diff_mean", lambda p: p.prob_abs_diff, ours="prob_abs_diff_mean"),
        FrameworkMetric("verl", "training/rollout_probs_diff_max", lambda p: p.prob_abs_diff, reduce="max",
                        ours="prob_abs_diff_max"),
        FrameworkMetric("verl", "training/rollout_probs_diff_std", lambda p: p.prob_abs_diff, reduce="std",
                        note="sample std (ddof 1) of |p_train - p_rollout|"),
        FrameworkMetric("verl", "training/rollout_actor_probs_pearson_corr", probs, reduce="pearson",
                        note="Pearson correlation of the probabilities"),
    ]
    return out + (_is_metrics(settings) if settings.get("rollout_is") is not None else [])


# --- snippets ---

def render(by_kind: dict[str, Recommendation], target: Target) -> list[str]:
    # verl 0.9.1 / 0.8.0: trainer/config/algorithm.py:179-185 (RolloutCorrectionConfig), rollout.yaml
    # (calculate_log_probs: true by default in 0.9.1 :237, false in 0.8.0 :225; dtype :43 / :35;
    # enable_rollout_routing_replay :337 / :348); engine/fsdp.yaml:82 (fsdp_config.dtype),
    # engine/megatron.yaml:120 (megatron.dtype).
    lines = [f"# keys: verl/trainer/config/algorithm.py (RolloutCorrectionConfig), {target.release.read_from}"]
    algo: list[str] = []
    actor: list[str] = []
    rollout: list[str] = []
    correction = by_kind.get("correction")
    if correction is not None:
        settings = express(correction.params["mode"], correction.params, target.release)
        assert settings is not None  # render_config drops a correction the release cannot express
        algo += [f"{key}: {yaml_scalar(value)}" for key, value in settings.items()]
        rollout.append("calculate_log_probs: true  # the sampler's log-probs feed rollout_is / rollout_rs")
    if "recompute_old_logprobs" in by_kind:
        algo.append("bypass_mode: false  # decoupled mode: the trainer recomputes old log-probs")
    megatron = "routing_replay" in by_kind
    if megatron:
        # engine_workers.py:496-505 (0.8.0 :475-484): the workers read actor.megatron.router_replay.mode
        # (strategy megatron) or actor.veomni.router_replay.mode (veomni); 0.8.0's actor.router_replay
        # loads but no worker reads it, 0.9.1 refuses it (workers/config/engine.py:50-73, :115).
        lines.append("# routing replay (R3): the Megatron actor (config ppo_megatron_trainer); on VeOmni "
                     "(model_engine=veomni) set actor.veomni.router_replay.mode: R3 instead")
        actor += ["megatron:", "  router_replay:", "    mode: R3"]
        rollout.append("enable_rollout_routing_replay: true  # the engine returns each token's experts")
    if "fp16" in by_kind:
        actor += ["  dtype: float16"] if megatron else ["fsdp_config:", "  dtype: float16  # the FSDP actor's compute dtype"]
        rollout.append("dtype: float16")
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
