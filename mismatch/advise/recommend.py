"""Recommendations: a stated rule turns the measured gap into a correction, fixes at the source, and configs.

Flow: summary.json (pairs, counts, engines, corrections, localization) + probes -> recommend -> render_config.
"""

from __future__ import annotations

import math
import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from mismatch import frameworks
from mismatch.advise.corrections import MODES, REJECTION_MODES
from mismatch.advise.diagnose import Cause, Diagnosis, batch_variant_from_probes, diagnose  # noqa: F401
from mismatch.advise.verdicts import gap_level
from mismatch.errors import MismatchError
from mismatch.frameworks._common import Target

RULE = """\
0. The diagnosis first (mismatch.advise.diagnose.RULE): each cause it finds, in its order, gets the
   fix at its source: a shift fix_alignment alone (every ratio is measured on misaligned pairs, so
   no correction or cost can be chosen from it); processed log-probs raw_logprobs; weights that
   differ fix_weight_sync, naming the tensors, layer, module and expert; a sampler that ran another
   config match_sampler_config (the replay that tells precision from weights); a step at a turn
   inspect_turn (the turn and the rollouts that show it); render drift fix_renderer; batch variance
   batch_invariant; routing flips routing_replay (never over a localized weight fault: it would
   hide it); bfloat16 rounding, when the evidence confirms it and its gap is large, fp16 (a small
   one gets the correction alone: fp16 is a migration). A minor cause (re-rendered
   tokens under 1% of the trained ones) explains no gap: its fix comes after everything else.
1. Then, only if the ratio still needs it meanwhile, the correction: none when the train/sampler gap
   (the like-for-like train_processed/sampler one when the sampler stored processed log-probs) is
   exact or negligible (mismatch.advise.verdicts.gap_level). Otherwise, of the simulated IS
   corrections the target framework's release can express (truncate, clip, IcePop and masks,
   sequence and geometric variants, IPO and DPPO masks; rejection filters correct no ratio alone),
   the one with the highest ESS among those that change at most 1% of trainable tokens with ESS >=
   0.9; ties go to fewer tokens changed, then to a weight mean nearer 1. Sequence-level modes when
   the mismatch grows with position or steps up at a turn, else token-level ones (all modes if the
   framework has none of that level). If none meets both bounds, the highest ESS, and it says so.
2. Gap large and no fault found that a fix removes (weights, sampler, processing, a turn):
   recompute_old_logprobs (cost: one extra forward pass over the batch's N tokens). A small gap gets
   the correction alone: nothing heavier than the gap justifies.
"""

MAX_FRAC_AFFECTED = 0.01  # at most 1% of trainable tokens clipped
MIN_ESS = 0.9
PAIR = "train/sampler"
PROCESSED_PAIR = "train_processed/sampler"


@dataclass(kw_only=True, slots=True, frozen=True)
class Recommendation:
    """One item of summary.json["recommendations"] (contract: kind, params, why; plus its cost)."""

    kind: str
    params: dict[str, Any] = field(default_factory=dict)
    why: str
    cost: str = ""

    def __post_init__(self) -> None:
        if not self.cost:  # what the fix costs to run: the other half of choosing it
            object.__setattr__(self, "cost", COSTS.get(self.kind, ""))

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "params": dict(self.params), "why": self.why, "cost": self.cost}

    def params_as_correction(self) -> dict[str, Any]:
        """A correction's mode and its own parameters (without the measured extras)."""
        names = MODES[self.params["mode"]].params
        return {"mode": self.params["mode"], "params": {k: self.params[k] for k in names}}


