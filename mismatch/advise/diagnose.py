"""The diagnosis: the evidence of an audit turned into ranked causes, before any advice.

summary.json (pairs, engines, alignment, drift, localization, weights, routing, prefix consistency)
+ probes -> diagnose -> causes, each with the pair it explains, the evidence for it and what rules
the other causes out. `recommend` fixes the causes at the source first and corrects the ratio only
if it still needs it meanwhile; the report's headline, the terminal audit and `recommend` lead with
the first cause. Here are the cause rules; readers.py reads the evidence they share.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from mismatch.advise.cause import Cause
from mismatch.advise.levels import GAPS, HEALTHY, pair_levels
from mismatch.advise.mechanisms import confinement_is_weights, mechanism_causes
from mismatch.advise.log_prob_semantics import alignment_shift, processed, trainer_temperature
from mismatch.advise.readers import (
    Side,
    batch_variant_from_probes,
    confined,
    fact_counts,
    facts,
    kl_words,
    listed,
    located,
    sides,
    three_digits,
)

RULE = """\
Causes, in the order they lead (each only on the evidence named):
1. alignment_shift: the stored log-probs fit the tokens best shifted (alignment shift != 0).
2. trainer_temperature: the trainer divides its logits by a temperature (its spec's temperature=T)
   other than the stored log-probs' (meta.sampler's when it declares processed ones, 1 for raw);
   else processed_logprobs: the stored log-probs are temperature/top-p processed; the gap left is
   the like-for-like pair's (train_processed/sampler).
3. weights: the weights of two sides differ: a weights diff of the engine's checkpoint against the
   trainer's, or the localizers confine the train/infer error to a few modules (each module's error
   over 10x the median module's and its rounding floor; an expert when one expert carries it).
4. sampler_weights: the replays agree (train/infer exact or negligible) but not the sampler
   (infer/sampler small or large; train_processed/sampler when processed), with no turn onset,
   while meta.sampler declares the replay's dtype and engine: the sampler ran other weights. sampler_config: the same, but meta.sampler declares another dtype,
   engine or attention: replay the sampler's config to tell them apart.
5. turn_onset: the train/sampler gap steps up at a turn (localization.turns onset rule).
6. render_drift: re-rendered messages give other tokens than were sampled (drift spans).
7. batch_variance: probes show batch-shape variance, or an inference source gave one prefix
   different log-probs in different requests (unless probes ran and show no batch variance).
8. routing_flips: MoE routing flips carry >= half of a trainer pair's k3, and no weight fault is
   localized (a faulty expert flips routing downstream: routing replay would hide it).
9. precision: the sides differ in dtype with one in bfloat16, and the evidence confirms it: the
   third source runs the other side's weights in bfloat16 and reproduces the bf16 side (exact or
   negligible), or the kernel localizer spreads the error over most modules with none standing
   out, or the dtype probes show it. Never when meta.sampler declares bfloat16 and a replay in
   another dtype reproduces the stored log-probs bit for bit (the declaration is wrong).
10. kernel_path: the sides differ in engine kind (full forward vs decode, another engine) with the
   same dtype, the replay reproducing the sampler.
