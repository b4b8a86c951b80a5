"""CI gate: thresholds, baseline drift, fail-closed cases, bad input, JUnit XML read back by a parser."""

from __future__ import annotations

import json
import math
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from mismatch.errors import MismatchError, ResultsError
from mismatch.advise.gate import (DRIFT_METRICS, drift_pct, github_annotations, load_summary, load_thresholds,
                           parse_limits, run_gate, write_junit)
from mismatch.analysis.metrics import PAIR_METRICS

METRICS = {name: 0.5 for name in PAIR_METRICS} | {"n_tokens": 100, "n_rollouts": 4, "kl_k3": 2e-4,
                                                   "ratio_q999": 1.5, "ess": 0.99}


def summary(**pairs_override) -> dict:
    pairs = {"train/sampler": dict(METRICS), "train/infer": dict(METRICS) | {"kl_k3": 5e-3}}
    for pair, metrics in pairs_override.items():
        pairs[pair.replace("__", "/")] = metrics
    return {"schema": "mismatch.summary/v1", "pairs": pairs}


def failed(result) -> list[str]:
    return [check.name for check in result.failures]


def test_parse_limits_defaults_to_train_sampler_and_keeps_qualified_pairs():
    assert parse_limits(["kl_k3=1e-3", "train/infer.ratio_q999=2"]) == {
        "train/sampler.kl_k3": 1e-3, "train/infer.ratio_q999": 2.0}
    # The quantiles' former names still gate the renamed metrics.
    assert parse_limits(["ratio_p999=2", "ratio_p01=0.5"]) == {"train/sampler.ratio_q999": 2.0,
                                                             "train/sampler.ratio_q01": 0.5}


@pytest.mark.parametrize(("item", "message"), [
    ("kl_k3", "--max 'kl_k3': expected METRIC=VALUE, e.g. kl_k3=1e-3"),
    ("kl=1", "--max kl=1: unknown metric 'kl' (valid: " + ", ".join(PAIR_METRICS) + ")"),
    ("train.kl_k3=1", "--max train.kl_k3=1: pair 'train' is not A/B (e.g. train/sampler)"),
    ("kl_k3=small", "--max kl_k3=small: limit 'small' is not a number"),
    ("kl_k3=nan", "--max kl_k3=nan: limit is NaN"),
])
def test_bad_limits_are_one_line_user_errors(item, message):
    with pytest.raises(MismatchError) as info:
        parse_limits([item])
    assert str(info.value) == message


def test_thresholds_toml(tmp_path: Path):
    path = tmp_path / "gate.toml"
    path.write_text('max_drift_pct = 10\n[max]\nkl_k3 = 1e-3\n"train/infer.ratio_q999" = 2\n'
                    '[max."infer/sampler"]\nkl_k3 = 1e-6\n[min]\ness = 0.9\n')
    thresholds = load_thresholds(path)
    assert thresholds.maxima == {"train/sampler.kl_k3": 1e-3, "train/infer.ratio_q999": 2.0,
                                 "infer/sampler.kl_k3": 1e-6}
    assert thresholds.minima == {"train/sampler.ess": 0.9}
    assert thresholds.max_drift_pct == 10.0


def test_bad_thresholds_toml(tmp_path: Path):
    path = tmp_path / "gate.toml"
    path.write_text("[maximum]\nkl_k3 = 1\n")
    with pytest.raises(MismatchError) as info:
        load_thresholds(path)
    assert str(info.value) == f"{path}: unknown key 'maximum' (valid: max, min, max_drift_pct)"
    path.write_text("[max]\nkl_k4 = 1\n")
    with pytest.raises(MismatchError, match=r": \[max\] kl_k4: unknown metric 'kl_k4' \(valid: n_tokens, "):
        load_thresholds(path)
    path.write_text("[max\n")
    with pytest.raises(MismatchError, match="not valid TOML"):
        load_thresholds(path)
    with pytest.raises(MismatchError) as info:
        load_thresholds(tmp_path / "none.toml")
    assert str(info.value) == f"{tmp_path / 'none.toml'}: no such thresholds file"


def test_passing_gate():
    result = run_gate(summary(), maxima=parse_limits(["kl_k3=1e-3", "train/infer.kl_k3=1e-2"]),
                      minima={"ess": 0.9})
    assert result.passed and result.exit_code == 0
    assert [c.kind for c in result.checks] == ["schema", "tokens", "tokens", "max", "max", "min"]


def test_failing_gate_names_the_metric_value_and_limit():
    result = run_gate(summary(), maxima=parse_limits(["train/infer.kl_k3=1e-3"]), minima={"ess": 0.995})
    assert result.exit_code == 1
    assert failed(result) == ["train/infer.kl_k3", "train/sampler.ess"]
    assert [c.message for c in result.failures] == ["train/infer.kl_k3 = 0.005 > max 0.001",
                                                    "train/sampler.ess = 0.99 < min 0.995"]