COSTS = {
    "no_correction": "none",
    "fix_alignment": "an exporter fix; nothing at run time",
    "fix_renderer": "a harness or chat-template fix; nothing at run time",
    "correction": "a few element-wise operations per token in the loss; no extra pass",
    "recompute_old_logprobs": "one extra forward pass (no backward) over every token of each batch",
    "fp16": "loss scaling in the trainer, and weights within float16's range; memory as bf16",
    "batch_invariant": "inference throughput (reported 10-60% for bitwise modes)",
    "raw_logprobs": "none: an engine setting",
    "fix_weight_sync": "a fix to the weight sync or the checkpoint; nothing at run time",
    "match_sampler_config": "one more audit, with the sampler's config as --infer",
    "inspect_turn": "reading the named rollouts at that turn (mismatch report)",
    "routing_replay": "the engine returns each token's experts (layers x top-k ids per token); the trainer "
                      "forces them: no extra pass",
}


@dataclass(kw_only=True, slots=True, frozen=True)
class Evidence:
    """What the rule reads: the diagnosis, and the gap and simulated corrections of the pair a
    correction would be chosen on."""

    metrics: dict[str, Any]  # summary["pairs"][pair]
    corrections: list[dict[str, Any]]
    diagnosis: Diagnosis = field(default_factory=lambda: Diagnosis(causes=()))
    pair: str = PAIR  # the pair the correction is chosen on (the like-for-like one when processed)
    num_tokens: int | None = None
    num_trainable_tokens: int | None = None
    grows_with_position: bool | None = None
    onset_turn: int | None = None  # where the gap steps up (localization.turns)

    @property
    def level(self) -> str:
        return gap_level(self.metrics)


def evidence_from_summary(summary: dict[str, Any], *, corrections: list[dict[str, Any]] | None = None,
                          grows_with_position: bool | None = None, batch_variant: bool | None = None,
                          probes: list[dict[str, Any]] | None = None, drift: dict[str, Any] | None = None,
                          alignment: dict[str, Any] | None = None) -> Evidence:
    """Evidence from summary.json; keyword arguments override or add what the summary lacks.

    `corrections` defaults to summary["corrections"]; `grows_with_position` to
    summary["localization"]["turns"]["position_slope"]["grows_with_position"]; `batch_variant` to what
    `probes` (ProbeResult dicts, probes/result.py) show; `drift` / `alignment` to summary["drift"] /
    summary["alignment"].
    """
    seen = dict(summary)  # what the diagnosis reads: the summary with the findings given here
    if drift is not None:
        seen["drift"] = drift
    if alignment is not None:
        seen["alignment"] = alignment
    turns = (summary.get("localization") or {}).get("turns") or {}
    if grows_with_position is None:
        grows_with_position = (turns.get("position_slope") or {}).get("grows_with_position")
    counts = summary.get("counts") or {}
    pair = correction_pair(seen)
    return Evidence(
        metrics=(summary.get("pairs") or {}).get(pair) or {}, pair=pair,
        diagnosis=diagnose(seen, probes=probes, batch_variant=batch_variant),
        corrections=list(corrections if corrections is not None else summary.get("corrections") or []),
        num_tokens=counts.get("tokens"), num_trainable_tokens=counts.get("trainable_tokens"),
        grows_with_position=grows_with_position, onset_turn=turns.get("onset_turn"))


def correction_pair(summary: dict[str, Any]) -> str:
    """The pair a correction is chosen on: train/sampler, or the like-for-like train_processed/
    sampler when the sampler stored processed log-probs (a correction computed on mismatched
    semantics would correct the processing, which raw_logprobs fixes)."""
    processed = (summary.get("alignment") or {}).get("logprob_semantics") == "processed"
    return PROCESSED_PAIR if processed and PROCESSED_PAIR in (summary.get("pairs") or {}) else PAIR


def recommend(summary: dict[str, Any], target: Target | None = None, **findings: Any) -> list[Recommendation]:
    """The rule (module docstring) applied to a summary, for `target`'s framework release (any
    framework's modes without one); `findings` as for evidence_from_summary."""
    return rule(evidence_from_summary(summary, **findings), target)


