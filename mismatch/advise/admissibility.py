"""Each cause's admissibility test, run before the diagnosis (diagnose.py) claims it: a cause is
earned by evidence that can carry it, or it is not claimed.

Terms:
- envelope: the bf16 gap measured on these weights, the kl_k3 of two replays of the same
  checkpoint that differ in dtype (one bfloat16). It bounds what rounding (and the kernels beside
  it) can do to this model; nothing else here can.
- size: a numeric cause (precision, kernel_path, batch_variance, position_drift) explains a gap at
  most SIZE_FACTOR times its envelope. With no envelope measured, rounding never puts more than
  ROUNDING_TAIL of the tokens' ratios outside [0.5, 2].
- independence: a stored stream (the sampler's, or one replayed as an engine: `--infer sampler`,
  `stored:NAME`) is never evidence of how it was produced (readers.Side.replayed); the rules read
  only replays as witnesses.
- identity: a gap with IDENTITY_TAIL of the tokens' ratios outside [0.5, 2] is another model's
  rollouts, not rounding, a weight-sync fault or a stale copy of this one.
- consistency: no cause whose own evidence contradicts it: processed log-probs only when the
  like-for-like gap is well under the raw one; routing flips only when both sides are shown to run
  the same weights; the sampler's weights only when the replay runs all the sampler declared (a
  truncated sampler, top-p / top-k / min-p, is not replayed here: issue 46's cause).
"""

from __future__ import annotations

from dataclasses import dataclass

from mismatch.advise.cause import Cause
from mismatch.results import summary_model as model
from mismatch.results.summary_model import UNSET, CauseWhere, Summary, present
from mismatch.advise.levels import HEALTHY
from mismatch.advise.readers import Side, three_digits
from mismatch.rollouts.declared_checkpoint import declared_name

SIZE_FACTOR = 10.0    # a gap this many times its envelope is more than the numeric cause
ROUNDING_TAIL = 0.01  # no envelope: rounding never takes this share of tokens outside [0.5, 2]
IDENTITY_TAIL = 0.5   # half the tokens' probabilities off by 2x: another model's rollouts
LIKE_FOR_LIKE = 0.5   # the processing explains a gap when the like-for-like gap is under this share of it
NUMERIC = {"precision": "bfloat16 rounding", "kernel_path": "the engines' kernels",
           "batch_variance": "batch variance", "position_drift": "position drift"}


@dataclass(kw_only=True, slots=True, frozen=True)
class Envelope:
    """The bf16 gap measured on these weights: the pair of replays it was measured on, its kl_k3."""

    pair: str
    kl_k3: float
    words: str

    def to_record(self) -> model.Envelope:
        return model.Envelope(pair=self.pair, kl_k3=self.kl_k3, words=self.words)


@dataclass(kw_only=True, slots=True, frozen=True)
class Refusal:
    """A cause found but not claimed: the test it failed, and why."""

    kind: str
    pair: str
    test: str  # size | consistency
    why: str

    def to_record(self) -> model.Refusal:
        return model.Refusal(kind=self.kind, pair=self.pair, test=self.test, why=self.why)


def envelope(summary: Summary, side: dict[str, Side]) -> Envelope | None:
    """Two replays of the same checkpoint, one in bfloat16 and one not (their engines may differ
    too: then the envelope bounds the kernels as well), and their kl_k3; None when no pair of the
    run is that."""
    for pair, metrics in summary.pairs.items():
        a, _, b = pair.partition("/")
        if a not in side or b not in side:
            continue
        x, y = side[a], side[b]
        if not (x.replayed and y.replayed) or x.weights is None or x.weights != y.weights:
            continue
        dtypes = x.differs(y).get("dtype")
        kl = metrics.kl_k3
        if dtypes is None or "bfloat16" not in dtypes or not isinstance(kl, (int, float)):
            continue
        also = {k: v for k, v in x.differs(y).items() if k != "dtype"}
        return Envelope(pair=pair, kl_k3=float(kl),
                        words=f"the bf16 gap measured on these weights ({pair}: {a} in {x.dtype}, {b} in {y.dtype}"
                              + (f", also {', '.join(f'{k} {p} vs {q}' for k, (p, q) in also.items())}" if also else "")
                              + f", kl_k3 {three_digits(kl)})")
    return None


def times(kl: float, bound: float) -> str:
    return f"{kl / bound:,.0f}x" if bound > 0 else "infinitely many times"


def size_test(cause: Cause, summary: Summary, found: Envelope | None) -> str | None:
    """Why a numeric cause cannot carry its pair's gap, or None when it can."""
    if cause.kind not in NUMERIC:
        return None
    kl, tail = summary.metric(cause.pair, "kl_k3"), summary.metric(cause.pair, "frac_outside_2")
    name = NUMERIC[cause.kind]
    if found is not None:
        if found.pair == cause.pair or not isinstance(kl, (int, float)):
            return None  # measured on itself: the envelope is this gap
        if kl > SIZE_FACTOR * found.kl_k3:
            return (f"more than {name}: {cause.pair} kl_k3 {three_digits(kl)} is {times(kl, found.kl_k3)} "
                    f"{found.words}")
        return None
    if isinstance(tail, (int, float)) and tail > ROUNDING_TAIL:
        return (f"more than {name}: {tail:.1%} of {cause.pair} tokens have a ratio outside [0.5, 2], which "
                f"rounding never gives (over {ROUNDING_TAIL:.0%}); no bf16 gap was measured on these weights")
    return None


def processed_test(cause: Cause, summary: Summary) -> str | None:
    """Processed log-probs explain the gap only when the trainer with the sampler's processing (the
    like-for-like pair) comes much closer to them than the raw trainer does."""
    return not_processing(summary) if cause.kind == "processed_logprobs" else None


