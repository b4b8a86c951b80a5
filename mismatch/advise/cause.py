"""One cause of a gap, as the diagnosis names it (advise/diagnose.py finds them)."""

from __future__ import annotations

from dataclasses import dataclass, field

from mismatch.results import summary_model as model
from mismatch.results.summary_model import CauseWhere


@dataclass(kw_only=True, slots=True, frozen=True)
class Cause:
    """One cause: the pair whose gap it explains, in words with where it is, and why."""

    kind: str
    pair: str
    title: str                      # the cause in one phrase, naming where (layer, module, turn, ...)
    evidence: tuple[str, ...]       # what supports it
    rules_out: tuple[str, ...] = ()  # why not the other causes
    fix: str = ""                   # the recommendation kind that fixes it at the source
    where: CauseWhere = field(default_factory=CauseWhere)  # where it is, what it names
    minor: bool = False             # real, but too small to explain the gap: listed, never leading

    def to_record(self) -> model.Cause:
        """As summary.json's diagnosis lists it."""
        return model.Cause(kind=self.kind, pair=self.pair, title=self.title, evidence=list(self.evidence),
                           rules_out=list(self.rules_out), fix=self.fix, where=self.where, minor=self.minor)