11. position_drift: the gap grows with position, with no turn onset.
index_flips (before routing_flips) and layer_type (before precision): advise/mechanisms.py RULE.
"""

ROUTING_SHARE = 0.5  # the share of a pair's k3 on tokens with a routing flip that makes it the cause
MINOR_DRIFT = 0.01  # re-rendered tokens under this share of the trained ones explain no gap


@dataclass(kw_only=True, slots=True, frozen=True)
class Diagnosis:
    causes: tuple[Cause, ...]
    findings: tuple[str, ...] = ()  # facts that explain no gap but change how to read one

    @property
    def lead(self) -> Cause | None:
        return next((cause for cause in self.causes if not cause.minor), None)

    def of_kind(self, kind: str) -> Cause | None:
        return next((cause for cause in self.causes if cause.kind == kind), None)

    def for_pair(self, pair: str) -> Cause | None:
        return next((cause for cause in self.causes if cause.pair == pair and not cause.minor), None)

    def to_dict(self) -> dict[str, Any]:
        return {"causes": [cause.to_dict() for cause in self.causes], "findings": list(self.findings),
                "rule": RULE}


def diagnose(summary: dict[str, Any], *, probes: list[dict[str, Any]] | None = None,
             batch_variant: bool | None = None) -> Diagnosis:
    """The causes the summary's evidence supports, in the order RULE gives."""
    level = pair_levels(summary)
    side = sides(summary)
    shift = alignment_shift(summary)
    if shift is not None:  # every other number is measured on misaligned pairs
        return Diagnosis(causes=(shift,))
    weights = _weights(summary, level, side)
    index_flips, layer_type = mechanism_causes(summary, level)
    if weights is not None and not confinement_is_weights(summary):
        weights = None  # confinement alone, on one checkpoint: the two paths differ, not a tensor (mechanisms.RULE)
    temperature = trainer_temperature(summary, level)
    # A trainer that scales its logits looks, to the semantics check, like processed stored log-probs.
    found = [temperature or processed(summary, level), weights, _sampler_side(summary, level, side),
             _turn_onset(summary), _render_drift(summary),
             _batch_variance(summary, side, batch_variant if batch_variant is not None
                             else _probes_batch_variant(probes)),
             index_flips, _routing(summary, weights), layer_type, _precision(summary, level, side, weights, probes),
             _kernel_path(summary, level, side, weights), _position_drift(summary)]
    causes = tuple(cause for cause in found if cause is not None)
    return Diagnosis(causes=_minor_drift_last(causes, summary), findings=tuple(_findings(summary, level, side)))


# --- one function per cause ---

def _weights(summary: dict[str, Any], level: dict[str, str], side: dict[str, Side]) -> Cause | None:
    """A weights diff of two checkpoints, else the localizers confining train/infer to a few modules."""
    for source, diff in (summary.get("weights") or {}).items():
        differing = diff.get("differing") or []
        if diff.get("identical") or not differing:
            continue
        pair = f"train/{source}"
        worst = differing[0]
        experts = [f"{t['name']}[{e}]" for t in differing for e in t.get("experts_differing") or []]
        where = located([t["name"] for t in differing], experts)
        evidence = [f"the weights diff of {diff.get('b')} against {diff.get('a')}: {diff.get('verdict')}",
                    f"worst {worst['name']}: max relative difference {three_digits(worst.get('max_rel_diff'))}, "
                    f"||a-b||/||a|| {three_digits(worst.get('rel_l2_diff'))}"]
        localized = confined(summary)
        if localized is not None:
            evidence.append(localized["words"])
        return Cause(kind="weights", pair=pair, fix="fix_weight_sync", where={"source": source, **where},
                     title=f"the weights {source} ran differ from the trainer's in {where['words']}",
                     evidence=tuple(evidence),
                     rules_out=_same_config_words(side, "train", source, level.get(pair)))
    localized = confined(summary)
    if localized is None:
        return None
    pair = "train/infer"
    return Cause(kind="weights", pair=pair, fix="fix_weight_sync", where={"source": "infer", **localized["where"]},
                 title=f"the weights of train and infer differ in {localized['where']['words']}",
                 evidence=(localized["words"],),
                 rules_out=(*_same_config_words(side, "train", "infer", level.get(pair)),
                            "precision and kernels round every module a little; one module carrying the "
                            "error is a difference in its weights"))


def _same_config_words(side: dict[str, Side], a: str, b: str, gap: str | None) -> tuple[str, ...]:
    if a not in side or b not in side:
        return ()
    differs = side[a].differs(side[b])
    if differs:
        return (f"{a} and {b} also differ in {facts(differs)}: that adds rounding, but not error confined to "
                "these tensors",)
    return (f"{a} and {b} run the same dtype ({side[a].dtype}) and engine ({side[a].kind}): not precision or "
            "kernels",)


