"""The numeric causes of a gap (diagnose.py's rules 7-11): batch variance, MoE routing flips,
bfloat16 rounding, the engines' kernels, position drift. Each is claimed only within its size
envelope (admissibility.size_test); routing flips only with the same weights on both sides."""

from __future__ import annotations

from typing import Any

from mismatch.results.summary_model import CauseWhere, ProbeResult, Summary, present
from mismatch.advise.cause import Cause
from mismatch.advise.levels import GAPS, HEALTHY
from mismatch.advise.readers import Side, confined, listed, three_digits
from mismatch.advise.readers import facts as facts_words

ROUTING_SHARE = 0.5  # the share of a pair's k3 on tokens with a routing flip that makes it the cause


def batch_variance(summary: Summary, side: dict[str, Side], probed: bool | None) -> Cause | None:
    from mismatch.engines import TORCH_KINDS

    split = {source: found for source, found in summary.split_prefixes().items()
             if summary.engine(source).kind not in TORCH_KINDS}
    if probed is False or not (probed or split):  # probes that ran and show none outweigh a split prefix
        return None
    evidence = []
    if probed:
        evidence.append("the probes show log-probs that change with batch composition")
    for source, found in split.items():
        worst = present(found.worst)
        evidence.append(f"{source} gave one prefix different log-probs in different requests: "
                        f"{found.frac_prefixes_bitwise_equal:.1%} of {found.n_prefixes:,} shared prefixes "
                        f"bitwise equal, spread up to {found.max_abs_spread:.3g}"
                        + (f" (rollouts {listed(worst.rollouts)})" if worst is not None and worst.rollouts else ""))
    pair = "train/sampler" if "sampler" in split or probed else f"train/{next(iter(split))}"
    return Cause(kind="batch_variance", pair=pair, fix="batch_invariant",
                 title="the inference engine's log-probs change with what else is in the batch",
                 evidence=tuple(evidence), where=CauseWhere(sources=sorted(split)),
                 rules_out=("the same prefix and the same weights gave different numbers: neither weights nor "
                            "the renderer can do that",))


def routing_flips(summary: Summary, weights: Cause | None) -> Cause | None:
    from mismatch.analysis.routing import routing_share

    routing = summary.section("routing")
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
                     where=CauseWhere(pair=pair, k3_share=share,
                                      frac_tokens_with_flip=agreement["frac_tokens_with_flip"]))
    return None


def precision(summary: Summary, level: dict[str, str], side: dict[str, Side], weights: Cause | None,
               probes: list[ProbeResult] | None) -> Cause | None:
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
        if _replay_refutes_the_declared_bf16(level, side, bf16):
            continue
        confirmed = _bf16_replay_reproduces(level, side, bf16, b if bf16 == a else a) or _spread(summary, pair) \
            or _dtype_probes(probes)
        if confirmed is None:
            continue
        return Cause(kind="precision", pair=pair, fix="fp16",
                     title=f"bfloat16 rounding: {bf16} runs in bfloat16, the other side of {pair} in {_other(dtypes)}",
                     evidence=(f"{a} and {b} differ in {facts_words(differs)}", confirmed),
                     rules_out=("no module carries the error alone: not one weight tensor",),
                     where=CauseWhere(bf16_source=bf16, sources=[bf16], pair=pair, gap=level[pair]))
    return None


def _other(dtypes: tuple[Any, Any]) -> str:
    return next(d for d in dtypes if d != "bfloat16")