def not_processing(summary: Summary) -> str | None:
    """Why the processing cannot be what makes the gap (the like-for-like gap is no smaller than the
    raw one), or None."""
    kl_like, kl_raw = summary.metric("train_processed/sampler", "kl_k3"), summary.metric("train/sampler", "kl_k3")
    if not isinstance(kl_like, (int, float)) or not isinstance(kl_raw, (int, float)):
        return None
    if kl_like < LIKE_FOR_LIKE * kl_raw:
        return None
    return (f"not the processing: the like-for-like gap (train_processed/sampler, kl_k3 {three_digits(kl_like)}) "
            f"is no smaller than the raw one (train/sampler, kl_k3 {three_digits(kl_raw)})")


def routing_test(cause: Cause, level: dict[str, str], side: dict[str, Side], *, sampler_fault: bool) -> str | None:
    """Routing flips are rounding near the router's ties only when both sides of the pair are shown
    to run the same weights: two replays of one checkpoint, or, for the sampler, a replay that
    reproduces it (exact, or up to rounding with no sampler-side fault found: `sampler_fault`).
    Otherwise a faulty expert or router on one side flips routing too, and routing replay would
    hide it."""
    if cause.kind != "routing_flips":
        return None
    a, _, b = cause.pair.partition("/")
    x, y = side.get(a), side.get(b)
    if x is not None and y is not None and x.replayed and y.replayed and x.weights is not None \
            and x.weights == y.weights:
        return None
    if b == "sampler":
        witness = next((s for s in ("infer", "train") if s in side and side[s].replayed and s != a
                        and (level.get(f"{s}/sampler") == "exact"
                             or (level.get(f"{s}/sampler") in HEALTHY and not sampler_fault))), None)
        if witness is not None:
            return None
        return (f"not rounding at the router's ties: no replay reproduces the sampler (infer/sampler "
                f"{level.get('infer/sampler', 'not measured')}"
                + (", and the sampler's side is found at fault" if sampler_fault else "") + "), so its weights are not shown to be the trainer's; a "
                "faulty expert or router on the sampler's side flips routing too, and routing replay would hide it")
    return (f"not rounding at the router's ties: {a} and {b} are not shown to run the same weights")


def identity(summary: Summary, level: dict[str, str], side: dict[str, Side], pair: str,
             found: Envelope | None) -> Cause | None:
    """These rollouts were not sampled by this checkpoint: the trainer (a replay of it) puts most of
    the sampled tokens' probabilities off by more than 2x, which no numeric cause reaches and no
    perturbed or stale copy of a trained model does."""
    tail, kl = summary.metric(pair, "frac_outside_2"), summary.metric(pair, "kl_k3")
    train = side.get("train")
    # NaN (no stored log-probs to pair: the summary in memory, before JSON writes it null) is no tail.
    if train is None or not train.replayed or not isinstance(tail, (int, float)) or not tail >= IDENTITY_TAIL:
        return None
    declared = present(summary.declared.checkpoint)
    evidence = [f"{tail:.1%} of {pair} tokens have a ratio outside [0.5, 2] (kl_k3 {three_digits(kl)})"]
    if declared:
        evidence.append(f"the rollouts declare meta.sampler.checkpoint {declared}; this audit replays "
                        f"{summary.checkpoint}")
    # Each rollout's own meta.checkpoint, compared by name or weight digests (rollouts/declared_checkpoint.py).
    compared = model.present(summary.declared_checkpoint)
    if compared is not None and not compared.agrees:
        evidence.append("the rollouts declare meta.checkpoint " + "; ".join(
            f"{declared_name(row.checkpoint)} ({row.rollouts} of {compared.rollouts} rollouts, {row.match})"
            for row in compared.declared) + f"; this audit replays {summary.checkpoint}")
    reach = (f"{times(float(kl), found.kl_k3)} {found.words}" if found is not None and isinstance(kl, (int, float))
             else f"rounding never takes over {ROUNDING_TAIL:.0%} of tokens outside [0.5, 2]")
    return Cause(kind="identity", pair=pair, fix="match_checkpoint",
                 title="these rollouts were not sampled by this checkpoint",
                 evidence=tuple(evidence),
                 rules_out=(f"no numeric cause reaches it: {reach}",
                            f"a weight-sync fault or a stale copy moves some probabilities, not over "
                            f"{IDENTITY_TAIL:.0%} of them by 2x"),
                 where=CauseWhere(checkpoint=summary.checkpoint, declared=declared,
                                  declared_by_rollouts=[declared_name(row.checkpoint) for row in compared.declared]
                                  if compared is not None else UNSET))


TRUNCATION_OFF = {"top_p": (1.0,), "top_k": (-1, 0), "min_p": (0.0,)}  # meta.sampler values that truncate nothing


def truncation_test(cause: Cause, summary: Summary, *, like_for_like: bool) -> str | None:
    """The sampler's side is blamed on its weights only when the replay runs all the sampler
    declared: truncated sampling (top-p < 1, top-k > 0, min-p > 0) is replayed only by the
    like-for-like pass (`like_for_like`), and it can move stored log-probs with the same weights."""
    if cause.kind != "sampler_weights" or like_for_like:
        return None
    declared = summary.declared
    values = {"top_p": declared.top_p, "top_k": declared.top_k, "min_p": declared.min_p}
    truncated = [f"{name} {values[name]}" for name, off in TRUNCATION_OFF.items()
                 if isinstance(values[name], (int, float)) and values[name] not in off]
    if not truncated:
        return None
    return (f"not shown to be the sampler's weights: it declares truncated sampling ({', '.join(truncated)}), which "
            "this replay does not apply, and which can move the stored log-probs with the same weights")
