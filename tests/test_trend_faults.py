"""`mismatch trend` on runs whose gap is real: 12 steps whose sampler is the tiny model in bf16, the
sampler's weights faulted from step 6 on (one tensor of layer 1 scaled by 1.25, as a bad weight sync
would leave it) or never. Each step samples its own rollouts and its own count of them and records
its own sampling seed, as a training run does; the audits are real stored-only audits of log-probs
computed here by transformers (fp32 trainer, bf16 sampler).

A change is named only where the step's CI leaves the level before it; the faulted run names step
6, once, with its p-value; the clean run names nothing, and a per-step seed or rollout count is
no engine change.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from mismatch.cli import main
from test_report import Opened, browser  # noqa: F401  (the report's Chromium fixture)
from test_trend import responses  # noqa: F401  (the tiny model's own text, with its fp32 log-probs)

pytestmark = pytest.mark.slow

STEPS, FAULT_AT = 12, 6
# The headline metrics a weight fault moves by a factor (k3 ~45x here); each has a CI over rollouts per step.
HEADLINE_METRICS = ("kl_k1", "kl_k2", "log_ratio_abs_mean")
FAULT_SCALE = 1.25  # layer 1's mlp.down_proj: k3 about 45x the clean bf16 gap on this text (measured: 7.7e-4 against 1.7e-5)


@pytest.fixture(scope="module")
def sampler_logprobs(tiny_checkpoint: Path, responses) -> dict[str, list[np.ndarray]]:  # noqa: F811
    """Each response's log-probs under the bf16 sampler, clean and with the planted weight fault."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.bfloat16).eval()

    def score() -> list[np.ndarray]:
        found = []
        for prompt, response, _, _ in responses:
            ids = torch.tensor([prompt + response])
            with torch.no_grad():
                logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1)
            found.append(logp[torch.arange(len(prompt) - 1, ids.shape[1] - 1), ids[0, len(prompt):]].double().numpy())
        return found

    clean = score()
    with torch.no_grad():
        model.model.layers[1].mlp.down_proj.weight.mul_(FAULT_SCALE)
    return {"clean": clean, "fault": score()}


def audit_run(root: Path, checkpoint: Path, responses, sampler: dict, *, fault: bool, seed: int) -> list[Path]:  # noqa: F811
    import mismatch

    rng, dirs = np.random.default_rng(seed), []
    for step in range(STEPS):
        stream = sampler["fault" if fault and step >= FAULT_AT else "clean"]
        lines = []
        for i in range(int(rng.integers(36, 45))):  # each step its own number of rollouts
            j = int(rng.integers(len(responses)))
            prompt, response, trainer, _ = responses[j]
            length = int(rng.integers(8, len(response) + 1))
            lines.append(json.dumps({"id": f"s{step}-r{i}", "meta": {"step": step, "sampler": {
                "engine": "vllm", "dtype": "bfloat16", "temperature": 1.0, "logprobs": "raw", "seed": 1000 + step}},
                "branches": [{"id": "main", "kind": "main", "parent": None, "fork_at": None, "segments": [
                    {"role": "user", "tokens": prompt},
                    {"role": "assistant", "tokens": response[:length], "logprobs": stream[j][:length].tolist(),
                     "extra_logprobs": {"trainer": trainer[:length].tolist()}}]}]}))
        rollouts = root / f"rollouts_{step}.jsonl"
        rollouts.write_text("\n".join(lines) + "\n")
        dirs.append(root / f"step_{step}")
        mismatch.audit(checkpoint, rollouts, train="stored:trainer", infer="sampler", out=dirs[-1])
    return dirs


