"""The diagnosis: the evidence of an audit turned into ranked causes, before any advice.

summary.json (pairs, engines, alignment, drift, localization, weights, routing, prefix consistency)
+ probes -> diagnose -> causes, each with the pair it explains, the evidence for it and what rules
the other causes out. `recommend` fixes the causes at the source first and corrects the ratio only
if it still needs it meanwhile; the report's headline, the terminal audit and `recommend` lead with
the first cause. Here are the cause rules; readers.py reads the evidence they share.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import msgspec

from mismatch.advise.admissibility import (
    SIZE_FACTOR,
    Envelope,
    Refusal,
    envelope,
    identity,
    not_processing,
    processed_test,
    routing_test,
    size_test,
    times,
    truncation_test,
)
from mismatch.advise.cause import Cause
from mismatch.advise.levels import GAPS, HEALTHY, pair_levels
from mismatch.advise.numeric_causes import (  # noqa: F401 (ROUTING_SHARE: the rule's constant, read by tests)
    ROUTING_SHARE,
    batch_variance,
    kernel_path,
    position_drift,
    precision,
    routing_flips,
)
from mismatch.advise.log_prob_semantics import alignment_shift, processed, trainer_temperature
from mismatch.advise.truncation import truncated_sampling
from mismatch.advise.mechanisms import confinement_is_weights, layer_type_test, mechanism_causes
from mismatch.advise.off_sample import off_sample
from mismatch.advise.readers import (
    Side,
    batch_variant_from_probes,
    confined,
    fact_counts,
    facts as facts_words,
    kl_words,
    listed,
    located,
    sampler_spec,
    sides,
    three_digits,
)
from mismatch.advise.unexplained import unexplained
from mismatch.results import summary_model as model
from mismatch.results.summary_model import CauseWhere, ProbeResult, Summary, present

RULE = """\
Causes, in the order they lead (each only on the evidence named, and only once it passes its
admissibility test, advise/admissibility.py):
1. alignment_shift: the stored log-probs fit the tokens best shifted (alignment shift != 0).
   identity: a replay of the checkpoint puts over half the sampled tokens' ratios outside
   [0.5, 2]: these rollouts were not sampled by this checkpoint (no numeric cause reaches it).
   A shift is the answer alone (every other number is measured on misaligned pairs); identity
   leads, followed only by causes between two replays (every pair with the sampler compares two
   models).
2. trainer_temperature: the trainer divides its logits by a temperature (its spec's temperature=T)
   other than the stored log-probs' (meta.sampler's when it declares processed ones, 1 for raw);
   else truncated_sampling: the stored log-probs sit above the replay's by the kept mass of a
   top-p/top-k/min-p (none lowered, unlikely ones too), declared or estimated (advise/truncation.py);
   else processed_logprobs: the stored log-probs are temperature/top-p processed; the gap left is
   the like-for-like pair's (train_processed/sampler). Test: the like-for-like gap is under half
   the raw one (else the processing is not what makes it).
3. weights: the weights of two sides differ: a weights diff of the engine's checkpoint against the
   trainer's, or the localizers confine the train/infer error to a few modules (each module's error
   over 10x the median module's and its rounding floor; an expert when one expert carries it).
4. sampler_weights: a replay (never a stored stream: `--infer sampler` is no witness) that runs
   the sampler's declared config (meta.sampler's dtype, engine, attention) and the trainer's
   weights, yet the stored log-probs are beyond that config's noise (infer/sampler, or
   train_processed/sampler when processed, over 10x the replays' own gap, or any gap when the
   replays agree), with no turn onset: the sampler ran other weights or an undeclared config;
   `mismatch weights` against the synced checkpoint and a replay in another dtype tell them apart.
   The same when meta.sampler declares another config but the gap is over 10x the bf16 gap
   measured on these weights. sampler_config: meta.sampler declares another dtype, engine or
   attention and the gap is within what that config could make: replay the sampler's config.
5. turn_onset: the train/sampler gap steps up at a turn (localization.turns onset rule).
6. render_drift: re-rendered messages give other tokens than were sampled (drift spans).
7. batch_variance: probes show batch-shape variance, or an inference source gave one prefix
   different log-probs in different requests (unless probes ran and show no batch variance).
8. routing_flips: MoE routing flips carry >= half of a trainer pair's k3, and no weight fault is
   localized (a faulty expert flips routing downstream: routing replay would hide it). Test: both
   sides run the same weights (two replays of one checkpoint; for the sampler, a replay that
   reproduces it), else a sampler-side expert or router fault would be hidden.
