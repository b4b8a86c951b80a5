"""Two next-token distributions compared position by position: the whole vocabulary where both
sides have their logits (torch engines), bounded where one side gives only its top-K (vLLM).

Terms, per position, for sides A and B (the pair A/B of summary.json):
- `kl_ab` = KL(A‖B) = Σ_v a_v (log a_v − log b_v), `kl_ba` = KL(B‖A), `tv` = ½ Σ_v |a_v − b_v|.
- The *known* set: the tokens whose probability both sides gave (every token for two full sides;
  for a top-K side its K tokens plus the sampled one). Everything else is merged into one outcome,
  "the rest", with mass 1 − Σ_known on each side. Merging outcomes can only lower an f-divergence
  (the data processing inequality), so KL and TV on the merged distributions are exact when the
  known set is the vocabulary and lower bounds otherwise; `tv_hi` adds the two rests whole, an
  upper bound (equal to `tv` when exact). `exact` says which.
- `overlap`: |top-K of A ∩ top-K of B| / K. `tail_a`, `tail_b`: each side's mass outside its own top-K
  (what a top-K view of it leaves out). `argmax_agree`: the two most likely tokens are the same.
- `rank_a`, `rank_b`: the sampled token's rank on each side, 1 = the argmax (as vLLM counts); NaN
  where a top-K side cannot say (SGLang reports no rank: one outside its top-K is unknown).
- `token`: the known token where |a_v − b_v| is largest (what moved the distribution most).
- `sampled_equal`: the sampled token's log-prob bit for bit equal on both sides; `row_equal`: every
  known log-prob bit for bit equal (the whole row when both sides are full).

A chunk of rows is held as [C, V] at most: the caller feeds a chunk at a time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

# The per-position columns, in the order a chunk's array holds them (float64 [C, len(TERMS)]).
TERMS = ("kl_ab", "kl_ba", "tv", "tv_hi", "overlap", "tail_a", "tail_b", "argmax_agree", "rank_a", "rank_b",
         "token", "sampled_equal", "row_equal", "exact")


@dataclass(kw_only=True, slots=True)
class FullRows:
    """A side's whole next-token log-softmax for C positions (fp32 [C, V], a torch tensor)."""

    logp_CV: Any


@dataclass(kw_only=True, slots=True)
class TopRows:
    """A side's top-K for C positions: token ids and log-probs [C, K'] (K' ≥ K: the sampled token is
    added where it is not in the top-K; padding ids are −1), and the sampled token's log-prob and
    rank [C] as the engine reported them (NaN: not reported)."""

    ids_CK: np.ndarray
    logp_CK: np.ndarray
    sampled_logp_C: np.ndarray
    sampled_rank_C: np.ndarray
    k: int


def compare_rows(a: FullRows | TopRows, b: FullRows | TopRows, sampled_C: np.ndarray, k: int,
                 vocab_size: int) -> np.ndarray:
    """The TERMS of C positions (float64 [C, len(TERMS)]); `sampled_C`: the token sampled at each."""
    import torch

    sampled = torch.from_numpy(np.asarray(sampled_C, dtype=np.int64))
    logp_a, known_a = _dense(a, vocab_size)
    logp_b, known_b = _dense(b, vocab_size)
    known = known_a & known_b
    exact = bool(known.all()) if isinstance(a, FullRows) and isinstance(b, FullRows) else False
    la = logp_a.double().masked_fill(~known, float("-inf"))
    lb = logp_b.double().masked_fill(~known, float("-inf"))
    pa, pb = la.exp(), lb.exp()
    both = known & (pa > 0)
    kl_ab = torch.where(both, pa * (la - lb), torch.zeros_like(pa)).sum(-1)
    kl_ba = torch.where(known & (pb > 0), pb * (lb - la), torch.zeros_like(pb)).sum(-1)
    diff = (pa - pb).abs()
    tv = 0.5 * diff.sum(-1)
    (rest_a, exact_rest_a), (rest_b, exact_rest_b) = _rest(a, logp_a, known, pa), _rest(b, logp_b, known, pb)
    tv_hi = tv + 0.5 * (rest_a + rest_b)
    if not exact:  # the rest as one outcome on each side (a lower bound; see the docstring)
        kl_ab = kl_ab + _merged(rest_a, exact_rest_a, rest_b, exact_rest_b)
        kl_ba = kl_ba + _merged(rest_b, exact_rest_b, rest_a, exact_rest_a)
        tv = tv + 0.5 * (rest_a - rest_b).abs()
    else:
        tv_hi = tv
    top_a, tail_a, argmax_a, rank_a = _top(a, logp_a, sampled, k)
    top_b, tail_b, argmax_b, rank_b = _top(b, logp_b, sampled, k)
    overlap = (top_a[:, :, None] == top_b[:, None, :]).any(-1).sum(-1).double() / k
    token = diff.masked_fill(~known, -1.0).argmax(-1)
    sampled_a = logp_a.gather(1, sampled[:, None]).squeeze(1)
    sampled_b = logp_b.gather(1, sampled[:, None]).squeeze(1)
    row_equal = (torch.where(known, logp_a, 0) == torch.where(known, logp_b, 0)).all(-1)
    columns = [kl_ab, kl_ba, tv, tv_hi, overlap, tail_a, tail_b, (argmax_a == argmax_b).double(),
               rank_a.double(), rank_b.double(), token.double(), (sampled_a == sampled_b).double(),
               row_equal.double(), torch.full_like(tv, float(exact))]
    return torch.stack([c.double() for c in columns], dim=1).numpy()


