"""The `mismatch` command's own process, set up as the batch job it is: set once by the console
script (cli.run), never by the library, which runs inside other people's processes (a training
loop) whose allocator and collector are theirs to tune.

Measured on the stored-log-prob audit of benchmarks/audit_stored.py (10k rollouts, 9.3M token
rows, two cores; benchmarks/RESULTS.md): 1.9M page faults and 6-7 s of system time went to glibc
handing every freed chunk-sized array back to the kernel and faulting it in again on the next
chunk (~0.26M faults and 2.5 s once freed memory is kept), and 1-2 s of CPU to the cycle
collector's young generation, run every 700 allocations while the rollouts' JSON is decoded
into millions of lists and dicts that hold no cycles; and ~0.3 s to the interpreter's teardown
collecting every object still alive as the command ends (half of it without: end_batch).
"""

from __future__ import annotations

import ctypes
import gc

# mallopt(3) parameters (malloc.h): M_TRIM_THRESHOLD and M_MMAP_THRESHOLD.
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
# Arrays up to this size come from the heap, and freed ones are reused there instead of unmapped:
# a chunk's per-token arrays are ~2 MiB (analysis/chunked.py), a block's a few; 32 MiB is glibc's
# largest mmap threshold on 64-bit systems.
MMAP_THRESHOLD = 32 * 2**20
# The heap gives memory back to the kernel only when this much is free at its top: the peak RSS
# is unchanged (the memory was in use at the peak anyway), the faults to refill it are gone.
TRIM_THRESHOLD = 256 * 2**20
# The young generation's collection every this many container allocations (Python's default:
# 700); cycles are still collected, a few hundred thousand objects later.
GC_GENERATION0 = 100_000


def tune_for_batch() -> None:
    """Keep freed heap memory for reuse (glibc only; elsewhere the allocator is left alone) and
    collect cycles less often. For the command's process: see the module docstring."""
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
    interpreter's teardown runs (they find no garbage a batch job needs freed; ~0.13 s after a
    10k-rollout audit). Finalizers registered to run at exit still run."""
    gc.freeze()
