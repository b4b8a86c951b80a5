"""Options several commands share, and the checks of their values made before any work.

Parsing that needs the library imports it on use, so `mismatch --help` stays light.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Optional

import typer

from mismatch.errors import MismatchError

if TYPE_CHECKING:
    from mismatch.frameworks.protocol import Target
    from mismatch.results.summary_model import ProbeResult


JsonFlag = Annotated[bool, typer.Option("--json", help="Print machine-readable JSON to stdout.")]
FrameworkOption = Annotated[Optional[str], typer.Option(
    "--for", help="Your trainer: verl, trl, slime, prime-rl, openrlhf or areal, as NAME[==VERSION]"
                  "[:SETTING=VALUE,...] (its own correction settings; default: $MISMATCH_FRAMEWORK).")]
ShardOption = Annotated[Optional[str], typer.Option(
    "--shard", help="Replay only shard I of N (I/N, 0-based); combine with `mismatch merge`.")]
BlockOption = Annotated[int, typer.Option(
    "--block-size", min=1, help="Rollouts per unit of work (resume, shards, batching).")]
DEFAULT_BLOCK = 64  # mismatch.replay.DEFAULT_BLOCK, repeated so --help needs no heavy import


def read_probes(path: Path) -> list[ProbeResult]:
    """The `results` of a `mismatch probe --out FILE` JSON."""
    import msgspec

    from mismatch.results.summary_model import Probes, present

    try:
        payload = json.loads(path.read_text())
    except FileNotFoundError:
        raise MismatchError(f"{path}: no such probes file") from None
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
        raise MismatchError(f"{path}: not valid JSON ({exc})") from None
    not_probes = MismatchError(f"{path}: not a `mismatch probe --out` file (no `results` list)")
    if not isinstance(payload, dict):
        raise not_probes
    try:
        results = present(msgspec.convert(payload, Probes, strict=False).results)
    except msgspec.ValidationError as error:  # names the field: `$.results[0].bitwise_equal_frac`
        raise MismatchError(f"{path}: {error}") from None
    if results is None:
        raise not_probes
    return results


def target_for(spec: str | None) -> Target | None:
    """--for, else $MISMATCH_FRAMEWORK: NAME[==VERSION][:SETTING=VALUE,...]; checked before any work."""
    from mismatch.frameworks import parse_target

    spec = spec or os.environ.get("MISMATCH_FRAMEWORK") or None
    if spec is None:
        return None
    try:
        return parse_target(spec)
    except MismatchError as error:
        source = "--for" if spec != os.environ.get("MISMATCH_FRAMEWORK") else "MISMATCH_FRAMEWORK"
        raise MismatchError(f"{source}: {error}") from None


def shard_for(text: str | None):
    from mismatch.replay import Shard

    return Shard.parse(text) if text is not None else None
