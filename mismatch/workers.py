"""Forked processes: jobs run side by side (`fork_jobs`, the parent running the first itself),
the plumbing the rollouts readers share (`forked`, `reporting`, `send_payload`, `received`,
`PrefetchedReceiver`, `stop`), and how many processes an analysis, or the reading of a rollouts
file, may use.

A fork, not a fresh interpreter: the child starts with the parent's imports and data (a token
table in memory, the closures that read tokens.parquet), so nothing but a child's results is
pickled, and only on its way back; their large buffers (arrays, Arrow's) travel beside the
pickle, as they lie in memory (`send_payload`). A child dies with its parent however the parent dies (kill -9
included: `_dies_with_parent`), so none is left stuck on a pipe, holding the parent's files.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import pickle
import queue
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from multiprocessing.connection import Connection
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from mismatch.errors import MismatchError

T = TypeVar("T")
WORKERS_VARIABLE = "MISMATCH_WORKERS"
# What the work can use: an analysis pass is read in two halves (analysis/chunked.py, PARTS_PER_PASS), so
# a third process would have nothing to read.
ANALYSIS_PROCESSES = 2
# Below this much work a fork costs more than it saves: a million token rows, and the rollouts
# file of about as many tokens.
MIN_ROWS_TO_FORK = 1_000_000
MIN_BYTES_TO_FORK = 32 * 2**20
# prctl(2) option (linux/prctl.h): the signal the kernel sends this process when its parent dies.
_PR_SET_PDEATHSIG = 1


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity where the system tells it, else all of them."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def analysis_workers(num_rows: int, environ: Mapping[str, str] | None = None) -> int:
    """How many processes the analysis of `num_rows` token rows uses (see _workers)."""
    return _workers(ANALYSIS_PROCESSES if num_rows >= MIN_ROWS_TO_FORK else 1, environ)


def reading_workers(num_bytes: int, environ: Mapping[str, str] | None = None) -> int:
    """How many forked processes read a rollouts file of `num_bytes` (rollouts/forked.py). Every
    reader scans each line to find its own blocks, so each further one is paid for by another
    MIN_BYTES_TO_FORK of the file."""
    return _workers(1 + num_bytes // MIN_BYTES_TO_FORK if num_bytes >= MIN_BYTES_TO_FORK else 1, environ)


def _workers(usable: int, environ: Mapping[str, str] | None) -> int:
    """MISMATCH_WORKERS when set (1: never fork; whatever the size), else as many as the work can
    use (`usable`), up to the CPUs this process may run on."""
    text = (os.environ if environ is None else environ).get(WORKERS_VARIABLE)
    if text is not None:
        if not text.strip().isdigit() or int(text) < 1:
            raise MismatchError(f"{WORKERS_VARIABLE}={text!r}: must be a whole number of processes, 1 or more")
        return int(text)
    return max(1, min(usable, usable_cpus()))


def fork_jobs(jobs: Sequence[Callable[[], T]]) -> list[T]:
    """Each job's result, in order: the first run here, every other one in a forked child."""
    children: list[Forked] = []
    try:
        children.extend(forked(_child, job) for job in jobs[1:])
        results = [jobs[0]()]
        results.extend(received(child, "an analysis worker") for child in children)
        return results
    finally:
        stop(children)


def _child(job: Callable[[], object], send: Connection) -> None:
    with reporting(send):
        send_payload(send, job())


Forked = tuple[multiprocessing.process.BaseProcess, Connection]  # a forked child and the end it sends to


def forked(target: Callable[..., None], *args: Any) -> Forked:
    """A forked daemon child running target(*args, send): it sends (True, payload) messages, or
    (False, a traceback) when it fails (`reporting`)."""
    # Output buffered before the fork would be written again by the child as it exits.
    sys.stdout.flush()
    sys.stderr.flush()
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    child = context.Process(target=_as_child, args=(os.getpid(), target, *args, send), daemon=True)
    child.start()
    send.close()
    return child, receive


def _as_child(parent: int, target: Callable[..., None], *args: Any) -> None:
    _dies_with_parent(parent)
    target(*args)


def _dies_with_parent(parent: int) -> None:
    """In a forked child, first thing: killed (SIGKILL) when `parent` dies, however it dies.

    A daemon child is killed by its parent's exit only when the parent exits normally; a parent
    killed by a signal (kill -9, or SIGTERM before the CLI caught it) left its readers stuck on a
    pipe forever. Linux's parent-death signal goes with the thread that forked the child (every
    fork here is made and waited for by one thread). Elsewhere a thread watches the parent."""
    libc_prctl = getattr(ctypes.CDLL(None), "prctl", None) if sys.platform.startswith("linux") else None
    if libc_prctl is not None:
        libc_prctl(_PR_SET_PDEATHSIG, ctypes.c_ulong(signal.SIGKILL))
    else:
        threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()
    if os.getppid() != parent:  # the parent died before the signal was asked for: nobody to send to
        os._exit(1)
    # The terminal's Ctrl-C reaches the whole process group: the parent alone decides (it stops
    # its children as it unwinds); SIGTERM kills a child at once, not the parent's CLI handler.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        threading.Event().wait(0.5)
    os._exit(1)