9. precision: the sides differ in dtype with one in bfloat16, and the evidence confirms it: a
   replay (not a stored stream) of the other side's weights in bfloat16 reproduces the bf16 side
   (exact or negligible), or the kernel localizer spreads the error over most modules with none
   standing out, or the dtype probes show it. Never when meta.sampler declares bfloat16 and a
   replay in another dtype reproduces the stored log-probs bit for bit (the declaration is wrong).
10. kernel_path: the sides differ in engine kind (full forward vs decode, another engine) with the
   same dtype, the replay reproducing the sampler.
11. position_drift: the gap grows with position, with no turn onset.
index_flips (before routing_flips) and layer_type (before precision): advise/mechanisms.py RULE.
Size test of the numeric causes (precision, kernel_path, batch_variance, position_drift): the
pair's kl_k3 at most 10x the bf16 gap measured on these weights (two replays of the checkpoint in
two dtypes), else "more than <cause>: Nx the bf16 gap"; with none measured, at most 1% of tokens
outside [0.5, 2].
unexplained: when the ratio's pair (train/sampler, or train_processed/sampler) has a gap and no
cause passes its test: the gap's size, what was ruled out, and the next command to run.
off_sample (--distribution, after every other cause: it explains no sampled ratio): the whole
next-token distribution's KL is over 10x its sampled estimate (advise/off_sample.py RULE); it
leads only when no other cause does.
"""

MINOR_DRIFT = 0.01  # re-rendered tokens under this share of the trained ones explain no gap
PROCESSED_PAIR = "train_processed/sampler"


@dataclass(kw_only=True, slots=True, frozen=True)
class Diagnosis:
    causes: tuple[Cause, ...]
    findings: tuple[str, ...] = ()  # facts that explain no gap but change how to read one
    refused: tuple[Refusal, ...] = ()  # causes found but not claimed: the test each failed
    envelope: Envelope | None = None  # the bf16 gap measured on these weights, when two replays give it

    @property
    def lead(self) -> Cause | None:
        return next((cause for cause in self.causes if not cause.minor), None)

    def of_kind(self, kind: str) -> Cause | None:
        return next((cause for cause in self.causes if cause.kind == kind), None)

    def for_pair(self, pair: str) -> Cause | None:
        return next((cause for cause in self.causes if cause.pair == pair and not cause.minor), None)

    def to_record(self) -> model.Diagnosis:
        """As summary.json holds it (with the RULE it applied)."""
        return model.Diagnosis(causes=[cause.to_record() for cause in self.causes], findings=list(self.findings),
                               refused=[r.to_record() for r in self.refused],
                               envelope=self.envelope.to_record() if self.envelope is not None else None, rule=RULE)


@dataclass(kw_only=True, slots=True, frozen=True)
class Facts:
    """What every rule reads: the summary, each pair's level, each side's config, the probes, the
    bf16 envelope and the weights cause (found first: several rules defer to it)."""

    summary: Summary
    level: dict[str, str]
    side: dict[str, Side]
    probes: list[ProbeResult] | None
    batch_variant: bool | None
    envelope: Envelope | None
    weights: Cause | None
    ratio_pair: str  # the pair the RL ratio is judged on


@dataclass(kw_only=True, slots=True, frozen=True)
class Rule:
    """A cause rule: `find` returns the cause its evidence shows, or None; `test` says why a found
    cause cannot be claimed (its admissibility test), or None when it can."""

    find: Callable[[Facts], Cause | None]
    test: Callable[[Cause, Facts], str | None] = lambda cause, facts: None


def _size(cause: Cause, facts: Facts) -> str | None:
    return size_test(cause, facts.summary, facts.envelope)


RULES: tuple[Rule, ...] = (
    # A trainer that scales its logits looks, to the semantics check, like processed stored log-probs.
    # Truncated sampling (top-p/top-k/min-p) is told from a temperature by its shape (advise/truncation.py).
    Rule(find=lambda f: trainer_temperature(f.summary, f.level) or truncated_sampling(f.summary, f.level)
         or processed(f.summary, f.level),
         test=lambda cause, f: processed_test(cause, f.summary)),
    Rule(find=lambda f: f.weights),
    Rule(find=lambda f: _sampler_side(f), test=lambda cause, f: truncation_test(cause, f.summary, like_for_like=f.ratio_pair == PROCESSED_PAIR)),
    Rule(find=lambda f: _turn_onset(f.summary)),
    Rule(find=lambda f: _render_drift(f.summary)),
    Rule(find=lambda f: batch_variance(f.summary, f.side, f.batch_variant), test=_size),
    # The new architectures' mechanisms (advise/mechanisms.py): DSA index flips, a layer type's path.
    Rule(find=lambda f: mechanism_causes(f.summary, f.level)[0]),
    Rule(find=lambda f: routing_flips(f.summary, f.weights),
         test=lambda cause, f: routing_test(cause, f.level, f.side, sampler_fault=_sampler_side(f) is not None)),
    Rule(find=lambda f: mechanism_causes(f.summary, f.level)[1], test=lambda cause, f: layer_type_test(cause, f.summary)),
    Rule(find=lambda f: precision(f.summary, f.level, f.side, f.weights, f.probes), test=_size),
    Rule(find=lambda f: kernel_path(f.summary, f.level, f.side, f.weights), test=_size),
    Rule(find=lambda f: position_drift(f.summary), test=_size),
)


def diagnose(summary: Summary, *, probes: list[ProbeResult] | None = None,
             batch_variant: bool | None = None) -> Diagnosis:
    """The causes the summary's evidence supports and their admissibility tests pass, in the order
    RULE gives; "unexplained" when the ratio's pair has a gap and none does."""
    level = pair_levels(summary)
    side = sides(summary)
    shift = alignment_shift(summary)
    if shift is not None:  # every other number is measured on misaligned pairs
        return Diagnosis(causes=(shift,))
    found_envelope = envelope(summary, side)
    # The ratio is judged like for like when the stored log-probs are processed, unless the
    # processing cannot be what makes the gap (then the like-for-like pair is no better a judge).
    processed_run = summary.semantics in ("processed", "truncated") \
        and not_processing(summary) is None
    ratio_pair = PROCESSED_PAIR if processed_run and PROCESSED_PAIR in level else "train/sampler"
    foreign = identity(summary, level, side, ratio_pair, found_envelope)
    facts = Facts(summary=summary, level=level, side=side, probes=probes, envelope=found_envelope,
                  batch_variant=batch_variant if batch_variant is not None else _probes_batch_variant(probes),
                  weights=_weights_fault(summary, level, side), ratio_pair=ratio_pair)
    kept, refused = [], []
    for rule in RULES:
        cause = rule.find(facts)
        if cause is None:
            continue
        why = rule.test(cause, facts)
        if why is None:
            kept.append(cause)
        else:
            refused.append(Refusal(kind=cause.kind, pair=cause.pair, test=_test_name(cause), why=why))
    if foreign is not None:  # every pair with the sampler compares two models; two replays still say what they say
        kept = [foreign, *(cause for cause in kept if _between_replays(cause, side))]
    causes = _minor_drift_last(tuple(kept), summary)
    if level.get(ratio_pair) in GAPS and not any(not cause.minor for cause in causes):
        causes = (unexplained(summary, side, ratio_pair=ratio_pair, found=found_envelope, refused=refused), *causes)
    # After the unexplained test: a gap off the sampled tokens explains no sampled ratio.
    beyond = off_sample(summary) if foreign is None else None
    if beyond is not None:
        lead = next((i for i, cause in enumerate(causes) if cause.minor), len(causes))
        causes = (*causes[:lead], beyond, *causes[lead:])  # before the minor causes: a real finding
    return Diagnosis(causes=causes, findings=tuple(_findings(summary, level, side)), refused=tuple(refused),
                     envelope=found_envelope)


