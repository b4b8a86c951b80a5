"""Recommendations: a stated rule turns the diagnosis and the measured gap into fixes at the source
and, only if the ratio still needs one meanwhile, a correction.

Flow: summary.json (pairs, counts, engines, corrections, localization) + probes -> Evidence
(evidence.py) -> rule: each cause's fix at its source, the correction (choice.py), recompute ->
render_config (snippets.py) for a framework release.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from msgspec.structs import replace

from mismatch.advise.choice import choose_correction
from mismatch.advise.cause import Cause
from mismatch.advise.mechanisms import mechanism_fix
from mismatch.advise.evidence import Evidence, evidence_from_summary
from mismatch.advise.truncation import replay_kept_set
from mismatch.results import summary_model as model
from mismatch.results.summary_model import UNSET, Summary, present, to_builtins
from mismatch.frameworks.protocol import Recommendation, Target

RULE = """\
0. The diagnosis first (mismatch.advise.diagnose.RULE): each cause it finds, in its order, gets the
   fix at its source: a shift fix_alignment alone (every ratio is measured on misaligned pairs, so
   no correction or cost can be chosen from it); truncated sampling replay_kept_set (the target
   release's own way, else untruncated training rollouts); processed log-probs raw_logprobs; weights that
   differ fix_weight_sync, naming the tensors, layer, module and expert; a sampler that ran another
   config match_sampler_config (the replay that tells precision from weights); a step at a turn
   inspect_turn (the turn and the rollouts that show it); render drift fix_renderer; batch variance
   batch_invariant; routing flips routing_replay (never over a localized weight fault: it would
   hide it); a gap of the whole distribution off the sampled tokens inspect_token_rows (the token
   and positions); bfloat16 rounding, when the evidence confirms it and its gap is large, fp16 (a small
   one gets the correction alone: fp16 is a migration). A minor cause (re-rendered
   tokens under 1% of the trained ones) explains no gap: its fix comes after everything else.
   Rollouts another checkpoint sampled (identity) get match_checkpoint, then the fixes of causes
   found between two replays, and no correction: no ratio between two models is worth correcting. An unexplained gap gets no fix of its own and no recompute: only
   the correction meanwhile (its headline names the next command that would decide).
1. Then, only if the ratio still needs it meanwhile, the correction: none when the train/sampler gap
   (the like-for-like train_processed/sampler one when the sampler stored processed log-probs) is
   exact or negligible (mismatch.advise.levels.gap_level). Otherwise, of the simulated IS
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


def recommend(summary: Summary, target: Target | None = None, **findings: Any) -> list[Recommendation]:
    """The rule (RULE) applied to a summary, for `target`'s framework release (any
    framework's modes without one); `findings` as for evidence_from_summary."""
    return rule(evidence_from_summary(summary, **findings), target)


def rule(evidence: Evidence, target: Target | None = None) -> list[Recommendation]:
    diagnosis = evidence.diagnosis
    if diagnosis.lead is not None and diagnosis.lead.kind == "alignment_shift":
        return [_fix_alignment(diagnosis.lead)]
    if diagnosis.lead is not None and diagnosis.lead.kind == "identity":  # no ratio between two models to correct
        out = [_match_checkpoint(diagnosis.lead)]
        for cause in [c for c in diagnosis.causes[1:] if not c.minor]:
            _add(out, _source_fix(cause))
        return out
    out: list[Recommendation] = []
    for cause in [c for c in diagnosis.causes if not c.minor]:
        _add(out, _source_fix(cause, target.framework if target is not None else None))
    out.append(choose_correction(evidence, target))
    if evidence.level == "large" and not any(c.kind in FAULTS or c.kind == "unexplained" for c in diagnosis.causes):
        out.append(_recompute(evidence))
    for cause in [c for c in diagnosis.causes if c.minor]:  # real, but explaining no gap: after the answer
        _add(out, _source_fix(cause))
    return out


def _add(out: list[Recommendation], fix: Recommendation | None) -> None:
    if fix is not None and all(r.kind != fix.kind for r in out):
        out.append(fix)


# Causes a fix removes at the source: recomputing old log-probs would only hide them.
FAULTS = frozenset({"off_sample", "processed_logprobs", "truncated_sampling", "trainer_temperature", "weights", "sampler_weights", "sampler_config", "turn_onset"})


def _source_fix(cause: Cause, framework: str | None = None) -> Recommendation | None:
    """The fix at a cause's source, in the words of the cause's evidence (kernel paths and position
    drift have none of their own: recompute and the correction's level answer them)."""
    why = "; ".join([cause.title, *cause.evidence, *cause.rules_out])
    where = to_builtins(replace(cause.where, words=UNSET))
    if cause.where.words is not UNSET:  # where the fault is, as a reader says it (the headline's "fix: ...")
        where["at"] = cause.where.words
    if cause.kind == "processed_logprobs":
        return _raw_logprobs(why)
    if cause.kind == "truncated_sampling":
        return replay_kept_set(cause, why, framework)
    if cause.kind == "trainer_temperature":
        return Recommendation(kind="match_temperature", params=where,
                              why=f"{why}: the trainer must scale by the temperature the stored log-probs carry "
                                  f"(set {cause.where.config_key or 'the trainer temperature'} to "
                                  f"{cause.where.stored_temperature:g}, or store log-probs at the trainer's), before "
                                  "correcting anything")
    if cause.kind in ("weights", "sampler_weights"):
        return Recommendation(kind="fix_weight_sync", params={"cause": cause.kind, **where},
                              why=f"{why}; fix the weight sync (the tensor names it maps, a shard or layer it "
                                  "misses, a stale copy) before correcting anything: a correction would train on "
                                  "a policy the trainer does not have")
    if cause.kind == "sampler_config":
        return Recommendation(kind="match_sampler_config", params=where,
                              why=f"{why}; audit again with --infer {present(cause.where.infer)} (the sampler's config): "
                                  "if the replay then reproduces the stored log-probs the gap is that config's "
                                  "numerics, if not the sampler ran other weights")
    if cause.kind == "turn_onset":
        return Recommendation(kind="inspect_turn", params=where,
                              why=f"{why}; compare turn {cause.where.turn} with the turn before it in these rollouts "
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
    if cause.kind in ("layer_type", "index_flips"):
        return mechanism_fix(cause, why)
    if cause.kind == "off_sample":
        token = present(cause.where.token_id)
        rows = f"token {token}'s rows" if token is not None else "the output heads"
        return Recommendation(kind="inspect_token_rows", params={**where, "rows": rows},
                              why=f"{why}: " + (f"compare token {token}'s rows on the two sides (lm_head, embedding: "
                                                f"`mismatch weights`) and any logit processor, bias or mask on it"
                                                if token is not None else
                                                "compare the two sides' output heads (`mismatch weights`), their "
                                                "logit processors and vocabulary masks")
                                  + "; the sampled tokens' ratio does not show it, so no correction of the ratio "
                                    "removes it")
    if cause.kind == "precision":
        if cause.where.gap != "large":  # a small bf16 gap: the correction alone, not a migration
            return None
        return Recommendation(kind="fp16", params={"dtype": "float16", "instead_of": "bfloat16", **where},
                              why=f"{why}; float16 has 10 mantissa bits to bfloat16's 7, so the same kernels round "
                                  "8x less and the gap shrinks at the source (Qi et al. 2025, 'Defeating the "
                                  "Training-Inference Mismatch via FP16'); the trainer needs loss scaling, and "
                                  "weights must fit float16's range")
    return None


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
    shift = cause.where.shift
    return Recommendation(kind="fix_alignment", params={"shift": shift, "rollouts": present(cause.where.rollouts) or []},
                          why=f"{'; '.join([cause.title, *cause.evidence])}: an off-by-one pairs each log-prob with "
                              "the wrong token; align logprob[i] with token[i] before any correction (every number "
                              "above is measured on misaligned pairs)")


def _match_checkpoint(cause: Cause) -> Recommendation:
    declared = present(cause.where.declared)
    return Recommendation(kind="match_checkpoint",
                          params={k: v for k, v in to_builtins(cause.where).items() if v is not None},
                          why=f"{'; '.join([cause.title, *cause.evidence, *cause.rules_out])}: audit these rollouts "
                              "against the checkpoint that sampled them"
                              + (f" (they declare {declared})" if declared else "")
                              + ", or sample them again from this one; no correction makes another model's "
                              "log-probs this one's")


def _raw_logprobs(why: str) -> Recommendation:
    return Recommendation(kind="raw_logprobs", params={"vllm": "logprobs_mode=raw_logprobs"},
                          why=f"{why}: store raw log-probs (vLLM logprobs_mode='raw_logprobs') or apply the same "
                              "processing in the trainer, before correcting anything")


def recommendation_records(recommendations: Sequence[Recommendation]) -> list[model.Recommendation]:
    """summary.json's `recommendations`."""
    return [model.Recommendation(kind=r.kind, params=dict(r.params), why=r.why, cost=r.cost) for r in recommendations]
