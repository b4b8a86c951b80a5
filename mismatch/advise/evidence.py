"""What the recommendation rule reads (recommend.py RULE): the diagnosis, and the gap and the
simulated corrections of the pair a correction would be chosen on, from summary.json and any
findings given beside it."""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from mismatch.advise.diagnose import Diagnosis, diagnose
from mismatch.advise.levels import gap_level
from mismatch.results.section_records import Alignment, Drift
from mismatch.results.summary_model import Correction, PairMetrics, ProbeResult, Summary, present

PAIR = "train/sampler"
PROCESSED_PAIR = "train_processed/sampler"


@dataclass(kw_only=True, slots=True, frozen=True)
class Evidence:
    """What the rule reads: the diagnosis, and the gap and simulated corrections of the pair a
    correction would be chosen on."""

    metrics: PairMetrics | None  # summary.pairs[pair]
    corrections: list[Correction]
    diagnosis: Diagnosis = field(default_factory=lambda: Diagnosis(causes=()))
    pair: str = PAIR  # the pair the correction is chosen on (the like-for-like one when processed)
    num_tokens: int | None = None
    num_trainable_tokens: int | None = None
    grows_with_position: bool | None = None
    onset_turn: int | None = None  # where the gap steps up (localization.turns)

    @property
    def level(self) -> str:
        return gap_level(self.metrics) if self.metrics is not None else "unknown"


def evidence_from_summary(summary: Summary, *, corrections: list[Correction] | None = None,
                          grows_with_position: bool | None = None, batch_variant: bool | None = None,
                          probes: list[ProbeResult] | None = None, drift: Drift | None = None,
                          alignment: Alignment | None = None) -> Evidence:
    """Evidence from summary.json; keyword arguments override or add what the summary lacks.

    `corrections` defaults to summary.corrections; `grows_with_position` to
    summary.localization.turns.position_slope.grows_with_position; `batch_variant` to what
    `probes` (probes/result.py's records) show; `drift` / `alignment` to summary.drift /
    summary.alignment.
    """
    given = {name: value for name, value in (("drift", drift), ("alignment", alignment)) if value is not None}
    seen = msgspec.structs.replace(summary, **given)  # what the diagnosis reads: the summary with the findings given here
    if grows_with_position is None:
        grows_with_position = summary.grows_with_position
    counts = summary.counts
    pair = correction_pair(seen)
    return Evidence(
        metrics=summary.pairs.get(pair), pair=pair,
        diagnosis=diagnose(seen, probes=probes, batch_variant=batch_variant),
        corrections=list(corrections if corrections is not None else summary.corrections),
        num_tokens=present(counts.tokens), num_trainable_tokens=present(counts.trainable_tokens),
        grows_with_position=grows_with_position, onset_turn=summary.onset_turn)


def correction_pair(summary: Summary) -> str:
    """The pair a correction is chosen on: train/sampler, or the like-for-like train_processed/
    sampler when the sampler stored processed log-probs (a correction computed on mismatched
    semantics would correct the processing, which raw_logprobs fixes)."""
    processed = summary.semantics in ("processed", "truncated")
    return PROCESSED_PAIR if processed and PROCESSED_PAIR in summary.pairs else PAIR
