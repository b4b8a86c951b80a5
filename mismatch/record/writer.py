"""The recording's only disk I/O: whole JSONL lines appended from a bounded queue, fsynced per batch.

Last step of `mismatch record`: `proxy` puts finished rollouts on the queue; this task writes
them in a worker thread, so no request handler ever waits on the disk. A rollout reaches the
file as one `write` of one complete line and is fsynced before the next batch starts: a crash
loses the conversations still open, never a line already written.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

QUEUE_SIZE = 1024  # rollouts waiting for the disk; past it the flusher waits, the harness does not
_DONE = None  # the sentinel that ends the writer


def open_out(path: Path, *, force: bool) -> int:
    """The output file's descriptor, opened for appending (created, or emptied with --force)."""
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | (os.O_TRUNC if force else os.O_EXCL)
    return os.open(path, flags, 0o644)


def encode_line(rollout: dict[str, Any]) -> bytes:
    # allow_nan=False: a NaN would make a line no JSON parser reads back.
    text = json.dumps(rollout, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    try:
        return (text + "\n").encode()
    except UnicodeEncodeError:
        # A lone surrogate (a harness's "\ud800" escape) has no UTF-8: written as the escape it came as.
        return (json.dumps(rollout, separators=(",", ":"), allow_nan=False) + "\n").encode()


def _append(fd: int, lines: list[bytes]) -> None:
    for line in lines:
        view = memoryview(line)
        while view:  # a regular file takes the whole line; the loop covers a short write
            written = os.write(fd, view)
            view = view[written:]
    os.fsync(fd)


class Writer:
    """Append-only writer task: `put` rollouts, then `close` to drain, sync and close the file."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.queue: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=QUEUE_SIZE)
        self.num_written = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._write_batches())

    async def put(self, rollout: dict[str, Any]) -> None:
        await self.queue.put(encode_line(rollout))

    async def _write_batches(self) -> None:
        while True:
            line = await self.queue.get()
            batch = [line]
            while not self.queue.empty():  # everything already waiting goes in one fsync
                batch.append(self.queue.get_nowait())
            lines = [item for item in batch if item is not _DONE]
            if lines:
                await asyncio.to_thread(_append, self.fd, lines)
                self.num_written += len(lines)
            if _DONE in batch:
                return

    async def close(self) -> None:
        await self.queue.put(_DONE)
        if self._task is not None:
            await self._task
        os.close(self.fd)
