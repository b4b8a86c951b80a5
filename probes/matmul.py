"""Matmul probe: the model's linear layers under batch size, split-K, accumulation, fusion and dtype.

Part of `mismatch probe`: projections and lm_head are most of a forward's FLOPs and the first
place a trainer and an inference engine pick different kernels.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from mismatch.probes.result import ProbeResult, dtype_name, measure, not_applicable
from mismatch.probes.shapes import ProbeShapes, randn

FAMILY = "matmul"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def attention_projections(shapes: ProbeShapes) -> list[tuple[str, int, int]]:
    """(name, in, out) of the attention's projections: q/k/v/o, or MLA's low-rank ones."""
    if shapes.mla is None:
        return [("q_proj", shapes.hidden, shapes.num_heads * shapes.head_dim),
                ("k_proj/v_proj", shapes.hidden, shapes.num_kv_heads * shapes.head_dim),
                ("o_proj", shapes.num_heads * shapes.head_dim, shapes.hidden)]
    mla, num_heads = shapes.mla, shapes.num_heads
    if mla.q_lora_rank is None:
        q = [("q_proj", shapes.hidden, num_heads * mla.qk_head_dim)]
    else:
        q = [("q_a_proj", shapes.hidden, mla.q_lora_rank), ("q_b_proj", mla.q_lora_rank, num_heads * mla.qk_head_dim)]
    # kv_a_proj_with_mqa: the latent and the one rotary key all heads share; kv_b_proj: per-head k_nope and v.
    return [*q, ("kv_a_proj_with_mqa", shapes.hidden, mla.kv_lora_rank + mla.qk_rope_head_dim),
            ("kv_b_proj", mla.kv_lora_rank, num_heads * (mla.qk_nope_head_dim + mla.v_head_dim)),
            ("o_proj", num_heads * mla.v_head_dim, shapes.hidden)]


def mlp_projections(shapes: ProbeShapes) -> list[tuple[str, int, int]]:
    """(name, in, out) of the MLPs the model runs: dense, router, experts (gate and up fused, as
    transformers and vLLM store them), shared experts."""
    named = []
    if shapes.intermediate is not None:
        named += [("gate_proj/up_proj", shapes.hidden, shapes.intermediate),
                  ("down_proj", shapes.intermediate, shapes.hidden)]
    if (moe := shapes.moe) is not None:
        named += [("router", shapes.hidden, moe.num_experts),
                  ("experts.gate_up_proj", shapes.hidden, 2 * moe.intermediate),
                  ("experts.down_proj", moe.intermediate, shapes.hidden)]
        if moe.shared_intermediate:
            named += [("shared_experts.gate_proj/up_proj", shapes.hidden, moe.shared_intermediate),
                      ("shared_experts.down_proj", moe.shared_intermediate, shapes.hidden)]
    return named


def linear_ops(shapes: ProbeShapes) -> list[tuple[str, int, int]]:
    """(name, in, out) of each distinct projection shape, names joined when shapes coincide."""
    named = [*attention_projections(shapes), *mlp_projections(shapes), ("lm_head", shapes.hidden, shapes.vocab)]
    merged: dict[tuple[int, int], list[str]] = {}
    for name, fan_in, fan_out in named:
        merged.setdefault((fan_in, fan_out), []).append(name)
    return [("/".join(names), fan_in, fan_out) for (fan_in, fan_out), names in merged.items()]


def merged_name(shapes: ProbeShapes, part: str) -> str:
    """The name `linear_ops` gives the shape that `part` (e.g. "down_proj") shares with others."""
    return next(name for name, _, _ in linear_ops(shapes) if part in name.split("/"))


def op_name(name: str, w_KD: torch.Tensor) -> str:
    return f"linear {name} {w_KD.shape[1]}->{w_KD.shape[0]}"


def in_row_blocks(x_ND: torch.Tensor, w_KD: torch.Tensor, rows_per_call: int) -> torch.Tensor:
    return torch.cat([F.linear(x_ND[start:start + rows_per_call], w_KD)
                      for start in range(0, x_ND.shape[0], rows_per_call)])


def batch_invariance(x_ND: torch.Tensor, w_KD: torch.Tensor, *, rows_per_call: int, op: str) -> ProbeResult:
    """Rows computed in calls of `rows_per_call` vs all N rows in one call (the trainer's batch)."""
    num_rows = x_ND.shape[0]
    if rows_per_call == 1:
        source, variation = "batch_size", f"each row alone vs in a batch of {num_rows}"
    else:
        source, variation = "chunking", f"rows in calls of {rows_per_call} vs one call of {num_rows}"
    return measure(in_row_blocks(x_ND, w_KD, rows_per_call), F.linear(x_ND, w_KD), family=FAMILY,
                   op=op, variation=variation, source=source)


def split_k(x_ND: torch.Tensor, w_KD: torch.Tensor, num_splits: int) -> torch.Tensor:
    """Split-K: one GEMM per slice of the reduction dim, partial results added left to right."""
    parts = [F.linear(x_part, w_part) for x_part, w_part in
             zip(x_ND.tensor_split(num_splits, dim=1), w_KD.tensor_split(num_splits, dim=1), strict=True)]
    total = parts[0]
    for part in parts[1:]:
        total = total + part
    return total


def split_k_order(x_ND: torch.Tensor, w_KD: torch.Tensor, *, num_splits: int, op: str) -> ProbeResult:
    return measure(split_k(x_ND, w_KD, num_splits), F.linear(x_ND, w_KD), family=FAMILY, op=op,
                   variation=f"K split in {num_splits}, partials added vs one GEMM",
                   source="reduction_order")


def fp32_accumulate(x_ND: torch.Tensor, w_KD: torch.Tensor) -> torch.Tensor:
    """The same low-precision inputs multiplied and accumulated in fp32, rounded once at the end."""
    return F.linear(x_ND.float(), w_KD.float()).to(x_ND.dtype)


def native_vs_fp32_accumulate(x_ND: torch.Tensor, w_KD: torch.Tensor, *, op: str) -> ProbeResult:
    """Does this device's low-precision GEMM equal fp32 accumulation with one final rounding?"""
    return measure(F.linear(x_ND, w_KD), fp32_accumulate(x_ND, w_KD), family=FAMILY, op=op,
                   variation=f"native {dtype_name(x_ND.dtype)} GEMM vs fp32 accumulate, round once",
                   source="accumulation")


def low_precision_partial_sums(x_ND: torch.Tensor, w_KD: torch.Tensor, num_splits: int) -> torch.Tensor:
    """Partial sums kept in the inputs' dtype: each K slice's sum and the running total rounded."""
    total = None
    for x_part, w_part in zip(x_ND.tensor_split(num_splits, dim=1),
                              w_KD.tensor_split(num_splits, dim=1), strict=True):
        part = F.linear(x_part.float(), w_part.float()).to(x_ND.dtype)
        total = part if total is None else (total.float() + part.float()).to(x_ND.dtype)
    return total


def partial_sum_precision(x_ND: torch.Tensor, w_KD: torch.Tensor, *, num_splits: int, op: str) -> ProbeResult:
    name = dtype_name(x_ND.dtype)
    return measure(low_precision_partial_sums(x_ND, w_KD, num_splits), fp32_accumulate(x_ND, w_KD),
                   family=FAMILY, op=op, source="accumulation",
                   variation=f"{num_splits} partial sums rounded to {name} vs fp32 accumulate, round once")


def fused_bias(x_ND: torch.Tensor, w_KD: torch.Tensor, b_K: torch.Tensor, *, op: str) -> ProbeResult:
    """Bias added inside the GEMM (addmm: one call, as F.linear with bias does) vs a separate add."""
    fused = torch.addmm(b_K, x_ND, w_KD.t())
    separate = x_ND @ w_KD.t() + b_K
    return measure(fused, separate, family=FAMILY, op=op + " +bias", source="fma",
                   variation="addmm(bias, x, W^T) vs x @ W^T + bias")


def dtype_vs_fp32(x_ND: torch.Tensor, w_KD: torch.Tensor, dtype: torch.dtype, *, op: str) -> ProbeResult:
    """The whole op in `dtype` vs in fp32 rounded to `dtype` (the error a dtype choice costs)."""
    return measure(F.linear(x_ND.to(dtype), w_KD.to(dtype)), F.linear(x_ND, w_KD).to(dtype),
                   family=FAMILY, op=op, source="dtype",
                   variation=f"{dtype_name(dtype)} inputs and GEMM vs fp32 GEMM rounded to {dtype_name(dtype)}")


def intermediate_rounding(x_ND: torch.Tensor, w1_HD: torch.Tensor, w2_DH: torch.Tensor, *,
                          op: str) -> ProbeResult:
    """Two chained GEMMs on bf16 values, accumulating in fp32: intermediate rounded to bf16 or not."""
    x, w1, w2 = (t.to(torch.bfloat16).float() for t in (x_ND, w1_HD, w2_DH))
    rounded = F.linear(F.linear(x, w1).to(torch.bfloat16).float(), w2).to(torch.bfloat16)
    once = F.linear(F.linear(x, w1), w2).to(torch.bfloat16)
    return measure(rounded, once, family=FAMILY, op=op, source="rounding",
                   variation="intermediate rounded to bf16 between GEMMs vs kept fp32, rounded once")


@contextmanager
def float32_matmul_precision(precision: str) -> Iterator[None]:
    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(precision)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(saved)


def tf32(x_ND: torch.Tensor, w_KD: torch.Tensor, *, op: str) -> ProbeResult:
    variation = "fp32 GEMM with TF32 allowed vs IEEE fp32"
    if x_ND.device.type != "cuda":
        return not_applicable(family=FAMILY, op=op, variation=variation, source="tf32",
                              dtype=x_ND.dtype, device=x_ND.device.type,
                              note=f"TF32 is a CUDA tensor-core mode; not applicable on {x_ND.device.type}")
    with float32_matmul_precision("high"):  # "high" = TF32 allowed
        fast = F.linear(x_ND, w_KD)
    with float32_matmul_precision("highest"):
        exact = F.linear(x_ND, w_KD)
    return measure(fast, exact, family=FAMILY, op=op, variation=variation, source="tf32")


def probe_family(shapes: ProbeShapes, *, device: torch.device, gen: torch.Generator) -> list[ProbeResult]:
    num_rows = shapes.tokens
    results: list[ProbeResult] = []
    weights: dict[str, torch.Tensor] = {}
    x_by_width: dict[int, torch.Tensor] = {}
    for name, fan_in, fan_out in linear_ops(shapes):
        # Unit-variance activations and 1/sqrt(fan_in) weights keep outputs O(1), as in a trained model.
        x_ND = x_by_width.setdefault(fan_in, randn(num_rows, fan_in, gen=gen, device=device))
        w_KD = weights[name] = randn(fan_out, fan_in, gen=gen, device=device, scale=fan_in ** -0.5)
        op = op_name(name, w_KD)
        for dtype in DTYPES:
            for rows_per_call in (1, num_rows // 4):
                results.append(batch_invariance(x_ND.to(dtype), w_KD.to(dtype), rows_per_call=rows_per_call, op=op))
        results.append(tf32(x_ND, w_KD, op=op))
    # Reduction-dim variations on the MLP down projection most tokens run (an expert's in an MoE).
    width = shapes.mlp_intermediate
    down, gate = (("experts.down_proj", "experts.gate_up_proj") if shapes.moe is not None
                  else ("down_proj", "gate_proj"))
    down, gate = merged_name(shapes, down), merged_name(shapes, gate)
    x_NI, w_DI = x_by_width[width], weights[down]
    op = op_name(down, w_DI)
    for num_splits in (2, 4):
        results.append(split_k_order(x_NI, w_DI, num_splits=num_splits, op=op))
    for dtype in (torch.bfloat16, torch.float16):
        results.append(native_vs_fp32_accumulate(x_NI.to(dtype), w_DI.to(dtype), op=op))
        results.append(dtype_vs_fp32(x_NI, w_DI, dtype, op=op))
    results.append(partial_sum_precision(x_NI.to(torch.bfloat16), w_DI.to(torch.bfloat16), num_splits=8, op=op))
    b_D = randn(shapes.hidden, gen=gen, device=device)
    for dtype in DTYPES:
        results.append(fused_bias(x_NI.to(dtype), w_DI.to(dtype), b_D.to(dtype), op=op))
    w_IH = weights[gate][:width]  # an expert's fused gate_up: its first half is the gate
    results.append(intermediate_rounding(x_by_width[shapes.hidden], w_IH, w_DI, op=f"linear {gate} then {down}"))
    return results
