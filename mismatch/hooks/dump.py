"""Format v1 written as a training run goes: one line per rollout, appended and fsynced per step.

A hook calls `StepDump.write(rollouts, step=N)` once per training step with format v1 rollout
dicts (`sample_rollout` builds the common one: prompt, then a response whose mask marks the
trained tokens, refusing one whose mask or log-probs do not align with it). The dump never harms
the run it records and never loses a rollout it could keep:

- each line is whole or absent: written under an exclusive lock of the file (processes on one
  machine share it), and a write the disk refuses (full, quota, file size limit) is cut back to the
  line before it, counted (`num_lost`, `first_loss`) and logged, never raised into training;
- a torn tail (a kill mid-write, a crash before the cut) is found and cut when the file is opened,
  so a resumed run appends whole lines after whole lines (`num_torn_bytes` says what was cut);
- every rollout is checked against format v1 before it is written (`check_rollout`, the rules
  `mismatch validate` applies): one that fails is counted and left out with the first reason kept;
- an id already in the file (a hook that numbers its samples per step, a resumed run) is written
  as `ID@sSTEP` (`ID@sSTEP.K` after that), the id given kept in meta.source.id;
- meta is made JSON-safe (numpy and torch scalars and arrays, NaN as null, any other object as its
  repr), so a framework's values never make a line fail to encode.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import math
import operator
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec

from mismatch.errors import MismatchError
from mismatch.rollouts.importers._common import branch, masked_segments

logger = logging.getLogger(__name__)

_TAIL_READ = 1 << 16  # bytes read at a time, backwards, to find the last whole line of a torn file


class DumpInputError(MismatchError):
    """What a hook was given cannot be one rollout: a mask or a log-prob stream that does not align
    with the response (one line: the rollout and the lengths)."""


class DumpSetupError(MismatchError):
    """A hook asked to dump what its run cannot give (no sampler log-probs): one line naming the
    setting that gives them."""


class _IdOnly(msgspec.Struct):
    id: Any = None


class StepDump:
    """An append-only format v1 file for one run (thread-safe: a step's writes never interleave;
    process-safe on one machine: each line is written under flock)."""

    def __init__(self, path: str | os.PathLike[str], *, framework: str, meta: Mapping[str, Any] | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.framework = framework
        self.meta = json_safe_meta(dict(meta or {}))  # e.g. sampler: {engine, dtype, temperature, logprobs}
        self.num_written = 0
        self.num_refused = 0
        self.first_refusal: str | None = None
        self.num_lost = 0  # whole, valid rollouts the disk did not take (full, quota, size limit)
        self.first_loss: str | None = None
        self.num_torn_bytes = 0  # a torn tail cut when the file was opened
        self._lock = threading.Lock()
        self._fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CREAT, 0o644)
        with _locked(self._fd):
            self.num_torn_bytes = _cut_torn_tail(self._fd)
            self._ids = _ids_in(self.path)
        if self.num_torn_bytes:
            logger.warning("mismatch: %s ended in a torn line (%d bytes: a write cut short); cut it, the whole "
                           "lines before it are kept", self.path, self.num_torn_bytes)

    def refuse(self, reason: str) -> None:
        """Count a rollout left out before it reached `write` (a hook's input that is not one)."""
        self.num_refused += 1
        self.first_refusal = self.first_refusal or reason

    def write(self, rollouts: Iterable[dict[str, Any]], *, step: int) -> int:
        """Append `rollouts` tagged with `step` (meta.step) and fsync; returns how many were written.
        Never raises for a rollout or for the disk: see the module's docstring."""
        lines = []
        with self._lock:
            for rollout in rollouts:
                try:
                    line = self._line(rollout, step, self.num_written + len(lines) + 1)
                except Exception as error:  # a hook's rollout must not stop the run: counted, reason kept
                    self.refuse(f"{type(error).__name__}: {error}")
                    continue
                if line is not None:
                    lines.append(line)
            written = self._append(lines)
        return written

    def _line(self, rollout: dict[str, Any], step: int, number: int) -> bytes | None:
        from mismatch.record.writer import encode_line
        from mismatch.rollouts import check_rollout

        step = operator.index(step)  # numpy and torch integers too; 2.5 or "7" is refused (TypeError)
        given = rollout.get("id")
        meta = json_safe_meta({**self.meta, **dict(rollout.get("meta") or {}), "step": step})
        source = {"format": self.framework, "hook": "mismatch.hooks"}
        rollout_id = self._unique(given, step)
        if rollout_id != given:
            source["id"] = given
        rollout = {**rollout, "id": rollout_id, "meta": {**meta, "source": source}}
        _, errors = check_rollout(rollout, file=str(self.path), line=number, vocab_size=None)
        if errors:
            self.refuse(str(errors[0]))
            return None
        return encode_line(rollout)

    def _unique(self, rollout_id: Any, step: int) -> Any:
        if not isinstance(rollout_id, str) or rollout_id not in self._ids:
            return rollout_id
        candidate, k = f"{rollout_id}@s{step}", 1
        while candidate in self._ids:
            candidate, k = f"{rollout_id}@s{step}.{k}", k + 1
        return candidate

    def _append(self, lines: list[bytes]) -> int:
        """Each line whole or not at all; what the disk refuses is cut back and counted."""
        if not lines:
            return 0
        written = 0
        try:
            if self._fd < 0:  # written after close(): lost like a refused write, never raised
                raise OSError(errno.EBADF, "the dump was closed", str(self.path))
            with _locked(self._fd):
                for line in lines:
                    end = os.fstat(self._fd).st_size
                    try:
                        _write_all(self._fd, line)
                    except OSError:
                        os.ftruncate(self._fd, end)  # no half line for the next write to be glued to
                        raise
                    written += 1
                    self._ids.add(_id_of(line))
                os.fsync(self._fd)
        except OSError as error:
            self.num_lost += len(lines) - written
            reason = f"{errno.errorcode.get(error.errno or 0, 'OSError')}: {error.strerror or error}"
            self.first_loss = self.first_loss or reason
            logger.warning("mismatch: %d rollout(s) not written to %s (%s); the file keeps whole lines only",
                           len(lines) - written, self.path, reason)
        self.num_written += written
        return written

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def __enter__(self) -> StepDump:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _locked:
    """flock(LOCK_EX) on a file descriptor for a `with` block."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __enter__(self) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def __exit__(self, *exc: object) -> None:
        fcntl.flock(self.fd, fcntl.LOCK_UN)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:  # a regular file takes the whole line; a short write (the disk filling) loops to its error
        view = view[os.write(fd, view):]


def _cut_torn_tail(fd: int) -> int:
    """Truncate the file after its last newline; the bytes cut (0 when it ends in one or is empty).
    Every line the dump writes ends in a newline: a tail without one was cut short mid-write."""
    size = os.fstat(fd).st_size
    end = size
    while end > 0:
        start = max(0, end - _TAIL_READ)
        block = os.pread(fd, end - start, start)
        newline = block.rfind(b"\n")
        if newline >= 0:
            end = start + newline + 1
            break
        end = start
    if end < size:
        os.ftruncate(fd, end)
    return size - end


def _ids_in(path: Path) -> set[str]:
    """The ids already in the file (a resumed run must not write one again); a line that is not a
    rollout is `mismatch validate`'s to report, not the hook's."""
    decoder = msgspec.json.Decoder(_IdOnly)
    ids: set[str] = set()
    with open(path, "rb") as handle:
        for line in handle:
            try:
                found = decoder.decode(line).id
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            if isinstance(found, str):
                ids.add(found)
    return ids


def _id_of(line: bytes) -> Any:
    return msgspec.json.decode(line, type=_IdOnly).id


def json_safe_meta(value: Any, depth: int = 0) -> Any:
    """`value` as JSON holds it: numpy/torch scalars and arrays as numbers and lists, NaN and ±inf as
    null, keys as strings, any other object as its repr (a framework's config object, a dtype)."""
    if depth > 32:  # a self-referencing or absurdly deep object: its repr, cut
        return repr(value)[:200]
    if value is None or isinstance(value, (bool, str)):
        return value
    if isinstance(value, int):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(key): json_safe_meta(item, depth + 1) for key, item in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [json_safe_meta(item, depth + 1) for item in value]
    if callable(getattr(value, "tolist", None)):  # numpy and torch: scalars and arrays
        try:
            return json_safe_meta(value.tolist(), depth + 1)
        except Exception:  # a tensor on a device that cannot be read here
            return repr(value)[:200]
    if callable(getattr(value, "item", None)):
        try:
            return json_safe_meta(value.item(), depth + 1)
        except Exception:
            return repr(value)[:200]
    return repr(value)[:200]


def sample_rollout(rollout_id: str, prompt: Sequence[int], response: Sequence[int], mask: Sequence[int],
                   sampler_logprobs: Sequence[float] | None, *, extra_logprobs: Mapping[str, Sequence[float]] | None = None,
                   off_role: str = "tool", meta: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """One format v1 rollout of a prompt and a response: mask-1 runs are assistant tokens with the
    sampler's log-probs (and each `extra_logprobs` stream, e.g. the trainer's old log-probs, under its
    name), mask-0 runs `off_role` ("tool": environment tokens inside the response; "assistant":
    sampled tokens left out of the loss). Log-probs are per response token, as frameworks keep them.

    The mask and every log-prob stream must have one entry per response token: a 13-entry mask on
    15 tokens dropped 2 tokens, one extra leading log-prob shifted every log-prob by a token, and
    both made lines that validate. Raises DumpInputError (a hook counts it as a refusal)."""
    response, mask = [int(t) for t in response], [int(bool(m)) for m in mask]
    _aligned(rollout_id, "mask", len(mask), len(response))
    logp = _floats(sampler_logprobs)
    if logp is not None:
        _aligned(rollout_id, "sampler log-probs", len(logp), len(response))
    extra = {name: _floats(values) for name, values in (extra_logprobs or {}).items()}
    for name, values in extra.items():
        if values is not None:
            _aligned(rollout_id, f"extra_logprobs[{name!r}]", len(values), len(response))
    segments = [{"role": "user", "tokens": [int(t) for t in prompt], "trainable": False},
                *masked_segments(response, mask, logp, off_role=off_role)]
    if extra:
        _attach_extra(segments[1:], extra)
    return {"id": rollout_id, "meta": dict(meta or {}), "branches": [branch("main", segments)]}


def _aligned(rollout_id: str, what: str, count: int, num_tokens: int) -> None:
    if count != num_tokens:
        raise DumpInputError(f"rollout {rollout_id!r}: {count} {what} entries for {num_tokens} response tokens "
                             "(one per response token)")


def _floats(values: Sequence[float] | None) -> list[float] | None:
    """Plain floats; a NaN or infinity is not a log-prob a line can hold (the check refuses it)."""
    if values is None:
        return None
    return [float(v) if math.isfinite(float(v)) else float("nan") for v in values]


def _attach_extra(segments: list[dict[str, Any]], extra: dict[str, list[float] | None]) -> None:
    """Each extra stream split over the response's assistant segments, like the sampler's."""
    offset = 0
    for segment in segments:
        count = len(segment["tokens"])
        if segment["role"] == "assistant":
            streams = {name: values[offset:offset + count] for name, values in extra.items() if values is not None}
            if streams:
                segment["extra_logprobs"] = streams
        offset += count
