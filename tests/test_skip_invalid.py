"""`audit --skip-invalid`: a rollout in error costs that rollout, not the file. The valid rollouts are
audited (stored log-probs, and a real trainer replay on the tiny checkpoint), the others counted and
listed in summary.json `skipped`, with the errors `mismatch validate` gives for them.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mismatch.cli import main
from mismatch.results import validate_summary


def _rollout(i: int, **meta) -> dict:
    n = 5 + i % 4
    logp = [-0.4 - 0.02 * k for k in range(n)]
    return {"id": f"r{i}", "meta": meta, "branches": [{"id": "main", "segments": [
        {"role": "user", "tokens": [1, 2, 3]},
        {"role": "assistant", "tokens": [20 + (i + k) % 30 for k in range(n)], "logprobs": logp,
         "extra_logprobs": {"trainer": [v - 0.01 * (k % 2) for k, v in enumerate(logp)]}}]}]}


def _hostile_file(path: Path, vocab: int) -> tuple[int, list[int]]:
    """16 lines, 4 of them valid (lines 1, 6, 11, 15): the rest each break one rule."""
    lines, bad = [], []
    for i in range(16):
        rollout = _rollout(i, step=i)
        kind = i % 5
        if i in (0, 5, 10, 14):
            lines.append(json.dumps(rollout))
            continue
        if kind == 1:  # a flagged event recorded as null
            rollout["branches"][0]["segments"][1]["logprobs"][1] = None
        elif kind == 2:
            rollout["meta"]["step"] = "7"
        elif kind == 3:
            rollout["branches"][0]["segments"][1]["tokens"][0] = vocab + 5
        elif kind == 4:
            rollout["id"] = "r0"  # a duplicate id
        else:
            rollout["branches"][0]["segments"][1]["logprobs"].append(-0.1)  # one log-prob too many
        lines.append(json.dumps(rollout))
        bad.append(i + 1)
    text = "\n".join(lines) + "\n"
    torn = json.dumps(_rollout(99))
    path.write_text(text + torn[: len(torn) // 2])  # and a torn last line
    return 4, bad + [17]


def _vocab(checkpoint: Path) -> int:
    return json.loads((checkpoint / "config.json").read_text())["vocab_size"]


@pytest.mark.parametrize("train", ["stored:trainer", "hf"])
def test_skip_invalid_audits_the_valid_rollouts_and_lists_the_others(tiny_checkpoint, tmp_path, capsys, train):
    rollouts = tmp_path / "recorded.jsonl"
    valid, bad_lines = _hostile_file(rollouts, _vocab(tiny_checkpoint))
    args = ["audit", str(tiny_checkpoint), "--rollouts", str(rollouts), "--train", train, "--infer", "sampler"]
    assert main([*args, "--out", str(tmp_path / "strict")]) == 2  # without the flag the file is refused
    err = capsys.readouterr().err
    assert f"{rollouts}:2: rollout 'r1'" in err and not (tmp_path / "strict").exists()
    out = tmp_path / "audit"
    assert main([*args, "--out", str(out), "--skip-invalid"]) == 0
    said = capsys.readouterr().out
    assert f"skipped {len(bad_lines)} invalid rollout(s) of {len(bad_lines) + valid}" in said
    summary = json.loads((out / "summary.json").read_text())
    assert validate_summary(summary) == []
    assert summary["pairs"]["train/sampler"]["n_rollouts"] == valid == summary["counts"]["rollouts"]
    skipped = summary["skipped"]
    assert skipped["count"] == len(bad_lines) and skipped["valid"] == valid
    assert [entry["line"] for entry in skipped["rollouts"]] == bad_lines
    reasons = {entry["line"]: entry["error"] for entry in skipped["rollouts"]}
    expected = {0: "6 logprobs for 5 tokens", 1: "is not a number: null", 2: 'meta.step: must be a non-negative integer',
                3: f">= vocab size {_vocab(tiny_checkpoint)}", 4: "duplicate rollout id (first at line 1)"}
    for line in bad_lines[:-1]:
        kind = (line - 1) % 5
        said_here = expected[kind] if kind else f"{6 + (line - 1) % 4} logprobs for {5 + (line - 1) % 4} tokens"
        assert said_here in reasons[line], (line, reasons[line])
    assert "invalid JSON" in reasons[17] and skipped["rollouts"][-1]["rollout"] is None
    assert summary["inputs"]["options"]["skip_invalid"] is True


def test_skip_invalid_on_a_file_with_no_valid_rollout_is_one_line(tiny_checkpoint, tmp_path, capsys):
    rollouts = tmp_path / "bad.jsonl"
    rollout = _rollout(1)
    rollout["meta"]["step"] = -1
    rollouts.write_text(json.dumps(rollout) + "\n{\n")
    assert main(["audit", str(tiny_checkpoint), "--rollouts", str(rollouts), "--train", "stored:trainer",
                 "--infer", "sampler", "--out", str(tmp_path / "out"), "--skip-invalid"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.endswith("no valid rollout (2 invalid, skipped); `mismatch validate` lists them")
    assert len(err.splitlines()) == 1 and not (tmp_path / "out").exists()