def _weights_fault(summary: Summary, level: dict[str, str], side: dict[str, Side]) -> Cause | None:
    """The weights cause, unless it rests on the localizers' confinement alone on one checkpoint
    where the two paths run different algorithms (advise/mechanisms.py: the paths differ, not a tensor)."""
    weights = _weights(summary, level, side)
    return weights if weights is None or confinement_is_weights(summary) else None


def _between_replays(cause: Cause, side: dict[str, Side]) -> bool:
    return all(source in side and side[source].replayed for source in cause.pair.split("/"))


def _test_name(cause: Cause) -> str:
    return "consistency" if cause.kind in ("processed_logprobs", "routing_flips", "sampler_weights") else "size"


# --- one function per cause ---

def _weights(summary: Summary, level: dict[str, str], side: dict[str, Side]) -> Cause | None:
    """A weights diff of two checkpoints, else the localizers confining train/infer to a few modules."""
    for source, diff in (present(summary.weights) or {}).items():
        differing = diff.differing or []
        if diff.identical or not differing:
            continue
        pair = f"train/{source}"
        worst = differing[0]
        experts = [f"{t.name}[{e}]" for t in differing for e in t.experts_differing or ()]
        where = located([t.name for t in differing], experts)
        evidence = [f"the weights diff of {present(diff.b)} against {present(diff.a)}: {present(diff.verdict)}",
                    f"worst {worst.name}: max relative difference {three_digits(worst.max_rel_diff)}, "
                    f"||a-b||/||a|| {three_digits(worst.rel_l2_diff)}"]
        localized = confined(summary)
        if localized is not None:
            evidence.append(localized.words)
        return Cause(kind="weights", pair=pair, fix="fix_weight_sync", where=msgspec.structs.replace(where, source=source),
                     title=f"the weights {source} ran differ from the trainer's in {where.words}",
                     evidence=tuple(evidence),
                     rules_out=_same_config_words(side, "train", source, level.get(pair)))
    localized = confined(summary)
    if localized is None:
        return None
    pair = "train/infer"
    return Cause(kind="weights", pair=pair, fix="fix_weight_sync", where=msgspec.structs.replace(localized.where, source="infer"),
                 title=f"the weights of train and infer differ in {localized.where.words}",
                 evidence=(localized.words,),
                 rules_out=(*_same_config_words(side, "train", "infer", level.get(pair)),
                            "precision and kernels round every module a little; one module carrying the "
                            "error is a difference in its weights"))