def rule(evidence: Evidence, target: Target | None = None) -> list[Recommendation]:
    diagnosis = evidence.diagnosis
    if diagnosis.lead is not None and diagnosis.lead.kind == "alignment_shift":
        return [_fix_alignment(diagnosis.lead)]
    out: list[Recommendation] = []
    for cause in [c for c in diagnosis.causes if not c.minor]:
        _add(out, _source_fix(cause))
    out.append(choose_correction(evidence, target))
    if evidence.level == "large" and not any(c.kind in FAULTS for c in diagnosis.causes):
        out.append(_recompute(evidence))
    for cause in [c for c in diagnosis.causes if c.minor]:  # real, but explaining no gap: after the answer
        _add(out, _source_fix(cause))
    return out


def _add(out: list[Recommendation], fix: Recommendation | None) -> None:
    if fix is not None and all(r.kind != fix.kind for r in out):
        out.append(fix)


# Causes a fix removes at the source: recomputing old log-probs would only hide them.
FAULTS = frozenset({"processed_logprobs", "weights", "sampler_weights", "sampler_config", "turn_onset"})


def _source_fix(cause: Cause) -> Recommendation | None:
    """The fix at a cause's source, in the words of the cause's evidence (kernel paths and position
    drift have none of their own: recompute and the correction's level answer them)."""
    why = "; ".join([cause.title, *cause.evidence, *cause.rules_out])
    where = {k: v for k, v in cause.where.items() if k != "words"}
    if "words" in cause.where:  # where the fault is, as a reader says it (the headline's "fix: ...")
        where["at"] = cause.where["words"]
    if cause.kind == "processed_logprobs":
        return _raw_logprobs(why)
    if cause.kind in ("weights", "sampler_weights"):
        return Recommendation(kind="fix_weight_sync", params={"cause": cause.kind, **where},
                              why=f"{why}; fix the weight sync (the tensor names it maps, a shard or layer it "
                                  "misses, a stale copy) before correcting anything: a correction would train on "
                                  "a policy the trainer does not have")
    if cause.kind == "sampler_config":
        return Recommendation(kind="match_sampler_config", params=where,
                              why=f"{why}; audit again with --infer {where.get('infer')} (the sampler's config): "
                                  "if the replay then reproduces the stored log-probs the gap is that config's "
                                  "numerics, if not the sampler ran other weights")
    if cause.kind == "turn_onset":
        return Recommendation(kind="inspect_turn", params=where,
                              why=f"{why}; compare turn {where['turn']} with the turn before it in these rollouts "
                                  "(the report lists them): what the harness or the engine did differently there "
                                  "is the fix")
    if cause.kind == "render_drift":
        return Recommendation(kind="fix_renderer", params=where,
                              why=f"{why}: the trainer is scoring text the model never sampled; train on the "
                                  "stored token ids, or fix the chat template / tool-call renderer")
    if cause.kind == "batch_variance":
        return Recommendation(kind="batch_invariant", params={"vllm_env": "VLLM_BATCH_INVARIANT=1",
                                                              "sglang_flag": "--enable-deterministic-inference",
                                                              **where},
                              why=f"{why}: a batch-invariant (deterministic) inference mode removes batch noise at "
                                  "the source, at a throughput cost (reported 10-60% for bitwise modes; measure it "
                                  "with mismatch diff)")
    if cause.kind == "routing_flips":
        return Recommendation(kind="routing_replay", params=where,
                              why=f"{why}: the trainer follows the experts the engine routed each token to (R3)")
    if cause.kind == "precision":
        if cause.where.get("gap") != "large":  # a small bf16 gap: the correction alone, not a migration
            return None
        return Recommendation(kind="fp16", params={"dtype": "float16", "instead_of": "bfloat16", **where},
                              why=f"{why}; float16 has 10 mantissa bits to bfloat16's 7, so the same kernels round "
                                  "8x less and the gap shrinks at the source (Qi et al. 2025, 'Defeating the "
                                  "Training-Inference Mismatch via FP16'); the trainer needs loss scaling, and "
                                  "weights must fit float16's range")
    return None


