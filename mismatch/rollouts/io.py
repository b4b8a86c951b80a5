"""Rollout files, read one rollout at a time: JSONL or Parquet -> checked `Rollout`s.

The first step of the flow (ARCHITECTURE.md, "Load and check"): each line or row is decoded and
checked (`decode`), then checked against the ones before it in its file (`FileChecks`: unique
ids, one routing shape), so an error names its file:line, rollout and field; nothing is held
but the rollout at hand.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from mismatch.errors import RolloutError
from mismatch.rollouts.decode import UNPARSED, check_rollout, decode_line, loads, raw_id
from mismatch.rollouts.model import Rollout, first_routed
from mismatch.rollouts.problems import layers_by_k, short_id

PARQUET_BATCH_SIZE = 256
SKIPPED = object()  # a line read past, not decoded (another reader's: rollouts/forked.py)
# The read buffer of a JSONL file: a rollout's line is tens of kB, and Python's default buffer (8
# kB) reads one in several system calls and pieces joined; every forked reader reads every line.
# Reading the lines of the benchmark's 233 MB file, CPU-s: 0.19-0.25 by default, 0.07-0.08 with 64
# kB, 0.14 with 1 MB (past the CPU's caches).
READ_BUFFER = 64 * 2**10

Rows = Iterator[tuple[int, object, list[RolloutError]]]  # (line or row, decoded value, read errors)


@dataclass(kw_only=True, slots=True, frozen=True)
class ValidationReport:
    num_rollouts: int  # valid rollouts
    num_invalid: int  # rollouts (lines/rows) with at least one error
    num_branches: int  # counts below are over valid rollouts only
    num_tokens: int  # sum of each branch's own stream (shared context is not counted twice)
    num_trainable_tokens: int
    errors: list[RolloutError]
    truncated: bool  # more than max_errors errors; the rest were counted in num_invalid only

    @property
    def ok(self) -> bool:
        return not self.errors


# ---------------------------------------------------------------------------------------------
# Readers: (line, value, errors) of each rollout of a file


def read_jsonl(path: Path, file: str, wanted: Callable[[int], bool] | None = None, limit: int | None = None) -> Rows:
    """(line, value, errors) of each rollout line; `wanted(n)` says whether the file's n-th
    rollout (from 0) is decoded, the others come as SKIPPED. `limit`: only the whole lines within
    the file's first `limit` bytes are read (the size a run pinned: rollouts/pinned.py)."""
    number = -1
    with path.open("rb", buffering=READ_BUFFER) as f:
        for line_no, text in enumerate(f if limit is None else _lines_within(f, limit), start=1):
            if not text or text.isspace():  # as `not text.strip()`, without copying the line
                continue
            number += 1
            if wanted is not None and not wanted(number):
                yield line_no, SKIPPED, []
                continue
            raw, why = decode_line(text)
            errors = [] if why is None else [RolloutError(f"invalid JSON: {why}", file=file, line=line_no)]
            yield line_no, raw, errors


def _lines_within(handle: BinaryIO, limit: int) -> Iterator[bytes]:
    """The lines of the file's first `limit` bytes. A last one the limit cuts (no newline) while
    the file goes on past it was still being written when the size was taken: not yet a line.
    (One that ends the file without a newline is a line, as it is without a limit.)"""
    left = limit
    while left > 0 and (text := handle.readline(left)):
        left -= len(text)
        if left == 0 and not text.endswith(b"\n") and handle.read(1):
            return
        yield text


def _decode_json_columns(row: dict, file: str, line: int) -> list[RolloutError]:
    """Parquet may hold the free-form `meta` and `messages` as JSON strings; decode them in place."""
    errors = []
    rollout_id = row.get("id") if isinstance(row.get("id"), str) and row["id"] else None
    for key in ("meta", "messages"):
        if isinstance(row.get(key), str):
            row[key], why = loads(row[key])
            if why is not None:
                errors.append(RolloutError(f"invalid JSON: {why}", file=file, line=line,
                                           rollout=short_id(rollout_id), field=key))
                row[key] = None  # reported once here, not again as "must be an object"
    return errors