def _same_config_words(side: dict[str, Side], a: str, b: str, gap: str | None) -> tuple[str, ...]:
    if a not in side or b not in side:
        return ()
    differs = side[a].differs(side[b])
    if differs:
        return (f"{a} and {b} also differ in {facts_words(differs)}: that adds rounding, but not error confined to "
                "these tensors",)
    return (f"{a} and {b} run the same dtype ({side[a].dtype}) and engine ({side[a].kind}): not precision or "
            "kernels",)


def _sampler_side(facts: Facts) -> Cause | None:
    """A replay of the trainer's weights that runs the sampler's declared config, yet the stored
    log-probs are beyond that config's noise, from the first turn on (a step at a later turn is
    turn_onset: the turns before it were reproduced, so were the weights): the sampler ran other
    weights or a config it did not declare. Judged like for like when the stored log-probs are
    processed. A stored stream replayed as an engine (`--infer sampler`) is no witness. When the
    sampler declares another config: decided if the gap is over SIZE_FACTOR times the bf16 gap
    measured on these weights, else sampler_config (replay the sampler's config)."""
    summary, level, side = facts.summary, facts.level, facts.side
    # Raw pairs differ by the processing: judged like for like when the ratio is.
    judged = PROCESSED_PAIR if facts.ratio_pair == PROCESSED_PAIR else "infer/sampler"
    # "negligible" is under the thresholds, yet more than a deterministic replay's own noise can be:
    # only the sampler's own torch path (_beyond_declared) judges it.
    if level.get(judged) not in (*GAPS, "negligible") or facts.weights is not None:
        return None
    if summary.onset_turn is not None:
        return None
    sampler, infer, train = side.get("sampler"), side.get("infer"), side.get("train")
    if sampler is None or infer is None or train is None or not (infer.replayed and train.replayed):
        return None
    if infer.weights is not None and train.weights is not None and infer.weights != train.weights:
        return None
    kl = summary.metric(judged, "kl_k3")
    replays = summary.metric("train/infer", "kl_k3")
    if not isinstance(kl, (int, float)) or not isinstance(replays, (int, float)):
        return None
    differs, found = sampler.differs(infer), facts.envelope
    agree = (f"train/infer is {level['train/infer']} (kl_k3 {three_digits(replays)}), {judged} is {level[judged]} "
             f"(kl_k3 {kl_words(summary, judged)}) from the first turn on")
    spec = sampler_spec(sampler)
    if not differs:
        size = _beyond_declared(facts, judged, float(kl))
        return _sampler_weights(summary, sampler, spec, agree, size) if size is not None else None
    if level[judged] not in GAPS:
        return None
    if found is not None and kl > SIZE_FACTOR * found.kl_k3:
        size = (f"{judged} kl_k3 {three_digits(kl)} is {times(kl, found.kl_k3)} {found.words}: more than the "
                f"declared config ({facts_words(differs)}) can make")
        return _sampler_weights(summary, sampler, spec, agree, size)
    if level.get("train/infer") not in HEALTHY and kl <= SIZE_FACTOR * replays:
        return None  # within the replays' own gap: the numeric rules judge it
    return Cause(kind="sampler_config", pair="infer/sampler", fix="match_sampler_config",
                 title=f"the sampler ran another config than this replay: {facts_words(differs)}",
                 evidence=(agree, f"meta.sampler declares {facts_words(differs)}"),
                 rules_out=("precision or weights cannot be told apart until a replay runs the sampler's config",),
                 where=CauseWhere(differs={k: list(v) for k, v in differs.items()}, infer=spec))


