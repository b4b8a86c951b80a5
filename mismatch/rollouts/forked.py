"""A JSONL rollouts file read by several processes at once, block by block, in file order.

The file's blocks (`block_size` rollouts each) are dealt round robin to forked readers. Each reads
every line but decodes and checks only its own blocks' rollouts, and runs the caller's `work` on
each of its blocks whose rollouts are all valid. The parent receives each reader's next blocks
ahead (a thread per reader: workers.PrefetchedReceiver), takes them in file order and runs the checks across
the file on the way (unique ids, one routing shape: FileChecks), so the error raised is the one a
single reader raises first, word for word.

A fork, not a fresh interpreter: `work` may be a closure over the caller's state, and only its
results (and each rollout's LineFacts and errors) travel back, pickled, their large buffers beside
the pickle (workers.send_payload).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, TypeVar

from mismatch.errors import RolloutError
from mismatch.rollouts.decode import UNPARSED, check_rollout
from mismatch.rollouts.io import SKIPPED, FileChecks, LineFacts, empty_file_error, open_rollouts, read_jsonl
from mismatch.rollouts.model import Rollout
from mismatch.workers import PrefetchedReceiver, Forked, forked, reporting, send_payload, stop

T = TypeVar("T")
Work = Callable[[int, list[int], list[Rollout]], T]  # (block, file indices, its rollouts) -> result
_ErrorFields = tuple[str, str, int | None, str | None, str | None]  # a RolloutError, picklable


def forked_blocks(path: str | Path, *, vocab_size: int | None, num_experts: int | None, block_size: int,
                  workers: int, work: Work[T], limit: int | None = None) -> Iterator[T]:
    """`work` of every block of the file, in file order, from `workers` forked readers; raises
    the file's first RolloutError as iter_rollouts does (no rollouts: the empty-file error).
    `limit`: read whole lines within that many bytes only (the size pinned for the run)."""
    file, _ = open_rollouts(path, limit=limit)  # a missing or unreadable file: its one-line error, now
    readers: list[Forked] = []
    drained: list[PrefetchedReceiver] = []
    try:
        readers.extend(forked(_reader, file, index, workers, block_size, vocab_size, num_experts, limit, work)
                       for index in range(workers))
        # Received ahead: a reader goes on with its next block while this process stores the last.
        drained.extend(PrefetchedReceiver(reader, "a rollouts reader") for reader in readers)
        checks = FileChecks(file)
        block = 0
        while (found := drained[block % workers].next()) is not None:
            facts, errors, result = found
            for fact, fields in zip(facts, errors):
                bad = [RolloutError(reason, file=at, line=line, rollout=rollout, field=name)
                       for reason, at, line, rollout, name in fields] + checks.errors(fact)
                if bad:
                    raise bad[0]
            yield result
            block += 1
        if block == 0:
            raise empty_file_error(file)
    finally:
        for drain in drained:
            drain.close()
        stop(readers)


def _reader(file: str, index: int, workers: int, block_size: int, vocab_size: int | None,
            num_experts: int | None, limit: int | None, work: Work[Any], send: Connection) -> None:
    """Reader `index`: its blocks of the file, one message each, then None."""
    def mine(number: int) -> bool:  # the n-th rollout lies in one of this reader's blocks
        return (number // block_size) % workers == index

    with reporting(send):
        current, rows = -1, []
        for number, (line, raw, read_errors) in enumerate(read_jsonl(Path(file), file, wanted=mine, limit=limit)):
            if raw is SKIPPED:
                continue
            block = number // block_size
            if block != current and rows:
                send_payload(send, _block(file, current, rows, vocab_size, num_experts, work))
                rows = []
            current = block
            rows.append((number, line, raw, read_errors))
        if rows:
            send_payload(send, _block(file, current, rows, vocab_size, num_experts, work))
        send_payload(send, None)


def _block(file: str, block: int, rows: list[tuple[int, int, object, list[RolloutError]]],
           vocab_size: int | None, num_experts: int | None, work: Work[Any]) -> tuple[list[LineFacts], list[list[_ErrorFields]], Any]:
    """Each rollout's facts and errors, and `work` of the block when every rollout is valid."""
    facts, errors, rollouts = [], [], []
    for _, line, raw, read_errors in rows:
        rollout, found = (None, []) if raw is UNPARSED else check_rollout(
            raw, file=file, line=line, vocab_size=vocab_size, num_experts=num_experts)
        facts.append(LineFacts.of(line, raw, rollout))
        errors.append([(e.reason, e.file, e.line, e.rollout, e.field) for e in read_errors + found])
        rollouts.append(rollout)
    valid = not any(errors)
    return facts, errors, work(block, [number for number, *_ in rows], rollouts) if valid else None