def _gap_words(metrics: dict[str, Any]) -> str:
    return (f"kl_k3 {metrics['kl_k3']:.3g}, ratio q0.1-q99.9 {metrics['ratio_q001']:.3g}-"
            f"{metrics['ratio_q999']:.3g} over {metrics['n_tokens']:,} trainable tokens")


def choose_correction(evidence: Evidence, target: Target | None = None) -> Recommendation:
    """Rule 3: the simulated correction with the most ESS among those that change at most 1% of the
    trainable tokens, from the modes `target`'s release can express (any framework's, without one)."""
    level = evidence.level
    if level == "unknown":
        return Recommendation(kind="no_correction", params={"gap": level},
                              why="no stored sampler log-probs on trainable tokens: the train/sampler "
                                  "ratio cannot be measured, so no correction can be chosen")
    if level in ("exact", "negligible"):
        return Recommendation(kind="no_correction", params={"gap": level},
                              why=f"the {evidence.pair} ratio is 1 up to rounding ({_gap_words(evidence.metrics)}): "
                                  "a correction would change nothing")
    who = target.label if target is not None else "a framework"
    expressible = [c for c in evidence.corrections if _expressible(c, target)]
    if not expressible:
        raise MismatchError(f"no simulated corrections that {who} can express: summary.json has no "
                            "'corrections' (simulate them with mismatch.advise.corrections.summary_corrections)")
    # A step at a turn biases every later token the same way, as a slope along position does.
    unit = "sequence" if evidence.grows_with_position or evidence.onset_turn is not None else "token"
    candidates = [c for c in expressible if _mode_level(c) == unit] or expressible
    ranked = sorted(candidates, key=_rank)
    chosen = ranked[0]
    passing = [c for c in ranked if _passes(c)]
    why = [f"the {evidence.pair} gap is {level} ({_gap_words(evidence.metrics)})",
           _unit_reason(evidence, candidates is not expressible),
           _winner_words(chosen, ranked, who, passing=bool(passing))]
    params = {"mode": chosen["mode"], **chosen["params"], "frac_tokens_affected": chosen["frac_tokens_affected"],
              "frac_rollouts_affected": chosen["frac_rollouts_affected"], "ess": chosen["ess"],
              "weight_mean": chosen.get("weight_mean"), "meets_rule": bool(passing),
              "ranked": [_brief(c) for c in ranked[:5]]}
    if target is not None:
        params["framework"] = target.label
    if evidence.pair != PAIR:
        params["pair"] = evidence.pair
    return Recommendation(kind="correction", why="; ".join(why), params=params)


def _expressible(correction: dict[str, Any], target: Target | None) -> bool:
    """A correction a trainer can run: an IS mode (a rejection filter corrects no ratio by itself),
    with a native setting in `target`'s release, or in some framework's newest release without one."""
    mode = correction.get("mode")
    if mode not in MODES or mode in REJECTION_MODES:
        return False
    params = correction.get("params") or {}
    if target is not None:
        return frameworks.module(target.framework).express(mode, params, target.release) is not None
    return any(module.express(mode, params, module.RELEASES[-1]) is not None
               for module in frameworks.MODULES.values())


def _mode_level(correction: dict[str, Any]) -> str:
    return MODES[correction["mode"]].level


def _rank(correction: dict[str, Any]) -> tuple[bool, float, float, float]:
    """Passing first; then the most ESS (the least variance the weights add); then the fewest tokens
    changed; then the weight mean nearest 1 (the least mass taken from the gradient)."""
    weight_mean = correction.get("weight_mean")
    bias = abs(_num(weight_mean) - 1.0) if weight_mean is not None else math.inf
    return (not _passes(correction), -_num(correction.get("ess")), _num(correction.get("frac_tokens_affected"), 1.0),
            bias)