def _read_parquet(path: Path, file: str) -> Rows:
    # Imported here: JSONL users should not pay for pyarrow's import.
    import pyarrow as pa
    import pyarrow.parquet as pq

    def unreadable(e: Exception) -> RolloutError:
        if isinstance(e, UnicodeDecodeError):  # Arrow does not check UTF-8 on read; Python decodes
            reason = f"a string is not UTF-8 (byte 0x{e.object[e.start]:02x})"
        else:  # Arrow's messages may span lines (thrift errors end in "\n"); keep the first.
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return RolloutError(f"not a readable Parquet file: {reason}", file=file)

    try:
        parquet = pq.ParquetFile(path)
    # ArrowInvalid; OSError for a corrupt footer; UnicodeDecodeError for damaged schema names
    except (pa.ArrowException, OSError, UnicodeDecodeError) as e:
        raise unreadable(e) from None
    batches = parquet.iter_batches(batch_size=PARQUET_BATCH_SIZE)
    row_no = 0
    while True:
        try:  # a corrupt page surfaces only when its batch is read
            batch = next(batches, None)
            rows = None if batch is None else batch.to_pylist()
        except (pa.ArrowException, OSError, UnicodeDecodeError) as e:
            raise unreadable(e) from None
        if rows is None:
            return
        for row in rows:
            row_no += 1
            yield row_no, row, _decode_json_columns(row, file, row_no)


def open_rollouts(path: str | os.PathLike[str], limit: int | None = None) -> tuple[str, Rows]:
    """Check the path now (not at the first `next`) and pick the reader by suffix. `limit`: a
    JSONL file is read to that many bytes (read_jsonl); a Parquet file is written whole, never
    appended, so a run's pin needs only its digest (rollouts/pinned.py)."""
    file = os.fspath(path)
    p = Path(file)
    if not p.exists():
        raise RolloutError("no such file", file=file)
    if not p.is_file():
        raise RolloutError("not a file", file=file)
    try:  # fail now, with one line, rather than with a PermissionError at the first `next`
        p.open("rb").close()
    except OSError as e:
        raise RolloutError(f"cannot read: {e.strerror or e}", file=file) from None
    if p.suffix.lower() == ".parquet":
        return file, _read_parquet(p, file)
    return file, read_jsonl(p, file, limit=limit)


# ---------------------------------------------------------------------------------------------
# Checks across a file


@dataclass(frozen=True, slots=True)
class LineFacts:
    """What the checks across a file need of one of its rollouts (picklable: a forked reader
    sends them to the process that checks the file's order, rollouts/forked.py)."""

    line: int
    raw_id: str | None                          # the `id` as written, when a non-empty string
    rollout_id: str | None                      # the valid rollout's id
    routed: tuple[str, tuple[int, int]] | None  # (field, (layers, k)) of its first routed_experts

    @classmethod
    def of(cls, line: int, raw: object, rollout: Rollout | None) -> LineFacts:
        written = raw_id(raw)
        return cls(line=line, raw_id=written if isinstance(written, str) and written else None,
                   rollout_id=rollout.id if rollout is not None else None,
                   routed=first_routed(rollout) if rollout is not None else None)


class FileChecks:
    """The checks of a rollout against the ones before it in its file: one routing shape, unique ids."""

    def __init__(self, file: str) -> None:
        self.file = file
        self.first_line: dict[str, int] = {}  # rollout id -> line; one small entry per rollout, not per token
        self.routing: tuple[int, tuple[int, int]] | None = None  # (line, shape) of the first stored routing

    def errors(self, facts: LineFacts) -> list[RolloutError]:
        errors = []
        first = facts.routed
        if first is not None and self.routing is None:
            self.routing = (facts.line, first[1])
        elif first is not None and first[1] != self.routing[1]:
            errors.append(RolloutError(f"{layers_by_k(first[1])} per token, but line {self.routing[0]} stores "
                                       f"{layers_by_k(self.routing[1])} (one model routes a file)", file=self.file,
                                       line=facts.line, rollout=short_id(facts.rollout_id), field=first[0]))
        if facts.raw_id is not None:
            if facts.raw_id in self.first_line:
                errors.append(RolloutError(f"duplicate rollout id (first at line {self.first_line[facts.raw_id]})",
                                           file=self.file, line=facts.line, rollout=short_id(facts.raw_id),
                                           field="id"))
            else:
                self.first_line[facts.raw_id] = facts.line
        return errors


