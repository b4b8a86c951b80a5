"""Kernel probes: each op family run under the variations that differ between inference and training.

`mismatch probe CHECKPOINT` calls `run_probes` at the model's own shapes, on CPU or CUDA with the
same code; each result says whether two ways of computing the same values agree bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from mismatch.engines.hf import resolve_device
from mismatch.errors import MismatchError
from mismatch.probes import attention, linear_attention, matmul, norm, reductions, router, softmax
from mismatch.probes.result import SOURCES, ProbeResult
from mismatch.probes.shapes import ProbeShapes, shapes_from_checkpoint

FAMILIES = {"matmul": matmul.probe_family, "attention": attention.probe_family, "norm": norm.probe_family,
            "softmax": softmax.probe_family, "reductions": reductions.probe_family, "router": router.probe_family,
            "linear_attention": linear_attention.probe_family}


def run_probes(checkpoint_or_shapes: str | Path | ProbeShapes, *, device: str = "auto", seed: int = 0,
               families: Sequence[str] = tuple(FAMILIES)) -> list[ProbeResult]:
    """Every probe of `families` at a checkpoint's shapes (config.json only, no weights loaded)."""
    shapes = checkpoint_or_shapes if isinstance(checkpoint_or_shapes, ProbeShapes) \
        else shapes_from_checkpoint(checkpoint_or_shapes)
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        raise MismatchError(f"unknown probe family {unknown[0]!r} (known: {', '.join(FAMILIES)})")
    target = torch.device(resolve_device(device))
    results: list[ProbeResult] = []
    for family in families:
        # A generator per family: one family's inputs do not depend on which others ran.
        gen = torch.Generator().manual_seed(seed)
        with torch.inference_mode():
            results.extend(FAMILIES[family](shapes, device=target, gen=gen))
    return results


def environment(device: str = "auto") -> dict[str, Any]:
    """What the results depend on besides the code: record it next to them."""
    target = torch.device(resolve_device(device))
    facts: dict[str, Any] = {"device": target.type, "torch": torch.__version__,
                             "num_threads": torch.get_num_threads(),
                             "cpu_capability": torch.backends.cpu.get_cpu_capability()}
    if target.type == "cuda":
        facts["gpu"] = torch.cuda.get_device_name(target)
    return facts


def format_table(results: Sequence[ProbeResult]) -> str:
    """Plain-text table, one line per result: for `mismatch probe` without --json."""
    lines = [f"{'family':<10} {'source':<15} {'dtype':<8} {'equal':>7} {'max_abs':>9} {'ulp':>6}  op | variation"]
    for r in results:
        if not r.applicable:
            numbers = f"{'n/a':>7} {'':>9} {'':>6}"
        else:
            # Rounded down, so "100.0%" only ever means every element is bitwise equal.
            percent = math.floor(r.bitwise_equal_frac * 1000) / 10
            numbers = f"{percent:>6.1f}% {r.max_abs_diff:>9.2e} {r.max_ulp_diff:>6}"
        flips = "" if r.num_flipped is None else \
            f" | top-k flipped for {r.num_flipped} tokens ({r.flipped_frac:.2%})"
        lines.append(f"{r.family:<10} {r.source:<15} {r.dtype:<8} {numbers}  {r.op} | {r.variation}{flips}")
    return "\n".join(lines)


__all__ = ["FAMILIES", "SOURCES", "ProbeResult", "ProbeShapes", "environment", "format_table",
           "run_probes", "shapes_from_checkpoint"]