def _beyond_declared(facts: Facts, judged: str, kl: float) -> str | None:
    """Why `judged`'s gap is beyond the noise of the sampler's declared config, which this replay
    runs; None when it is not, or cannot be sized. The noise: on the sampler's own torch path, the
    most this replay moved one shared prefix between requests, S, bounding a per-token kl_k3 of
    S^2 / 2 (torch on this CPU is batch-invariant: S is 0 or rounding); on another path, the bf16
    gap measured on these weights."""
    from mismatch.engines import TORCH_KINDS

    summary, sampler, infer = facts.summary, facts.side["sampler"], facts.side["infer"]
    declared = ", ".join(f"{name} {value}" for name, value in (("dtype", sampler.dtype), ("engine", sampler.kind))
                         if value) or "nothing declared to compare"
    if infer.kind in TORCH_KINDS and infer.kind == sampler.kind:
        found = summary.prefix_findings().get("infer")
        spread = (present(found.max_abs_spread) if found is not None else None) or 0.0
        noise = 0.5 * float(spread) ** 2
        if kl <= SIZE_FACTOR * noise:
            return None
        return (f"this replay runs the sampler's declared config ({declared}) on the sampler's own torch path, whose "
                f"noise is measured here: one shared prefix moved at most {three_digits(spread)} between requests "
                f"(kl_k3 at most {three_digits(noise)}), and {judged} is kl_k3 {three_digits(kl)} "
                f"({_bitwise_words(summary, judged)})")
    found = facts.envelope
    if facts.level[judged] not in GAPS or found is None or kl <= SIZE_FACTOR * found.kl_k3:
        return None
    return (f"this replay runs the sampler's declared config ({declared}); {judged} kl_k3 {three_digits(kl)} is "
            f"{times(kl, found.kl_k3)} {found.words}, over the {SIZE_FACTOR:g}x that config's numerics can make")


def _bitwise_words(summary: Summary, pair: str) -> str:
    value = summary.metric(pair, "bitwise_equal_frac")
    return f"{value:.1%} of tokens bitwise equal" if isinstance(value, (int, float)) else "not bitwise equal"


def _sampler_weights(summary: Summary, sampler: Side, spec: str, agree: str, size: str) -> Cause:
    checkpoint = summary.checkpoint or "CHECKPOINT"
    # The other dtype in words, not as a spec: a snippet's comment must not read like a precision setting.
    other = "fp32" if sampler.dtype == "bfloat16" else "bf16"
    separates = (f"`mismatch weights {checkpoint} SYNCED_CHECKPOINT` (the copy the sampler loaded) shows other "
                 f"weights; a replay of {spec.split(':')[0]} in {other} shows whether the gap moves with the config")
    return Cause(kind="sampler_weights", pair="infer/sampler", fix="fix_weight_sync",
                 where=CauseWhere(source="sampler", words="the sampler's weights", infer=spec),
                 title="the sampler ran other weights or an undeclared config, not the checkpoint replayed here",
                 evidence=(agree, size),
                 rules_out=("the replays agree up to their own noise, so neither the trainer's kernels nor its "
                            "precision make the gap; the sampler's side does: fix the weight sync (or the "
                            "checkpoint given), not the precision",
                            f"what separates other weights from an undeclared config: {separates}"))


