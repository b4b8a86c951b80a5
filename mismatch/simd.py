"""Branch-free building blocks for the fused loops: exp and expm1, and float max/min as integer max/min.

Under fused. Without SVML (numba's vector math library, not installed here) a `math.exp` in a
loop is a scalar libm call, and a float max or min reduction does not vectorize unless NaN is
ruled out (a fast-math flag that would also drop our NaN semantics). These are written so that
LLVM vectorizes the loops that call them (AVX-512: 8 lanes):

- `exp_expm1(x)`: exp(x) and expm1(x) from one range reduction and one polynomial, within 1 and
  2 ulps of libm's (tests/test_fused.py compares them across the double range, inf and NaN
  included), ~1 ns for both where the loop vectorizes, against ~7 ns for two libm calls;
- `order_key(x)` / `from_order_key(k)`: an int64 whose signed order is x's order, so a running
  `max(key, order_key(x))` is an integer reduction (NaN keys lie beyond +inf; a run holding one
  never has its statistics used, see metrics._pair_tokens).

Importable without numba (the names are then None; fused.available() is False).
"""

from __future__ import annotations

import math

try:
    import numba
    from numba.core import types
    from numba.extending import intrinsic
except ImportError:
    numba = None

# ln 2 split so that k * _LN2_HI is exact for |k| < 2^20 (fdlibm's split), and 1 / ln 2.
_LN2_HI = 6.93147180369123816490e-01
_LN2_LO = 1.90821492927058770002e-10
_INV_LN2 = 1.44269504088896338700e+00
# Taylor coefficients 1/n! for n = 13 down to 2: e^r - 1 = r + r^2 (1/2 + r (1/6 + ...)). On the
# reduced range |r| <= ln2/2 the first term left out, r^14/14!, is below 0.2 ulp of the result.
_TAYLOR = tuple(1.0 / math.factorial(n) for n in range(13, 1, -1))
_SIGN_OFF = 0x7FFFFFFFFFFFFFFF  # every bit but the sign

if numba is not None:
    @intrinsic
    def _float_from_bits(typingctx, bits):
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], context.get_value_type(types.float64))
        return types.float64(types.int64), codegen

    @intrinsic
    def _bits_of_float(typingctx, value):
        def codegen(context, builder, signature, args):
            return builder.bitcast(args[0], context.get_value_type(types.int64))
        return types.int64(types.float64), codegen

    def _njit(fn):
        return numba.njit(cache=True, nogil=True, inline="always")(fn)
else:  # pragma: no cover - the numpy paths run instead
    _float_from_bits = _bits_of_float = None

    def _njit(fn):
        return fn

_C13, _C12, _C11, _C10, _C9, _C8, _C7, _C6, _C5, _C4, _C3, _C2 = _TAYLOR


@_njit
def exp_expm1(x: float) -> tuple[float, float]:  # pragma: no cover - compiled
    """(exp(x), expm1(x)). x = k ln2 + r with |r| <= ln2/2; e^r - 1 = q by polynomial; then
    exp = (1 + q) 2^k and expm1 = (q + 1 - 2^-k) 2^k, which is q itself at k = 0 (no cancellation
    near 0). 2^k is built from its bits, as two factors for exp, so results near overflow and in
    the subnormal range come out right; x is clamped to [-746, 710] first (beyond, exp is 0 or inf)."""
    c = min(max(x, -746.0), 710.0)
    k = math.floor(c * _INV_LN2 + 0.5)
    r = (c - k * _LN2_HI) - k * _LN2_LO
    p = _C13 * r + _C12
    p = p * r + _C11
    p = p * r + _C10
    p = p * r + _C9
    p = p * r + _C8
    p = p * r + _C7
    p = p * r + _C6
    p = p * r + _C5
    p = p * r + _C4
    p = p * r + _C3
    p = p * r + _C2
    q = (r * r) * p + r
    ki = numba.int64(k)
    half = ki >> 1
    s1 = _float_from_bits((half + 1023) << 52)
    s2 = _float_from_bits((ki - half + 1023) << 52)
    e = ((1.0 + q) * s1) * s2
    # expm1 = (q + 1 - 2^-k) 2^k: one rounding before an exact scaling. Past |k| = 56, e - 1 is as
    # close (2^k - 1 rounds to 2^k, or e to nothing next to -1).
    near = min(max(ki, -56), 56)
    m = (q + (1.0 - _float_from_bits((1023 - near) << 52))) * _float_from_bits((near + 1023) << 52)
    if ki != near:
        m = e - 1.0
    if math.isnan(x):  # NaN in, NaN out
        e = m = x
    return e, m


@_njit
def order_key(x: float) -> int:  # pragma: no cover - compiled
    """An int64 ordered like x: a float's bits, with the magnitude bits flipped for negatives."""
    bits = _bits_of_float(x)
    return bits ^ ((bits >> 63) & _SIGN_OFF)


@_njit
def from_order_key(key: int) -> float:  # pragma: no cover - compiled
    return _float_from_bits(key ^ ((key >> 63) & _SIGN_OFF))
