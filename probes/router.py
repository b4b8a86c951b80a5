"""Router probe: an MoE router's logits -> scores -> top-k experts, under batch, chunking and dtype.

Part of `mismatch probe` for MoE models: a score that moves by one ulp can send a token to another
expert, and then its whole MLP output changes; each result counts the tokens whose selection flips.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from mismatch.probes.result import ProbeResult, dtype_name, measure
from mismatch.probes.shapes import MoEShapes, ProbeShapes, randn
from mismatch.probes.ulp import ulp_diff

FAMILY = "router"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TOKENS_PER_ROW = 8  # a flip rate is a proportion: 64 tokens would resolve it only in steps of 1.6%


def scores(logits_NE: torch.Tensor, moe: MoEShapes) -> torch.Tensor:
    """What top-k reads, in fp32 whatever the logits' dtype (transformers and vLLM both upcast)."""
    logits_NE = logits_NE.float()
    return torch.sigmoid(logits_NE) if moe.scoring == "sigmoid" else torch.softmax(logits_NE, dim=-1)


def select(scores_NE: torch.Tensor, moe: MoEShapes, bias_E: torch.Tensor | None = None) -> torch.Tensor:
    """Each token's top-k expert ids, sorted: a set, since the order within the k does not route.

    DeepSeek-V3 (transformers' DeepseekV3TopkRouter): a bias that picks but does not weigh, and
    only the topk_groups groups with the largest sum of their two best scores are eligible.
    """
    choice_NE = scores_NE if bias_E is None else scores_NE + bias_E
    if moe.num_groups > 1:
        num_tokens, per_group = choice_NE.shape[0], moe.num_experts // moe.num_groups
        grouped_NGX = choice_NE.view(num_tokens, moe.num_groups, per_group)
        group_scores_NG = grouped_NGX.topk(min(2, per_group), dim=-1).values.sum(-1)
        kept_NG = torch.zeros_like(group_scores_NG, dtype=torch.bool).scatter_(
            1, group_scores_NG.topk(moe.topk_groups, dim=-1).indices, True)
        choice_NE = choice_NE.masked_fill(~kept_NG.repeat_interleave(per_group, dim=1), float("-inf"))
    return choice_NE.topk(moe.top_k, dim=-1).indices.sort(dim=-1).values


def compare(logits_NE: torch.Tensor, baseline_NE: torch.Tensor, moe: MoEShapes, bias_E: torch.Tensor | None, *,
            op: str, variation: str, source: str, note: str = "") -> ProbeResult:
    """The scores compared bit for bit (fp32), and the tokens whose top-k set differs."""
    scores_NE, baseline_scores_NE = scores(logits_NE, moe), scores(baseline_NE, moe)
    flipped_N = (select(scores_NE, moe, bias_E) != select(baseline_scores_NE, moe, bias_E)).any(-1)
    result = measure(scores_NE, baseline_scores_NE, family=FAMILY, op=op, variation=variation, source=source,
                     note=note)
    return dataclasses.replace(result, num_flipped=int(flipped_N.sum()), flipped_frac=float(flipped_N.double().mean()))


def in_row_blocks(x_ND: torch.Tensor, w_ED: torch.Tensor, rows_per_call: int) -> torch.Tensor:
    return torch.cat([F.linear(x_ND[start:start + rows_per_call], w_ED)
                      for start in range(0, x_ND.shape[0], rows_per_call)])


def near_ties(x_ND: torch.Tensor, w_ED: torch.Tensor, top_k: int, *, gap_ulps: int = 2) -> torch.Tensor:
    """x moved, per token, until its k-th and (k+1)-th router logits are `gap_ulps` fp32 ulps apart.

    In float64: x steps along w_a - w_b, which moves the two logits toward each other and the others
    a little; repeated, so the pair is again the one at the top-k boundary. Rounding x to fp32 at
    the end leaves the gap at a few ulps (the probe reports the gap it got).
    """
    x_ND, w_ED = x_ND.double(), w_ED.double()
    for _ in range(4):
        top_NK = (x_ND @ w_ED.T).topk(top_k + 1, dim=-1)
        logit_a_N, logit_b_N = top_NK.values[:, top_k - 1], top_NK.values[:, top_k]
        step_ND = w_ED[top_NK.indices[:, top_k - 1]] - w_ED[top_NK.indices[:, top_k]]
        target_N = gap_ulps * torch.finfo(torch.float32).eps * logit_a_N.abs()
        x_ND = x_ND - ((logit_a_N - logit_b_N - target_N) / step_ND.pow(2).sum(-1))[:, None] * step_ND
    return x_ND.float()


