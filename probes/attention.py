"""Attention probe: prefill vs decode, chunked prefill, split-KV decode, batch size, kernel and dtype.

Part of `mismatch probe`: the trainer runs one causal prefill over the whole sequence, the
inference engine prefills in chunks and decodes one query at a time over a (split) KV cache.
At the model's head dims (MLA's too) and scale; soft-capped and sliding-window variants where
the config has them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mismatch.probes.result import ProbeResult, dtype_name, measure
from mismatch.probes.shapes import ProbeShapes, randn

FAMILY = "attention"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Sliding-window variants run over window + tokens keys: a 4096-key window would cost minutes on a
# CPU, and what a variation changes (which keys a query sees) is there at any window larger than a tile.
MAX_WINDOW = 256


def expand_kv(kv_BKLd: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Grouped-query KV heads repeated to one per query head (what HF's repeat_kv does)."""
    return kv_BKLd.repeat_interleave(num_heads // kv_BKLd.shape[1], dim=1)


def prefill(q_BHLd: torch.Tensor, k_BKLd: torch.Tensor, v_BKLd: torch.Tensor, *,
            scale: float | None = None) -> torch.Tensor:
    """One causal SDPA over the whole sequence: the trainer's path."""
    num_heads = q_BHLd.shape[1]
    return F.scaled_dot_product_attention(q_BHLd, expand_kv(k_BKLd, num_heads),
                                          expand_kv(v_BKLd, num_heads), is_causal=True, scale=scale)


def decode(q_BHLd: torch.Tensor, k_BKLd: torch.Tensor, v_BKLd: torch.Tensor, *,
           scale: float | None = None) -> torch.Tensor:
    """Each position as a single query over the KV cache up to it: the sampler's path."""
    num_heads = q_BHLd.shape[1]
    k_BHLd, v_BHLd = expand_kv(k_BKLd, num_heads), expand_kv(v_BKLd, num_heads)
    return torch.cat([F.scaled_dot_product_attention(q_BHLd[:, :, t:t + 1], k_BHLd[:, :, :t + 1],
                                                     v_BHLd[:, :, :t + 1], scale=scale)
                      for t in range(q_BHLd.shape[2])], dim=2)


def chunked_prefill(q_BHLd: torch.Tensor, k_BKLd: torch.Tensor, v_BKLd: torch.Tensor,
                    chunk: int, *, scale: float | None = None) -> torch.Tensor:
    """Queries in chunks, each over all keys before its end with a causal mask inside the chunk."""
    num_heads, length = q_BHLd.shape[1], q_BHLd.shape[2]
    k_BHLd, v_BHLd = expand_kv(k_BKLd, num_heads), expand_kv(v_BKLd, num_heads)
    outs = []
    for start in range(0, length, chunk):
        stop = min(start + chunk, length)
        keep_CE = torch.arange(stop, device=q_BHLd.device)[None, :] <= \
            torch.arange(start, stop, device=q_BHLd.device)[:, None]
        outs.append(F.scaled_dot_product_attention(q_BHLd[:, :, start:stop], k_BHLd[:, :, :stop],
                                                   v_BHLd[:, :, :stop], attn_mask=keep_CE, scale=scale))
    return torch.cat(outs, dim=2)


def attend_with_lse(q_BH1d: torch.Tensor, k_BHTd: torch.Tensor, v_BHTd: torch.Tensor, *,
                    scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One KV split's partial attention in fp32 and its log-sum-exp, as flash-decoding computes it."""
    compute = torch.promote_types(q_BH1d.dtype, torch.float32)  # fp64 stays fp64 (tests check the math)
    scale = q_BH1d.shape[-1] ** -0.5 if scale is None else scale
    scores_BH1T = (q_BH1d.to(compute) @ k_BHTd.to(compute).transpose(-1, -2)) * scale
    lse_BH1 = torch.logsumexp(scores_BH1T, dim=-1)
    return torch.exp(scores_BH1T - lse_BH1[..., None]) @ v_BHTd.to(compute), lse_BH1


def split_kv_decode(q_BHLd: torch.Tensor, k_BKLd: torch.Tensor, v_BKLd: torch.Tensor, *,
                    num_splits: int, positions: range, scale: float | None = None) -> torch.Tensor:
    """Decode at `positions`, the KV cache split in `num_splits`, partials merged by log-sum-exp.

    With num_splits=1 it is the same arithmetic in one pass, so a difference is the split alone.
    """
    num_heads = q_BHLd.shape[1]
    k_BHLd, v_BHLd = expand_kv(k_BKLd, num_heads), expand_kv(v_BKLd, num_heads)
    outs = []
    for t in positions:
        q_BH1d = q_BHLd[:, :, t:t + 1]
        parts = [attend_with_lse(q_BH1d, k_part, v_part, scale=scale) for k_part, v_part in
                 zip(k_BHLd[:, :, :t + 1].tensor_split(num_splits, dim=2),
                     v_BHLd[:, :, :t + 1].tensor_split(num_splits, dim=2), strict=True)]
        lse_SBH1 = torch.stack([lse for _, lse in parts])
        weight_SBH1 = torch.exp(lse_SBH1 - torch.logsumexp(lse_SBH1, dim=0))
        out_BH1d = sum(weight_SBH1[i][..., None] * out for i, (out, _) in enumerate(parts))
        outs.append(out_BH1d.to(q_BHLd.dtype))
    return torch.cat(outs, dim=2)


def keep_mask(num_queries: int, num_keys: int, *, window: int | None, device: torch.device) -> torch.Tensor:
    """[queries, keys] True where a query may attend: causal, the queries being the last positions,
    and within `window` keys of the query, itself included (transformers' sliding-window mask)."""
    query_Q1 = torch.arange(num_keys - num_queries, num_keys, device=device)[:, None]
    key_1K = torch.arange(num_keys, device=device)[None, :]
    keep_QK = key_1K <= query_Q1
    return keep_QK if window is None else keep_QK & (query_Q1 - key_1K < window)


def eager(q_BHQd: torch.Tensor, k_BKLd: torch.Tensor, v_BKLd: torch.Tensor, *, scale: float | None = None,
          softcap: float | None = None, window: int | None = None) -> torch.Tensor:
    """HF's eager attention (Gemma-2's with soft-capping): scores in the input dtype, capped there,
    additive mask, softmax in fp32, cast back. Queries are the last positions of the keys."""
    num_heads = q_BHQd.shape[1]
    k_BHLd, v_BHLd = expand_kv(k_BKLd, num_heads), expand_kv(v_BKLd, num_heads)
    scale = q_BHQd.shape[-1] ** -0.5 if scale is None else scale
    scores_BHQL = (q_BHQd @ k_BHLd.transpose(-1, -2)) * scale
    if softcap is not None:
        scores_BHQL = torch.tanh(scores_BHQL / softcap) * softcap
    keep_QL = keep_mask(q_BHQd.shape[2], k_BHLd.shape[2], window=window, device=q_BHQd.device)
    scores_BHQL = scores_BHQL + torch.zeros_like(scores_BHQL).masked_fill(~keep_QL, torch.finfo(scores_BHQL.dtype).min)
    weights_BHQL = torch.softmax(scores_BHQL, dim=-1, dtype=torch.float32).to(q_BHQd.dtype)
    return weights_BHQL @ v_BHLd


def fp32_scores(q_BHQd: torch.Tensor, k_BKLd: torch.Tensor, v_BKLd: torch.Tensor, *, scale: float | None = None,
                softcap: float | None = None, window: int | None = None) -> torch.Tensor:
    """What fused kernels (flash-attn's softcap, vLLM) do: scores, cap and softmax in fp32, one rounding."""
    return eager(q_BHQd.float(), k_BKLd.float(), v_BKLd.float(), scale=scale, softcap=softcap,
                 window=window).to(q_BHQd.dtype)


def windowed_decode(q_BHLd: torch.Tensor, k_BKLd: torch.Tensor, v_BKLd: torch.Tensor, *, scale: float | None,
                    softcap: float | None, window: int | None, positions: range) -> torch.Tensor:
    """Decode at `positions`, each query over only the keys it sees (the last `window` of them when
    the layer slides), as a windowed KV cache holds them: no mask, fewer keys in the reduction."""
    outs = []
    for t in positions:
        first = 0 if window is None else max(0, t + 1 - window)
        outs.append(eager(q_BHLd[:, :, t:t + 1], k_BKLd[:, :, first:t + 1], v_BKLd[:, :, first:t + 1],
                          scale=scale, softcap=softcap))
    return torch.cat(outs, dim=2)


def mla_expanded_prefill(q_BHLe: torch.Tensor, latent_BLr: torch.Tensor, k_rope_BLp: torch.Tensor,
                         w_uk_Hnr: torch.Tensor, w_uv_Hvr: torch.Tensor, *, scale: float) -> torch.Tensor:
    """MLA as transformers runs it: kv_b_proj expands the latent to per-head k_nope and v, the shared
    rotary key is appended to every head's k, then one causal SDPA."""
    num_heads = q_BHLe.shape[1]
    k_nope_BHLn = torch.einsum("blr,hnr->bhln", latent_BLr, w_uk_Hnr)
    k_rope_BHLp = k_rope_BLp[:, None].expand(-1, num_heads, -1, -1)
    v_BHLv = torch.einsum("blr,hvr->bhlv", latent_BLr, w_uv_Hvr)
    return prefill(q_BHLe, torch.cat([k_nope_BHLn, k_rope_BHLp], dim=-1), v_BHLv, scale=scale)


def mla_absorbed_decode(q_BHLe: torch.Tensor, latent_BLr: torch.Tensor, k_rope_BLp: torch.Tensor,
                        w_uk_Hnr: torch.Tensor, w_uv_Hvr: torch.Tensor, *, scale: float) -> torch.Tensor:
    """MLA decode as vLLM and DeepSeek's kernels run it: W_UK folded into the query and W_UV applied
    after, so each query attends over the latent cache itself (kv_lora_rank + rope wide, one "head")."""
    dim_nope = w_uk_Hnr.shape[1]
    q_latent_BHLr = torch.einsum("bhln,hnr->bhlr", q_BHLe[..., :dim_nope], w_uk_Hnr)
    q_BHLc = torch.cat([q_latent_BHLr, q_BHLe[..., dim_nope:]], dim=-1)
    num_heads = q_BHLc.shape[1]
    # One cache row per position, read by every head: keys are latent + rotary key, values the latent.
    keys_BHLc = torch.cat([latent_BLr, k_rope_BLp], dim=-1)[:, None].expand(-1, num_heads, -1, -1)
    values_BHLr = latent_BLr[:, None].expand(-1, num_heads, -1, -1)
    out_latent_BHLr = torch.cat([F.scaled_dot_product_attention(q_BHLc[:, :, t:t + 1], keys_BHLc[:, :, :t + 1],
                                                                values_BHLr[:, :, :t + 1], scale=scale)
                                 for t in range(q_BHLc.shape[2])], dim=2)
    return torch.einsum("bhlr,hvr->bhlv", out_latent_BHLr, w_uv_Hvr)


def attention_dims(shapes: ProbeShapes) -> tuple[int, int, int]:
    """(kv heads, q/k head dim, v head dim): MLA's q/k carry a rotary part its v does not."""
    if shapes.mla is not None:
        return shapes.num_heads, shapes.mla.qk_head_dim, shapes.mla.v_head_dim
    return shapes.num_kv_heads, shapes.head_dim, shapes.head_dim


def op_name(q_BHLd: torch.Tensor, k_BKLd: torch.Tensor, v_BKLd: torch.Tensor | None = None, *,
            kind: str = "sdpa causal") -> str:
    batch, num_heads, length, head_dim = q_BHLd.shape
    name = f"{kind} B={batch} H={num_heads} KV={k_BKLd.shape[1]} L={length} d={head_dim}"
    if v_BKLd is not None and v_BKLd.shape[-1] != head_dim:
        name += f" dv={v_BKLd.shape[-1]}"
    return name


def softcap_probes(q32: torch.Tensor, k32: torch.Tensor, v32: torch.Tensor, shapes: ProbeShapes) -> list[ProbeResult]:
    """Gemma-2's attention logit soft-capping: only eager-style kernels apply it, each rounding differently."""
    cap, scale = shapes.attn_softcap, shapes.attn_scale
    op = op_name(q32, k32, v32, kind=f"eager causal soft-cap {cap:g}")
    results: list[ProbeResult] = []
    for dtype in DTYPES:
        q, k, v = q32.to(dtype), k32.to(dtype), v32.to(dtype)
        name = dtype_name(dtype)
        full = eager(q, k, v, scale=scale, softcap=cap)
        results.append(measure(windowed_decode(q, k, v, scale=scale, softcap=cap, window=None,
                                               positions=range(q.shape[2])), full, family=FAMILY, op=op,
                               source="prefill_decode",
                               variation="decode one query at a time over the KV cache vs one prefill"))
        results.append(measure(full, fp32_scores(q, k, v, scale=scale, softcap=cap), family=FAMILY, op=op,
                               source="rounding",
                               variation=f"scores capped in {name} (HF eager) vs capped in fp32, rounded once "
                                         "(fused soft-cap kernels)"))
        if dtype == torch.float32:
            results.append(measure(prefill(q, k, v, scale=scale), full, family=FAMILY, op=op,
                                   source="implementation", variation="soft-capping dropped (SDPA) vs applied",
                                   note="not rounding: what a kernel that ignores attn_logit_softcapping costs"))
        else:
            results.append(measure(full, eager(q32, k32, v32, scale=scale, softcap=cap).to(dtype), family=FAMILY,
                                   op=op, source="dtype", variation=f"{name} vs fp32 rounded to {name}"))
    return results


def sliding_probes(shapes: ProbeShapes, *, device: torch.device, gen: torch.Generator) -> list[ProbeResult]:
    """Sliding-window layers over more keys than the window: masked prefill vs a windowed KV cache."""
    window, batch = min(shapes.sliding_window, MAX_WINDOW), 4
    length = window + shapes.tokens  # the later queries lose their first keys to the window
    num_kv_heads, qk_dim, v_dim = attention_dims(shapes)
    q32 = randn(batch, shapes.num_heads, length, qk_dim, gen=gen, device=device)
    k32 = randn(batch, num_kv_heads, length, qk_dim, gen=gen, device=device)
    v32 = randn(batch, num_kv_heads, length, v_dim, gen=gen, device=device)
    cap, scale = shapes.attn_softcap, shapes.attn_scale
    kind = f"eager sliding window {window}" + (f" soft-cap {cap:g}" if cap is not None else "")
    op = op_name(q32, k32, v32, kind=kind)
    note = "" if window == shapes.sliding_window else \
        f"the config's window is {shapes.sliding_window}; probed at {window} to keep the probe fast"
    results: list[ProbeResult] = []
    for dtype in DTYPES:
        q, k, v = q32.to(dtype), k32.to(dtype), v32.to(dtype)
        name = dtype_name(dtype)
        full = eager(q, k, v, scale=scale, softcap=cap, window=window)
        positions = range(window, length)  # the queries whose window has slid
        results.append(measure(windowed_decode(q, k, v, scale=scale, softcap=cap, window=window, positions=positions),
                               full[:, :, window:], family=FAMILY, op=op, source="prefill_decode", note=note,
                               variation=f"decode over the last {window} keys only (windowed KV cache) vs masked "
                                         f"prefill (positions {window}..{length - 1})"))
        if cap is None:  # SDPA cannot soft-cap: with a cap there is no SDPA path to compare
            keep_LL = keep_mask(length, length, window=window, device=device)
            sdpa = F.scaled_dot_product_attention(q, expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1]),
                                                  attn_mask=keep_LL, scale=scale)
            results.append(measure(sdpa, full, family=FAMILY, op=op, source="implementation", note=note,
                                   variation="SDPA with the sliding-window mask vs HF eager"))
        if dtype == torch.float32:
            results.append(measure(eager(q, k, v, scale=scale, softcap=cap), full, family=FAMILY, op=op,
                                   source="implementation", variation="window ignored (full causal) vs applied",
                                   note="not rounding: what a kernel that ignores sliding_window costs"))
        else:
            results.append(measure(full, eager(q32, k32, v32, scale=scale, softcap=cap, window=window).to(dtype),
                                   family=FAMILY, op=op, source="dtype", note=note,
                                   variation=f"{name} vs fp32 rounded to {name}"))
    return results


