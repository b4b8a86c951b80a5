"""Distance between two floats in units in the last place (ULPs) of their own dtype.

Every probe reports it next to max abs diff: "1 ULP" means one rounding apart at any magnitude.
"""

from __future__ import annotations

import torch

# Same-width signed ints to read a float's bits; float64 is left out on purpose: distances
# between far-apart float64 values do not fit in int64.
_BITS = {torch.float32: (torch.int32, 0x7FFF_FFFF),
         torch.bfloat16: (torch.int16, 0x7FFF),
         torch.float16: (torch.int16, 0x7FFF)}

SUPPORTED_DTYPES = tuple(_BITS)


def ordinal(x: torch.Tensor) -> torch.Tensor:
    """Each float's index on its dtype's number line (int64): neighbours differ by 1, +0 and -0 are 0.

    IEEE floats of one sign are ordered like their bit patterns read as integers; negative floats
    run the other way, so their magnitude bits are negated. NaNs get indices beyond ±inf and are
    not meaningful: callers compare finite values.
    """
    int_dtype, magnitude_mask = _BITS[x.dtype]
    bits = x.contiguous().view(int_dtype).to(torch.int64)
    return torch.where(bits < 0, -(bits & magnitude_mask), bits)


def ulp_diff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """|ordinal(a) - ordinal(b)| elementwise: how many representable floats apart a and b are."""
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    return (ordinal(a) - ordinal(b)).abs()


def max_ulp_diff(a: torch.Tensor, b: torch.Tensor) -> int:
    return int(ulp_diff(a, b).max()) if a.numel() else 0


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise bit-for-bit equality (so +0 vs -0 counts as different, unlike `==`)."""
    assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
    int_dtype, _ = _BITS[a.dtype]
    return a.contiguous().view(int_dtype) == b.contiguous().view(int_dtype)
