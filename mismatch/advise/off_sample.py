"""A gap of the whole next-token distribution that the sampled tokens do not show (`--distribution`).

Terms. The sampled-token metrics see a distribution only through the tokens that were sampled:
kl_k3, averaged over them, estimates KL between the two sides' next-token distributions (Schulman's
k3, an unbiased estimator when the tokens are drawn from the side it conditions on). The
distribution pass measures that KL itself at every trainable position (summary.json
`distribution[pair].kl`, exact for torch sides, a lower bound against a top-K side). When the
measured KL is many times its sampled estimate, the difference lives on tokens the rollouts never
sampled: a corrupted lm_head or embedding row, a token one side masks or biases, top-K sets that
differ. No sampled ratio shows it today; greedy evals and later samples will.

Test (OFF_SAMPLE_FACTOR): the pair's whole-distribution KL is at least OFF_SAMPLE_FACTOR times its
sampled-token kl_k3, and at least OFF_SAMPLE_FACTOR times NEGLIGIBLE_KL (a KL below that is
negligible whatever its sampled estimate). Rounding moves both alike (their ratio near 1, measured
on the tiny checkpoint's 6 toy-agent rollouts against hf fp32: 0.93 for vLLM bf16 at K = 20, 0.69
for hf bf16, 2.1 for vLLM fp32 at a KL of 4e-13; docs/distribution.md), so it does not pass.
The title names the token when one token carries at least CONCENTRATED of the moved probability
(the distribution's `tokens`): one row of the vocabulary, not the whole head.
"""

from __future__ import annotations

import math

from mismatch.advise.cause import Cause
from mismatch.advise.levels import NEGLIGIBLE_KL
from mismatch.advise.readers import three_digits
from mismatch.results.summary_model import CauseWhere, Summary, present

OFF_SAMPLE_FACTOR = 10.0  # whole-distribution KL over its sampled estimate that puts the gap off the samples
CONCENTRATED = 0.5        # one token's share of the moved probability that names it


def off_sample(summary: Summary) -> Cause | None:
    """The first distribution pair whose whole-distribution KL the sampled tokens miss (the test
    above), as a cause on that pair; None without --distribution or when the test fails."""
    for pair, entry in (present(summary.distribution) or {}).items():
        if pair not in summary.pairs:
            continue
        kl, k3 = present(entry.kl), summary.metric(pair, "kl_k3")
        if not _finite(kl) or not _finite(k3) or kl < OFF_SAMPLE_FACTOR * max(float(k3), NEGLIGIBLE_KL):
            continue
        bound = "" if present(entry.exact) else " (a lower bound: one side gave its top-K only)"
        evidence = [f"mean KL({pair.replace('/', '‖')}) over the whole next-token distribution at "
                    f"{present(entry.n_positions)} trainable positions is {three_digits(kl)}{bound}, "
                    f"{kl / max(float(k3), 1e-300):.3g}x the sampled tokens' kl_k3 {three_digits(k3)}"]
        tokens = present(entry.tokens) or []  # token_id, tv_share, n_positions; most moved first
        lead = tokens[0] if tokens and tokens[0]["tv_share"] >= CONCENTRATED else None
        if lead is not None:
            evidence.append(f"token {lead['token_id']} carries {lead['tv_share']:.0%} of the probability that "
                            f"moved, at {lead['n_positions']} positions")
        worst = (present(entry.worst) or [])[:3]  # rollout, pos, kl_ab, ...; largest KL first
        if worst:
            evidence.append("worst positions: " + "; ".join(
                f"rollout {row['rollout']} position {row['pos']} (KL {three_digits(row['kl_ab'])})" for row in worst))
        argmax = present(entry.argmax_agree_frac)
        if _finite(argmax) and argmax < 1.0:
            evidence.append(f"the most likely token differs at {1.0 - argmax:.2%} of positions (greedy decoding "
                            "would differ there)")
        where = f"token {lead['token_id']}" if lead is not None else "tokens that were not sampled"
        return Cause(kind="off_sample", pair=pair, fix="inspect_token_rows",
                     title=f"the whole next-token distribution differs off the sampled tokens, in {where}",
                     evidence=tuple(evidence),
                     rules_out=(f"rounding moves the sampled tokens' estimate and the whole distribution alike; "
                                f"this KL is over {OFF_SAMPLE_FACTOR:g}x its estimate",),
                     where=CauseWhere(token_id=lead["token_id"] if lead is not None else None,
                                      positions=[{"rollout": row["rollout"], "pos": row["pos"]} for row in worst],
                                      kl=kl, kl_k3=k3))
    return None


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)