def _merged(rest_p: Any, exact_p: bool, rest_q: Any, exact_q: bool) -> Any:
    """rest_p log(rest_p / rest_q): the merged outcome's KL term (0 where rest_p is 0). A top-K side's
    rest at or below its resolution is 0 as rest_p and the resolution as rest_q (TOP_K_REST_RESOLUTION)."""
    import torch

    if not exact_p:
        rest_p = torch.where(rest_p > TOP_K_REST_RESOLUTION, rest_p, torch.zeros_like(rest_p))
    if not exact_q:
        rest_q = rest_q.clamp(min=TOP_K_REST_RESOLUTION)
    term = rest_p * (rest_p.log() - rest_q.log())
    # Negative only when the rest of p is below the rest of q: a lower bound of 0 is still valid
    # on the merged pair as a whole (KL ≥ 0), but this one term may be negative; kept as is.
    return torch.where(rest_p > 0, term, torch.zeros_like(term))


# What a top-K side's rest (1 − Σ of its float32 probabilities) cannot tell from 0: the rounding of
# that sum. `_merged` reads a rest at or below it as 0 where it is the side measured (the term's lower
# end) and as this much where it is the side divided by, so that rounding never turns a lower bound
# into an infinity or a value the inputs cannot carry.
TOP_K_REST_RESOLUTION = 4 * float(np.finfo(np.float32).eps)


def _rest(side: FullRows | TopRows, logp_CV: Any, known: Any, p: Any) -> tuple[Any, bool]:
    """The side's mass outside the known set [C], and whether it is exact. A full side sums it from
    its own log-probs (1 − Σ_known cancels catastrophically when the known set holds nearly all the
    mass); a top-K side knows only 1 − Σ_known, to TOP_K_REST_RESOLUTION."""
    import torch

    if isinstance(side, FullRows):
        return torch.where(known, torch.zeros_like(p), logp_CV.double().exp()).sum(-1), True
    return (1.0 - p.sum(-1)).clamp(min=0.0), False


def _dense(side: FullRows | TopRows, vocab_size: int) -> tuple[Any, Any]:
    """The side's log-probs over the vocabulary [C, V] (fp32) and which of them it gave [C, V]."""
    import torch

    if isinstance(side, FullRows):
        logp = side.logp_CV.float()
        return logp, torch.ones_like(logp, dtype=torch.bool)
    ids = torch.from_numpy(side.ids_CK.astype(np.int64))
    values = torch.from_numpy(side.logp_CK.astype(np.float32))
    num_rows = ids.shape[0]
    logp = torch.full((num_rows, vocab_size), float("-inf"))
    known = torch.zeros((num_rows, vocab_size), dtype=torch.bool)
    valid = ids >= 0
    rows = torch.arange(num_rows)[:, None].expand_as(ids)
    logp[rows[valid], ids[valid]] = values[valid]
    known[rows[valid], ids[valid]] = True
    return logp, known


def _top(side: FullRows | TopRows, logp_CV: Any, sampled: Any, k: int) -> tuple[Any, Any, Any, Any]:
    """The side's top-K ids [C, K], mass outside them [C], argmax [C] and the sampled token's rank [C]."""
    import torch

    if isinstance(side, FullRows):
        values, ids = logp_CV.topk(k, dim=-1)
        tail = (1.0 - values.double().exp().sum(-1)).clamp(min=0.0)
        sampled_logp = logp_CV.gather(1, sampled[:, None])
        # vLLM counts ties in (x >= value; vllm/v1/sample/ops/logprobs.py, batched_count_greater_than).
        rank = (logp_CV >= sampled_logp).sum(-1)
        return ids, tail, ids[:, 0], rank
    # The engine's top-K is its first k entries by log-prob (the sampled token may be appended).
    values = torch.from_numpy(side.logp_CK.astype(np.float64))
    ids = torch.from_numpy(side.ids_CK.astype(np.int64))
    order = values.masked_fill(ids < 0, float("-inf")).argsort(dim=-1, descending=True)[:, :k]
    top_ids = ids.gather(1, order)
    top_values = values.gather(1, order)
    tail = (1.0 - top_values.exp().sum(-1)).clamp(min=0.0)
    # NaN where the engine reports no rank (SGLang, for a sampled token outside its top-K).
    return top_ids, tail, top_ids[:, 0], torch.from_numpy(side.sampled_rank_C.astype(np.float64))