def _brief(correction: dict[str, Any]) -> dict[str, Any]:
    return {"mode": correction["mode"], "params": dict(correction["params"]), "ess": correction.get("ess"),
            "frac_tokens_affected": correction.get("frac_tokens_affected"),
            "weight_mean": correction.get("weight_mean"), "meets_rule": _passes(correction)}


def describe(correction: dict[str, Any]) -> str:
    """`token_icepop [0.5, 5]`, `token_truncate cap 2`, `ipo_mask threshold 0.1`."""
    params = correction["params"]
    if "low" in params and "high" in params:
        return f"{correction['mode']} [{params['low']:g}, {params['high']:g}]"
    return f"{correction['mode']} " + ", ".join(f"{k} {v:g}" for k, v in params.items())


def _effect(correction: dict[str, Any]) -> str:
    verb = "clipped" if correction["mode"] in _CLIPPING else "dropped"
    return (f"ESS {_num(correction.get('ess')):.3f}, {_num(correction.get('frac_tokens_affected')):.2%} of tokens "
            f"{verb}, weight mean {_num(correction.get('weight_mean')):.3f}")


_CLIPPING = frozenset({"token_truncate", "sequence_truncate", "geometric_truncate", "token_clip", "sequence_clip",
                       "rollout_clip", "rollout_balanced_truncate"})


def _winner_words(chosen: dict[str, Any], ranked: list[dict[str, Any]], who: str, *, passing: bool) -> str:
    if passing:
        words = (f"{describe(chosen)} keeps the most ESS of the {len(ranked)} simulated corrections {who} can "
                 f"express that change at most {MAX_FRAC_AFFECTED:.0%} of trainable tokens with ESS >= {MIN_ESS} "
                 f"({_effect(chosen)})")
    else:
        words = (f"no simulated correction {who} can express changes at most {MAX_FRAC_AFFECTED:.0%} of tokens "
                 f"with ESS >= {MIN_ESS}; {describe(chosen)} keeps the most ESS ({_effect(chosen)}): the tail is "
                 "too heavy for a correction alone, fix the source")
    other = next((c for c in ranked[1:] if c["mode"] != chosen["mode"]), None)
    if other is not None:
        words += f"; the best other mode, {describe(other)}: {_effect(other)}"
    same = [c for c in ranked[1:] if c["mode"] == chosen["mode"]]
    if same and "cap" in chosen["params"]:
        below = [c for c in same if c["params"]["cap"] < chosen["params"]["cap"]]
        if below:
            nearest = max(below, key=lambda c: c["params"]["cap"])
            words += f"; cap {nearest['params']['cap']:g} would clip {_num(nearest['frac_tokens_affected']):.2%} " \
                     f"(ESS {_num(nearest['ess']):.3f})"
    return words


def _num(value: Any, missing: float = -math.inf) -> float:
    return missing if value is None or value != value else float(value)


def _passes(correction: dict[str, Any]) -> bool:
    frac, ess = correction.get("frac_tokens_affected"), correction.get("ess")
    return frac is not None and ess is not None and frac <= MAX_FRAC_AFFECTED and ess >= MIN_ESS


def _unit_reason(evidence: Evidence, restricted: bool) -> str:
    if evidence.onset_turn is not None or evidence.grows_with_position:
        reason = (f"the mismatch steps up at turn {evidence.onset_turn} and stays" if evidence.onset_turn is not None
                  else "the mismatch grows with position")
        reason += (": later tokens are biased the same way, so the product over the sequence is what drifts and "
                   "a per-token cap would miss it")
        return f"sequence-level modes only, because {reason}" if restricted else \
            f"{reason}, but no sequence-level mode is expressible here"
    if evidence.grows_with_position is None:
        return "token-level modes (the position trend was not measured; token level is the safe default)"
    return "token-level modes, because the mismatch does not grow with position: per-token noise, corrected per token"