@contextmanager
def reporting(send: Connection) -> Iterator[None]:
    """In a child: whatever stops it goes to the parent as (False, its traceback)."""
    try:
        yield
    except BaseException:  # noqa: BLE001 - whatever stopped the child is the parent's to raise
        send.send((False, traceback.format_exc()))
    finally:
        send.close()


# A buffer this large or larger travels beside its payload's pickle (send_payload); a smaller one
# is copied into it, not worth a write of its own.
OUT_OF_BAND_BYTES = 64 * 2**10


@dataclass(frozen=True, slots=True)
class _OutOfBand:
    """A payload pickled with protocol 5 (PEP 574) and the sizes of its buffers, which follow this
    message through the pipe, raw and in order."""

    pickled: bytes
    sizes: tuple[int, ...]

    def load(self, receive: Connection) -> Any:
        """The payload, its buffers read from the pipe straight into the memory they keep (the
        arrays unpickled over them; EOFError if the child dies on the way)."""
        return pickle.loads(self.pickled, buffers=[_read_exactly(receive.fileno(), size) for size in self.sizes])


def send_payload(send: Connection, payload: Any) -> None:
    """In a child: `payload` to the parent (`received`), pickled with its large buffers (a numpy
    array's, an Arrow table's) out of band and written to the pipe as they lie in memory.

    Connection.send pickles them into the message (a copy), and the parent reads the message into
    a growing buffer (another) and unpickles it (a third): a block of a rollouts file, megabytes,
    cost the parent more to receive than to write to tokens.parquet."""
    buffers: list[memoryview] = []

    def out_of_band(buffer: pickle.PickleBuffer) -> bool:  # False: out of band
        try:
            raw = buffer.raw()
        except BufferError:  # not contiguous: in the pickle
            return True
        if raw.nbytes < OUT_OF_BAND_BYTES:
            return True
        buffers.append(raw)
        return False

    pickled = pickle.dumps(payload, protocol=5, buffer_callback=out_of_band)
    send.send((True, _OutOfBand(pickled, tuple(raw.nbytes for raw in buffers))))
    for raw in buffers:
        _write_all(send.fileno(), raw)


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data):]


def _read_exactly(fd: int, size: int) -> np.ndarray:
    """`size` bytes from the pipe into fresh (uninitialized, writable) memory."""
    buffer = np.empty(size, dtype=np.uint8)
    view, done = memoryview(buffer), 0
    while done < size:
        read = os.readv(fd, [view[done:]])
        if read == 0:
            raise EOFError
        done += read
    return buffer


def received(child: Forked, what: str) -> Any:
    """The child's next payload (as `send_payload` or Connection.send sent it); its traceback, or
    its death, raised as a RuntimeError."""
    process, receive = child
    try:
        ok, payload = receive.recv()
        if isinstance(payload, _OutOfBand):
            payload = payload.load(receive)
    except EOFError:
        process.join()
        raise RuntimeError(f"{what} process died (exit code {process.exitcode})") from None
    if not ok:
        raise RuntimeError(f"{what} process failed:\n{payload}")
    return payload


class PrefetchedReceiver:
    """A child's payloads received ahead of the caller by a thread, at most `depth` of them
    waiting: a child's message (a block of a rollouts file: megabytes) fills the pipe, so without
    it the child would wait for this process to finish the work before it takes the next one, and
    the cores would idle in turn. `next()` gives them in order, and raises what `received` raises."""

    def __init__(self, child: Forked, what: str, depth: int = 2) -> None:
        self.child = child
        self._queue: queue.Queue[tuple[bool, Any]] = queue.Queue(maxsize=depth)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._drain, args=(what,), daemon=True)
        self._thread.start()

    def _drain(self, what: str) -> None:
        while not self._closed.is_set():
            try:
                item: tuple[bool, Any] = (True, received(self.child, what))
            except BaseException as exc:  # noqa: BLE001 - the child's failure, raised by next()
                item = (False, exc)
            while not self._closed.is_set():
                try:
                    self._queue.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if not item[0] or item[1] is None:  # failed, or the child's last message
                return

    def next(self) -> Any:
        ok, payload = self._queue.get()
        if not ok:
            raise payload
        return payload

    def close(self) -> None:
        """Stop receiving: the child killed first, so a receive in progress ends (EOF) before its
        pipe is closed under it (`stop` closes it next)."""
        self._closed.set()
        process, _ = self.child
        if process.is_alive():
            process.kill()
        self._thread.join()


def stop(children: Sequence[Forked]) -> None:
    """Each child's pipe closed, the child killed if still running, and reaped."""
    for process, receive in children:
        receive.close()
        if process.is_alive():
            process.kill()
        process.join()
