"""Jobs run side by side, one per forked process: how an analysis uses a second core.

A fork, not a fresh interpreter: the child starts with the parent's imports and data (a token
table in memory, the closures that read tokens.parquet), so nothing but each job's result is
pickled, and only on its way back. The parent runs the first job itself.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection
from typing import TypeVar

from mismatch.errors import MismatchError

T = TypeVar("T")
WORKERS_VARIABLE = "MISMATCH_WORKERS"
# Measured with two cores (benchmarks/RESULTS.md): each group of analyses reads the whole table
# again, and the costliest analysis alone is a quarter of the work.
MAX_WORKERS = 2
# Below this many token rows a fork and a second reading of the table cost more than they save.
MIN_ROWS_TO_FORK = 1_000_000


def analysis_workers(num_rows: int, environ: Mapping[str, str] | None = None) -> int:
    """How many processes the analysis of `num_rows` token rows uses: MISMATCH_WORKERS when set
    (1: never fork; any size), else up to MAX_WORKERS of the cores this process may run on, for a
    table of at least MIN_ROWS_TO_FORK rows."""
    text = (os.environ if environ is None else environ).get(WORKERS_VARIABLE)
    if text is not None:
        if not text.strip().isdigit() or int(text) < 1:
            raise MismatchError(f"{WORKERS_VARIABLE}={text!r}: must be a whole number of processes, 1 or more")
        return int(text)
    return min(MAX_WORKERS, len(os.sched_getaffinity(0))) if num_rows >= MIN_ROWS_TO_FORK else 1


def fork_jobs(jobs: Sequence[Callable[[], T]]) -> list[T]:
    """Each job's result, in order: the first run here, every other one in a forked child."""
    # Output buffered before the fork would be written again by each child as it exits.
    sys.stdout.flush()
    sys.stderr.flush()
    context = multiprocessing.get_context("fork")
    children: list[tuple[multiprocessing.process.BaseProcess, Connection]] = []
    try:
        for job in jobs[1:]:
            receive, send = context.Pipe(duplex=False)
            child = context.Process(target=_child, args=(job, send), daemon=True)
            child.start()
            send.close()
            children.append((child, receive))
        import time
        t = time.perf_counter()
        results = [jobs[0]()]
        t1 = time.perf_counter()
        results.extend(_result_of(child, receive) for child, receive in children)
        open("/tmp/t/log", "a").write(f"parent job {t1 - t} wait+load {time.perf_counter() - t1}\n")
        return results
    finally:
        for child, receive in children:
            receive.close()
            if child.is_alive():
                child.kill()
            child.join()


def _child(job: Callable[[], object], send: Connection) -> None:
    try:
        import time
        t = time.perf_counter()
        payload: tuple[bool, object] = (True, job())
        t1 = time.perf_counter()
        open("/tmp/t/log", "a").write(f"child job {t1 - t}\n")
    except BaseException:  # noqa: BLE001 - whatever stopped the job is the parent's to raise
        payload = (False, traceback.format_exc())
    send.send_bytes(pickle.dumps(payload, protocol=pickle.HIGHEST_PROTOCOL))
    send.close()


def _result_of(child: multiprocessing.process.BaseProcess, receive: Connection) -> object:
    try:
        ok, payload = pickle.loads(receive.recv_bytes())
    except EOFError:
        child.join()
        raise RuntimeError(f"an analysis worker process died (exit code {child.exitcode})") from None
    if not ok:
        raise RuntimeError(f"an analysis worker process failed:\n{payload}")
    return payload