def _recompute(evidence: Evidence) -> Recommendation:
    tokens, trainable = evidence.num_tokens, evidence.num_trainable_tokens
    cost = "one extra forward pass (no backward) over the batch's tokens"
    if tokens is not None:
        cost = f"one extra forward pass (no backward) over N = {tokens:,} tokens per batch like this one"
        cost += f" ({trainable:,} of them trainable)" if trainable is not None else ""
    return Recommendation(kind="recompute_old_logprobs",
                          params={"extra_forward_tokens": tokens, "trainable_tokens": trainable},
                          why="recompute PPO's old log-probs with the trainer instead of reusing the sampler's, "
                              "so the clip is taken against the trainer's own policy and the IS correction "
                              f"handles only the sampler/trainer gap; cost: {cost}")


def _fix_alignment(cause: Cause) -> Recommendation:
    shift = cause.where["shift"]
    return Recommendation(kind="fix_alignment", params={"shift": shift, "rollouts": cause.where.get("rollouts", [])},
                          why=f"{'; '.join([cause.title, *cause.evidence])}: an off-by-one pairs each log-prob with "
                              "the wrong token; align logprob[i] with token[i] before any correction (every number "
                              "above is measured on misaligned pairs)")


def _raw_logprobs(why: str) -> Recommendation:
    return Recommendation(kind="raw_logprobs", params={"vllm": "logprobs_mode=raw_logprobs"},
                          why=f"{why}: store raw log-probs (vLLM logprobs_mode='raw_logprobs') or apply the same "
                              "processing in the trainer, before correcting anything")


# --- config snippets ---

def render_config(recommendations: Iterable[Recommendation | dict[str, Any]], target: Target | str,
                  logged: dict[str, Any] | None = None, causes: Sequence[dict[str, Any]] = ()) -> str:
    """A ready-to-paste snippet with the target release's real keys: YAML (verl, trl, areal), TOML
    (prime-rl), CLI flags (slime, openrlhf). The diagnosed `causes` (summary.json diagnosis) lead
    its comments; fixes without a config key become comments. A correction the release cannot
    express is said so and left out (recommend for the target chooses one it can)."""
    if isinstance(target, str):
        target = frameworks.parse_target(target, detect=False)
    module = frameworks.module(target.framework)
    recs = [r if isinstance(r, Recommendation) else Recommendation(**r) for r in recommendations]
    by_kind = {r.kind: r for r in recs}
    lines = [f"# mismatch recommend --for {target.framework}=={target.release.version}"]
    lines += [f"# note: {target.note}"] if target.note else []
    lines += [f"# cause: {cause['title']} ({cause['pair']})" for cause in causes if not cause.get("minor")]
    lines += [f"# {rec.kind}: {rec.why} (cost: {rec.cost})" if rec.cost else f"# {rec.kind}: {rec.why}"
              for rec in recs]
    correction = by_kind.get("correction")
    if correction is not None and module.express(correction.params["mode"], correction.params,
                                                 target.release) is None:
        lines.append(f"# {target.label} cannot express {describe(correction.params_as_correction())}: "
                     f"nothing to set for it (mismatch recommend --for {target.framework} picks one it can)")
        del by_kind["correction"]
    lines += module.render(by_kind, target)
    if logged:
        lines.append(f"# on these tokens, with {_settings_words(logged['settings'])}, {target.label} logs: "
                     + ", ".join(f"{key} {_fmt(value)}" for key, value in logged["metrics"].items()))
    return "\n".join(_wrapped(lines)) + "\n"


def _settings_words(settings: dict[str, Any]) -> str:
    return ", ".join(f"{key}={value}" for key, value in settings.items()) or "its defaults"


def _fmt(value: Any) -> str:
    return "n/a" if value is None else f"{value:.4g}"


