"""Reduction probe: sum/mean order and precision, and fused multiply-add vs separate multiply and add.

Part of `mismatch probe`: every norm, softmax and matmul ends in a reduction; this isolates the
order, the partial-sum precision and the FMA question on plain tensors of the model's widths.
"""

from __future__ import annotations

import torch

from mismatch.probes.result import ProbeResult, dtype_name, measure
from mismatch.probes.shapes import ProbeShapes, randn

FAMILY = "reductions"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def sequential_sum(x_ND: torch.Tensor, *, reverse: bool = False) -> torch.Tensor:
    """Left-to-right (or right-to-left) sum, one rounding to x's dtype after every add."""
    columns = range(x_ND.shape[1] - 1, -1, -1) if reverse else range(x_ND.shape[1])
    total_N = torch.zeros(x_ND.shape[0], dtype=x_ND.dtype, device=x_ND.device)
    for j in columns:
        total_N = total_N + x_ND[:, j]
    return total_N


def blocked_sum(x_ND: torch.Tensor, num_blocks: int) -> torch.Tensor:
    return torch.stack([block.sum(-1) for block in x_ND.tensor_split(num_blocks, dim=-1)], dim=-1).sum(-1)


def exact_sum(x_ND: torch.Tensor) -> torch.Tensor:
    """fp64 sum rounded once to x's dtype: correctly rounded for any width a model has."""
    return x_ND.double().sum(-1).to(x_ND.dtype)


def fma_reference(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """a*b + c with a single rounding: the fp64 product of two fp32 values is exact."""
    return (a.double() * b.double() + c.double()).to(a.dtype)


def probe_family(shapes: ProbeShapes, *, device: torch.device, gen: torch.Generator) -> list[ProbeResult]:
    num_rows = shapes.tokens
    results: list[ProbeResult] = []
    for width in sorted({shapes.hidden, shapes.mlp_intermediate}):
        x32 = randn(num_rows, width, gen=gen, device=device)
        op = f"sum N={num_rows} D={width}"
        for dtype in DTYPES:
            x = x32.to(dtype)
            name = dtype_name(dtype)
            alone = torch.cat([x[i:i + 1].sum(-1) for i in range(num_rows)])
            results.append(measure(alone, x.sum(-1), family=FAMILY, op=op, source="batch_size",
                                   variation=f"each row alone vs in a batch of {num_rows}"))
            results.append(measure(x.mean(-1), x.sum(-1) / width, family=FAMILY, op=f"mean N={num_rows} D={width}",
                                   source="implementation", variation="x.mean() vs x.sum() / D"))
            results.append(measure(x.sum(-1), exact_sum(x), family=FAMILY, op=op, source="reduction_order",
                                   variation=f"torch {name} sum vs correctly rounded (fp64) sum"))
            results.append(measure(x.flip(-1).sum(-1), x.sum(-1), family=FAMILY, op=op, source="reduction_order",
                                   variation="reversed element order vs torch order"))
            results.append(measure(blocked_sum(x, 4), x.sum(-1), family=FAMILY, op=op, source="reduction_order",
                                   variation="4 block sums then their sum vs torch order"))
            results.append(measure(sequential_sum(x), sequential_sum(x, reverse=True), family=FAMILY, op=op,
                                   source="reduction_order",
                                   variation=f"left-to-right vs right-to-left, rounded to {name} each add"))
            if dtype != torch.float32:
                results.append(measure(sequential_sum(x), x.float().sum(-1).to(dtype), family=FAMILY, op=op,
                                       source="accumulation",
                                       variation=f"running sum in {name} vs fp32 accumulate, round once"))
                results.append(measure(x.sum(-1), x.float().sum(-1).to(dtype), family=FAMILY, op=op,
                                       source="accumulation",
                                       variation=f"native {name} sum vs fp32 sum of the same values, round once"))
                results.append(measure(x.sum(-1), x32.sum(-1).to(dtype), family=FAMILY, op=op, source="dtype",
                                       variation=f"{name} sum vs fp32 sum rounded to {name}"))
    results.extend(fma_probes(shapes, device=device, gen=gen))
    return results


def fma_probes(shapes: ProbeShapes, *, device: torch.device, gen: torch.Generator) -> list[ProbeResult]:
    """Fused (one rounding) vs separate multiply and add, elementwise and inside a dot product."""
    num_rows, width = shapes.tokens, shapes.hidden
    a32, b32, c32 = (randn(num_rows, width, gen=gen, device=device) for _ in range(3))
    op = f"a*b+c N={num_rows} D={width}"
    results: list[ProbeResult] = []
    for dtype in DTYPES:
        a, b, c = a32.to(dtype), b32.to(dtype), c32.to(dtype)
        results.append(measure(torch.addcmul(c, a, b), a * b + c, family=FAMILY, op=op, source="fma",
                               variation="torch.addcmul(c, a, b) vs a * b + c"))
        if dtype == torch.float32:
            results.append(measure(torch.addcmul(c, a, b), fma_reference(a, b, c), family=FAMILY, op=op,
                                   source="fma", variation="torch.addcmul vs true FMA (one rounding)"))
            results.append(measure(a * b + c, fma_reference(a, b, c), family=FAMILY, op=op, source="fma",
                                   variation="a * b + c vs true FMA (one rounding)"))
        dot_op = f"row dot N={num_rows} D={width}"
        results.append(measure((a[:, None, :] @ b[:, :, None]).reshape(num_rows), (a * b).sum(-1),
                               family=FAMILY, op=dot_op, source="fma",
                               variation="dot product in a GEMM kernel (multiply-accumulate) vs multiply then sum"))
    return results
