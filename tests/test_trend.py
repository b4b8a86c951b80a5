"""`mismatch trend`: a synthetic training run of audits built from the tiny checkpoint, whose stored
log-probs' gap grows after one step in long responses only; a control run whose gap does not move;
a resume across which the sampler restarts in another dtype; the trend gate and its report.

Each step's rollouts are the tiny model's own text (the toy agent's sampled turns, cut to a short
or a long response) and the trainer's log-probs are the tiny model's (hf, fp32, computed once);
the sampler's are those times exp(ε), ε ~ N(0, σ) per token, σ growing after step K in the long
responses. The audits are real stored-only audits (no model replay: the gap is the one planted).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from mismatch.cli import main
from test_report import Opened, browser  # noqa: F401  (the module's Chromium fixture, used below)

pytestmark = pytest.mark.slow

STEPS, K = 24, 12
SIGMA, GROWTH = 0.02, 0.25  # noise of a log-prob; its growth per step after K in long responses
SHORT, LONG = (6, 14), (40, 64)  # response lengths, in tokens


@pytest.fixture(scope="module")
def responses(tiny_checkpoint: Path, sampled_rollouts: Path) -> list[tuple[list[int], np.ndarray]]:
    """(prompt, response, the tiny model's log-prob of each response token and the entropy of the
    distribution it was drawn from): windows of 16 + 64
    tokens, every 8th, over the main branch of each sampled rollout (the tiny model's own text)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32).eval()
    found = []
    for line in sampled_rollouts.read_text().splitlines():
        stream = [t for segment in json.loads(line)["branches"][0]["segments"] for t in segment["tokens"]]
        for start in range(0, len(stream) - 16 - LONG[1] + 1, 8):
            prompt, response = stream[start:start + 16], stream[start + 16:start + 16 + LONG[1]]
            ids = torch.tensor([prompt + response])
            with torch.no_grad():
                logp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
            entropy = torch.distributions.Categorical(logits=logp[15:]).entropy().numpy()
            found.append((prompt, response, logp[torch.arange(15, ids.shape[1] - 1), ids[0, 16:]].numpy(), entropy))
    assert len(found) >= 4, "the toy agent sampled too little text to build a run from"
    return found


def write_step(path: Path, responses: list, step: int, rng: np.random.Generator, *, grows: bool | str,
               sampler_dtype: str = "bfloat16", rollouts: int = 40, k: int = K) -> None:
    """One step's rollouts; `grows`: the gap grows after step k in the long responses (True), in
    the tokens whose distribution has over 1 nat of entropy ("entropy"), or nowhere (False)."""
    lines = []
    for i in range(rollouts):
        prompt, response, logp, entropy = responses[i % len(responses)]
        long = i % 2 == 1
        length = int(rng.integers(*(LONG if long else SHORT)))
        length = min(length, len(response))
        factor = 1 + GROWTH * max(0, step - k + 1)
        where = entropy[:length] > 1.0 if grows == "entropy" else np.full(length, bool(grows) and long)
        sigma = SIGMA * np.where(where, factor, 1.0)
        trainer = logp[:length]
        sampler = np.minimum(trainer * np.exp(rng.normal(0, sigma, length)), 0.0)
        lines.append(json.dumps({"id": f"s{step}-r{i}", "meta": {"step": step, "sampler": {
            "engine": "vllm", "dtype": sampler_dtype, "temperature": 1.0, "logprobs": "raw"}},
            "branches": [{"id": "main", "kind": "main", "parent": None, "fork_at": None, "segments": [
                {"role": "user", "tokens": prompt},
                {"role": "assistant", "tokens": response[:length], "logprobs": sampler.tolist(),
                 "extra_logprobs": {"trainer": trainer.tolist()}}]}]}))
    path.write_text("\n".join(lines) + "\n")


def audit_run(root: Path, checkpoint: Path, responses: list, *, grows: bool, seed: int,
              steps: int = STEPS, dtype_at: int | None = None, checkpoints: list[Path] | None = None) -> list[Path]:
    import mismatch

    rng = np.random.default_rng(seed)
    dirs = []
    for step in range(steps):
        rollouts = root / f"rollouts_{step}.jsonl"
        dtype = "float16" if dtype_at is not None and step >= dtype_at else "bfloat16"
        write_step(rollouts, responses, step, rng, grows=grows, sampler_dtype=dtype)
        out = root / f"step_{step}"
        mismatch.audit(checkpoints[step] if checkpoints else checkpoint, rollouts, train="stored:trainer",
                       infer="sampler", out=out)
        dirs.append(out)
    return dirs


@pytest.fixture(scope="module")
def growing_run(tmp_path_factory, tiny_checkpoint, responses) -> list[Path]:
    return audit_run(tmp_path_factory.mktemp("growing"), tiny_checkpoint, responses, grows=True, seed=1)


@pytest.fixture(scope="module")
def control_run(tmp_path_factory, tiny_checkpoint, responses) -> list[Path]:
    return audit_run(tmp_path_factory.mktemp("control"), tiny_checkpoint, responses, grows=False, seed=2)


def trend_json(dirs: list[Path], capsys, *extra: str) -> dict:
    capsys.readouterr()
    assert main(["trend", *map(str, dirs), "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_trend_names_the_step_where_the_gap_grows_and_attributes_it_to_length(growing_run, capsys):
    found = trend_json(growing_run, capsys)
    assert found["num_steps"] == STEPS and found["step_from"] == "directory name"
    assert len(found["change_points"]) == 1 and abs(found["change_points"][0] - K) <= 1, found["change_points"]
    change = found["changes"][0]
    assert change["after"]["slope_per_step"] > change["before"]["slope_per_step"]
    assert change["strata"]["explained_by"][0] == "length" and "prob" not in change["strata"]["explained_by"]
    hot = change["strata"]["length"]["hot"]
    assert all(found_edge >= 32 for found_edge in [2.0 ** (b - 1) for b in hot["buckets"]]), hot
    assert hot["growth_share"] >= 0.8 and hot["factor"] > 2 * hot["rest_factor"]
    # Low-probability tokens carry more of the gap, but every probability bucket grew alike.
    assert (change["strata"]["prob"]["hot"]["contrast"] or 0) < 1.5
    assert change["strata"]["entropy"]["unavailable"].startswith("no entropy column")
    # Over the whole run too, and the responses did not get longer: the growth is within buckets.
    growth = found["growth"]["strata"]
    assert growth["explained_by"][0] == "length" and abs(growth["length"]["mix"]) < 0.2 * growth["length"]["growth"]
    assert change["causes"][0].startswith("concentrated in response length (trained tokens in the rollout) [32, 64)")


def test_each_step_has_its_metric_with_a_ci_over_rollouts_and_framework_metrics(growing_run, capsys):
    found = trend_json(growing_run, capsys)
    rows = found["series"]["kl_k3"]
    assert [row["step"] for row in rows] == list(range(STEPS))
    for row, path in zip(rows, growing_run):
        summary = json.loads((path / "summary.json").read_text())
        assert row["value"] == summary["pairs"]["train/sampler"]["kl_k3"]
        assert row["ci_low"] < row["value"] < row["ci_high"]
    assert "verl:rollout_corr/k3_kl" in found["series"] and "ess" in found["series"]
    # ESS is a function of two means over tokens: a CI by the delta method (trend/steps._ess) around
    # the audit's own value; a quantile does not decompose over rollouts: no CI claimed.
    for row, path in zip(found["series"]["ess"], growing_run):
        summary = json.loads((path / "summary.json").read_text())
        assert row["value"] == pytest.approx(summary["pairs"]["train/sampler"]["ess"], rel=1e-9)
        assert row["ci_low"] <= row["value"] <= row["ci_high"]
    assert all(row["ci_low"] is None for row in found["series"]["ratio_q999"])


def test_a_control_run_names_no_change(control_run, capsys):
    found = trend_json(control_run, capsys)
    assert found["change_points"] == [] and found["changes"] == []
    assert [jump for jump in found["jumps"] if jump["significant"]] == []


def test_the_terminal_leads_with_the_change_and_its_cause(growing_run, capsys):
    capsys.readouterr()
    assert main(["trend", *map(str, growing_run)]) == 0
    out = capsys.readouterr().out
    first = out.strip().splitlines()[0]
    assert "changed at step" in first and "length" in first, out


def test_a_resume_that_restarts_the_sampler_in_another_dtype_is_named(tmp_path, tiny_checkpoint, responses, capsys):
    from safetensors.torch import load_file, save_file

    resumed = tmp_path / "resumed"  # the checkpoint the run resumed from: one tensor moved
    shutil.copytree(tiny_checkpoint, resumed)
    tensors = load_file(resumed / "model.safetensors")
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] * 1.01
    save_file(tensors, resumed / "model.safetensors", metadata={"format": "pt"})
    dirs = audit_run(tmp_path, tiny_checkpoint, responses, grows=False, seed=3, steps=2, dtype_at=1,
                     checkpoints=[tiny_checkpoint, resumed])
    found = trend_json(dirs, capsys, "--weights")
    # The stored log-probs did not move: the restart is recorded, with its test, and not claimed as a jump.
    assert found["jumps"] == []
    (jump,) = found["configuration_changes"]
    assert jump["step"] == 1 and jump["from_step"] == 0 and jump["significant"] is False and jump["p_value"] > 0.01
    assert jump["causes"][0] == "engine restart: dtype: sampler.meta.dtype 'bfloat16' → 'float16'"
    assert jump["weights"]["compared"] and jump["weights"]["top_tensor"] == name
    assert jump["weights"]["rel_l2"] == pytest.approx(0.01, rel=1e-3)
    summary = json.loads((dirs[1] / "summary.json").read_text())
    (dirs[1] / "summary.json").write_text(json.dumps({**summary, "mismatch_version": "0.0.9"}))
    (again,) = trend_json(dirs, capsys)["configuration_changes"]
    assert again["causes"][:2] == ["another mismatch version audited this step: mismatch.mismatch_version "
                                   f"{summary['mismatch_version']!r} → '0.0.9'", jump["causes"][0]]
    (dirs[1] / "summary.json").write_text(json.dumps(summary))
    capsys.readouterr()
    assert main(["trend", *map(str, dirs)]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first.startswith("no change in kl_k3 of train/sampler over 2 steps") and first.endswith(
        "engine restart: dtype: sampler.meta.dtype 'bfloat16' → 'float16'") and "without a significant move" in first, first


def test_the_trend_gate_fails_on_a_slope_past_the_limit_and_writes_junit(growing_run, control_run, tmp_path, capsys):
    junit = tmp_path / "trend.xml"
    assert main(["gate", "--trend", *map(str, growing_run), "--max-slope", "kl_k3=1e-6", "--junit", str(junit)]) == 1
    assert "slope" in capsys.readouterr().out
    assert 'failures="1"' in junit.read_text()
    assert main(["gate", "--trend", *map(str, control_run), "--max-slope", "kl_k3=1e-4",
                 "--max-step-change", "kl_k3=1e-3"]) == 0


def test_the_trend_report_marks_the_change_and_links_each_step(growing_run, tmp_path, capsys):
    out = tmp_path / "trend.html"
    assert main(["trend", *map(str, growing_run), "--report", str(out)]) == 0
    html = out.read_text()
    assert "<script" in html and "https://" not in html.split("<script", 1)[0]  # self-contained
    found = trend_json(growing_run, capsys)
    assert f"change point: step {found['change_points'][0]}" in html
    for path in growing_run[:2]:  # relative links: the run and its page move together
        assert f'href="{os.path.relpath(path / "index.html", tmp_path)}"' in html


def test_bad_input_is_one_line_and_exit_2(growing_run, tmp_path, capsys):
    assert main(["trend", str(tmp_path / "missing")]) == 2
    assert main(["trend", str(growing_run[0]), str(growing_run[0])]) == 2
    assert "is given twice" in capsys.readouterr().err
    twin = tmp_path / "again" / growing_run[0].name
    shutil.copytree(growing_run[0], twin)
    assert main(["trend", str(growing_run[0]), str(twin), str(growing_run[1])]) == 2
    assert "are both step 0" in capsys.readouterr().err
    assert main(["trend", *map(str, growing_run[:3]), "--metric", "nope"]) == 2
    assert "no metric 'nope'" in capsys.readouterr().err


def test_change_points_name_no_step_on_noisy_lines_and_find_a_clear_bend_and_jump():
    from mismatch.trend.changes import change_points

    steps = np.arange(30)
    named = 0
    for seed in range(300):  # docs/trend.md: "on 300 simulated noisy lines it named no step"
        rng = np.random.default_rng(seed)
        named += len(change_points(steps, 1e-4 + 2e-7 * steps + rng.normal(0, 1e-5, 30), np.full(30, 1e-5)))
    assert named == 0
    rng = np.random.default_rng(0)
    bend = 1e-4 + rng.normal(0, 1e-5, 30) + np.where(steps >= 12, (steps - 11) * 1e-5, 0)
    assert [abs(point.index - 12) <= 1 for point in change_points(steps, bend, np.full(30, 1e-5))] == [True]
    jump = 1e-4 + rng.normal(0, 1e-5, 30) + np.where(steps >= 20, 5e-5, 0)
    assert [(point.index, point.kind) for point in change_points(steps, jump, None)] == [(20, "level")]


def test_the_trend_page_draws_every_timeline_in_chromium(browser, growing_run, tmp_path):  # noqa: F811
    out = tmp_path / "trend.html"
    assert main(["trend", *map(str, growing_run), "--report", str(out)]) == 0
    opened = Opened(browser, out)
    charts = opened.charts()
    assert charts and all(charts.values()), charts  # every timeline drew its SVG
    assert "trend-kl_k3" in charts
    marks = opened.page.eval_on_selector_all(".chart[data-fig='trend-kl_k3'] .annotation-text", "els => els.map(e => e.textContent)")
    assert any(text.startswith("change point: step") for text in marks), marks
    opened.assert_clean()


def test_growth_in_high_entropy_tokens_is_attributed_to_the_trainers_entropy(tmp_path, tiny_checkpoint, responses,
                                                                            capsys):
    """The hf trainer records the entropy at each position; a gap that grows only where it is over
    1 nat is named by it, from the summaries alone."""
    import mismatch

    rng, dirs = np.random.default_rng(4), []
    for step in range(10):
        rollouts = tmp_path / f"rollouts_{step}.jsonl"
        write_step(rollouts, responses, step, rng, grows="entropy", k=5)
        dirs.append(tmp_path / f"step_{step}")
        mismatch.audit(tiny_checkpoint, rollouts, train="hf:dtype=float32", infer="sampler", out=dirs[-1])
    summary = json.loads((dirs[0] / "summary.json").read_text())
    entropy = summary["strata"]["train/sampler"]["entropy"]
    assert sum(entropy["n_tokens"]) == summary["pairs"]["train/sampler"]["n_tokens"]
    found = trend_json(dirs, capsys)
    assert [abs(step - 5) <= 1 for step in found["change_points"]] == [True], found["change_points"]
    strata = found["changes"][0]["strata"]
    assert "entropy" in strata["explained_by"] and "length" not in strata["explained_by"], strata["explained_by"]
    # The growth is planted above 1 nat; the hot buckets lie there (the weighted change point's
    # windows may put the fastest growth above 2 nats, a part of it).
    assert strata["entropy"]["hot"]["where"] in ("trainer entropy (nats) ≥ 1", "trainer entropy (nats) ≥ 2"), \
        strata["entropy"]["hot"]


def test_one_audit_of_a_step_indexed_dump_is_split_by_its_rollouts_steps(growing_run, tiny_checkpoint, tmp_path, capsys):
    """The hooks and importers tag each rollout with meta.step: the whole dump audited once gives
    the same per-step series (from rollouts.parquet's `step`) and the same change point."""
    import mismatch

    dump = tmp_path / "dump.jsonl"
    dump.write_text("".join((path.parent / f"rollouts_{step}.jsonl").read_text()
                            for step, path in enumerate(growing_run)))
    mismatch.audit(tiny_checkpoint, dump, train="stored:trainer", infer="sampler", out=tmp_path / "once")
    found = trend_json([tmp_path / "once"], capsys)
    assert found["num_steps"] == STEPS and found["step_from"] == "meta.step"
    per_step = trend_json(growing_run, capsys)
    assert found["change_points"] == per_step["change_points"]
    for once, each in zip(found["series"]["kl_k3"], per_step["series"]["kl_k3"]):
        assert once["step"] == each["step"]
        assert once["value"] == pytest.approx(each["value"], rel=1e-9)
        assert once["ci_low"] == pytest.approx(each["ci_low"], rel=1e-9)
    assert found["changes"][0]["strata"]["length"]["unavailable"].startswith("not in these summaries")
    from mismatch.replay import Shard

    shards = [tmp_path / f"shard{i}" for i in range(2)]
    for index, out in enumerate(shards):
        mismatch.audit(tiny_checkpoint, dump, train="stored:trainer", infer="sampler", out=out, block_size=16,
                       shard=Shard(index=index, count=2))
    assert main(["merge", *map(str, shards), "--out", str(tmp_path / "merged")]) == 0
    merged = trend_json([tmp_path / "merged"], capsys)
    assert [row["value"] for row in merged["series"]["kl_k3"]] == pytest.approx(
        [row["value"] for row in found["series"]["kl_k3"]], rel=1e-9)
    assert main(["trend", str(growing_run[0])]) == 2
    assert f"{growing_run[0]} holds 1 training step (rollouts.parquet" in capsys.readouterr().err
