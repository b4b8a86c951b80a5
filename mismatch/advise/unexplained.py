"""The answer when no cause passes its admissibility test (diagnose.py): the gap's size against
the bf16 gap measured on these weights, what was ruled out, and the next command that would decide.
It has no fix of its own: `recommend` gives the correction meanwhile."""

from __future__ import annotations


from mismatch.results.summary_model import CauseWhere, Summary, present, to_builtins
from mismatch.advise.admissibility import Envelope, Refusal, times
from mismatch.advise.cause import Cause
from mismatch.advise.readers import Side, sampler_spec, three_digits


def unexplained(summary: Summary, side: dict[str, Side], *, ratio_pair: str, found: Envelope | None,
                refused: list[Refusal]) -> Cause:
    """The gap's size, what was ruled out, and the next command to run; no fix of its own (the
    correction meanwhile is recommend's)."""
    pair = ratio_pair
    kl, tail = summary.metric(pair, "kl_k3"), summary.metric(pair, "frac_outside_2")
    size = (f"{times(float(kl), found.kl_k3)} {found.words}" if found is not None and isinstance(kl, (int, float))
            else "no bf16 gap measured on these weights to size it against")
    ruled = [r.why for r in refused] + _ruled_out(summary, side)
    command = _next_command(summary, side, found)
    return Cause(kind="unexplained", pair=pair,
                 # No "(kl_k3" in a title: the banner cuts a verdict's numbers off there.
                 title=f"unexplained: the {pair} gap, kl_k3 {three_digits(kl)}"
                       + (f" with {tail:.2%} of tokens outside [0.5, 2]," if isinstance(tail, (int, float)) else ",")
                       + " passes no cause's test",
                 evidence=(size,), rules_out=tuple(ruled),
                 where=CauseWhere(next=command, ruled_out=ruled,
                                  envelope=to_builtins(found.to_record()) if found is not None else None))


def _ruled_out(summary: Summary, side: dict[str, Side]) -> list[str]:
    """What the evidence shows is not the cause (each only where it was measured)."""
    out = []
    if summary.alignment and summary.alignment.stored:
        out.append("alignment shift 0" + (", stored log-probs raw" if summary.semantics == "raw" else ""))
    if any(not diff.differing for diff in (present(summary.weights) or {}).values()):
        out.append("the weights diff finds no differing tensor")
    turns = summary.localization.turns
    if turns and turns.n_tokens and summary.onset_turn is None:
        out.append("no turn where the gap steps up")
    drift = summary.drift
    if drift and drift.num_rollouts_checked and not drift.spans:
        out.append("no render drift")
    infer = side.get("infer")
    if infer is not None and not infer.replayed:
        out.append("infer replays a stored stream, not the model: it is no evidence of how the stored log-probs "
                   "were made (stored, not replayed)")
    return out


def _next_command(summary: Summary, side: dict[str, Side], found: Envelope | None) -> str:
    """The audit that would decide: a replay of the sampler's declared config beside an fp32 trainer
    (it measures the bf16 gap on these weights, and whether the sampler's config reproduces the
    stored log-probs); with that replay already here, the localizers and the weights diff."""
    base = (f"mismatch audit {summary.checkpoint or 'CHECKPOINT'} --rollouts "
            f"{summary.rollouts_file or 'ROLLOUTS'} --train hf:dtype=float32")
    sampler, infer = side.get("sampler"), side.get("infer")
    spec = sampler_spec(sampler) if sampler is not None else "hf-decode:dtype=bfloat16"
    runs_declared = infer is not None and infer.replayed and sampler is not None and not sampler.differs(infer)
    if not runs_declared:
        return f"{base} --infer {spec} --out OUT2"
    if found is None:
        return f"{base} --infer {_with_dtype(spec, 'bfloat16')} --out OUT2"
    localize = " --localize" if spec.split(":", 1)[0] in ("hf", "hf-decode") else ""  # torch engines only
    return (f"mismatch weights {summary.checkpoint or 'CHECKPOINT'} SYNCED_CHECKPOINT (the copy the sampler "
            f"loaded); {base} --infer {spec}{localize} --out OUT2")


def _with_dtype(spec: str, dtype: str) -> str:
    kind = spec.split(":", 1)[0]
    return f"{kind}:dtype={dtype}"
