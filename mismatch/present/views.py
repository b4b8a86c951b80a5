"""Typed views of the summary.json sections the model keeps open (`dict[str, Any]` in
results/summary_model.py): what the terminal and the report read of `diff` and each pair's
`distribution` entry, as records. (alignment, drift and localization are records of the model
itself: results/section_records.py.)

A view names only the fields a reader shows; the section's other keys stay in the summary (the
report still lists every field of a section as it is). Each field defaults to "not recorded"
(None, an empty list or map), so an older or hand-made summary reads as far as it goes; a field
of the wrong type is one line (`SectionError`), never a traceback.
"""

from __future__ import annotations

from typing import Any, TypeVar

import msgspec

from mismatch.errors import ResultsError

_V = TypeVar("_V")


class SectionError(ResultsError):
    """A section of summary.json whose field is not of the type a run writes."""


class View(msgspec.Struct, kw_only=True, forbid_unknown_fields=False):
    """A reader's view of one open section: unknown keys ignored, every field optional."""


def view(data: Any, kind: type[_V], where: str, *, source: str = "summary.json") -> _V:
    """`data` (a section's plain JSON) as the view `kind`; `where` names the section of `source` in
    the error."""
    try:
        return msgspec.convert(data if data is not None else {}, kind, strict=False)
    except msgspec.ValidationError as error:
        raise SectionError(f"{source} {where}: {error}") from None


# --- diff -----------------------------------------------------------------------------------------

class MetricDelta(View):
    """One metric of `diff.deltas`: a/reference, b/reference, b − a and its bootstrap 95% CI."""

    a: float | None = None
    b: float | None = None
    delta: float | None = None
    ci95: list[float | None] | None = None


class DistributionCloser(View):
    """`diff.distribution`: which config is closer on the whole next-token distribution (mean KL)."""

    kl: dict[str, float | None] = msgspec.field(default_factory=dict)  # {"a": …, "b": …}
    closer: str | None = None  # a | b | tie, None when a side's KL is only a bound
    rule: str = ""


class Comparison(View):
    """summary.json `diff` (analysis.comparison.ConfigComparison and the engines' throughputs):
    b/reference − a/reference per metric, the closer config by kl_k3 and the rule behind it,
    where a and b disagree most, and each config's replay speed."""

    deltas: dict[str, MetricDelta] = msgspec.field(default_factory=dict)
    closer_to_reference: str | None = None  # a | b | tie
    closer_rule: str | None = None
    where: dict[str, Any] = msgspec.field(default_factory=dict)  # by_turn, by_position, worst_tokens
    throughput_tokens_per_s: dict[str, float | None] = msgspec.field(default_factory=dict)
    distribution: DistributionCloser | None = None


# --- the whole next-token distribution ------------------------------------------------------------

class BitwiseClaim(View):
    claim: str = ""


class NextTokenGap(View):
    """One pair of summary.json `distribution` (analysis.distribution): both sides' distributions
    over the vocabulary at every trainable position: exact or bounded by a top-K side, the bitwise
    claim checked, the tokens that moved most, the worst positions and turns."""

    k: int | None = None
    exact: bool = False
    bounded: str | None = None
    bitwise: BitwiseClaim = msgspec.field(default_factory=BitwiseClaim)
    tokens: list[dict[str, Any]] = msgspec.field(default_factory=list)
    worst: list[dict[str, Any]] = msgspec.field(default_factory=list)
    turns: list[dict[str, Any]] = msgspec.field(default_factory=list)
