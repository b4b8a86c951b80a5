"""The command's process is set up as a batch job (mismatch/batch.py); the library's is left alone."""

from __future__ import annotations

import ctypes
import json
import subprocess
import sys

import pytest

from mismatch.batch import GC_GENERATION0

CHUNKS = """
import resource, sys
import numpy as np
if sys.argv[1] == "tuned":
    from mismatch.batch import tune_for_batch
    tune_for_batch()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(30):  # an analysis's pattern: a chunk's arrays made, dropped, made again
    arrays = [np.ones(1 << 18) for _ in range(16)]  # 16 x 2 MiB
    del arrays
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _glibc() -> bool:
    try:
        return hasattr(ctypes.CDLL(None), "mallopt")
    except OSError:
        return False


def _huge_pages_always() -> bool:
    """With transparent huge pages on for every mapping, a refilled heap faults once per 2 MiB
    page, and the untuned count is too small to tell the two apart."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            return "[always]" in f.read()
    except OSError:
        return False


@pytest.mark.skipif(not _glibc(), reason="mallopt is glibc's")
@pytest.mark.skipif(_huge_pages_always(), reason="transparent huge pages [always]: too few faults to compare")
def test_freed_chunks_are_reused_not_faulted_in_again() -> None:
    faults = {mode: int(subprocess.run([sys.executable, "-c", CHUNKS, mode], capture_output=True, text=True,
                                       check=True).stdout)
              for mode in ("plain", "tuned")}
    # 30 rounds of 32 MiB: ~245k faults when glibc trims the heap after each round, the first
    # round's ~8k when it keeps the memory.
    assert faults["tuned"] * 10 < faults["plain"], faults


def test_the_console_script_tunes_its_process_and_the_library_does_not() -> None:
    probe = ("import atexit, gc, json, sys\n"
             "start = gc.get_threshold()\n"
             "import mismatch, mismatch.pipeline.audit, mismatch.cli\n"
             "library = gc.get_threshold()\n"
             "atexit.register(lambda: print(json.dumps([start, library, gc.get_threshold()])))\n"
             "sys.argv = ['mismatch', '--version']\n"
             "mismatch.cli.run()\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    start, library, command = json.loads(done.stdout.splitlines()[-1])
    assert library == start  # importing the library changes nothing
    assert command[0] == GC_GENERATION0 != start[0]


def test_the_console_script_puts_arrows_buffers_in_jemalloc_unless_told_otherwise() -> None:
    """Arrow's pool is jemalloc in the command's process on Linux (its default, mimalloc, faults
    every chunk's buffers in again); a pool named in the environment is kept; importing the
    library leaves Arrow alone."""
    import os

    command = ("import sys, mismatch.cli\n"
               "sys.argv = ['mismatch', '--version']\n"
               "try:\n"
               "    mismatch.cli.run()\n"
               "except SystemExit:\n"
               "    pass\n"
               "import pyarrow\n"
               "print(pyarrow.default_memory_pool().backend_name)\n")
    library = "import os, mismatch, mismatch.pipeline.audit\nprint(os.environ.get('ARROW_DEFAULT_MEMORY_POOL'))\n"
    environ = {name: value for name, value in os.environ.items() if name != "ARROW_DEFAULT_MEMORY_POOL"}

    def last_line(code: str, **more: str) -> str:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                              env={**environ, **more})
        return done.stdout.split()[-1]

    if sys.platform.startswith("linux"):
        assert last_line(command) == "jemalloc"
    assert last_line(command, ARROW_DEFAULT_MEMORY_POOL="system") == "system"
    assert last_line(library) == "None"


def test_worker_counts_follow_the_cpus_and_what_the_work_can_use(monkeypatch) -> None:
    """mismatch/workers.py: no machine's core count is built in; MISMATCH_WORKERS still decides."""
    from mismatch import workers

    monkeypatch.setattr(workers, "usable_cpus", lambda: 16)
    big_file = 7 * workers.MIN_BYTES_TO_FORK  # a reader more for each MIN_BYTES_TO_FORK of file
    assert workers.analysis_workers(workers.MIN_ROWS_TO_FORK, environ={}) == workers.ANALYSIS_PROCESSES == 2
    assert workers.reading_workers(big_file, environ={}) == 8
    assert workers.reading_workers(workers.MIN_BYTES_TO_FORK, environ={}) == 2
    assert workers.reading_workers(workers.MIN_BYTES_TO_FORK - 1, environ={}) == 1
    assert workers.reading_workers(big_file, environ={"MISMATCH_WORKERS": "3"}) == 3
    monkeypatch.setattr(workers, "usable_cpus", lambda: 1)
    assert workers.reading_workers(big_file, environ={}) == workers.analysis_workers(10**9, environ={}) == 1


def test_usable_cpus_without_an_affinity_call_are_the_cpu_count(monkeypatch) -> None:
    import os

    from mismatch import workers

    if hasattr(os, "sched_getaffinity"):
        assert workers.usable_cpus() == len(os.sched_getaffinity(0))
        monkeypatch.delattr(os, "sched_getaffinity")
    monkeypatch.setattr(os, "cpu_count", lambda: 5)
    assert workers.usable_cpus() == 5
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert workers.usable_cpus() == 1
