"""`mismatch audit` end to end on the tiny checkpoint: clean control, a real gap, bad inputs."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from mismatch.pipeline.audit import audit
from mismatch.cli import main
from mismatch.analysis.metrics import PAIR_METRICS


def test_clean_control_is_bitwise_equal(tiny_checkpoint, sampled_rollouts, tmp_path) -> None:
    result = audit(tiny_checkpoint, sampled_rollouts, train="hf", infer="hf", out=tmp_path / "out")
    pair = result.summary["pairs"]["train/infer"]
    assert pair["n_tokens"] > 100
    assert pair["bitwise_equal_frac"] == 1.0
    assert pair["kl_k3"] == 0.0 and pair["kl_k1"] == 0.0 and pair["ess"] == 1.0


def test_results_dir_contract(tiny_checkpoint, sampled_rollouts, tmp_path) -> None:
    out = tmp_path / "out"
    code = main(["audit", str(tiny_checkpoint), "--rollouts", str(sampled_rollouts),
                 "--train", "hf:dtype=float32", "--infer", "hf-decode:dtype=bfloat16", "--out", str(out)])
    assert code == 0
    assert sorted(p.name for p in out.iterdir()) == ["index.html", "rollouts.parquet", "summary.json",
                                                     "tokens.parquet"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["schema"] == "mismatch.summary/v1"
    assert set(summary["pairs"]) == {"train/sampler", "train/infer", "infer/sampler"}
    for metrics in summary["pairs"].values():
        assert list(metrics) == list(PAIR_METRICS)
    tokens = pd.read_parquet(out / "tokens.parquet")
    for column in ("rollout", "branch", "turn", "segment", "pos", "role", "token_id", "trainable",
                   "logp_sampler", "logp_train", "logp_infer"):
        assert column in tokens.columns
    assert tokens["logp_train"].dtype == np.float64
    # Every trainable token has all three log-probs; the gap is real, not a copy.
    trainable = tokens[tokens["trainable"]]
    assert trainable[["logp_sampler", "logp_train", "logp_infer"]].notna().all().all()
    train_infer = summary["pairs"]["train/infer"]
    assert train_infer["log_ratio_abs_max"] > 1e-3 and train_infer["bitwise_equal_frac"] < 0.5
    assert summary["turns"] and summary["roles"] and summary["branch_kinds"]
    assert summary["verdicts"]["infer/sampler"]["level"] == "exact"
    assert summary["verdicts"]["train/infer"]["level"] in ("small", "large")
    assert {k["branch_kind"] for k in summary["branch_kinds"]} == {"main", "subagent", "summary"}


def test_bf16_gap_is_reproducible_and_sampler_replay_is_exact(tiny_checkpoint, sampled_rollouts,
                                                              tmp_path) -> None:
    runs = [audit(tiny_checkpoint, sampled_rollouts, train="hf:dtype=float32",
                  infer="hf-decode:dtype=bfloat16") for _ in range(2)]
    first, second = (r.summary["pairs"] for r in runs)
    assert first["train/infer"]["kl_k3"] > 0
    assert repr(first) == repr(second)  # bit-identical run to run, NaNs included
    # The rollouts were sampled by this very path (bf16, prompt prefill + token decode, batch 1),
    # so replaying it reproduces the stored log-probs exactly: replay fidelity is perfect.
    assert first["infer/sampler"]["bitwise_equal_frac"] == 1.0
    assert first["infer/sampler"]["kl_k3"] == 0.0
    np.testing.assert_array_equal(runs[0].tokens["logp_infer"], runs[1].tokens["logp_infer"])


def test_existing_results_dir_needs_force(tiny_checkpoint, sampled_rollouts, tmp_path, capsys) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "mine.txt").write_text("the user's file")
    args = ["audit", str(tiny_checkpoint), "--rollouts", str(sampled_rollouts), "--out", str(out)]
    assert main(args) == 2
    assert capsys.readouterr().err.strip() == f"mismatch: error: {out}: already exists; pass --force to replace it"
    assert main([*args, "--force"]) == 2  # not ours: never replaced
    assert (out / "mine.txt").read_text() == "the user's file"


def _rollout(**segment_overrides) -> dict:
    segment = {"role": "assistant", "tokens": [5, 6], "logprobs": [-0.5, -1.0], **segment_overrides}
    return {"id": "r-1", "branches": [{"id": "main", "kind": "main", "parent": None, "fork_at": None,
                                       "segments": [{"role": "user", "tokens": [1, 2, 3]}, segment]}]}


BAD_INPUTS = {
    "length_mismatch": (_rollout(logprobs=[-0.5]),
                        "branches[0].segments[1].logprobs: 1 logprobs for 2 tokens"),
    "nan_logprob": (_rollout(logprobs=[-0.5, float("nan")]),
                    "branches[0].segments[1].logprobs: logprob at index 1 is nan"),
    "inf_logprob": (_rollout(logprobs=[float("-inf"), -1.0]),
                    "branches[0].segments[1].logprobs: logprob at index 0 is -inf"),
    "positive_logprob": (_rollout(logprobs=[0.25, -1.0]),
                         "branches[0].segments[1].logprobs: logprob at index 0 is 0.25 > 0"),
    "token_out_of_vocab": (_rollout(tokens=[5, 999_999]),
                           "branches[0].segments[1].tokens: token id 999999 at index 1 is >= vocab size {vocab}"),
    "unknown_role": (_rollout(role="robot"),
                     "branches[0].segments[1].role: unknown role 'robot' "
                     "(expected one of: system, user, assistant, tool, summary)"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_rollout_is_one_line_and_exit_2(case, tiny_checkpoint, tmp_path, capsys) -> None:
    from mismatch.checkpoint import checkpoint_info

    raw, field_and_reason = BAD_INPUTS[case]
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"id": "r-0", "branches": _rollout()["branches"]}) + "\n"
                    + json.dumps(raw) + "\n")
    out = tmp_path / "out"
    code = main(["audit", str(tiny_checkpoint), "--rollouts", str(path), "--out", str(out)])
    vocab = checkpoint_info(tiny_checkpoint).vocab_size
    expected = f"mismatch: error: {path}:2: rollout 'r-1': " + field_and_reason.format(vocab=vocab)
    assert code == 2
    assert capsys.readouterr().err.rstrip("\n") == expected
    assert not out.exists() and list(tmp_path.iterdir()) == [path]


def test_missing_parent_and_empty_file(tiny_checkpoint, tmp_path, capsys) -> None:
    tree = _rollout()
    tree["branches"].append({"id": "sub", "kind": "subagent", "parent": "nope", "fork_at": 1,
                             "segments": [{"role": "user", "tokens": [1]}]})
    cases = {
        "tree.jsonl": (json.dumps(tree) + "\n",
                       "tree.jsonl:1: rollout 'r-1': branches[1].parent: "
                       "parent 'nope' is not a branch of this rollout"),
        "empty.jsonl": ("", "empty.jsonl: no rollouts (empty file)"),
    }
    for name, (text, message) in cases.items():
        path = tmp_path / name
        path.write_text(text)
        out = tmp_path / "out"
        assert main(["audit", str(tiny_checkpoint), "--rollouts", str(path), "--out", str(out)]) == 2
        assert capsys.readouterr().err.rstrip("\n") == f"mismatch: error: {tmp_path}/{message}"
        assert not out.exists()


def test_validate_reports_every_problem(tmp_path, capsys) -> None:
    path = tmp_path / "mixed.jsonl"
    lines = [_rollout(), _rollout(logprobs=[-0.5]), _rollout(role="robot"), _rollout()]
    for index, raw in enumerate(lines):
        raw["id"] = f"r-{index}"
    path.write_text("\n".join(json.dumps(raw) for raw in lines) + "\n")
    assert main(["validate", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [
        f"{path}:2: rollout 'r-1': branches[0].segments[1].logprobs: 1 logprobs for 2 tokens",
        f"{path}:3: rollout 'r-2': branches[0].segments[1].role: unknown role 'robot' "
        "(expected one of: system, user, assistant, tool, summary)"]
    assert captured.out == (f"{path}: 4 rollouts, 2 error(s) in 2; valid ones hold 2 branches, "
                            "10 tokens (4 trainable)\n")


def test_usage_error_and_debug_traceback(tmp_path, capsys) -> None:
    assert main(["audit", str(tmp_path)]) == 2
    assert capsys.readouterr().err.startswith("mismatch: error: Missing option")
    missing = tmp_path / "nope"
    env = {**os.environ, "MISMATCH_DEBUG": "1"}
    done = subprocess.run([sys.executable, "-m", "mismatch", "validate", str(missing)],
                          capture_output=True, text=True, env=env)
    assert done.returncode != 0 and "Traceback" in done.stderr and "RolloutError" in done.stderr


def test_console_script_json_output(tiny_checkpoint, sampled_rollouts, tmp_path) -> None:
    script = Path(sys.executable).with_name("mismatch")
    done = subprocess.run([str(script), "audit", str(tiny_checkpoint), "--rollouts",
                           str(sampled_rollouts), "--out", str(tmp_path / "o"), "--json",
                           "--infer", "hf"], capture_output=True, text=True, check=True)
    summary = json.loads(done.stdout)
    assert summary["pairs"]["train/infer"]["bitwise_equal_frac"] == 1.0
    assert all(v is None or math.isfinite(v) for v in summary["pairs"]["train/sampler"].values())


def test_engine_start_is_a_labelled_phase(tiny_checkpoint, tmp_path) -> None:
    """Each engine's start is announced (total None) before its token bar, and closed when done."""
    from mismatch.replay import ReplayOptions, replay_sources

    events = []

    def factory(label, total):
        events.append((label, total))
        return lambda done: events.append((label, "done")) if total is None else None

    example = Path(__file__).resolve().parents[1] / "examples" / "rollouts.jsonl"
    replay_sources(tiny_checkpoint, example, {"train": "hf", "infer": "hf-decode"}, ReplayOptions(progress=factory))
    starts = [(label, total) for label, total in events if total is None or total == "done"]
    assert starts == [("starting train: hf", None), ("starting train: hf", "done"),
                      ("starting infer: hf-decode", None), ("starting infer: hf-decode", "done")]
    bar = next(e for e in events if e[0].startswith("replay infer: hf-decode"))
    assert events.index(("starting infer: hf-decode", "done")) < events.index(bar)
    # The bar says what the engine feeds: every branch's context again, so more than it scores.
    assert re.fullmatch(r"replay infer: hf-decode \(feeds \d+(\.\d)?k? tokens\)", bar[0]), bar[0]