def _sampler_side(summary: dict[str, Any], level: dict[str, str], side: dict[str, Side]) -> Cause | None:
    """The replays agree with each other but not with the stored log-probs, from the first turn on
    (a step at a later turn is turn_onset: the turns before it were reproduced, so were the weights),
    judged like for like when the stored log-probs are processed."""
    processed = (summary.get("alignment") or {}).get("logprob_semantics") == "processed"
    judged = "train_processed/sampler" if processed else "infer/sampler"  # raw pairs differ by the processing
    if level.get("train/infer") not in HEALTHY or level.get(judged) not in GAPS:
        return None
    if ((summary.get("localization") or {}).get("turns") or {}).get("onset_turn") is not None:
        return None
    if "sampler" not in side or "infer" not in side:
        return None
    differs = side["sampler"].differs(side["infer"])
    agree = (f"train/infer is {level['train/infer']} (the two replays agree), {judged} is {level[judged]} "
             f"(kl_k3 {kl_words(summary, judged)}) from the first turn on")
    if differs:
        spec = _sampler_spec(side["sampler"])
        return Cause(kind="sampler_config", pair="infer/sampler", fix="match_sampler_config",
                     title=f"the sampler ran another config than this replay: {facts(differs)}",
                     evidence=(agree, f"meta.sampler declares {facts(differs)}"),
                     rules_out=("precision or weights cannot be told apart until a replay runs the sampler's "
                                "config",),
                     where={"differs": {k: list(v) for k, v in differs.items()}, "infer": spec})
    declared = ", ".join(f"{name} {value}" for name, value in (("dtype", side["sampler"].dtype),
                                                               ("engine", side["sampler"].kind)) if value)
    return Cause(kind="sampler_weights", pair="infer/sampler", fix="fix_weight_sync",
                 where={"source": "sampler", "words": "the sampler's weights"},
                 title="the sampler ran other weights than the checkpoint replayed",
                 evidence=(agree, f"meta.sampler declares what the replay runs ({declared or 'nothing to compare'})"),
                 rules_out=("the replays agree, so neither the trainer's kernels nor its precision make the gap; "
                            "the sampler's side does: fix the weight sync (or the checkpoint given), not the "
                            "precision",))


def _sampler_spec(sampler: Side) -> str:
    kind = sampler.kind if sampler.kind in ("hf", "hf-decode", "vllm") else "hf-decode"
    return f"{kind}:dtype={sampler.dtype}" if sampler.dtype else kind


def _turn_onset(summary: dict[str, Any]) -> Cause | None:
    turns = (summary.get("localization") or {}).get("turns") or {}
    turn = turns.get("onset_turn")
    if turn is None:
        return None
    detail = turns.get("onset") or {}
    rows = {row["turn"]: row for row in turns.get("by_turn") or [] if "turn" in row}
    before = [row["log_ratio_abs_mean"] for t, row in rows.items() if t < turn and row.get("compared")]
    at = rows.get(turn, {})
    rollouts = [row["rollout"] for row in detail.get("rollouts") or []]
    evidence = [f"mean |log-ratio| {at.get('log_ratio_abs_mean', float('nan')):.3g} at turn {turn}, after "
                f"{max(before):.3g} at most before it" if before and at else f"the onset rule departs at turn {turn}"]
    if detail:
        evidence.append(f"{detail['n_rollouts_departing']} of {detail['n_rollouts_compared']} rollouts step up "
                        f"from turn {turn}" + (f": {listed(rollouts)}" if rollouts else ""))
    held = _turn_holds(detail)
    if held:
        evidence.append(f"turn {turn} holds {held}")
    return Cause(kind="turn_onset", pair=turns.get("pair", "train/sampler"), fix="inspect_turn",
                 title=f"the gap steps up at turn {turn}" + (f" ({held})" if held else ""),
                 evidence=tuple(evidence),
                 rules_out=("a step at one turn, not a slope along position: kernels and precision grow with "
                            "context smoothly; something changed at this turn (a summary, a tool result, a "
                            "rewritten history, or the sampler's weights updated mid-rollout)",),
                 where={"turn": turn, "rollouts": rollouts[:10], "new_roles": detail.get("new_roles") or [],
                        "new_branch_kinds": detail.get("new_branch_kinds") or []})


