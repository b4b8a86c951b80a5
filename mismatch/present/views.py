"""Typed views of the summary.json sections the model keeps open (`dict[str, Any]` in
results/summary_model.py): what the terminal and the report read of `diff`, `alignment`, the
turn localizer's `localization.turns` and each pair's `distribution` entry, as records.

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


# --- alignment ----------------------------------------------------------------------------------

class AlignmentFinding(View):
    kind: str = ""
    message: str = ""
    fix: str | None = None


class Alignment(View):
    """summary.json `alignment` (analysis.alignment): is the stored column the quantity the replay
    computes: its best shift, its semantics (raw or processed), the temperature that fits, and the
    share of positions with no, padded or constant log-probs."""

    stored: str | None = None  # the stored source checked; None: nothing stored to check
    shift: int | None = None  # stored[i] fits token i + shift
    logprob_semantics: str | None = None  # raw | processed | unknown
    estimated_temperature: float | None = None
    padded_zero_frac: float | None = None
    constant_frac: float | None = None
    missing_trainable_frac: float | None = None
    findings: list[AlignmentFinding] = msgspec.field(default_factory=list)


# --- render drift ----------------------------------------------------------------------------------

class Drift(View):
    """summary.json `drift` (rollouts.drift): re-rendered tokens that differ from the sampled ones:
    how many rollouts were checked and drifted, the spans and the trainable tokens they touch."""

    num_rollouts_checked: int = 0
    num_rollouts_drifted: int = 0
    num_spans: int = 0
    trainable_tokens_touched: int | None = None
    spans: list[dict[str, Any]] = msgspec.field(default_factory=list)


# --- the turn localizer -----------------------------------------------------------------------------

class PositionSlope(View):
    """The gap's linear growth along position (localize.slope): per 1000 tokens, with its 95% CI."""

    slope_per_1k: float | None = None
    ci95_per_1k: list[float | None] | None = None
    p_value: float | None = None
    grows_with_position: bool = False


class Onset(View):
    n_rollouts_departing: int | None = None
    n_rollouts_compared: int | None = None


class TurnFindings(View):
    """summary.json `localization.turns` (localize.turns): the pair it reads, the first turn where
    the gap steps up (None: none does), how many rollouts depart there, and the drift along
    position. Its tables stay in the section."""

    pair: str | None = None
    n_tokens: int | None = None
    onset_turn: int | None = None
    onset: Onset | None = None
    position_slope: PositionSlope | None = None


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