@pytest.mark.parametrize(("broken", "failing", "message"), [
    ({"schema": "mismatch.summary/v2"}, "results schema",
     "results schema 'mismatch.summary/v2' is not 'mismatch.summary/v1'"),
    ({"pairs": {"train/sampler": METRICS | {"n_tokens": 0, "kl_k3": None}}}, "results train/sampler tokens",
     "results train/sampler: 0 tokens (nothing was measured)"),
    ({"pairs": {"train/sampler": METRICS | {"kl_k3": None}}}, "train/sampler.kl_k3",
     "train/sampler.kl_k3: NaN (max 0.001)"),
    ({"pairs": {"train/sampler": {k: v for k, v in METRICS.items() if k != "kl_k3"}}}, "train/sampler.kl_k3",
     "train/sampler.kl_k3: metric 'kl_k3' missing (max 0.001)"),
])
def test_fails_closed(broken, failing, message):
    result = run_gate(summary() | broken, maxima={"kl_k3": 1e-3})
    assert result.exit_code == 1
    assert failing in failed(result)
    assert message in [c.message for c in result.failures]


def test_nan_as_a_float_fails_too():
    result = run_gate(summary(train__sampler=METRICS | {"kl_k3": math.nan}), maxima={"kl_k3": 1.0})
    assert failed(result) == ["train/sampler.kl_k3"]


def test_baseline_drift():
    worse = summary(train__sampler=METRICS | {"kl_k3": 2.5e-4, "ess": 0.5})
    result = run_gate(worse, baseline=summary(), max_drift_pct=20)
    assert failed(result) == ["train/sampler.kl_k3 drift"]  # +25%; ess is not in the default drift set
    drift = next(c for c in result.checks if c.name == "train/sampler.kl_k3 drift")
    assert drift.value == pytest.approx(25.0) and drift.limit == 20
    assert drift.message == "train/sampler.kl_k3 = 0.00025 vs baseline 0.0002: 25% worse (> 20%)"
    assert {c.name for c in result.checks if c.kind == "drift"} == {f"{k} drift" for k in DRIFT_METRICS}
    gated = run_gate(worse, minima={"ess": 0.1}, baseline=summary(), max_drift_pct=30)
    assert failed(gated) == ["train/sampler.ess drift"]  # gated metrics drift-checked too: -49.5%


def test_improvement_is_not_drift():
    better = summary(train__sampler=METRICS | {"kl_k3": 1e-5})
    assert run_gate(better, baseline=summary(), max_drift_pct=0).passed


def test_baseline_fails_closed():
    result = run_gate(summary(), baseline={"schema": "other", "pairs": {}}, max_drift_pct=10)
    assert "baseline schema" in failed(result)
    assert "train/sampler.kl_k3 drift" in failed(result)
    assert "train/sampler.kl_k3: baseline no pair 'train/sampler' (pairs: none) (max drift 10%)" in [
        c.message for c in result.failures]


def test_drift_pct():
    assert drift_pct(1.2, 1.0, "kl_k3") == pytest.approx(20.0)
    assert drift_pct(0.8, 1.0, "kl_k3") == 0.0
    assert drift_pct(0.8, 1.0, "ess") == pytest.approx(20.0)
    assert drift_pct(0.9, 1.0, "ratio_mean") == pytest.approx(10.0)  # either way
    assert drift_pct(1e-9, 0.0, "kl_k3") == math.inf
    assert drift_pct(0.0, 0.0, "kl_k3") == 0.0


@pytest.mark.parametrize(("kwargs", "message"), [
    ({}, "nothing to gate: give --max METRIC=VALUE, a thresholds file, or --baseline DIR with --max-drift PCT"),
    ({"baseline": {}}, "--baseline DIR and --max-drift PCT go together"),
    ({"maxima": {"kl_k3": 1}, "max_drift_pct": 5}, "--baseline DIR and --max-drift PCT go together"),
    ({"baseline": {}, "max_drift_pct": -1}, "--max-drift -1: must be a percentage >= 0"),
    ({"maxima": {"kl": 1}}, "gate max: unknown metric 'kl' (valid: " + ", ".join(PAIR_METRICS) + ")"),
])
def test_bad_gate_input(kwargs, message):
    with pytest.raises(MismatchError) as info:
        run_gate(summary(), **kwargs)
    assert str(info.value) == message


def test_junit_xml_parses_with_one_testcase_per_check(tmp_path: Path):
    result = run_gate(summary(), maxima=parse_limits(["kl_k3=1e-3", "train/infer.kl_k3=1e-3"]))
    path = write_junit(result, tmp_path / "ci" / "gate.xml")
    assert sorted(p.name for p in path.parent.iterdir()) == ["gate.xml"]  # no temp file left behind
    root = ET.parse(path).getroot()
    assert root.tag == "testsuites"
    [suite] = root.findall("testsuite")
    assert (suite.get("tests"), suite.get("failures")) == ("5", "1")
    cases = suite.findall("testcase")
    assert [c.get("name") for c in cases] == ["results schema", "results train/sampler tokens",
                                             "results train/infer tokens", "train/sampler.kl_k3",
                                             "train/infer.kl_k3"]
    failures = [(c.get("name"), c.find("failure").get("message")) for c in cases if c.find("failure") is not None]
    assert failures == [("train/infer.kl_k3", "train/infer.kl_k3 = 0.005 > max 0.001")]


