"""Progress off a terminal (a pipe, a CI log): plain lines, whole, one per stage start, quarter and
end; an engine's load is a stage of its own; the demo's build and sampling report their counts;
a rerun after an interruption says how many blocks it resumed."""

from __future__ import annotations

import re
from pathlib import Path

from mismatch.cli import main
from test_faults_resume import _interrupted

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "rollouts.jsonl"


def test_off_a_terminal_each_stage_is_plain_whole_lines(tiny_checkpoint, tmp_path, capsys) -> None:
    label = "replay train: hf:dtype=float32,attn=eager,batch_tokens=512"
    assert main(["audit", str(tiny_checkpoint), "--rollouts", str(EXAMPLE), "--train", label.split(": ", 1)[1],
                 "--infer", "sampler", "--out", str(tmp_path / "audit")]) == 0
    err = capsys.readouterr().err
    assert "\r" not in err and "\x1b[" not in err and "…\n" not in err.replace(" …\n", ""), err  # nothing redrawn or cut
    lines = err.splitlines()
    loaded = [line for line in lines if line.startswith("starting train: ")]
    assert len(loaded) == 1 and re.fullmatch(r"starting train: \S+: done in \d+\.\d s", loaded[0]), lines
    bar = [line for line in lines if line.startswith(label)]
    assert lines.index(loaded[0]) < lines.index(bar[0])  # the load is a stage of its own, before the replay
    total = int(re.search(r": 0/(\d+) tokens scored$", bar[0]).group(1))
    assert re.fullmatch(rf".*: {total}/{total} tokens scored \(100%, \d+\.\d s\)", bar[-1]), bar
    assert 2 <= len(bar) <= 6, bar  # the start, the quarters it crossed: a log, not a stream of redraws


def test_a_rerun_after_an_interruption_says_how_many_blocks_it_resumed(tmp_path, capsys) -> None:
    args, _ = _interrupted(tmp_path)
    capsys.readouterr()
    assert main(args) == 0
    err = capsys.readouterr().err
    assert re.search(r"^--infer python:\S+: resumed 2 of 6 blocks from the interrupted run$", err, re.M), err


def test_the_demos_build_and_sampling_report_their_counts(tmp_path, tiny_checkpoint) -> None:
    from mismatch.demo.tinymodel import build_tiny_checkpoint
    from mismatch.demo.toy_agent import HarnessConfig, write_rollouts

    steps: list[int] = []
    build_tiny_checkpoint(tmp_path / "ckpt", steps=3, progress=steps.append)
    assert steps == [1, 1, 1]
    sampled: list[int] = []
    assert write_rollouts(tiny_checkpoint, tmp_path / "r.jsonl", HarnessConfig(num_rollouts=2), progress=sampled.append) == 2
    assert sampled == [1, 1]