def trend_json(dirs: list[Path], capsys, *extra: str) -> dict:
    capsys.readouterr()
    assert main(["trend", *map(str, dirs), "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.fixture(scope="module")
def faulted_run(tmp_path_factory, tiny_checkpoint, responses, sampler_logprobs) -> list[Path]:  # noqa: F811
    return audit_run(tmp_path_factory.mktemp("faulted"), tiny_checkpoint, responses, sampler_logprobs, fault=True, seed=6)


def test_a_weight_fault_from_step_6_is_named_once_at_step_6(faulted_run, capsys):
    dirs = faulted_run
    found = trend_json(dirs, capsys)
    series = found["series"]["kl_k3"]
    ratio = series[FAULT_AT]["value"] / series[FAULT_AT - 1]["value"]
    assert ratio > 30, (ratio, series)  # the fault is large, as planted (about 45x)
    assert found["change_points"] == [FAULT_AT], found["change_points"]
    change = found["changes"][0]
    assert change["p_value"] < 1e-3 and change["separated"] is True
    assert series[FAULT_AT]["ci_low"] > change["before"]["level"]  # the step's CI leaves the level before
    assert [jump["step"] for jump in found["jumps"]] == []  # the same change is not listed again as a jump
    assert not [c for c in found["configuration_changes"] if c["step"] == FAULT_AT]  # nothing recorded changed
    for metric in HEADLINE_METRICS:  # the same detector sees it in every headline metric
        assert trend_json(dirs, capsys, "--metric", metric)["change_points"] == [FAULT_AT], metric
    capsys.readouterr()
    assert main(["trend", *map(str, dirs)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith(f"kl_k3 of train/sampler changed at step {FAULT_AT} (level") and "p = " in first, first


@pytest.fixture(scope="module")
def clean_run(tmp_path_factory, tiny_checkpoint, responses, sampler_logprobs) -> list[Path]:  # noqa: F811
    return audit_run(tmp_path_factory.mktemp("clean"), tiny_checkpoint, responses, sampler_logprobs, fault=False, seed=7)


def test_a_clean_run_names_nothing_and_a_per_step_seed_is_no_engine_change(clean_run, capsys):
    dirs = clean_run
    found = trend_json(dirs, capsys)
    assert found["change_points"] == [] and found["changes"] == [], found["changes"]
    for metric in HEADLINE_METRICS:
        assert trend_json(dirs, capsys, "--metric", metric)["change_points"] == [], metric
    assert found["jumps"] == [], found["jumps"]
    assert found["configuration_changes"] == [], found["configuration_changes"]  # seed and count vary per step
    capsys.readouterr()
    assert main(["trend", *map(str, dirs)]) == 0
    assert capsys.readouterr().out.splitlines()[0].startswith("no change in kl_k3 of train/sampler over 12 steps")


# The metrics beside the headline ones: ESS has a CI by the delta method over rollouts
# (trend/steps._ess), chi2_token as a token-weighted mean; ratio_q999 none (a quantile of tokens,
# which rollouts.parquet does not hold). The clean run names nothing on any of them; the fault is
# named on ESS. Not on chi2_token (measured: -6e-4 ± 6e-4 before, -3.4e-3 ± 3.5e-3 after: a step's
# CI as wide as the shift) nor on ratio_q999 (1.036 → 1.30-1.36, no CI): not asserted, said in RESULTS.
OTHER_METRICS = ("ess", "chi2_token", "ratio_q999")


@pytest.mark.parametrize("metric", OTHER_METRICS)
def test_the_other_metrics_name_nothing_on_the_clean_run_and_ess_names_the_fault(metric, faulted_run, clean_run,
                                                                                 capsys):
    clean = trend_json(clean_run, capsys, "--metric", metric)
    assert clean["change_points"] == [] and clean["jumps"] == [], (clean["changes"], clean["jumps"])
    if metric == "ratio_q999":
        return
    rows = clean["series"][metric]
    assert all(row["ci_low"] is not None and row["ci_low"] <= row["value"] <= row["ci_high"] for row in rows), rows
    if metric == "ess":
        faulted = trend_json(faulted_run, capsys, "--metric", metric)
        assert faulted["change_points"] == [FAULT_AT], faulted["changes"]
        change = faulted["changes"][0]
        assert change["p_value"] < 1e-3 and change["separated"] is True


@pytest.mark.parametrize("width", [1280, 390])
def test_the_trend_page_in_chromium_leads_with_the_change_and_marks_it_on_every_timeline(
        browser, faulted_run, tmp_path, width):  # noqa: F811
    """The page at a laptop's and a phone's width: the headline card names step 6 on the first screen,
    every timeline draws its SVG with the change point marked, nothing makes the page scroll sideways."""
    import os
    import shutil

    out = tmp_path / "trend.html"
    assert main(["trend", *map(str, faulted_run), "--report", str(out)]) == 0
    opened = Opened(browser, out, width=width)
    page = opened.page
    charts = opened.charts()
    assert len(charts) >= 6 and all(charts.values()), charts
    marks = page.eval_on_selector_all(
        ".chart", "els => els.map(e => [...e.querySelectorAll('.annotation-text')].map(a => a.textContent))")
    assert all(f"change point: step {FAULT_AT}" in texts for texts in marks), marks
    card = page.query_selector("#headline")
    assert f"changed at step {FAULT_AT}" in card.inner_text() and "p-value" in card.inner_text()
    box = card.bounding_box()
    assert box["y"] + box["height"] <= 900, box  # the whole card on the first screen
    assert page.evaluate("document.documentElement.scrollWidth") <= width  # wide tables scroll inside themselves
    shot = tmp_path / f"trend-{width}.png"
    page.screenshot(path=str(shot), full_page=True)
    assert shot.stat().st_size > 10_000
    if os.environ.get("MISMATCH_SCREENSHOTS"):  # to look at them: MISMATCH_SCREENSHOTS=DIR pytest ...
        shutil.copy(shot, Path(os.environ["MISMATCH_SCREENSHOTS"]) / shot.name)
    opened.assert_clean()


def test_a_level_change_inside_the_steps_own_ci_is_not_claimed_and_one_outside_it_is():
    """The χ² test alone would take a small shift sustained over many steps; a change of level is
    claimed only where the step's 95% CI leaves the level before (issue: "jumped at step 300" with
    [1.69e-5, 3.84e-5] against [1.83e-5, 5.53e-5])."""
    from mismatch.trend.changes import change_points

    steps, errors = np.arange(200), np.full(200, 1e-5)
    # 1.6 standard errors, sustained over 100 steps: the χ² test passes (p ~ 1e-7), the step's CI
    # does not leave the level before.
    small = 2e-5 + np.where(steps >= 100, 1.6e-5, 0.0)
    assert change_points(steps, small, errors) == []
    large = 2e-5 + np.where(steps >= 100, 4e-5, 0.0)
    (point,) = change_points(steps, large, errors)
    assert (point.index, point.kind, point.separated) == (100, "level", True) and point.p_value < 1e-6
