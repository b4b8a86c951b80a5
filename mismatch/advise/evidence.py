"""What the recommendation rule reads (recommend.py RULE): the diagnosis, and the gap and the
simulated corrections of the pair a correction would be chosen on, from summary.json and any
findings given beside it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mismatch.advise.diagnose import Diagnosis, diagnose
from mismatch.advise.levels import gap_level
from mismatch.results.summary_model import partial_metrics

PAIR = "train/sampler"
PROCESSED_PAIR = "train_processed/sampler"


@dataclass(kw_only=True, slots=True, frozen=True)
class Evidence:
    """What the rule reads: the diagnosis, and the gap and simulated corrections of the pair a
    correction would be chosen on."""

    metrics: dict[str, Any]  # summary["pairs"][pair]
    corrections: list[dict[str, Any]]
    diagnosis: Diagnosis = field(default_factory=lambda: Diagnosis(causes=()))
    pair: str = PAIR  # the pair the correction is chosen on (the like-for-like one when processed)
    num_tokens: int | None = None
    num_trainable_tokens: int | None = None
    grows_with_position: bool | None = None
    onset_turn: int | None = None  # where the gap steps up (localization.turns)

    @property
    def level(self) -> str:
        return gap_level(partial_metrics(self.metrics))  # TRANSITIONAL: plain metrics


def evidence_from_summary(summary: dict[str, Any], *, corrections: list[dict[str, Any]] | None = None,
                          grows_with_position: bool | None = None, batch_variant: bool | None = None,
                          probes: list[dict[str, Any]] | None = None, drift: dict[str, Any] | None = None,
                          alignment: dict[str, Any] | None = None) -> Evidence:
    """Evidence from summary.json; keyword arguments override or add what the summary lacks.

    `corrections` defaults to summary["corrections"]; `grows_with_position` to
    summary["localization"]["turns"]["position_slope"]["grows_with_position"]; `batch_variant` to what
    `probes` (ProbeResult dicts, probes/result.py) show; `drift` / `alignment` to summary["drift"] /
    summary["alignment"].
    """
    seen = dict(summary)  # what the diagnosis reads: the summary with the findings given here
    if drift is not None:
        seen["drift"] = drift
    if alignment is not None:
        seen["alignment"] = alignment
    turns = (summary.get("localization") or {}).get("turns") or {}
    if grows_with_position is None:
        grows_with_position = (turns.get("position_slope") or {}).get("grows_with_position")
    counts = summary.get("counts") or {}
    pair = correction_pair(seen)
    return Evidence(
        metrics=(summary.get("pairs") or {}).get(pair) or {}, pair=pair,
        diagnosis=diagnose(seen, probes=probes, batch_variant=batch_variant),
        corrections=list(corrections if corrections is not None else summary.get("corrections") or []),
        num_tokens=counts.get("tokens"), num_trainable_tokens=counts.get("trainable_tokens"),
        grows_with_position=grows_with_position, onset_turn=turns.get("onset_turn"))


def correction_pair(summary: dict[str, Any]) -> str:
    """The pair a correction is chosen on: train/sampler, or the like-for-like train_processed/
    sampler when the sampler stored processed log-probs (a correction computed on mismatched
    semantics would correct the processing, which raw_logprobs fixes)."""
    processed = (summary.get("alignment") or {}).get("logprob_semantics") in ("processed", "truncated")
    return PROCESSED_PAIR if processed and PROCESSED_PAIR in (summary.get("pairs") or {}) else PAIR