def _bf16_replay_reproduces(level: dict[str, str], side: dict[str, Side], bf16: str, other: str) -> str | None:
    """A third source on the other end's weights, in bfloat16, reproduces the bf16 end: the gap is
    the same weights in two dtypes. (One reproducing the float end says nothing about the bf16 one.)"""
    for third in ("train", "infer", "sampler"):
        # Only a replay is a witness: a stored stream (the sampler's, `--infer sampler`) reproduces
        # itself whatever made it.
        if third in (bf16, other) or third not in side or side[third].dtype != "bfloat16" \
                or not side[third].replayed:
            continue
        if side[third].weights is not None and side[other].weights is not None \
                and side[third].weights != side[other].weights:
            continue
        pair = _pair_name(third, bf16)
        if level.get(pair) in HEALTHY:
            also = {k: v for k, v in side[third].differs(side[other]).items() if k != "dtype"}
            return (f"{third} runs {other}'s weights in bfloat16" + (f" (and {facts_words(also)})" if also else "")
                    + f" and reproduces {bf16} ({pair} {level[pair]}): the gap is between the same weights in "
                    + ("two dtypes" if not also else "two dtypes and engine paths"))
    return None


def _replay_refutes_the_declared_bf16(level: dict[str, str], side: dict[str, Side], bf16: str) -> bool:
    """meta.sampler says bfloat16, yet a replay in another dtype reproduces it bit for bit."""
    infer = side.get("infer")
    return bf16 == "sampler" and infer is not None and infer.replayed and level.get("infer/sampler") == "exact" \
        and infer.dtype not in (None, "bfloat16")


def _pair_name(x: str, y: str) -> str:
    order = ("train", "infer", "sampler")
    a, b = sorted((x, y), key=order.index)
    return f"{a}/{b}"


def _spread(summary: Summary, pair: str) -> str | None:
    if pair != "train/infer":
        return None
    kernels = summary.localization.kernels
    errors = [m.rel_error for m in (kernels.by_module or ()) if isinstance(m.rel_error, (int, float))] if kernels else []
    if errors and sum(e > 0 for e in errors) >= 0.5 * len(errors) and confined(summary) is None:
        return f"the kernel localizer finds error in {sum(e > 0 for e in errors)} of {len(errors)} modules, none standing out"
    return None


def _dtype_probes(probes: list[ProbeResult] | None) -> str | None:
    relevant = [p for p in probes or [] if p.source == "dtype" and p.applicable
                and isinstance(p.bitwise_equal_frac, (int, float)) and p.bitwise_equal_frac < 1.0]
    return "the dtype probes show each op changing with bfloat16" if relevant else None


def kernel_path(summary: Summary, level: dict[str, str], side: dict[str, Side],
                 weights: Cause | None) -> Cause | None:
    if weights is not None or level.get("train/infer") not in GAPS or "train" not in side or "infer" not in side \
            or not (side["train"].replayed and side["infer"].replayed):  # kernels are a replay's
        return None
    differs = side["train"].differs(side["infer"])
    if set(differs) - {"engine", "attn"} or not differs:
        return None
    faithful = level.get("infer/sampler") in HEALTHY
    return Cause(kind="kernel_path", pair="train/infer", fix="recompute_old_logprobs",
                 title=f"the engines' kernels differ ({facts_words(differs)}) at the same dtype",
                 evidence=(f"train and infer differ only in {facts_words(differs)}",
                           *(["the replay reproduces the sampler (infer/sampler "
                              f"{level['infer/sampler']}): the sampler's kernels are these"] if faithful else [])),
                 where=CauseWhere(differs={k: list(v) for k, v in differs.items()}))


def position_drift(summary: Summary) -> Cause | None:
    turns = summary.localization.turns
    if not turns or summary.onset_turn is not None or not summary.grows_with_position:
        return None
    slope = turns.position_slope  # set: it grows
    low, high = slope.ci95_per_1k or (None, None)
    return Cause(kind="position_drift", pair=turns.pair or "train/sampler",
                 title="the gap grows with context length",
                 evidence=(f"|log-ratio| rises {three_digits(slope.slope_per_1k)} per 1000 tokens of position (95% CI "
                           f"{three_digits(low)} to {three_digits(high)}), with no turn where it steps up",),
                 where=CauseWhere(slope_per_1k=present(slope.slope_per_1k)))
