"""The hooks' writer (mismatch/hooks/dump.py) against what a training run does to it: a disk that fills
mid-line (a real write limit, RLIMIT_FSIZE, in a child process), a process killed mid-write, a
resumed run appending, misaligned samples, ids reused across steps, numpy values in meta.

What is asserted is the file itself, read back by `mismatch validate` and `mismatch audit`, never
the writer's own word.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from mismatch.cli import main
from mismatch.hooks.dump import DumpInputError, StepDump, sample_rollout
from mismatch.rollouts import load_rollouts

PROMPT = [1, 2, 3]


def _sample(i: int, length: int = 6) -> dict:
    response = [10 + (i + k) % 50 for k in range(length)]
    logp = [-0.5 - 0.01 * k for k in range(length)]
    return sample_rollout(f"r{i}", PROMPT, response, [1] * length, logp,
                          extra_logprobs={"trainer_old": [v - 0.001 for v in logp]})


def _validate(path: Path, capsys) -> tuple[int, str]:
    code = main(["validate", str(path)])
    captured = capsys.readouterr()
    return code, captured.out + captured.err


# --- misaligned samples: refused by sample_rollout, and their lines by validate ------------------


@pytest.mark.parametrize(("mask", "logp", "extra", "said"), [
    ([1] * 13, [-0.1] * 15, None, "13 mask entries for 15 response tokens"),
    ([1] * 15, [-0.2] + [-0.1] * 15, None, "16 sampler log-probs entries for 15 response tokens"),
    ([1] * 15, [-0.1] * 14, None, "14 sampler log-probs entries for 15 response tokens"),
    ([1] * 15, [-0.1] * 15, {"trainer_old": [-0.1] * 16}, "16 extra_logprobs['trainer_old'] entries"),
])
def test_misaligned_samples_are_refused(mask, logp, extra, said):
    with pytest.raises(DumpInputError, match="rollout 'x': ") as raised:
        sample_rollout("x", PROMPT, list(range(20, 35)), mask, logp, extra_logprobs=extra)
    assert said in str(raised.value) and "\n" not in str(raised.value)


@pytest.mark.parametrize(("segment", "said"), [
    ({"role": "assistant", "tokens": list(range(20, 35)), "logprobs": [-0.2] + [-0.1] * 15},
     "logprobs: 16 logprobs for 15 tokens"),
    ({"role": "assistant", "tokens": list(range(20, 35)), "logprobs": [-0.1] * 13},
     "logprobs: 13 logprobs for 15 tokens"),
    ({"role": "assistant", "tokens": list(range(20, 35)), "logprobs": [-0.1] * 15,
      "extra_logprobs": {"trainer_old": [-0.1] * 16}}, "16 logprobs for 15 tokens"),
])
def test_validate_refuses_the_same_misaligned_lines_in_a_file(tmp_path, capsys, segment, said):
    good = _sample(0)
    bad = {"id": "x", "branches": [{"id": "main", "segments": [
        {"role": "user", "tokens": PROMPT, "trainable": False}, segment]}]}
    path = tmp_path / "f.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")
    code, said_out = _validate(path, capsys)
    assert code == 2
    assert f"{path}:2: rollout 'x': branches[0].segments[1]" in said_out and said in said_out


def test_a_hook_counts_a_misaligned_row_and_writes_the_others(tmp_path, capsys):
    """AReaL's wrapper on an episode of two rows, the second with a log-prob row one shorter than its
    tokens (as lists: `tensor_rows` takes a tensor's rows as it takes these): one written, one refused."""
    import asyncio

    from mismatch.hooks.areal import DumpingWorkflow

    class Episode:  # the wrapped workflow: returns this trajectory dict as AReaL's RLVRWorkflow would
        async def arun_episode(self, engine, data):
            return {"input_ids": [[1, 2, 3, 11, 12], [4, 5, 6, 13, 14]], "loss_mask": [[0, 0, 0, 1, 1]] * 2,
                    "logprobs": [[0.0, 0.0, 0.0, -0.1, -0.2], [0.0, 0.0, 0.0, -0.3]],
                    "versions": [[-1, -1, -1, 3, 3]] * 2, "attention_mask": [[1] * 5] * 2}

    class Engine:
        def get_version(self):
            return 3

    wrapper = DumpingWorkflow(Episode(), tmp_path / "d.jsonl")
    asyncio.run(wrapper.arun_episode(Engine(), None))
    dump = wrapper.mismatch_dump
    assert (dump.num_written, dump.num_refused, wrapper.num_failed) == (1, 1, 0)
    assert "1 sampler log-probs entries for 2 response tokens" in dump.first_refusal
    dump.close()
    assert _validate(tmp_path / "d.jsonl", capsys)[0] == 0


# --- the disk and the process ---------------------------------------------------------------------

_CHILD = textwrap.dedent("""
    import json, os, resource, signal, sys
    from mismatch.hooks.dump import StepDump, sample_rollout
    path, limit, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    if limit:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG, as on a full disk
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    dump = StepDump(path, framework="test")
    for step in range(steps):
        rollouts = [sample_rollout(f"s{step}-{i}", [1, 2, 3], list(range(10, 410)), [1] * 400, [-0.5] * 400,
                                   extra_logprobs={"trainer_old": [-0.51] * 400}) for i in range(4)]
        dump.write(rollouts, step=step)
        print(step, flush=True)
    print(json.dumps({"written": dump.num_written, "lost": dump.num_lost, "first_loss": dump.first_loss}))
""")


def _child(path: Path, limit: int, steps: int, **kwargs) -> subprocess.Popen:
    # No bytecode written under a write limit: importlib ignores a short write and leaves a truncated
    # .pyc that every later import of that module fails on (conftest shares one bytecode cache).
    return subprocess.Popen([sys.executable, "-c", _CHILD, str(path), str(limit), str(steps)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}, **kwargs)


def test_a_disk_that_fills_mid_line_costs_the_lines_it_refused_and_never_the_run(tmp_path, capsys, tiny_checkpoint):
    path = tmp_path / "dump.jsonl"
    limit = 40_000  # a few lines of ~4.7 kB: a write past it is cut by the kernel mid-line, then EFBIG
    child = _child(path, limit, 5)
    out, err = child.communicate(timeout=60)
    assert child.returncode == 0, err  # the training loop went on: nothing raised into it
    report = json.loads(out.strip().splitlines()[-1])
    assert report["first_loss"].startswith("EFBIG") and report["lost"] > 0
    assert report["written"] + report["lost"] == 20 and report["written"] >= 4
    data = path.read_bytes()
    assert data.endswith(b"\n") and data.count(b"\n") == report["written"]  # the half line was cut back
    assert _validate(path, capsys)[0] == 0
    # space freed, the run resumed: it appends whole lines after the whole lines
    child = _child(path, 0, 1)
    assert child.communicate(timeout=60) and child.returncode == 0
    rollouts = load_rollouts(path)
    assert len(rollouts) == report["written"] + 4
    assert len({r.id for r in rollouts}) == len(rollouts)  # s0-0 … written again: kept apart (s0-0@s0)
    assert _validate(path, capsys)[0] == 0
    out_dir = tmp_path / "audit"
    assert main(["audit", str(tiny_checkpoint), "--rollouts", str(path), "--train", "stored:trainer_old",
                 "--infer", "sampler", "--out", str(out_dir)]) == 0
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["pairs"]["train/sampler"]["n_rollouts"] == len(rollouts)
    capsys.readouterr()


def test_a_torn_tail_is_cut_when_the_dump_is_opened_and_the_whole_lines_audit(tmp_path, capsys, tiny_checkpoint):
    path = tmp_path / "dump.jsonl"
    with StepDump(path, framework="test") as dump:
        dump.write([_sample(i) for i in range(4)], step=0)
    whole = path.read_bytes()
    line = json.dumps(_sample(9)).encode()
    path.write_bytes(whole + line[: len(line) // 2])  # what a kill mid-write leaves
    code, said = _validate(path, capsys)
    assert code == 2 and f"{path}:5" in said  # unrepaired, the torn line is named
    with StepDump(path, framework="test") as dump:  # the resumed run
        assert dump.num_torn_bytes == len(line) // 2
        assert path.read_bytes() == whole
        dump.write([_sample(4)], step=1)
    assert _validate(path, capsys)[0] == 0
    assert [r.id for r in load_rollouts(path)] == ["r0", "r1", "r2", "r3", "r4"]
    out_dir = tmp_path / "audit"
    assert main(["audit", str(tiny_checkpoint), "--rollouts", str(path), "--train", "stored:trainer_old",
                 "--infer", "sampler", "--out", str(out_dir)]) == 0
    summary = json.loads((out_dir / "summary.json").read_text())
    assert summary["pairs"]["train/sampler"]["n_rollouts"] == 5
    capsys.readouterr()


def test_a_hook_killed_mid_write_leaves_whole_lines_after_reopening(tmp_path, capsys):
    path = tmp_path / "dump.jsonl"
    child = _child(path, 0, 10_000)
    assert child.stdout.readline()  # a step written: kill it in the middle of the next ones
    child.send_signal(signal.SIGKILL)
    child.wait(timeout=30)
    StepDump(path, framework="test").close()
    assert path.read_bytes().endswith(b"\n")
    assert _validate(path, capsys)[0] == 0
    assert len(load_rollouts(path)) >= 4


# --- ids and meta ---------------------------------------------------------------------------------


def test_one_id_at_two_steps_is_written_twice_under_two_ids(tmp_path, capsys):
    path = tmp_path / "d.jsonl"
    with StepDump(path, framework="test") as dump:
        dump.write([_sample(0)], step=0)
        dump.write([_sample(0)], step=1)
        dump.write([_sample(0)], step=1)
    rollouts = load_rollouts(path)
    assert [r.id for r in rollouts] == ["r0", "r0@s1", "r0@s1.1"]
    assert rollouts[1].meta["source"]["id"] == "r0" and rollouts[1].meta["step"] == 1
    assert _validate(path, capsys)[0] == 0


def test_numpy_values_in_meta_and_step_are_written_as_json(tmp_path, capsys):
    path = tmp_path / "d.jsonl"
    meta = {"sampler": {"temperature": np.float32(0.7), "top_k": np.int64(50)}, "reward": np.array([1.5, np.nan]),
            "config": object()}
    with StepDump(path, framework="test", meta=meta) as dump:
        sample = _sample(0)
        sample["meta"] = {"advantage": np.float64(-0.25), np.int64(3): "key"}
        assert dump.write([sample], step=np.int64(7)) == 1
        assert dump.write([_sample(1)], step=2.5) == 0 and "TypeError" in dump.first_refusal
    (rollout,) = load_rollouts(path)
    assert rollout.meta["step"] == 7 and rollout.meta["sampler"]["top_k"] == 50
    assert rollout.meta["reward"] == [1.5, None] and rollout.meta["advantage"] == -0.25
    assert rollout.meta["3"] == "key" and rollout.meta["config"].startswith("<object")
    assert _validate(path, capsys)[0] == 0


def test_a_rollout_that_breaks_format_v1_is_counted_not_raised(tmp_path):
    with StepDump(tmp_path / "d.jsonl", framework="test") as dump:
        bad = sample_rollout("nan", PROMPT, [5, 6], [1, 1], [-0.1, float("nan")])
        assert dump.write([bad, _sample(1)], step=0) == 1
        assert dump.num_refused == 1 and dump.first_refusal.endswith("logprob at index 1 is nan")
