"""Forked readers (rollouts/forked.py): the blocks a single reader gives, and the first error it
raises, word for word, whatever reader's block the fault lies in."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from mismatch.errors import RolloutError
from mismatch.rollouts import load_rollouts
from mismatch.rollouts.forked import forked_blocks
from tests.test_rollouts import as_plain, make_rollout, write_jsonl

BLOCK = 3


def _work(block: int, indices: list[int], rollouts: list) -> tuple[int, list[int], list[dict]]:
    return block, indices, [as_plain(rollout) for rollout in rollouts]


def _read(path: Path, workers: int) -> list:
    return list(forked_blocks(path, vocab_size=None, num_experts=None, block_size=BLOCK, workers=workers,
                              work=_work))


def _rows(n: int) -> list:
    return [make_rollout(f"r-{i}") for i in range(n)]


@pytest.mark.parametrize("workers", [1, 2, 3])
def test_forked_readers_give_the_blocks_of_one_reader_in_file_order(tmp_path, workers) -> None:
    rows: list = _rows(11)
    rows[4:4] = ["", "   "]  # blank lines: not rollouts, still counted as lines
    path = write_jsonl(tmp_path / "r.jsonl", rows)
    plain = [as_plain(rollout) for rollout in load_rollouts(path)]
    expected = [(b, list(range(b * BLOCK, min(11, (b + 1) * BLOCK))), plain[b * BLOCK:(b + 1) * BLOCK])
                for b in range(4)]
    assert _read(path, workers) == expected


def _bad_files() -> dict[str, list]:
    routed = make_rollout("r-routed")
    routed["branches"] = routed["branches"][:1]
    for segment in routed["branches"][0]["segments"]:
        segment["routed_experts"] = [[[0, 1]] for _ in segment["tokens"]]
    other_shape = json.loads(json.dumps(routed))
    other_shape["id"] = "r-other"
    for segment in other_shape["branches"][0]["segments"]:
        segment["routed_experts"] = [[[0, 1], [1, 2]] for _ in segment["tokens"]]
    token_float = make_rollout("r-float")
    token_float["branches"][0]["segments"][0]["tokens"][1] = 1.5
    return {
        # a bad rollout in the second reader's block, a worse one later in the first reader's
        "bad value in block 1": [*_rows(4), token_float, *_rows(3), {"id": 3}],
        "invalid JSON in block 2": [*_rows(7), "{not json", *_rows(2)],
        "a duplicate id across readers": [*_rows(5), make_rollout("r-1"), *_rows(2)],
        "two routing shapes across readers": [*_rows(1), routed, *_rows(2), other_shape],
        "an error in the last, short block": [*_rows(9), {"id": "r-x", "branches": []}],
    }


@pytest.mark.parametrize("name", list(_bad_files()))
@pytest.mark.parametrize("workers", [2, 3])
def test_the_first_error_is_the_single_readers_word_for_word(tmp_path, name, workers) -> None:
    path = write_jsonl(tmp_path / "r.jsonl", _bad_files()[name])
    with pytest.raises(RolloutError) as single:
        load_rollouts(path)
    with pytest.raises(RolloutError) as forked:
        _read(path, workers)
    assert str(forked.value) == str(single.value)


def test_an_empty_file_and_a_missing_one_are_the_single_readers_errors(tmp_path) -> None:
    empty = write_jsonl(tmp_path / "empty.jsonl", ["", " "])
    for path in (empty, tmp_path / "missing.jsonl"):
        with pytest.raises(RolloutError) as single:
            load_rollouts(path)
        with pytest.raises(RolloutError) as forked:
            _read(path, 2)
        assert str(forked.value) == str(single.value)


def test_a_reader_that_fails_is_raised_with_its_traceback(tmp_path) -> None:
    path = write_jsonl(tmp_path / "r.jsonl", _rows(7))

    def fails(block: int, indices: list[int], rollouts: list) -> None:
        if block == 1:
            raise KeyError("no column")

    with pytest.raises(RuntimeError, match=r"(?s)rollouts reader process failed.*KeyError: 'no column'"):
        list(forked_blocks(path, vocab_size=None, num_experts=None, block_size=BLOCK, workers=2, work=fails))


@pytest.mark.parametrize("shard", ["1/3", "12/13"], ids=["some blocks", "no block"])
def test_a_shard_read_by_forked_readers_writes_what_one_reader_writes(tmp_path, monkeypatch, shard) -> None:
    import pandas as pd

    import mismatch
    from mismatch.replay import Shard
    from tests.test_golden import GOLDEN, stored_checkpoint

    checkpoint = stored_checkpoint(tmp_path / "ckpt")
    summaries = {}
    for workers in ("1", "2"):
        monkeypatch.setenv("MISMATCH_WORKERS", workers)
        out = tmp_path / f"out-{workers}"
        summaries[workers] = mismatch.audit(checkpoint, GOLDEN / "rollouts.jsonl", train="stored:trainer",
                                            infer="stored:engine", out=out, block_size=4,
                                            shard=Shard.parse(shard)).summary
        summaries[workers].pop("created_unix")
    assert json.dumps(summaries["1"], sort_keys=True) == json.dumps(summaries["2"], sort_keys=True)
    for name in ("tokens.parquet", "rollouts.parquet"):
        one, two = (pd.read_parquet(tmp_path / f"out-{w}" / name) for w in ("1", "2"))
        assert one.equals(two), name
    # The golden fixture's 48 rollouts make 12 blocks of 4: shard 1/3 takes blocks 1, 4, 7 and 10,
    # shard 12/13 none.
    assert summaries["1"]["counts"]["rollouts"] == (16 if shard == "1/3" else 0)


def _counting(send) -> None:
    """A child that sends 0, 1, 2, ... until it is killed."""
    from mismatch.workers import reporting

    with reporting(send):
        number = 0
        while True:
            send.send((True, number))
            number += 1


def test_a_drained_child_stopped_early_is_killed_and_nothing_hangs() -> None:
    """workers.PrefetchedReceiver receives a child's messages ahead on a thread; a consumer that stops early
    (the parent raising the file's first error) kills the child and joins the thread."""
    from mismatch.workers import PrefetchedReceiver, forked, stop

    child = forked(_counting)
    drained = PrefetchedReceiver(child, "a counting child", depth=2)
    assert [drained.next() for _ in range(5)] == [0, 1, 2, 3, 4]
    drained.close()
    stop([child])
    assert not child[0].is_alive()


def test_a_drained_child_that_dies_is_raised_in_order() -> None:
    from mismatch.workers import PrefetchedReceiver, forked, stop

    def two_then_die(send) -> None:
        send.send((True, "a"))
        send.send((True, "b"))
        os._exit(3)

    child = forked(two_then_die)
    drained = PrefetchedReceiver(child, "a dying child")
    try:
        assert drained.next() == "a" and drained.next() == "b"
        with pytest.raises(RuntimeError, match=r"a dying child process died \(exit code 3\)"):
            drained.next()
    finally:
        drained.close()
        stop([child])


def _payload() -> dict:
    """What a reader sends: small values, and large buffers in a numpy array, a DataFrame, an
    Arrow table (dictionary, bool and NaN columns), each big enough to travel out of band."""
    import numpy as np
    import pandas as pd
    import pyarrow as pa

    rows = 50_000
    frame = pd.DataFrame({"logp": np.linspace(-3, 0, rows), "token": np.arange(rows, dtype=np.int64),
                          "role": pd.Categorical.from_codes(np.arange(rows) % 3, ["a", "b", "c"])})
    frame.loc[7, "logp"] = np.nan
    table = pa.table({"x": pa.array(np.arange(rows, dtype=np.float64)), "ok": pa.array(np.arange(rows) % 2 == 0),
                      "rollout": pa.DictionaryArray.from_arrays(pa.array(np.arange(rows, dtype=np.int32) % 5),
                                                                ["r0", "r1", "r2", "r3", "r4"])})
    return {"keys": np.arange(rows, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15), "frame": frame,
            "table": table, "small": [1, "two", np.arange(3)], "strided": np.arange(2 * rows)[::2]}


def _sends_payload(send) -> None:
    from mismatch.workers import reporting, send_payload

    with reporting(send):
        send_payload(send, _payload())


def test_a_payload_travels_with_its_large_buffers_beside_the_pickle() -> None:
    """workers.send_payload: arrays, DataFrames and Arrow tables arrive equal, bit for bit (NaN
    kept), and writable (the memory they are read into is the receiver's own)."""
    import numpy as np

    from mismatch import workers
    from mismatch.workers import forked, received, stop

    child = forked(_sends_payload)
    try:
        got = received(child, "a sending child")
    finally:
        stop([child])
    sent = _payload()
    assert np.array_equal(got["keys"], sent["keys"]) and got["keys"].flags.writeable
    assert got["frame"].equals(sent["frame"]) and np.isnan(got["frame"]["logp"][7])
    assert got["table"].equals(sent["table"]) and got["table"].schema == sent["table"].schema
    assert got["small"][:2] == [1, "two"] and np.array_equal(got["small"][2], np.arange(3))
    assert np.array_equal(got["strided"], sent["strided"])
    assert sent["keys"].nbytes >= workers.OUT_OF_BAND_BYTES  # so it did not travel in the pickle


def test_a_child_that_dies_while_sending_a_large_buffer_is_raised(monkeypatch) -> None:
    """Killed half-way through a buffer written beside the pickle: the parent's read ends (EOF),
    and the death is raised as any other, not a hang or a half-read payload."""
    from mismatch import workers
    from mismatch.workers import forked, received, stop

    def half_then_die(fd, data) -> None:  # in the forked child
        os.write(fd, data[:1000])
        os._exit(4)

    monkeypatch.setattr(workers, "_write_all", half_then_die)
    child = forked(_sends_payload)
    try:
        with pytest.raises(RuntimeError, match=r"a dying sender process died \(exit code 4\)"):
            received(child, "a dying sender")
    finally:
        stop([child])


# A parent that forks an analysis worker (fork_jobs) and is killed -9 while the worker runs.
_KILLED_PARENT = '''
import os, signal, sys, time
from pathlib import Path
from mismatch.workers import fork_jobs

pid_file = Path(sys.argv[1])

def worker():
    pid_file.write_text(str(os.getpid()))
    time.sleep(60)

def parent():
    while not pid_file.exists() or not pid_file.read_text():
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGKILL)

fork_jobs([parent, worker])
'''


def test_a_forked_worker_dies_with_its_parent_killed_minus_9(tmp_path) -> None:
    import signal
    import subprocess
    import sys
    import time

    import psutil

    pid_file = tmp_path / "worker.pid"
    parent = subprocess.run([sys.executable, "-c", _KILLED_PARENT, str(pid_file)], timeout=60)
    assert parent.returncode == -signal.SIGKILL
    worker = psutil.Process(int(pid_file.read_text()))
    try:
        deadline = time.monotonic() + 10
        while worker.is_running() and worker.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        pass
    finally:
        if worker.is_running():
            worker.kill()


def _open_files(send) -> None:
    from mismatch.workers import reporting

    with reporting(send):
        fds = Path("/proc/self/fd")
        send.send((True, sorted(os.path.realpath(fd) for fd in fds.iterdir() if fd.exists())))


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")
def test_a_forked_child_does_not_hold_the_results_lock(tmp_path) -> None:
    """An flock belongs to the open file: a child holding the lock's descriptor would hold OUT
    for as long as it lived, after its parent's death too."""
    from mismatch.results import results_lock
    from mismatch.workers import forked, received, stop

    with results_lock(tmp_path / "o"):
        child = forked(_open_files)
        try:
            files = received(child, "a child")
        finally:
            stop([child])
        assert os.path.realpath(tmp_path / ".o.lock") not in files
        assert (tmp_path / ".o.lock").exists()  # the parent's lock, untouched by the child's exit


@pytest.mark.parametrize("workers", [1, 2])
def test_forked_readers_read_only_the_whole_lines_of_the_pinned_size(tmp_path, workers) -> None:
    """A file growing under the run (a live `record`): the readers stop at the size pinned at the
    start, and a line cut by the limit is not read."""
    path = write_jsonl(tmp_path / "r.jsonl", _rows(7))
    pinned = path.stat().st_size
    with path.open("a") as handle:  # appended after the pin: two more rollouts
        handle.write(json.dumps(make_rollout("late-0")) + "\n" + json.dumps(make_rollout("late-1")))
    read = list(forked_blocks(path, vocab_size=None, num_experts=None, block_size=BLOCK, workers=workers,
                              work=_work, limit=pinned))
    assert [index for _, indices, _ in read for index in indices] == list(range(7))
    cut = list(forked_blocks(path, vocab_size=None, num_experts=None, block_size=BLOCK, workers=workers,
                             work=_work, limit=pinned + 20))  # inside the first late line
    assert [index for _, indices, _ in cut for index in indices] == list(range(7))
