"""The gap against the user's PPO clip range: parsing, the shares by hand, and where it is said."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from test_golden import GOLDEN, stored_checkpoint

from mismatch.analysis.clip import ClipRange, table_clip_summary
from mismatch.cli import main
from mismatch.errors import MismatchError
from mismatch.present.headline import audit_banner, clip_sentence
from mismatch.results import read_summary


def test_clip_range_parses_symmetric_and_clip_higher() -> None:
    assert ClipRange.parse("0.2") == ClipRange(low=0.2, high=0.2)
    assert ClipRange.parse("0.2, 0.28") == ClipRange(low=0.2, high=0.28)
    for bad in ("x", "0", "1.5", "0.1,0.2,0.3", ""):
        with pytest.raises(MismatchError, match=r"--clip-eps .*expected EPS or EPS_LOW,EPS_HIGH"):
            ClipRange.parse(bad)


def test_shares_outside_the_clip_range_by_hand() -> None:
    # ratios 0.7 1.0 1.25 | 1.1 0.85 1.3 (turn 0 | turn 1): outside [0.8, 1.28] are 0.7 and 1.3;
    # outside [0.8, 1.2] also 1.25.
    ratios = np.array([0.7, 1.0, 1.25, 1.1, 0.85, 1.3])
    table = pd.DataFrame({"rollout": "r", "branch": "main", "branch_kind": "main", "turn": [0, 0, 0, 1, 1, 1],
                          "trainable": True, "logp_sampler": -1.0})
    table["logp_train"] = -1.0 + np.log(ratios)
    out = table_clip_summary(table, [("train", "sampler")], ClipRange(low=0.2, high=0.28))
    assert out["pairs"]["train/sampler"] == pytest.approx(2 / 6)
    assert out["turns"]["train/sampler"] == [{"turn": 0, "n_tokens": 3, "frac_outside_clip": pytest.approx(1 / 3)},
                                             {"turn": 1, "n_tokens": 3, "frac_outside_clip": pytest.approx(1 / 3)}]
    symmetric = table_clip_summary(table, [("train", "sampler")], ClipRange())
    assert symmetric["pairs"]["train/sampler"] == pytest.approx(3 / 6)
    assert symmetric["range"] == [0.8, 1.2]


def test_a_bad_clip_range_exits_2_before_any_work(tmp_path: Path, capsys) -> None:
    checkpoint = stored_checkpoint(tmp_path / "ckpt")
    code = main(["audit", str(checkpoint), "--rollouts", str(GOLDEN / "rollouts.jsonl"), "--out",
                 str(tmp_path / "out"), "--train", "stored:trainer", "--infer", "stored:engine", "--clip-eps", "2"])
    assert code == 2 and not (tmp_path / "out").exists()
    assert capsys.readouterr().err.startswith("mismatch: error: --clip-eps '2': expected")


def test_the_audit_says_it_first_in_the_cli_and_the_report(tmp_path: Path, capsys) -> None:
    checkpoint = stored_checkpoint(tmp_path / "ckpt")
    out = tmp_path / "out"
    assert main(["audit", str(checkpoint), "--rollouts", str(GOLDEN / "rollouts.jsonl"), "--out", str(out),
                 "--train", "stored:trainer", "--infer", "stored:engine", "--clip-eps", "0.01,0.02"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    frac = summary["clip"]["pairs"]["train/sampler"]
    assert summary["clip"]["range"] == [0.99, 1.02] and 0 < frac < 1
    record = read_summary(out)
    sentence = clip_sentence(record)
    assert sentence == f"mismatch alone takes {frac:.2%} of train/sampler tokens out of the clip range [0.99, 1.02]"
    assert sentence[1:] in capsys.readouterr().out
    banner = audit_banner(record)
    assert banner.details[0].startswith(f"Mismatch alone takes {frac:.2%} of train/sampler tokens")
    assert banner.numbers[0] == ("outside clip [0.99, 1.02]", frac, "pct")
    page = (out / "index.html").read_text()
    assert f"Mismatch alone takes {frac:.2%} of train/sampler tokens" in page
    # The framework-named metrics in the report too, with the crosswalk.
    assert 'id="frameworks"' in page and "rollout_corr/k3_kl" in page and "mismatch_kl/all/mean" in page


def test_the_audit_table_speaks_the_users_framework(tmp_path: Path, capsys, monkeypatch) -> None:
    checkpoint = stored_checkpoint(tmp_path / "ckpt")
    args = ["audit", str(checkpoint), "--rollouts", str(GOLDEN / "rollouts.jsonl"), "--train", "stored:trainer",
            "--infer", "stored:engine"]
    monkeypatch.setenv("MISMATCH_FRAMEWORK", "verl")  # the default when --for is not given
    assert main([*args, "--out", str(tmp_path / "a")]) == 0
    out = capsys.readouterr().out
    summary = json.loads((tmp_path / "a" / "summary.json").read_text())
    k3 = summary["framework_metrics"]["train/sampler"]["verl"]["rollout_corr/k3_kl"]
    assert "as verl 0.9.1 logs it" in out and "rollout_corr/k3_kl" in out and f"{k3:.4g}" in out
    assert main([*args, "--out", str(tmp_path / "b"), "--for", "deepspeed"]) == 2
    assert capsys.readouterr().err.startswith("mismatch: error: --for: unknown framework 'deepspeed'")
    assert not (tmp_path / "b").exists()
