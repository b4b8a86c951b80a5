"""The checkpoint each rollout declares it was sampled by (format v1 `meta.checkpoint`) against the
one this audit replays: summary.json `declared_checkpoint` (its `line`: said first when they disagree).

Terms. A declaration is a name or path (a string), or an object with `path` (or `name`) and/or
`sha256`: each weight file's SHA-256 by file name, as summary.json `inputs.checkpoint` lists the
audited one's (mismatch/identity.py). A declaration *matches by weights* when it gives digests and
they are the audited checkpoint's safetensors files' (all, no more), *differs by weights* when it
gives digests that are not; without digests it *matches by name* when its path is the audited
directory (resolved) or its last component is the directory's name, else it *differs by name*:
another name says nothing of the weights (a copy under another name), which the data decide (the
identity test, advise/admissibility.py).
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import msgspec

from mismatch.results.summary_model import DeclaredCheckpoint, DeclaredRow

MATCHES = ("same weights", "same name")          # a declaration that agrees with the audited checkpoint
DIFFERS = ("other weights", "another name")      # one that does not (by weights: decisive; by name: not)


class Declaration(msgspec.Struct, frozen=True, kw_only=True):
    """meta.checkpoint's object form (rollouts/rules.py check_declared_checkpoint has validated it)."""

    path: str | None = None
    name: str | None = None
    sha256: dict[str, str] | None = None  # weight file name -> digest: the files are the run's

    @property
    def named(self) -> str | None:
        return self.path or self.name


def _declaration(value: str | dict[str, Any]) -> str | Declaration:
    return value if isinstance(value, str) else msgspec.convert(value, Declaration)


def compare_declared(declared: list[Any], checkpoint: str | Path,
                     identity: list[dict[str, Any]] | None) -> DeclaredCheckpoint | None:
    """summary.json `declared_checkpoint` of each rollout's meta.checkpoint (None: undeclared)
    against `checkpoint` and its `identity` (inputs.checkpoint); None when no rollout declares one.

    `declared`: each distinct declaration with its rollout count and `match` (MATCHES, DIFFERS);
    `agrees`: every declaration matches; `by_weights`: whether any was compared by digests."""
    counts = Counter(_key(value) for value in declared if value is not None)
    if not counts:
        return None
    weights = {entry["file"]: entry["sha256"] for entry in identity or [] if "sha256" in entry}
    rows = [DeclaredRow(checkpoint=json.loads(key), rollouts=count,
                        match=_match(_declaration(json.loads(key)), Path(checkpoint), weights))
            for key, count in counts.most_common()]
    return DeclaredCheckpoint(
        rollouts=len(declared), undeclared=sum(value is None for value in declared), declared=rows,
        agrees=all(row.match in MATCHES for row in rows),
        by_weights=any(isinstance(found := _declaration(row.checkpoint), Declaration) and bool(found.sha256)
                       for row in rows))


def merged_declared(shards: list[tuple[DeclaredCheckpoint | None, int]]) -> DeclaredCheckpoint | None:
    """The shards' `declared_checkpoint` (each one's section, None where it declared nothing, with
    its rollout count) as one run's: each declaration's rollouts summed, a shard without the
    section counted undeclared; its `line` is worded again once the merged diagnosis is made."""
    if not any(found for found, _ in shards):
        return None
    counts: Counter[str] = Counter()
    match: dict[str, str] = {}
    for found, _ in shards:
        for row in found.declared if found else []:
            counts[_key(row.checkpoint)] += row.rollouts
            match[_key(row.checkpoint)] = row.match  # one checkpoint audited: the same match in each
    rows = [DeclaredRow(checkpoint=json.loads(key), rollouts=count, match=match[key])
            for key, count in counts.most_common()]
    return DeclaredCheckpoint(
        rollouts=sum(found.rollouts if found else count for found, count in shards),
        undeclared=sum(found.undeclared if found else count for found, count in shards),
        declared=rows, agrees=all(row.match in MATCHES for row in rows),
        by_weights=any(found is not None and found.by_weights is True for found, _ in shards))


def _key(value: Any) -> str:
    return json.dumps(value, sort_keys=True)


def _match(value: str | Declaration, checkpoint: Path, weights: dict[str, str]) -> str:
    if isinstance(value, Declaration) and value.sha256:
        return "same weights" if weights and value.sha256 == weights else "other weights"
    path = Path(str(value if isinstance(value, str) else value.named).rstrip("/"))
    try:
        same = path.resolve() == checkpoint.resolve() or path.name == checkpoint.resolve().name
    except (OSError, RuntimeError):
        same = path.name == checkpoint.name
    return "same name" if same else "another name"


def declared_name(value: str | dict[str, Any]) -> str:
    """A declaration as the output names it: its path or name, and its digests by count."""
    found = _declaration(value)
    if isinstance(found, str):
        return found
    named, digests = found.named or "(unnamed)", found.sha256 or {}
    return f"{named} ({len(digests)} weight file digest{'s' if len(digests) != 1 else ''})" if digests else str(named)


def declared_line(found: DeclaredCheckpoint | None, checkpoint: str, *, identity_cause: bool) -> str | None:
    """The first line of an audit's output when the rollouts' meta.checkpoint disagrees with the
    audited checkpoint (None when it agrees or nothing is declared): what they declare, with counts
    when the file mixes declarations, and what the data say: the identity test fired
    (`identity_cause`), or the data agree with this checkpoint (a notice, not a cause), or, when
    the digests differ, that they are other weights whatever the gap."""
    if not found or found.agrees:
        return None
    rows, total = found.declared, found.rollouts
    named = "; ".join(f"{declared_name(row.checkpoint)} ({row.rollouts} of {total} rollouts, {row.match})"
                      for row in rows)
    undeclared = f"; {found.undeclared} undeclared" if found.undeclared else ""
    head = f"the rollouts declare meta.checkpoint {named}{undeclared}; this audit replays {checkpoint}"
    if identity_cause:
        return f"{head}: the data agree that they were not sampled by it"
    if any(row.match == "other weights" for row in rows):
        return f"{head}: their weight digests differ from its files', though the gap does not show it"
    return f"{head}: notice, not a cause: the data agree with this checkpoint (a copy under another name?)"
