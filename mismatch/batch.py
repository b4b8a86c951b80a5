"""The `mismatch` command's own process, set up as the batch job it is: set once by the console
script (cli.run, cli.main), never by the library, which runs inside other people's processes (a
training loop) whose allocator, collector and signals are theirs.

Why (the figures: benchmarks/RESULTS.md, "Figures moved from the code"): glibc, and Arrow's default
allocator, hand every freed chunk-sized array back to the kernel and fault it in again on the next
chunk; the cycle collector's young generation runs every 700 allocations while the rollouts' JSON
is decoded into millions of lists and dicts that hold no cycles; and the interpreter's teardown
collects every object still alive as the command ends (end_batch).
"""

from __future__ import annotations

import ctypes
import gc
import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

# mallopt(3) parameters (malloc.h): M_TRIM_THRESHOLD and M_MMAP_THRESHOLD.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Arrays up to this size come from the heap, and freed ones are reused there instead of unmapped:
# a chunk's and a block's per-token arrays fit under it (results/chunks.py); it is glibc's
# largest mmap threshold on 64-bit systems.
MMAP_THRESHOLD = 32 * 2**20
# The heap gives memory back to the kernel only when this much is free at its top: the peak RSS
# is unchanged (the memory was in use at the peak anyway), the faults to refill it are gone.
TRIM_THRESHOLD = 256 * 2**20
# Arrow's memory pool (pyarrow reads ARROW_DEFAULT_MEMORY_POOL when it first allocates), on Linux:
# jemalloc, which Linux's pyarrow wheels carry. The wheels' default, mimalloc, hands a chunk's freed
# buffers back to the kernel, and to_pandas gives the analysis Arrow's own buffers as its column
# arrays, so every chunk of every pass faulted its columns in again; glibc's heap ("system") kept
# them but grew with the run (diff's largest process: 1.35x from 10^4 to 3*10^4 rollouts, against
# jemalloc's 1.17x and the same CPU: benchmarks/RESULTS.md). Elsewhere Arrow's default stays.
ARROW_MEMORY_POOL = "jemalloc" if sys.platform.startswith("linux") else None
# The young generation's collection every this many container allocations (Python's default:
# 700); cycles are still collected, a few hundred thousand objects later.
GC_GENERATION0 = 100_000


def tune_for_batch() -> None:
    """Keep freed heap memory for reuse (glibc only; elsewhere the allocator is left alone), Arrow's
    buffers in jemalloc on Linux (unless the environment names Arrow's pool), and collect cycles
    less often. For the command's process: see the module docstring."""
    if ARROW_MEMORY_POOL is not None:
        os.environ.setdefault("ARROW_DEFAULT_MEMORY_POOL", ARROW_MEMORY_POOL)
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to set
        pass
    else:
        mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_GENERATION0, older, oldest)


def end_batch() -> None:
    """Before the process exits: every live object is left out of the collections the
    interpreter's teardown runs (they find no garbage a batch job needs freed, and walking them
    costs time at the very end). Finalizers registered to run at exit still run."""
    gc.freeze()


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGINT, raised in the main thread as Ctrl-C is, so that every `finally` on the
    way out runs: the forked children stopped, the stage, the pending log and the lock removed,
    the finished blocks kept in the work dir for the rerun. A KeyboardInterrupt, so that what
    treats Ctrl-C as "stopped, not failed" (the dependency log) treats SIGTERM the same."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclass
class Interrupt:
    """The signal that interrupted the command, once one has."""
    signum: int | None = None


@contextmanager
def interruptible() -> Iterator[Interrupt]:
    """While the command runs, SIGTERM and SIGINT raise Interrupted (the first one: another
    arriving while the run unwinds is ignored, so the cleanup is not cut short; kill -9 still
    stops it, and its forked children with it). The former handlers are put back after. Off the
    main thread, where Python runs no signal handler, signals keep their own handlers."""
    interrupt = Interrupt()
    if threading.current_thread() is not threading.main_thread():
        yield interrupt
        return

    def handler(signum: int, frame: object) -> None:
        if interrupt.signum is None:
            interrupt.signum = signum
            raise Interrupted(signum)

    saved = {signum: signal.signal(signum, handler) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield interrupt
    finally:
        for signum, former in saved.items():  # None: a handler set outside Python
            signal.signal(signum, signal.SIG_DFL if former is None else former)
