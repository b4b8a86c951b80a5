"""summary.json (contract `mismatch.summary/v1`), built once from the stages' typed results.

`Provenance` is what was run, `Measured` what the token table's pair analyses found; a command adds
its own findings (audit: alignment, trees, corrections, ...; diff: the comparison) as named
entries, in one call; the summary is a `Summary` record (results/summary_model.py) and is never
edited: the advice (advise/'s `Advice` part: verdicts that name the diagnosed cause, the diagnosis,
`recommendations` and snippets) joins it through `with_parts`, which returns a new one.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import msgspec
import pandas as pd

from mismatch.version import __version__
from mismatch.advise.verdicts import verdicts
from mismatch.analysis.chunked import Analysis, Chunks, run_passes
from mismatch.analysis.counts import Counts
from mismatch.analysis.grouped_metrics import OVERALL, GroupedPairMetrics, breakdown_records
from mismatch.analysis.clip import ClipRange, clip_summary
from mismatch.analysis.metrics import PAIR_METRICS
from mismatch.results import SUMMARY_SCHEMA
from mismatch.results.section_records import Localization
from mismatch.results.summary_model import (
    BranchKindRow,
    Clip,
    PairMetrics,
    RoleRow,
    RowCounts,
    Summary,
    TurnRow,
    to_builtins,
)


@dataclass(kw_only=True, slots=True, frozen=True)
class Provenance:
    """What ran: the command, its inputs and each engine as it described itself."""

    command: str
    checkpoint: str
    rollouts_file: str
    engines: dict[str, Any]
    shard: dict[str, Any] | None = None  # summary.json `shard` (None: a bare summary of a table)
    inputs: dict[str, Any] | None = None  # the inputs' identity (pipeline.stages.prepare)


@dataclass(kw_only=True, slots=True, frozen=True)
class Measured:
    """summary.json's pair metrics over trainable tokens, their breakdowns and the row counts."""

    counts: dict[str, int]
    pairs: dict[str, PairMetrics]
    turns: list[TurnRow]
    roles: list[RoleRow]
    branch_kinds: list[BranchKindRow]
    clip: Clip | None


class SummaryAnalyses:
    """The analyses behind `Measured`, to run in a command's passes with its other analyses."""

    def __init__(self, pairs: tuple[tuple[str, str], ...], clip: ClipRange | None) -> None:
        self.pairs, self.clip = pairs, clip
        self.trainable = GroupedPairMetrics(pairs, ("turn", "branch_kind"), trainable_only=True,
                                            clip=(clip.low, clip.high) if clip is not None else None)
        self.every_row = GroupedPairMetrics(pairs, ("role",), trainable_only=False, overall=False)
        self.counts = Counts()
        self.analyses: list[Analysis] = [self.trainable, self.every_row, self.counts]

    def result(self) -> Measured:
        found, by_role = self.trainable.result(), self.every_row.result()
        return Measured(counts=self.counts.counts,
                        pairs={name: _metrics_row(frame) for name, frame in found[OVERALL].items()},
                        turns=msgspec.convert(breakdown_records(found["turn"], "turn"), list[TurnRow]),
                        roles=msgspec.convert(breakdown_records(by_role["role"], "role"), list[RoleRow]),
                        branch_kinds=msgspec.convert(breakdown_records(found["branch_kind"], "branch_kind"),
                                                     list[BranchKindRow]),
                        clip=msgspec.convert(clip_summary(self.clip, found), Clip) if self.clip is not None else None)


def summary_json(provenance: Provenance, measured: Measured,
                 findings: Mapping[str, Any] | None = None) -> Summary:
    """summary.json of a run: provenance, measurements, then the command's findings (entries that
    are None are left out; `localization`, `corrections` and `recommendations` are the schema's
    and default to empty). The advice (diagnosis, verdicts that name a cause, recommendations,
    snippets) is advise/'s part, which the command builds the summary with (`with_parts`)."""
    summary = Summary(
        schema=SUMMARY_SCHEMA, command=provenance.command, mismatch_version=__version__,
        created_unix=time.time(), checkpoint=provenance.checkpoint, rollouts_file=provenance.rollouts_file,
        counts=msgspec.convert(measured.counts, RowCounts), engines=provenance.engines, pairs=measured.pairs, verdicts=verdicts(measured.pairs),
        turns=measured.turns, roles=measured.roles, branch_kinds=measured.branch_kinds,
        localization=Localization(), corrections=[], recommendations=[])
    parts: dict[str, Any] = {}
    if measured.clip is not None:
        parts["clip"] = measured.clip
    if provenance.shard is not None:
        parts["shard"], parts["inputs"] = provenance.shard, provenance.inputs
    parts.update({key: value for key, value in (findings or {}).items() if value is not None})
    return with_parts(summary, parts)


def with_parts(summary: Summary, parts: Mapping[str, Any]) -> Summary:
    """`summary` with the named sections set (each converted to its record type where it comes as
    plain data): how a stage's part joins the summary, never by editing it."""
    hints = _section_types()
    # to_builtins first: an analysis' numpy scalars and arrays become the numbers and lists they hold
    return msgspec.structs.replace(summary, **{name: msgspec.convert(to_builtins(value), hints[name], strict=False)
                                               for name, value in parts.items()})


@functools.cache
def _section_types() -> dict[str, Any]:
    import typing

    return typing.get_type_hints(Summary)


def build_summary(chunks: Chunks, *, engines: dict[str, Any], checkpoint: str,
                  rollouts_file: str, pairs: tuple[tuple[str, str], ...], command: str,
                  clip: ClipRange | None = None) -> Summary:
    """summary.json's measurements of a filled token table's chunks of whole rollouts, nothing else
    (a report of a table in memory, the tests)."""
    analyses = SummaryAnalyses(pairs, clip)
    run_passes(chunks, analyses.analyses)
    return summary_json(Provenance(command=command, checkpoint=checkpoint, rollouts_file=rollouts_file,
                                   engines=engines), analyses.result())


def _metrics_row(frame: pd.DataFrame) -> PairMetrics:
    row = frame.iloc[0]
    return PairMetrics(**{name: int(row[name]) if name in ("n_tokens", "n_rollouts") else float(row[name])
                          for name in PAIR_METRICS})