def _turn_holds(detail: dict[str, Any]) -> str:
    new = [*(f"the first {role} rows" for role in detail.get("new_roles") or []),
           *(f"the first {kind} branches" for kind in detail.get("new_branch_kinds") or [])]
    return ", ".join(new)


def _render_drift(summary: dict[str, Any]) -> Cause | None:
    drift = summary.get("drift") or {}
    spans = drift.get("spans") or []
    if not spans:
        return None
    places = sorted({(span.get("rollout"), span.get("turn")) for span in spans}, key=str)
    words = ", ".join(f"{rollout} turn {turn}" for rollout, turn in places[:6]) + \
        (f" and {len(places) - 6} more" if len(places) > 6 else "")
    kinds = drift.get("spans_by_kind") or {}
    return Cause(kind="render_drift", pair="train/sampler", fix="fix_renderer",
                 title=f"re-rendered messages give other tokens than were sampled ({words})",
                 evidence=(f"{len(spans)} span(s) ({fact_counts(kinds)}), "
                           f"{drift.get('trainable_tokens_touched', 0)} trainable token(s) touched",),
                 where={"spans": len(spans), "rollouts": sorted({r for r, _ in places if r is not None})[:10],
                        "places": [{"rollout": r, "turn": t} for r, t in places[:20]]})


def _minor_drift_last(causes: tuple[Cause, ...], summary: dict[str, Any]) -> tuple[Cause, ...]:
    """A handful of drifted tokens (< MINOR_DRIFT of the trained ones) explains no gap: listed last,
    marked minor."""
    drift = next((c for c in causes if c.kind == "render_drift"), None)
    touched = (summary.get("drift") or {}).get("trainable_tokens_touched")
    trainable = (summary.get("counts") or {}).get("trainable_tokens")
    if drift is None or not (isinstance(touched, int) and trainable and touched < MINOR_DRIFT * trainable):
        return causes
    return (*[c for c in causes if c is not drift], replace(drift, minor=True))


def _probes_batch_variant(probes: list[dict[str, Any]] | None) -> bool | None:
    return batch_variant_from_probes(probes) if probes is not None else None


def _batch_variance(summary: dict[str, Any], side: dict[str, Side], probed: bool | None) -> Cause | None:
    from mismatch.analysis.prefixes import split_prefixes
    from mismatch.engines import TORCH_KINDS

    engines = summary.get("engines") or {}
    split = {source: found for source, found in split_prefixes(summary).items()
             if (engines.get(source) or {}).get("kind") not in TORCH_KINDS}
    if probed is False or not (probed or split):  # probes that ran and show none outweigh a split prefix
        return None
    evidence = []
    if probed:
        evidence.append("the probes show log-probs that change with batch composition")
    for source, found in split.items():
        worst = found.get("worst") or {}
        evidence.append(f"{source} gave one prefix different log-probs in different requests: "
                        f"{found['frac_prefixes_bitwise_equal']:.1%} of {found['n_prefixes']:,} shared prefixes "
                        f"bitwise equal, spread up to {found['max_abs_spread']:.3g}"
                        + (f" (rollouts {listed(worst['rollouts'])})" if worst.get("rollouts") else ""))
    pair = "train/sampler" if "sampler" in split or probed else f"train/{next(iter(split))}"
    return Cause(kind="batch_variance", pair=pair, fix="batch_invariant",
                 title="the inference engine's log-probs change with what else is in the batch",
                 evidence=tuple(evidence), where={"sources": sorted(split)},
                 rules_out=("the same prefix and the same weights gave different numbers: neither weights nor "
                            "the renderer can do that",))


