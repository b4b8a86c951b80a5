"""Format v1 written as a training run goes: one line per rollout, appended and fsynced per step.

A hook calls `StepDump.write(rollouts, step=N)` once per training step with format v1 rollout
dicts (`sample_rollout` builds the common one: prompt, then a response whose mask marks the
trained tokens). Each line is one `write` of one complete line, fsynced before the call returns,
so a killed run loses at most the step being written, never a line already there; a resumed run
appends to the same file. Every line is checked against format v1 before it is written: a hook
must never write a file `mismatch audit` refuses, and never stop the training run either, so a
rollout that fails the check is counted and left out, with the first reason kept.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from mismatch.rollouts.importers._common import branch, masked_segments


class StepDump:
    """An append-only format v1 file for one run (thread-safe: a step's writes never interleave)."""

    def __init__(self, path: str | os.PathLike[str], *, framework: str, meta: Mapping[str, Any] | None = None) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.framework = framework
        self.meta = dict(meta or {})  # e.g. sampler: {engine, dtype, temperature, logprobs}
        self.num_written = 0
        self.num_refused = 0
        self.first_refusal: str | None = None
        self._lock = threading.Lock()
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, rollouts: Iterable[dict[str, Any]], *, step: int) -> int:
        """Append `rollouts` tagged with `step` (meta.step) and fsync; returns how many were written."""
        from mismatch.record.writer import encode_line
        from mismatch.rollouts import check_rollout

        lines = []
        for rollout in rollouts:
            rollout = {**rollout, "meta": {**self.meta, **rollout.get("meta", {}), "step": int(step),
                                           "source": {"format": self.framework, "hook": "mismatch.hooks"}}}
            _, errors = check_rollout(rollout, file=str(self.path), line=self.num_written + len(lines) + 1,
                                      vocab_size=None)
            if errors:
                self.num_refused += 1
                self.first_refusal = self.first_refusal or str(errors[0])
                continue
            lines.append(encode_line(rollout))
        with self._lock:
            for line in lines:
                view = memoryview(line)
                while view:  # a regular file takes the whole line; the loop covers a short write
                    view = view[os.write(self._fd, view):]
            os.fsync(self._fd)
            self.num_written += len(lines)
        return len(lines)

    def close(self) -> None:
        with self._lock:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1

    def __enter__(self) -> StepDump:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def sample_rollout(rollout_id: str, prompt: Sequence[int], response: Sequence[int], mask: Sequence[int],
                   sampler_logprobs: Sequence[float] | None, *, extra_logprobs: Mapping[str, Sequence[float]] | None = None,
                   off_role: str = "tool", meta: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """One format v1 rollout of a prompt and a response: mask-1 runs are assistant tokens with the
    sampler's log-probs (and each `extra_logprobs` stream, e.g. the trainer's old log-probs, under its
    name), mask-0 runs `off_role` ("tool": environment tokens inside the response; "assistant":
    sampled tokens left out of the loss). Log-probs are per response token, as frameworks keep them."""
    response, mask = [int(t) for t in response], [int(bool(m)) for m in mask]
    logp = _floats(sampler_logprobs)
    segments = [{"role": "user", "tokens": [int(t) for t in prompt], "trainable": False},
                *masked_segments(response, mask, logp, off_role=off_role)]
    if extra_logprobs:
        _attach_extra(segments[1:], {name: _floats(values) for name, values in extra_logprobs.items()})
    return {"id": rollout_id, "meta": dict(meta or {}), "branches": [branch("main", segments)]}


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
