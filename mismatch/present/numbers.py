"""Numbers as people read them: the report's typography (`num`, `pct`, `formatted`) and the terminal's
plain ASCII (`plain`). One place, so a metric never reads two ways on one screen."""

from __future__ import annotations

import math
from typing import Any


def num(value: Any, digits: int = 4) -> str:
    """A metric for people: 4 significant digits, thousands separators for counts, '–' for none."""
    if value is None or isinstance(value, bool):
        return "–" if value is None else str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if not isinstance(value, float):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "∞" if value > 0 else "−∞"
    if value == 0:
        return "0"
    text = f"{value:.{digits}g}"
    if "e" in text:  # 1.234e-05 -> 1.234e-5: shorter, and no one reads the zero
        mantissa, exponent = text.split("e")
        text = f"{mantissa}e{int(exponent)}"
    return text.replace("-", "−")


def pct(value: Any) -> str:
    """A fraction as a percentage with 3 significant digits (never rounded to a misleading 0%)."""
    if value is None or not isinstance(value, (int, float)) or math.isnan(value):
        return "–"
    if value == 0:
        return "0%"
    return f"{value * 100:.3g}%"


def formatted(value: Any, kind: str = "num") -> str:
    """A value by its kind: "num" (num), "pct" (pct), "range" (low – high) or "ci" ([low, high], 3 digits)."""
    if kind == "pct":
        return pct(value)
    if kind in ("range", "ci"):
        low, high = value if isinstance(value, (tuple, list)) and len(value) == 2 else (None, None)
        if low is None and high is None:
            return "–"
        return f"[{num(low, 3)}, {num(high, 3)}]" if kind == "ci" else f"{num(low)} – {num(high)}"
    return num(value)


def plain(value: Any) -> str:
    """A number for the terminal: ASCII only (a log, a pipe), '-' for none, 4 significant digits."""
    if value is None:
        return "-"
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:.4g}"