def _routing(summary: dict[str, Any], weights: Cause | None) -> Cause | None:
    from mismatch.analysis.routing import routing_share

    routing = summary.get("routing") or {}
    for pair in ("train/infer", "train/sampler"):
        agreement = routing.get(pair)
        share = routing_share(agreement) if agreement else None
        if share is None or share < ROUTING_SHARE:
            continue
        flips = f"{agreement['frac_tokens_with_flip']:.2%} of {pair} tokens follow a different expert set"
        if weights is not None:  # the flips are the fault's downstream effect: R3 would hide it
            return None
        return Cause(kind="routing_flips", pair=pair, fix="routing_replay",
                     title=f"MoE routing flips carry {share:.0%} of the {pair} gap",
                     evidence=(f"{flips}, and they carry {share:.0%} of the gap (k3)",),
                     rules_out=("no weight fault is localized: the flips come from rounding near the router's "
                                "ties, which routing replay removes",),
                     where={"pair": pair, "k3_share": share, "frac_tokens_with_flip": agreement["frac_tokens_with_flip"]})
    return None


def _precision(summary: dict[str, Any], level: dict[str, str], side: dict[str, Side], weights: Cause | None,
               probes: list[dict[str, Any]] | None) -> Cause | None:
    """bf16 rounding, when the evidence says so: a replay in the other dtype that makes it vanish,
    error spread over every module, or the dtype probes."""
    if weights is not None:
        return None
    for pair, (a, b) in (("train/sampler", ("train", "sampler")), ("train/infer", ("train", "infer")),
                         ("infer/sampler", ("infer", "sampler"))):
        if level.get(pair) not in GAPS or a not in side or b not in side:
            continue
        differs = side[a].differs(side[b])
        dtypes = differs.get("dtype")
        if dtypes is None or "bfloat16" not in dtypes:
            continue
        bf16 = a if side[a].dtype == "bfloat16" else b
        if _declared_wrongly(level, side, bf16):
            continue
        confirmed = _vanishes(level, side, bf16, b if bf16 == a else a) or _spread(summary, pair) \
            or _dtype_probes(probes)
        if confirmed is None:
            continue
        return Cause(kind="precision", pair=pair, fix="fp16",
                     title=f"bfloat16 rounding: {bf16} runs in bfloat16, the other side of {pair} in {_other(dtypes)}",
                     evidence=(f"{a} and {b} differ in {facts(differs)}", confirmed),
                     rules_out=("no module carries the error alone: not one weight tensor",),
                     where={"bf16_source": bf16, "sources": [bf16], "pair": pair, "gap": level[pair]})
    return None


def _other(dtypes: tuple[Any, Any]) -> str:
    return next(d for d in dtypes if d != "bfloat16")


def _vanishes(level: dict[str, str], side: dict[str, Side], bf16: str, other: str) -> str | None:
    """A third source on the other end's weights, in bfloat16, reproduces the bf16 end: the gap is
    the same weights in two dtypes. (One reproducing the float end says nothing about the bf16 one.)"""
    for third in ("train", "infer", "sampler"):
        if third in (bf16, other) or third not in side or side[third].dtype != "bfloat16":
            continue
        if side[third].weights is not None and side[other].weights is not None \
                and side[third].weights != side[other].weights:
            continue
        pair = _pair_name(third, bf16)
        if level.get(pair) in HEALTHY:
            also = {k: v for k, v in side[third].differs(side[other]).items() if k != "dtype"}
            return (f"{third} runs {other}'s weights in bfloat16" + (f" (and {facts(also)})" if also else "")
                    + f" and reproduces {bf16} ({pair} {level[pair]}): the gap is between the same weights in "
                    + ("two dtypes" if not also else "two dtypes and engine paths"))
    return None


