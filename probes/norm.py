"""RMSNorm probe: batch size, variance reduction order and precision, and where the result is rounded.

Part of `mismatch probe`: HF rounds the normalized input to the model dtype *before* the weight
multiply; fused inference kernels multiply in fp32 and round once — a classic bitwise difference.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from mismatch.probes.result import ProbeResult, dtype_name, measure
from mismatch.probes.shapes import ProbeShapes, randn

FAMILY = "norm"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
EPS = 1e-5

VarianceFn = Callable[[torch.Tensor], torch.Tensor]  # fp32 [N, D] -> fp32 [N, 1]


def mean_square(h_ND: torch.Tensor) -> torch.Tensor:
    return h_ND.pow(2).mean(-1, keepdim=True)


def block_sums(x_ND: torch.Tensor, num_blocks: int) -> torch.Tensor:
    return torch.stack([block.sum(-1) for block in x_ND.tensor_split(num_blocks, dim=-1)], dim=-1)


def blocked_mean_square(num_blocks: int) -> VarianceFn:
    """Sum of squares in `num_blocks` blocks, then over blocks: another reduction order."""
    def variance(h_ND: torch.Tensor) -> torch.Tensor:
        return block_sums(h_ND.pow(2), num_blocks).sum(-1, keepdim=True) / h_ND.shape[-1]
    return variance


def reversed_mean_square(h_ND: torch.Tensor) -> torch.Tensor:
    return h_ND.flip(-1).pow(2).mean(-1, keepdim=True)


def low_precision_mean_square(dtype: torch.dtype, num_blocks: int) -> VarianceFn:
    """Block sums and the running total rounded to `dtype`: low-precision partial sums."""
    def variance(h_ND: torch.Tensor) -> torch.Tensor:
        block_sums_NB = block_sums(h_ND.pow(2), num_blocks).to(dtype)
        total_N = block_sums_NB[:, 0]
        for block in range(1, num_blocks):
            total_N = (total_N.float() + block_sums_NB[:, block].float()).to(dtype)
        return (total_N.float() / h_ND.shape[-1])[:, None]
    return variance


def rms_norm_hf(x_ND: torch.Tensor, w_D: torch.Tensor, variance: VarianceFn = mean_square) -> torch.Tensor:
    """transformers' LlamaRMSNorm: fp32 statistics, rounded to the input dtype, then times weight."""
    h_ND = x_ND.float()
    h_ND = h_ND * torch.rsqrt(variance(h_ND) + EPS)
    return w_D * h_ND.to(x_ND.dtype)


def rms_norm_round_once(x_ND: torch.Tensor, w_D: torch.Tensor) -> torch.Tensor:
    """What fused inference kernels do: weight multiplied in fp32, one rounding at the end."""
    h_ND = x_ND.float()
    return (h_ND * torch.rsqrt(mean_square(h_ND) + EPS) * w_D.float()).to(x_ND.dtype)


def rms_norm_no_upcast(x_ND: torch.Tensor, w_D: torch.Tensor) -> torch.Tensor:
    """Everything in the input dtype, no fp32 statistics: a naive low-precision implementation."""
    return w_D * (x_ND * torch.rsqrt(x_ND.pow(2).mean(-1, keepdim=True) + EPS))


def in_row_blocks(x_ND: torch.Tensor, w_D: torch.Tensor, rows_per_call: int) -> torch.Tensor:
    return torch.cat([rms_norm_hf(x_ND[start:start + rows_per_call], w_D)
                      for start in range(0, x_ND.shape[0], rows_per_call)])


def batch_invariance(x_ND: torch.Tensor, w_D: torch.Tensor, *, rows_per_call: int, op: str) -> ProbeResult:
    num_rows = x_ND.shape[0]
    if rows_per_call == 1:
        source, variation = "batch_size", f"each row alone vs in a batch of {num_rows}"
    else:
        source, variation = "chunking", f"rows in calls of {rows_per_call} vs one call of {num_rows}"
    return measure(in_row_blocks(x_ND, w_D, rows_per_call), rms_norm_hf(x_ND, w_D), family=FAMILY,
                   op=op, variation=variation, source=source)


def probe_family(shapes: ProbeShapes, *, device: torch.device, gen: torch.Generator) -> list[ProbeResult]:
    num_rows, hidden = shapes.tokens, shapes.hidden
    x32 = randn(num_rows, hidden, gen=gen, device=device, scale=3.0)  # residual streams are not unit-scale
    w32 = 1.0 + randn(hidden, gen=gen, device=device, scale=0.1)
    op = f"rms_norm N={num_rows} D={hidden}"
    results: list[ProbeResult] = []
    for dtype in DTYPES:
        x, w = x32.to(dtype), w32.to(dtype)
        name = dtype_name(dtype)
        for rows_per_call in (1, num_rows // 4):
            results.append(batch_invariance(x, w, rows_per_call=rows_per_call, op=op))
        results.append(measure(F.rms_norm(x, (hidden,), w, eps=EPS), rms_norm_hf(x, w), family=FAMILY,
                               op=op, source="implementation",
                               variation="torch F.rms_norm vs transformers LlamaRMSNorm"))
        if dtype == torch.float32:
            for label, variance in (("in 4 blocks", blocked_mean_square(4)),
                                    ("in reversed order", reversed_mean_square)):
                results.append(measure(rms_norm_hf(x, w, variance), rms_norm_hf(x, w), family=FAMILY,
                                       op=op, source="reduction_order",
                                       variation=f"sum of squares {label} vs torch mean"))
            continue
        results.append(measure(F.rms_norm(x, (hidden,), w, eps=EPS), rms_norm_round_once(x, w), family=FAMILY,
                               op=op, source="implementation",
                               variation=f"torch F.rms_norm vs fp32 throughout, rounded to {name} once"))
        results.append(measure(rms_norm_hf(x, w, low_precision_mean_square(dtype, 8)), rms_norm_hf(x, w),
                               family=FAMILY, op=op, source="accumulation",
                               variation=f"sum of squares in 8 partial sums rounded to {name} vs fp32"))
        results.append(measure(rms_norm_hf(x, w), rms_norm_round_once(x, w), family=FAMILY, op=op,
                               source="rounding",
                               variation=f"round to {name} before weight multiply (HF) vs once at the end (fused)"))
        results.append(measure(rms_norm_no_upcast(x, w), rms_norm_hf(x, w), family=FAMILY, op=op,
                               source="rounding",
                               variation=f"every intermediate in {name} vs fp32 statistics (HF)"))
        results.append(measure(rms_norm_hf(x, w), rms_norm_hf(x32, w32).to(dtype), family=FAMILY, op=op,
                               source="dtype",
                               variation=f"{name} input and weight vs fp32 rounded to {name}"))
    return results
