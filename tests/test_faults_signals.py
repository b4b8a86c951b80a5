"""The fault sweep's signals: an audit stopped by SIGTERM, SIGINT or kill -9 while its forked
readers run leaves no process alive and no lock held, says one line (not for kill -9, which
nothing can catch), and the same command run again finishes with the uninterrupted summary; a
lock whose holder is dead is taken over, a live holder's refused."""

from __future__ import annotations

import fcntl
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from mismatch.cli import main
from test_golden import GOLDEN, stored_checkpoint

INTERRUPTED = "mismatch: interrupted; rerun the same command to resume"
# 10 copies of the golden rollouts (1.6 MB, 480 rollouts) in blocks of 4: the two forked readers
# (MISMATCH_WORKERS=2 forks them whatever the size) run for seconds, not a moment.
COPIES, BLOCK = 10, "4"


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("signals")
    rollouts = root / "rollouts.jsonl"
    lines = (GOLDEN / "rollouts.jsonl").read_text().splitlines()
    with rollouts.open("w") as sink:
        for copy in range(COPIES):
            for line in lines:
                rollout = json.loads(line)
                rollout["id"] = f"{rollout['id']}-{copy}"
                sink.write(json.dumps(rollout) + "\n")
    return stored_checkpoint(root / "ckpt"), rollouts


def _args(inputs: tuple[Path, Path], out: Path) -> list[str]:
    checkpoint, rollouts = inputs
    return ["audit", str(checkpoint), "--rollouts", str(rollouts), "--train", "stored:trainer",
            "--infer", "stored:engine", "--out", str(out), "--block-size", BLOCK]


def _summary(out: Path) -> dict:
    summary = json.loads((out / "summary.json").read_text())
    summary.pop("created_unix")
    return summary


@pytest.fixture(scope="module")
def uninterrupted(inputs, tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("whole") / "o"
    assert main(_args(inputs, out)) == 0
    return _summary(out)


def _mismatch(args: list[str], log: Path) -> subprocess.Popen:
    # Output to a file, not a pipe: a child left alive would hold a pipe open and hang the test.
    with log.open("w") as sink:
        return subprocess.Popen([sys.executable, "-m", "mismatch", *args], stdout=sink, stderr=subprocess.STDOUT,
                                env={**os.environ, "MISMATCH_WORKERS": "2"})


def _running(processes: list[psutil.Process]) -> list[int]:
    alive = []
    for process in processes:
        try:
            if process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process.pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def _lock_is_free(lock: Path) -> bool:
    if not lock.exists():
        return True
    with lock.open("a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(handle, fcntl.LOCK_UN)
    return True


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGTERM, 143), (signal.SIGINT, 130),
                                             (signal.SIGKILL, -signal.SIGKILL)],
                         ids=["SIGTERM", "SIGINT", "kill -9"])
def test_an_audit_stopped_while_its_readers_run_leaves_nothing_running_and_resumes(
        inputs, uninterrupted, tmp_path, signum, code) -> None:
    out, log = tmp_path / "o", tmp_path / "log.txt"
    command = _mismatch(_args(inputs, out), log)
    parent = psutil.Process(command.pid)
    deadline = time.monotonic() + 60
    while len(parent.children()) < 2 and command.poll() is None and time.monotonic() < deadline:
        time.sleep(0.02)
    readers = parent.children()
    assert len(readers) == 2, log.read_text()
    os.kill(command.pid, signum)
    try:
        assert command.wait(timeout=30) == code, log.read_text()
        deadline = time.monotonic() + 10
        while _running(readers) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _running(readers) == [], "a forked reader outlived its run"
    finally:
        for reader in readers:  # what a failed run left, not another test's
            if _running([reader]):
                reader.kill()
    lock = tmp_path / ".o.lock"
    assert _lock_is_free(lock)
    left = sorted(path.name for path in tmp_path.iterdir() if path.name != "log.txt")
    if signum != signal.SIGKILL:
        assert log.read_text().splitlines()[-1] == INTERRUPTED
        assert set(left) <= {".o.work"}, left  # no stage, no pending log, no lock file
    rerun = _mismatch(_args(inputs, out), log)
    assert rerun.wait(timeout=120) == 0, log.read_text()
    assert _summary(out) == uninterrupted
    assert sorted(path.name for path in tmp_path.iterdir()) == ["log.txt", "o"]


def _finished_pid() -> int:
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def test_a_lock_whose_holder_is_dead_is_taken_over(tmp_path, capsys) -> None:
    """What a run killed before the fix left: its lock file, still locked by a child it forked
    (here: this test's own descriptor), naming a pid that is gone."""
    checkpoint, out = stored_checkpoint(tmp_path / "ckpt"), tmp_path / "o"
    args = ["audit", str(checkpoint), "--rollouts", str(GOLDEN / "rollouts.jsonl"), "--train", "stored:trainer",
            "--infer", "stored:engine", "--out", str(out)]
    lock = tmp_path / ".o.lock"
    lock.write_text(f"pid {_finished_pid()} on {socket.gethostname()}\n")
    with lock.open("a") as leftover_child:
        fcntl.flock(leftover_child, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert main(args) == 0, capsys.readouterr().err
    assert (out / "summary.json").exists() and not lock.exists()


def test_a_live_holder_keeps_its_lock(tmp_path, capsys) -> None:
    """The holder alive (this process) is refused; the same pid with another start time is not
    that process (its pid reused) and is taken over."""
    checkpoint, out = stored_checkpoint(tmp_path / "ckpt"), tmp_path / "o"
    args = ["audit", str(checkpoint), "--rollouts", str(GOLDEN / "rollouts.jsonl"), "--train", "stored:trainer",
            "--infer", "stored:engine", "--out", str(out)]
    lock = tmp_path / ".o.lock"
    here = f"pid {os.getpid()} on {socket.gethostname()}"
    lock.write_text(here + "\n")
    with lock.open("a") as holder:
        fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert main(args) == 2
        assert f"another mismatch run is writing it ({here})" in capsys.readouterr().err
        lock.write_text(here + "\nstarted 1\n")  # this pid, but a process started at boot
        assert main(args) == 0, capsys.readouterr().err
    assert (out / "summary.json").exists() and not lock.exists()
