"""Attention probe: prefill vs decode, chunked prefill, split-KV decode, batch size, kernel and dtype.

Part of `mismatch probe`: the trainer runs one causal prefill over the whole sequence, the
inference engine prefills in chunks and decodes one query at a time over a (split) KV cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from probes.result import ProbeResult, dtype_name, measure
from probes.shapes import ProbeShapes, randn

FAMILY = "attention"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def expand_kv(kv_BKLd: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Grouped-query KV heads repeated to one per query head (what HF's repeat_kv does)."""
    return kv_BKLd.repeat_interleave(num_heads // kv_BKLd.shape[1], dim=1)


def prefill(q_BHLd: torch.Tensor, k_BKLd: torch.Tensor, v_BKLd: torch.Tensor) -> torch.Tensor:
    """One causal SDPA over the whole sequence: the trainer's path."""
    num_heads = q_BHLd.shape[1]
    return F.scaled_dot_product_attention(q_BHLd, expand_kv(k_BKLd, num_heads),
                                          expand_kv(v_BKLd, num_heads), is_causal=True)


def decode(q_BHLd: torch.Tensor, k_BKLd: torch.Tensor, v_BKLd: torch.Tensor) -> torch.Tensor:
    """Each position as a single query over the KV cache up to it: the sampler's path."""
    num_heads = q_BHLd.shape[1]
    k_BHLd, v_BHLd = expand_kv(k_BKLd, num_heads), expand_kv(v_BKLd, num_heads)
    return torch.cat([F.scaled_dot_product_attention(q_BHLd[:, :, t:t + 1], k_BHLd[:, :, :t + 1],
                                                     v_BHLd[:, :, :t + 1])
                      for t in range(q_BHLd.shape[2])], dim=2)


def chunked_prefill(q_BHLd: torch.Tensor, k_BKLd: torch.Tensor, v_BKLd: torch.Tensor,
                    chunk: int) -> torch.Tensor:
    """Queries in chunks, each over all keys before its end with a causal mask inside the chunk."""
    num_heads, length = q_BHLd.shape[1], q_BHLd.shape[2]
    k_BHLd, v_BHLd = expand_kv(k_BKLd, num_heads), expand_kv(v_BKLd, num_heads)
    outs = []
    for start in range(0, length, chunk):
        stop = min(start + chunk, length)
        keep_CE = torch.arange(stop, device=q_BHLd.device)[None, :] <= \
            torch.arange(start, stop, device=q_BHLd.device)[:, None]
        outs.append(F.scaled_dot_product_attention(q_BHLd[:, :, start:stop], k_BHLd[:, :, :stop],
                                                   v_BHLd[:, :, :stop], attn_mask=keep_CE))
    return torch.cat(outs, dim=2)


def attend_with_lse(q_BH1d: torch.Tensor, k_BHTd: torch.Tensor,
                    v_BHTd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One KV split's partial attention in fp32 and its log-sum-exp, as flash-decoding computes it."""
    compute = torch.promote_types(q_BH1d.dtype, torch.float32)  # fp64 stays fp64 (tests check the math)
    scores_BH1T = (q_BH1d.to(compute) @ k_BHTd.to(compute).transpose(-1, -2)) * q_BH1d.shape[-1] ** -0.5
    lse_BH1 = torch.logsumexp(scores_BH1T, dim=-1)
    return torch.exp(scores_BH1T - lse_BH1[..., None]) @ v_BHTd.to(compute), lse_BH1


def split_kv_decode(q_BHLd: torch.Tensor, k_BKLd: torch.Tensor, v_BKLd: torch.Tensor, *,
                    num_splits: int, positions: range) -> torch.Tensor:
    """Decode at `positions`, the KV cache split in `num_splits`, partials merged by log-sum-exp.

    With num_splits=1 it is the same arithmetic in one pass, so a difference is the split alone.
    """
    num_heads = q_BHLd.shape[1]
    k_BHLd, v_BHLd = expand_kv(k_BKLd, num_heads), expand_kv(v_BKLd, num_heads)
    outs = []
    for t in positions:
        q_BH1d = q_BHLd[:, :, t:t + 1]
        parts = [attend_with_lse(q_BH1d, k_part, v_part) for k_part, v_part in
                 zip(k_BHLd[:, :, :t + 1].tensor_split(num_splits, dim=2),
                     v_BHLd[:, :, :t + 1].tensor_split(num_splits, dim=2), strict=True)]
        lse_SBH1 = torch.stack([lse for _, lse in parts])
        weight_SBH1 = torch.exp(lse_SBH1 - torch.logsumexp(lse_SBH1, dim=0))
        out_BH1d = sum(weight_SBH1[i][..., None] * out for i, (out, _) in enumerate(parts))
        outs.append(out_BH1d.to(q_BHLd.dtype))
    return torch.cat(outs, dim=2)


def eager(q_BHLd: torch.Tensor, k_BKLd: torch.Tensor, v_BKLd: torch.Tensor) -> torch.Tensor:
    """HF's eager attention: scores in the input dtype, additive mask, softmax in fp32, cast back."""
    num_heads, length = q_BHLd.shape[1], q_BHLd.shape[2]
    k_BHLd, v_BHLd = expand_kv(k_BKLd, num_heads), expand_kv(v_BKLd, num_heads)
    scores_BHLL = (q_BHLd @ k_BHLd.transpose(-1, -2)) * q_BHLd.shape[-1] ** -0.5
    future_LL = torch.ones(length, length, dtype=torch.bool, device=q_BHLd.device).triu(1)
    scores_BHLL = scores_BHLL + torch.zeros_like(scores_BHLL).masked_fill(
        future_LL, torch.finfo(scores_BHLL.dtype).min)
    weights_BHLL = torch.softmax(scores_BHLL, dim=-1, dtype=torch.float32).to(q_BHLd.dtype)
    return weights_BHLL @ v_BHLd


def op_name(q_BHLd: torch.Tensor, k_BKLd: torch.Tensor) -> str:
    batch, num_heads, length, head_dim = q_BHLd.shape
    return f"sdpa causal B={batch} H={num_heads} KV={k_BKLd.shape[1]} L={length} d={head_dim}"


def run(shapes: ProbeShapes, *, device: torch.device, gen: torch.Generator) -> list[ProbeResult]:
    batch, length = 4, shapes.tokens
    q32 = randn(batch, shapes.num_heads, length, shapes.head_dim, gen=gen, device=device)
    k32 = randn(batch, shapes.num_kv_heads, length, shapes.head_dim, gen=gen, device=device)
    v32 = randn(batch, shapes.num_kv_heads, length, shapes.head_dim, gen=gen, device=device)
    op = op_name(q32, k32)
    results: list[ProbeResult] = []
    for dtype in DTYPES:
        q, k, v = q32.to(dtype), k32.to(dtype), v32.to(dtype)
        full = prefill(q, k, v)
        alone = torch.cat([prefill(q[b:b + 1], k[b:b + 1], v[b:b + 1]) for b in range(batch)])
        results.append(measure(alone, full, family=FAMILY, op=op, source="batch_size",
                               variation=f"each sequence alone vs in a batch of {batch}"))
        results.append(measure(decode(q, k, v), full, family=FAMILY, op=op, source="prefill_decode",
                               variation="decode one query at a time over the KV cache vs one prefill"))
        chunk = length // 4
        results.append(measure(chunked_prefill(q, k, v, chunk), full, family=FAMILY, op=op,
                               source="chunking", variation=f"prefill in chunks of {chunk} vs one prefill"))
        positions = range(length // 2, length)  # long enough that every split holds several keys
        one_pass = split_kv_decode(q, k, v, num_splits=1, positions=positions)
        for num_splits in (2, 4):
            results.append(measure(split_kv_decode(q, k, v, num_splits=num_splits, positions=positions),
                                   one_pass, family=FAMILY, op=op, source="split_kv",
                                   variation=f"decode with KV split in {num_splits}, merged by log-sum-exp "
                                             f"vs one pass (positions {positions.start}..{positions.stop - 1})"))
        results.append(measure(eager(q, k, v), full, family=FAMILY, op=op, source="implementation",
                               variation="HF eager (matmul, fp32 softmax, matmul) vs SDPA"))
        if dtype != torch.float32:
            results.append(measure(full, prefill(q32, k32, v32).to(dtype), family=FAMILY, op=op,
                                   source="dtype",
                                   variation=f"{dtype_name(dtype)} SDPA vs fp32 SDPA rounded to {dtype_name(dtype)}"))
    return results