def _wrapped(lines: list[str], width: int = 100) -> list[str]:
    """Comment lines wrapped to `width` columns (a snippet is read in an editor); config lines as
    they are (a YAML value or a shell flag must not be split)."""
    out = []
    for line in lines:
        if line.startswith("# ") and len(line) > width:
            out += textwrap.wrap(line[2:], width=width, initial_indent="# ", subsequent_indent="#   ",
                                 break_on_hyphens=False, break_long_words=False)
        else:
            out.append(line)
    return out


@dataclass(kw_only=True, slots=True, frozen=True)
class Advice:
    """What `mismatch recommend` answers: the recommendations for a target (or framework-neutral),
    its snippet, and the target framework's own metrics at the settings it runs or will run."""

    recommendations: list[dict[str, Any]]
    diagnosis: dict[str, Any] = field(default_factory=dict)  # summary.json's "diagnosis", on these findings
    target: Target | None = None
    snippet: str | None = None
    logged: dict[str, Any] | None = None  # {"settings": {...}, "pair": "A/B", "metrics": {key: value}}

    def to_dict(self) -> dict[str, Any]:
        target = self.target
        return {"diagnosis": self.diagnosis, "recommendations": self.recommendations, "framework": target.framework if target else None,
                "release": target.release.version if target else None, "note": target.note if target else None,
                "config": self.snippet, "logged": self.logged}


def for_target(summary: dict[str, Any], target: Target | None, *, results: Path | None = None,
               probes: list[dict[str, Any]] | None = None) -> Advice:
    """The rule for `target`'s release (the modes it can express), its snippet, and what the target
    framework logs on the audit's tokens (results/tokens.parquet) at the settings the user named in
    the target, else at those the snippet sets."""
    stored_probes = (summary.get("probes") or {}).get("results")
    if target is None and probes is None:
        return Advice(recommendations=list(summary.get("recommendations") or []),
                      diagnosis=summary.get("diagnosis") or diagnose(summary, probes=stored_probes).to_dict())
    found = probes if probes is not None else stored_probes
    diagnosis = diagnose(summary, probes=found).to_dict()
    recs = recommendations_dicts(recommend(summary, target, probes=found))
    if target is None:
        return Advice(recommendations=recs, diagnosis=diagnosis)
    logged = None
    if results is not None:
        settings = target.settings or snippet_settings(recs, target)
        logged = logged_metrics(results, replace(target, settings=settings))
    return Advice(recommendations=recs, diagnosis=diagnosis, target=target, logged=logged,
                  snippet=render_config(recs, target, logged, causes=diagnosis["causes"]))


def snippet_settings(recommendations: Sequence[dict[str, Any]], target: Target) -> dict[str, Any]:
    """The correction settings the snippet sets, under the framework's own names."""
    correction = next((r for r in recommendations if r["kind"] == "correction"), None)
    if correction is None:
        return {}
    return frameworks.module(target.framework).express(correction["params"]["mode"], correction["params"],
                                                       target.release) or {}


def logged_metrics(results: Path, target: Target, pair: str = PAIR) -> dict[str, Any] | None:
    """The target framework's metrics on the results dir's tokens at the target's settings (over
    its defaults): one pass over tokens.parquet, in chunks."""
    from mismatch.analysis.framework_metrics import framework_metrics, settings_used
    from mismatch.results import TOKENS_FILE, tokens_chunks

    a, b = pair.split("/")
    file = Path(results) / TOKENS_FILE
    if not file.is_file():
        return None
    chunks = tokens_chunks([file])
    first = next(iter(chunks()), None)
    if first is None or f"logp_{a}" not in first.columns or f"logp_{b}" not in first.columns:
        return None
    settings = {target.framework: settings_used([target])[target.framework]}
    found = framework_metrics(chunks, [(a, b)], settings)[pair].get(target.framework) or {}
    return {"settings": settings[target.framework], "pair": pair, "metrics": found}


def recommendations_dicts(recommendations: Sequence[Recommendation]) -> list[dict[str, Any]]:
    """summary.json["recommendations"]."""
    return [r.to_dict() for r in recommendations]
