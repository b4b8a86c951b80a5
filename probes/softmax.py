"""Softmax / log_softmax probe over the vocabulary: batch, vocab sharding, precision, logit rounding.

Part of `mismatch probe`: the realized token's log-prob is the last op of both paths; trainers
upcast bf16 logits to fp32, engines may shard the vocab (tensor parallel) or keep bf16. Gemma's
final logit soft-cap, where the config has one, is one more rounding in the model dtype.
"""

from __future__ import annotations

import torch

from mismatch.probes.result import ProbeResult, dtype_name, measure
from mismatch.probes.shapes import ProbeShapes, randn

FAMILY = "softmax"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def in_row_blocks(logits_NV: torch.Tensor, rows_per_call: int) -> torch.Tensor:
    return torch.cat([torch.log_softmax(logits_NV[start:start + rows_per_call], dim=-1)
                      for start in range(0, logits_NV.shape[0], rows_per_call)])


def batch_invariance(logits_NV: torch.Tensor, *, rows_per_call: int, op: str) -> ProbeResult:
    num_rows = logits_NV.shape[0]
    if rows_per_call == 1:
        source, variation = "batch_size", f"each row alone vs in a batch of {num_rows}"
    else:
        source, variation = "chunking", f"rows in calls of {rows_per_call} vs one call of {num_rows}"
    return measure(in_row_blocks(logits_NV, rows_per_call), torch.log_softmax(logits_NV, dim=-1),
                   family=FAMILY, op=op, variation=variation, source=source)


def sharded_log_softmax(logits_NV: torch.Tensor, num_shards: int) -> torch.Tensor:
    """Vocab split across shards (tensor parallel): per-shard log-sum-exp, merged, then subtracted."""
    x_NV = logits_NV.to(torch.promote_types(logits_NV.dtype, torch.float32))
    lse_NS = torch.stack([torch.logsumexp(shard, dim=-1) for shard in x_NV.tensor_split(num_shards, dim=-1)],
                         dim=-1)
    return (x_NV - torch.logsumexp(lse_NS, dim=-1, keepdim=True)).to(logits_NV.dtype)


def low_precision_sum_exp(logits_NV: torch.Tensor, dtype: torch.dtype, num_blocks: int) -> torch.Tensor:
    """log_softmax in fp32 except that the sum of exp is kept in `dtype` partial sums."""
    x_NV = logits_NV.float()
    max_N1 = x_NV.max(dim=-1, keepdim=True).values
    exp_NV = torch.exp(x_NV - max_N1)
    total_N = None
    for block in exp_NV.tensor_split(num_blocks, dim=-1):
        part_N = block.sum(-1).to(dtype)
        total_N = part_N if total_N is None else (total_N.float() + part_N.float()).to(dtype)
    return (x_NV - max_N1 - torch.log(total_N.float())[:, None]).to(dtype)


def probe_family(shapes: ProbeShapes, *, device: torch.device, gen: torch.Generator) -> list[ProbeResult]:
    num_rows, vocab = shapes.tokens, shapes.vocab
    logits32 = randn(num_rows, vocab, gen=gen, device=device, scale=4.0)  # peaky, like a trained model
    op = f"log_softmax N={num_rows} V={vocab}"
    results: list[ProbeResult] = []
    for dtype in DTYPES:
        logits = logits32.to(dtype)
        name = dtype_name(dtype)
        for rows_per_call in (1, num_rows // 4):
            results.append(batch_invariance(logits, rows_per_call=rows_per_call, op=op))
        if dtype == torch.float32:
            # fp32 only: in 16-bit dtypes small probabilities underflow and log(softmax) is -inf.
            results.append(measure(torch.softmax(logits, dim=-1).log(), torch.log_softmax(logits, dim=-1),
                                   family=FAMILY, op=op, source="implementation",
                                   variation="log(softmax(x)) vs log_softmax(x)"))
            for num_shards in (2, 4):
                results.append(measure(sharded_log_softmax(logits, num_shards), torch.log_softmax(logits, dim=-1),
                                       family=FAMILY, op=op, source="reduction_order",
                                       variation=f"vocab in {num_shards} shards merged by log-sum-exp vs one pass"))
            continue
        native = torch.log_softmax(logits, dim=-1)
        fp32_on_same = torch.log_softmax(logits.float(), dim=-1)
        results.append(measure(native, fp32_on_same.to(dtype), family=FAMILY, op=op, source="accumulation",
                               variation=f"native {name} log_softmax vs fp32 on the same values, rounded once"))
        results.append(measure(low_precision_sum_exp(logits, dtype, 8), fp32_on_same.to(dtype), family=FAMILY,
                               op=op, source="accumulation",
                               variation=f"sum of exp in 8 partial sums rounded to {name} vs fp32"))
        # The trainer's path: lm_head emits logits in the model dtype, log_softmax runs in fp32 on them.
        results.append(measure(fp32_on_same, torch.log_softmax(logits32, dim=-1), family=FAMILY, op=op,
                               source="rounding",
                               variation=f"logits rounded to {name} before an fp32 log_softmax vs fp32 logits"))
        results.append(measure(native, torch.log_softmax(logits32, dim=-1).to(dtype), family=FAMILY, op=op,
                               source="dtype", variation=f"{name} log_softmax vs fp32 rounded to {name}"))
        if shapes.final_softcap is not None:
            results.append(final_softcap_rounding(logits, shapes.final_softcap))
    return results


def softcap(logits_NV: torch.Tensor, cap: float) -> torch.Tensor:
    """Gemma's final_logit_softcapping, in the logits' own dtype as transformers computes it."""
    return torch.tanh(logits_NV / cap) * cap


def final_softcap_rounding(logits_NV: torch.Tensor, cap: float) -> ProbeResult:
    """The cap on the lm_head's low-precision logits (transformers) vs on their fp32 upcast, each then
    through an fp32 log_softmax: tanh's rounding in the model dtype is all that differs."""
    name = dtype_name(logits_NV.dtype)
    return measure(torch.log_softmax(softcap(logits_NV, cap).float(), dim=-1),
                   torch.log_softmax(softcap(logits_NV.float(), cap), dim=-1), family=FAMILY,
                   op=f"soft-cap {cap:g} then log_softmax N={logits_NV.shape[0]} V={logits_NV.shape[1]}",
                   source="rounding", variation=f"logits capped in {name} vs capped in fp32, fp32 log_softmax")