def _checked(file: str, rows: Rows, vocab_size: int | None,
             num_experts: int | None = None) -> Iterator[tuple[Rollout | None, list[RolloutError]]]:
    checks = FileChecks(file)
    for line, raw, read_errors in rows:
        if raw is UNPARSED:
            yield None, read_errors
            continue
        rollout, errors = check_rollout(raw, file=file, line=line, vocab_size=vocab_size, num_experts=num_experts)
        errors = read_errors + errors + checks.errors(LineFacts.of(line, raw, rollout))
        yield (None if errors else rollout), errors


def empty_file_error(file: str) -> RolloutError:
    return RolloutError("no rollouts (empty file)", file=file)


# ---------------------------------------------------------------------------------------------
# The public readers


def iter_rollouts(path: str | os.PathLike[str], *, vocab_size: int | None = None,
                  num_experts: int | None = None, limit: int | None = None,
                  skip_invalid: bool = False) -> Iterator[Rollout]:
    """Rollouts of a JSONL or Parquet file, one at a time; raises `RolloutError` at the first bad one.
    `limit`: a JSONL file's whole lines within its first `limit` bytes only (open_rollouts).
    `skip_invalid`: a rollout in error is passed over (`validate_file` lists them) instead; a file
    with no valid rollout is still refused. (A file that cannot be read at all is refused either way.)"""
    file, rows = open_rollouts(path, limit)
    return _iter_valid(file, rows, vocab_size, num_experts, skip_invalid)


def _iter_valid(file: str, rows: Rows, vocab_size: int | None, num_experts: int | None,
                skip_invalid: bool = False) -> Iterator[Rollout]:
    num_rollouts = num_skipped = 0
    for rollout, errors in _checked(file, rows, vocab_size, num_experts):
        if errors:
            if skip_invalid:
                num_skipped += 1
                continue
            raise errors[0]
        num_rollouts += 1
        yield rollout
    if num_rollouts == 0:
        raise (empty_file_error(file) if not num_skipped else
               RolloutError(f"no valid rollout ({num_skipped} invalid, skipped); `mismatch validate` lists them",
                            file=file))


def load_rollouts(path: str | os.PathLike[str], *, vocab_size: int | None = None,
                  num_experts: int | None = None) -> list[Rollout]:
    return list(iter_rollouts(path, vocab_size=vocab_size, num_experts=num_experts))


def validate_file(path: str | os.PathLike[str], *, vocab_size: int | None = None, num_experts: int | None = None,
                  max_errors: int = 1000) -> ValidationReport:
    """Every problem in a file (up to max_errors), still streaming; raises only if the file cannot be opened."""
    file, rows = open_rollouts(path)
    num_rollouts = num_invalid = num_branches = num_tokens = num_trainable = 0
    errors: list[RolloutError] = []
    truncated = False
    for rollout, rollout_errors in _checked(file, rows, vocab_size, num_experts):
        if rollout_errors:
            num_invalid += 1
            room = max_errors - len(errors)
            truncated = truncated or len(rollout_errors) > room
            errors.extend(rollout_errors[:room])
            continue
        num_rollouts += 1
        num_branches += len(rollout.branches)
        for branch in rollout.branches:
            num_tokens += branch.num_tokens
            num_trainable += sum(len(s.tokens) for s in branch.segments if s.trainable)
    if num_rollouts == 0 and num_invalid == 0:
        errors.append(empty_file_error(file))
    return ValidationReport(num_rollouts=num_rollouts, num_invalid=num_invalid, num_branches=num_branches,
                            num_tokens=num_tokens, num_trainable_tokens=num_trainable, errors=errors,
                            truncated=truncated)