def mla_probes(shapes: ProbeShapes, *, device: torch.device, gen: torch.Generator) -> list[ProbeResult]:
    """MLA's two algorithms for one attention: expanded k/v (the trainer) vs the absorbed latent decode."""
    mla, batch, length = shapes.mla, 4, shapes.tokens
    num_heads = shapes.num_heads
    scale = shapes.attn_scale or mla.qk_head_dim ** -0.5  # both algorithms need the same, stated
    q32 = randn(batch, num_heads, length, mla.qk_head_dim, gen=gen, device=device)
    latent32 = randn(batch, length, mla.kv_lora_rank, gen=gen, device=device)
    k_rope32 = randn(batch, length, mla.qk_rope_head_dim, gen=gen, device=device)
    # kv_b_proj's weight, split per head into its k_nope and v parts.
    w_uk32 = randn(num_heads, mla.qk_nope_head_dim, mla.kv_lora_rank, gen=gen, device=device,
                   scale=mla.kv_lora_rank ** -0.5)
    w_uv32 = randn(num_heads, mla.v_head_dim, mla.kv_lora_rank, gen=gen, device=device,
                   scale=mla.kv_lora_rank ** -0.5)
    op = (f"MLA causal B={batch} H={num_heads} L={length} kv_lora_rank={mla.kv_lora_rank} "
          f"d_nope={mla.qk_nope_head_dim} d_rope={mla.qk_rope_head_dim} dv={mla.v_head_dim}")
    results: list[ProbeResult] = []
    for dtype in DTYPES:
        inputs = [t.to(dtype) for t in (q32, latent32, k_rope32, w_uk32, w_uv32)]
        expanded = mla_expanded_prefill(*inputs, scale=scale)
        results.append(measure(mla_absorbed_decode(*inputs, scale=scale), expanded, family=FAMILY, op=op,
                               source="prefill_decode",
                               variation="decode over the latent cache, W_UK and W_UV absorbed (vLLM MLA) vs "
                                         "expanded k/v prefill (transformers)"))
        if dtype != torch.float32:
            results.append(measure(expanded, mla_expanded_prefill(q32, latent32, k_rope32, w_uk32, w_uv32,
                                                                  scale=scale).to(dtype),
                                   family=FAMILY, op=op, source="dtype",
                                   variation=f"{dtype_name(dtype)} vs fp32 rounded to {dtype_name(dtype)}"))
    return results