def _turn_onset(summary: Summary) -> Cause | None:
    turns, turn = summary.localization.turns, summary.onset_turn
    if not turns or turn is None:
        return None
    detail = present(turns.onset)
    # by_turn rows: every turn's pair metrics, `compared` (enough tokens for the onset rule) beside them
    rows = {row["turn"]: row for row in turns.by_turn or ()}
    before = [row["log_ratio_abs_mean"] for t, row in rows.items() if t < turn and row["compared"]]
    rollouts = [row.rollout for row in detail.rollouts or ()] if detail is not None else []
    at = rows.get(turn)
    evidence = [f"mean |log-ratio| {at['log_ratio_abs_mean']:.3g} at turn {turn}, after "
                f"{max(before):.3g} at most before it" if before and at is not None
                else f"the onset rule departs at turn {turn}"]
    if detail is not None:
        evidence.append(f"{detail.n_rollouts_departing} of {detail.n_rollouts_compared} rollouts step up "
                        f"from turn {turn}" + (f": {listed(rollouts)}" if rollouts else ""))
    new_roles = list(detail.new_roles or ()) if detail is not None else []
    new_kinds = list(detail.new_branch_kinds or ()) if detail is not None else []
    held = ", ".join([*(f"the first {role} rows" for role in new_roles),
                      *(f"the first {kind} branches" for kind in new_kinds)])
    if held:
        evidence.append(f"turn {turn} holds {held}")
    return Cause(kind="turn_onset", pair=turns.pair or "train/sampler", fix="inspect_turn",
                 title=f"the gap steps up at turn {turn}" + (f" ({held})" if held else ""),
                 evidence=tuple(evidence),
                 rules_out=("a step at one turn, not a slope along position: kernels and precision grow with "
                            "context smoothly; something changed at this turn (a summary, a tool result, a "
                            "rewritten history, or the sampler's weights updated mid-rollout)",),
                 where=CauseWhere(turn=turn, rollouts=rollouts[:10], new_roles=new_roles, new_branch_kinds=new_kinds))


def _render_drift(summary: Summary) -> Cause | None:
    drift = present(summary.drift)
    spans = (drift.spans or []) if drift is not None else []
    if drift is None or not spans:
        return None
    places = sorted({(present(span.rollout), present(span.turn)) for span in spans}, key=str)
    words = ", ".join(f"{rollout} turn {turn}" for rollout, turn in places[:6]) + \
        (f" and {len(places) - 6} more" if len(places) > 6 else "")
    kinds = drift.spans_by_kind or {}
    return Cause(kind="render_drift", pair="train/sampler", fix="fix_renderer",
                 title=f"re-rendered messages give other tokens than were sampled ({words})",
                 evidence=(f"{len(spans)} span(s) ({fact_counts(kinds)}), "
                           f"{drift.trainable_tokens_touched or 0} trainable token(s) touched",),
                 where=CauseWhere(spans=len(spans), rollouts=sorted({r for r, _ in places if r is not None})[:10],
                                  places=[{"rollout": r, "turn": t} for r, t in places[:20]]))


def _minor_drift_last(causes: tuple[Cause, ...], summary: Summary) -> tuple[Cause, ...]:
    """A handful of drifted tokens (< MINOR_DRIFT of the trained ones) explains no gap: listed last,
    marked minor."""
    drift = next((c for c in causes if c.kind == "render_drift"), None)
    touched = present(summary.drift.trainable_tokens_touched) if summary.drift else None
    trainable = present(summary.counts.trainable_tokens)
    if drift is None or not (isinstance(touched, int) and trainable and touched < MINOR_DRIFT * trainable):
        return causes
    return (*[c for c in causes if c is not drift], replace(drift, minor=True))


def _probes_batch_variant(probes: list[ProbeResult] | None) -> bool | None:
    return batch_variant_from_probes(probes) if probes is not None else None


def _findings(summary: Summary, level: dict[str, str], side: dict[str, Side]) -> list[str]:
    out = []
    if level.get("train/infer") == "large" and level.get("train/sampler") in ("exact", "negligible", "small"):
        spec = present(summary.engine("infer").spec) or "infer"
        out.append(f"train/infer is large while train/sampler is {level['train/sampler']}: the engine config "
                   f"replayed here ({spec}) is farther from the trainer than the sampler was; it is not the "
                   f"sampler's config (infer/sampler {level.get('infer/sampler', 'unknown')})")
    sampler, infer = side.get("sampler"), side.get("infer")
    if (sampler is not None and infer is not None and infer.replayed and level.get("infer/sampler") == "exact"
            and sampler.differs(infer)):
        out.append(f"meta.sampler declares {facts_words(sampler.differs(infer))}, yet the replay reproduces the "
                   "stored log-probs bit for bit: the declaration is wrong")
    return out