def _declared_wrongly(level: dict[str, str], side: dict[str, Side], bf16: str) -> bool:
    """meta.sampler says bfloat16, yet a replay in another dtype reproduces it bit for bit."""
    infer = side.get("infer")
    return bf16 == "sampler" and infer is not None and level.get("infer/sampler") == "exact" \
        and infer.dtype not in (None, "bfloat16")


def _pair_name(x: str, y: str) -> str:
    order = ("train", "infer", "sampler")
    a, b = sorted((x, y), key=order.index)
    return f"{a}/{b}"


def _spread(summary: dict[str, Any], pair: str) -> str | None:
    if pair != "train/infer":
        return None
    kernels = ((summary.get("localization") or {}).get("kernels") or {}).get("by_module") or []
    errors = [m["rel_error"] for m in kernels if isinstance(m.get("rel_error"), (int, float))]
    if errors and sum(e > 0 for e in errors) >= 0.5 * len(errors) and confined(summary) is None:
        return f"the kernel localizer finds error in {sum(e > 0 for e in errors)} of {len(errors)} modules, none standing out"
    return None


def _dtype_probes(probes: list[dict[str, Any]] | None) -> str | None:
    relevant = [p for p in probes or [] if p.get("source") == "dtype" and p.get("applicable")
                and isinstance(p.get("bitwise_equal_frac"), (int, float)) and p["bitwise_equal_frac"] < 1.0]
    return "the dtype probes show each op changing with bfloat16" if relevant else None


def _kernel_path(summary: dict[str, Any], level: dict[str, str], side: dict[str, Side],
                 weights: Cause | None) -> Cause | None:
    if weights is not None or level.get("train/infer") not in GAPS or "train" not in side or "infer" not in side:
        return None
    differs = side["train"].differs(side["infer"])
    if set(differs) - {"engine", "attn"} or not differs:
        return None
    faithful = level.get("infer/sampler") in HEALTHY
    return Cause(kind="kernel_path", pair="train/infer", fix="recompute_old_logprobs",
                 title=f"the engines' kernels differ ({facts(differs)}) at the same dtype",
                 evidence=(f"train and infer differ only in {facts(differs)}",
                           *(["the replay reproduces the sampler (infer/sampler "
                              f"{level['infer/sampler']}): the sampler's kernels are these"] if faithful else [])),
                 where={"differs": {k: list(v) for k, v in differs.items()}})


def _position_drift(summary: dict[str, Any]) -> Cause | None:
    turns = (summary.get("localization") or {}).get("turns") or {}
    slope = turns.get("position_slope") or {}
    if turns.get("onset_turn") is not None or not slope.get("grows_with_position"):
        return None
    low, high = slope.get("ci95_per_1k") or (None, None)
    return Cause(kind="position_drift", pair=turns.get("pair", "train/sampler"),
                 title="the gap grows with context length",
                 evidence=(f"|log-ratio| rises {three_digits(slope.get('slope_per_1k'))} per 1000 tokens of position (95% CI "
                           f"{three_digits(low)} to {three_digits(high)}), with no turn where it steps up",),
                 where={"slope_per_1k": slope.get("slope_per_1k")})


def _findings(summary: dict[str, Any], level: dict[str, str], side: dict[str, Side]) -> list[str]:
    out = []
    if level.get("train/infer") == "large" and level.get("train/sampler") in ("exact", "negligible", "small"):
        spec = ((summary.get("engines") or {}).get("infer") or {}).get("spec", "infer")
        out.append(f"train/infer is large while train/sampler is {level['train/sampler']}: the engine config "
                   f"replayed here ({spec}) is farther from the trainer than the sampler was; it is not the "
                   f"sampler's config (infer/sampler {level.get('infer/sampler', 'unknown')})")
    sampler, infer = side.get("sampler"), side.get("infer")
    if (sampler is not None and infer is not None and level.get("infer/sampler") == "exact"
            and sampler.differs(infer)):
        out.append(f"meta.sampler declares {facts(sampler.differs(infer))}, yet the replay reproduces the "
                   "stored log-probs bit for bit: the declaration is wrong")
    return out