def boundary_gap_ulps(scores_NE: torch.Tensor, top_k: int) -> torch.Tensor:
    """Per token, how many fp32 ulps apart the k-th and (k+1)-th scores are."""
    top_NK = scores_NE.topk(top_k + 1, dim=-1).values
    return ulp_diff(top_NK[:, top_k - 1].contiguous(), top_NK[:, top_k].contiguous())


def op_name(moe: MoEShapes, num_tokens: int, hidden: int, *, ungrouped: bool = False) -> str:
    routing = moe.scoring
    if moe.num_groups > 1 and not ungrouped:
        routing += f", best {moe.topk_groups} of {moe.num_groups} groups"
    if moe.scoring == "sigmoid" and not ungrouped:
        routing += ", selection bias"
    return f"router top-{moe.top_k} of {moe.num_experts} ({routing}) N={num_tokens} D={hidden}"


def near_tie_probes(x32: torch.Tensor, w32: torch.Tensor, moe: MoEShapes) -> list[ProbeResult]:
    """Tokens whose k-th and (k+1)-th experts are a few ulps apart: how often does each variation flip
    them? Plain top-k (no groups, no bias), so a tie in logits is a tie in what top-k reads."""
    plain = dataclasses.replace(moe, num_groups=1, topk_groups=1)
    x_tied = near_ties(x32, w32, moe.top_k)
    reference = F.linear(x_tied, w32)
    gap = boundary_gap_ulps(scores(reference, plain), moe.top_k)
    note = f"fp32 reference's k-th vs (k+1)-th score: median {int(gap.median())} ulps apart, max {int(gap.max())}"
    op = "near-tie " + op_name(plain, x32.shape[0], x32.shape[1], ungrouped=True)
    results = [compare(reference, F.linear(x_tied, w32), plain, None, op=op, source="implementation", note=note,
                       variation="fp32 router vs the same fp32 router again (control: must not flip)"),
               compare(in_row_blocks(x_tied, w32, 1), reference, plain, None, op=op, source="batch_size", note=note,
                       variation=f"fp32, each token alone vs in a batch of {x32.shape[0]}")]
    for dtype in DTYPES[1:]:
        results.append(compare(F.linear(x_tied.to(dtype), w32.to(dtype)), reference, plain, None, op=op,
                               source="dtype", note=note,
                               variation=f"router GEMM in {dtype_name(dtype)} vs fp32"))
    return results


def probe_family(shapes: ProbeShapes, *, device: torch.device, gen: torch.Generator) -> list[ProbeResult]:
    moe = shapes.moe
    if moe is None:
        return []
    num_tokens = TOKENS_PER_ROW * shapes.tokens
    x32 = randn(num_tokens, shapes.hidden, gen=gen, device=device)
    w32 = randn(moe.num_experts, shapes.hidden, gen=gen, device=device, scale=shapes.hidden ** -0.5)
    # A trained DeepSeek-V3 router's selection bias is not zero; a zero one would hide its effect.
    bias_E = randn(moe.num_experts, gen=gen, device=device, scale=0.02) if moe.scoring == "sigmoid" else None
    op = op_name(moe, num_tokens, shapes.hidden)
    reference = F.linear(x32, w32)
    results: list[ProbeResult] = []
    for dtype in DTYPES:
        x, w, name = x32.to(dtype), w32.to(dtype), dtype_name(dtype)
        batched = F.linear(x, w)
        for rows_per_call in (1, num_tokens // 4):
            source, variation = (("batch_size", f"{name} logits, each token alone vs in a batch of {num_tokens}")
                                 if rows_per_call == 1 else
                                 ("chunking", f"{name} logits, tokens in calls of {rows_per_call} vs one call"))
            results.append(compare(in_row_blocks(x, w, rows_per_call), batched, moe, bias_E, op=op,
                                   variation=variation, source=source))
        if dtype == torch.float32:
            continue
        results.append(compare(batched, reference, moe, bias_E, op=op, source="dtype",
                               variation=f"router GEMM in {name} vs fp32"))
        # DeepSeek-V3 in transformers: the GEMM in fp32, but on the residual stream the model's dtype left.
        results.append(compare(F.linear(x.float(), w.float()), reference, moe, bias_E, op=op, source="rounding",
                               variation=f"fp32 router GEMM on inputs and weights rounded to {name} vs fp32"))
    results.extend(near_tie_probes(x32, w32, moe))
    return results