def test_github_annotations_escape_the_message():
    result = run_gate(summary(), maxima={"train/infer.kl_k3": 1e-3})
    assert github_annotations(result) == ["::error title=mismatch gate::train/infer.kl_k3 = 0.005 > max 0.001"]
    from mismatch.advise.gate import Check, GateResult
    odd = GateResult(checks=(Check(kind="max", name="x", value=1.0, limit=0.0, passed=False, message="50%\nup"),))
    assert github_annotations(odd) == ["::error title=mismatch gate::50%25%0Aup"]


def test_load_summary(tmp_path: Path):
    with pytest.raises(ResultsError) as info:
        load_summary(tmp_path)
    assert str(info.value) == f"{tmp_path}: no summary.json (not a mismatch results dir)"
    (tmp_path / "summary.json").write_text("{not json")
    with pytest.raises(ResultsError, match=r"summary.json: not valid JSON \("):
        load_summary(tmp_path)
    (tmp_path / "summary.json").write_text(json.dumps({"schema": "x"}))
    assert load_summary(tmp_path) == load_summary(tmp_path / "summary.json") == {"schema": "x"}


def test_a_pair_the_results_do_not_have_is_bad_input_not_a_failure():
    # `--max foo/bar.kl_k3=1` is a typo (exit 2, the valid pairs listed), never "gate FAILED" (exit 1).
    with pytest.raises(MismatchError) as info:
        run_gate(summary(), maxima=parse_limits(["foo/bar.kl_k3=1"]))
    assert str(info.value) == "gate: the results have no pair 'foo/bar' (pairs: train/sampler, train/infer)"
    with pytest.raises(MismatchError, match="the results have no pair 'train/sampler' \\(pairs: train/infer\\)"):
        run_gate({**summary(), "pairs": {"train/infer": METRICS}}, maxima={"kl_k3": 1e-3})


def test_failures_print_the_digits_that_tell_value_and_limit_apart():
    result = run_gate(summary(), maxima={"train/infer.kl_k3": 0.0049999999999999})
    assert [c.message for c in result.failures] == ["train/infer.kl_k3 = 0.005 > max 0.0049999999999999"]
    result = run_gate(summary(), maxima={"train/infer.kl_k3": 0.0049999})
    assert [c.message for c in result.failures] == ["train/infer.kl_k3 = 0.005 > max 0.0049999"]


@pytest.mark.parametrize("metric, value", [("kl_k3", -1e-4), ("ess", 1.2), ("bitwise_equal_frac", -0.5),
                                           ("ratio_q999", -1.0), ("kl_k3", math.inf)])
def test_an_impossible_value_is_bad_input_not_a_pass_or_a_failure(metric, value):
    edited = summary(train__sampler=dict(METRICS) | {metric: value})
    with pytest.raises(MismatchError, match=rf"^results: train/sampler\.{metric} = .* is impossible"):
        run_gate(edited, maxima={metric: 1e9}, minima={})


def test_literal_infinity_or_nan_in_summary_json_is_refused(tmp_path: Path):
    (tmp_path / "summary.json").write_text('{"schema": "mismatch.summary/v1", "pairs": '
                                           '{"train/sampler": {"kl_k3": -Infinity}}}')
    with pytest.raises(ResultsError, match=r"-Infinity is not a value summary.json holds"):
        load_summary(tmp_path)
    (tmp_path / "summary.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ResultsError, match=r"nested too deeply"):
        load_summary(tmp_path)


def test_one_metric_limited_twice_differently_is_refused(tmp_path: Path):
    from mismatch.advise.gate import combined_limits

    with pytest.raises(MismatchError, match=r"^--max train/sampler.kl_k3: given twice \(0.001 and 0.01\); keep one$"):
        parse_limits(["kl_k3=1e-3", "train/sampler.kl_k3=1e-2"])
    assert parse_limits(["kl_k3=1e-3", "kl_k3=0.001"]) == {"train/sampler.kl_k3": 1e-3}
    with pytest.raises(MismatchError, match=r"conflicts with t.toml's \[max\] train/sampler.kl_k3 = 0.001"):
        combined_limits({"train/sampler.kl_k3": 1e-3}, {"train/sampler.kl_k3": 1e-2}, bound="max", file="t.toml")
    with pytest.raises(MismatchError, match=r"no value can pass"):
        run_gate(summary(), maxima={"ess": 0.9}, minima={"ess": 0.95})
