"""One probe measurement: an op computed two ways that inference and training can differ in.

Every probe family returns a list of these; `run_probes` gathers them for `mismatch probe`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from mismatch.probes.ulp import bitwise_equal, max_ulp_diff

# What a variation changes; the last four are the sources of bitwise differences the literature names.
SOURCES = ("batch_size", "chunking", "split_kv", "prefill_decode", "dtype", "tf32", "implementation",
           "reduction_order", "accumulation", "fma", "rounding")


@dataclass(kw_only=True, slots=True, frozen=True)
class ProbeResult:
    family: str       # matmul | attention | norm | softmax | reductions | router | linear_attention
    op: str           # the op and its shape, e.g. "linear down_proj 384->128"
    variation: str    # what is compared with what, e.g. "each row alone vs in a batch of 64"
    source: str       # one of SOURCES
    dtype: str        # the dtype both outputs are compared in (ULPs are of this dtype)
    device: str
    applicable: bool  # False: the variation does not exist on this device (TF32 on a CPU)
    bitwise_equal_frac: float | None
    max_abs_diff: float | None
    max_ulp_diff: int | None
    num_elements: int
    note: str = ""
    # Router probes only: tokens whose set of top-k experts differs between the two computations.
    num_flipped: int | None = None
    flipped_frac: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"family": self.family, "op": self.op, "variation": self.variation,
                "source": self.source, "dtype": self.dtype, "device": self.device,
                "applicable": self.applicable, "bitwise_equal_frac": self.bitwise_equal_frac,
                "max_abs_diff": self.max_abs_diff, "max_ulp_diff": self.max_ulp_diff,
                "num_elements": self.num_elements, "note": self.note, "num_flipped": self.num_flipped,
                "flipped_frac": self.flipped_frac}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def measure(out: torch.Tensor, baseline: torch.Tensor, *, family: str, op: str, variation: str,
            source: str, note: str = "") -> ProbeResult:
    """Compare two computations of the same values, bit for bit, in their (shared) dtype."""
    assert source in SOURCES, source
    assert torch.isfinite(out).all() and torch.isfinite(baseline).all(), "probes compare finite values"
    diff = (out.double() - baseline.double()).abs()
    return ProbeResult(family=family, op=op, variation=variation, source=source,
                       dtype=dtype_name(out.dtype), device=out.device.type, applicable=True,
                       bitwise_equal_frac=float(bitwise_equal(out, baseline).double().mean()),
                       max_abs_diff=float(diff.max()), max_ulp_diff=max_ulp_diff(out, baseline),
                       num_elements=out.numel(), note=note)


def not_applicable(*, family: str, op: str, variation: str, source: str, dtype: torch.dtype,
                   device: str, note: str) -> ProbeResult:
    return ProbeResult(family=family, op=op, variation=variation, source=source,
                       dtype=dtype_name(dtype), device=device, applicable=False,
                       bitwise_equal_frac=None, max_abs_diff=None, max_ulp_diff=None,
                       num_elements=0, note=note)