def probe_family(shapes: ProbeShapes, *, device: torch.device, gen: torch.Generator) -> list[ProbeResult]:
    batch, length = 4, shapes.tokens
    num_kv_heads, qk_dim, v_dim = attention_dims(shapes)
    scale = shapes.attn_scale
    q32 = randn(batch, shapes.num_heads, length, qk_dim, gen=gen, device=device)
    k32 = randn(batch, num_kv_heads, length, qk_dim, gen=gen, device=device)
    v32 = randn(batch, num_kv_heads, length, v_dim, gen=gen, device=device)
    op = op_name(q32, k32, v32)
    results: list[ProbeResult] = []
    for dtype in DTYPES:
        q, k, v = q32.to(dtype), k32.to(dtype), v32.to(dtype)
        full = prefill(q, k, v, scale=scale)
        alone = torch.cat([prefill(q[b:b + 1], k[b:b + 1], v[b:b + 1], scale=scale) for b in range(batch)])
        results.append(measure(alone, full, family=FAMILY, op=op, source="batch_size",
                               variation=f"each sequence alone vs in a batch of {batch}"))
        results.append(measure(decode(q, k, v, scale=scale), full, family=FAMILY, op=op, source="prefill_decode",
                               variation="decode one query at a time over the KV cache vs one prefill"))
        chunk = length // 4
        results.append(measure(chunked_prefill(q, k, v, chunk, scale=scale), full, family=FAMILY, op=op,
                               source="chunking", variation=f"prefill in chunks of {chunk} vs one prefill"))
        positions = range(length // 2, length)  # long enough that every split holds several keys
        one_pass = split_kv_decode(q, k, v, num_splits=1, positions=positions, scale=scale)
        for num_splits in (2, 4):
            results.append(measure(split_kv_decode(q, k, v, num_splits=num_splits, positions=positions, scale=scale),
                                   one_pass, family=FAMILY, op=op, source="split_kv",
                                   variation=f"decode with KV split in {num_splits}, merged by log-sum-exp "
                                             f"vs one pass (positions {positions.start}..{positions.stop - 1})"))
        results.append(measure(eager(q, k, v, scale=scale), full, family=FAMILY, op=op, source="implementation",
                               variation="HF eager (matmul, fp32 softmax, matmul) vs SDPA"))
        if dtype != torch.float32:
            results.append(measure(full, prefill(q32, k32, v32, scale=scale).to(dtype), family=FAMILY, op=op,
                                   source="dtype",
                                   variation=f"{dtype_name(dtype)} SDPA vs fp32 SDPA rounded to {dtype_name(dtype)}"))
    if shapes.attn_softcap is not None:
        results.extend(softcap_probes(q32, k32, v32, shapes))
    if shapes.sliding_window is not None:
        results.extend(sliding_probes(shapes, device=device, gen=gen))
    if shapes.mla is not None:
        results.extend(mla_probes(shapes, device=device, gen=gen))
    return results
