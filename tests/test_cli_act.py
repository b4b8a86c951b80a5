"""`mismatch recommend` and `mismatch gate` on a real audit's results dir (exit codes, JUnit)."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

from mismatch.pipeline.audit import audit
from mismatch.cli import main


@pytest.fixture(scope="module")
def results(tiny_checkpoint, sampled_rollouts, tmp_path_factory):
    out = tmp_path_factory.mktemp("act") / "audit"
    audit(tiny_checkpoint, sampled_rollouts, train="hf", infer="hf-decode:dtype=bfloat16", out=out)
    return out


def test_audit_summary_carries_trl_corrections_and_a_recommendation(results) -> None:
    summary = json.loads((results / "summary.json").read_text())
    trl = {(c["mode"], c["params"].get("cap")) for c in summary["corrections"]}
    for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"):
        assert {(mode, 2.0), (mode, 3.0)} <= trl
    for item in summary["corrections"]:
        assert {"mode", "params", "frac_tokens_affected", "frac_rollouts_affected", "weight_mean",
                "weight_max", "ess"} <= set(item)
    # bf16 decode against an fp32 trainer on the tiny model is a small gap (kl_k3 ~6e-5, nothing
    # outside [0.5, 2]): one correction, the most ESS within 1% of tokens changed, and nothing heavier
    # (no recompute pass, no fp16 move).
    assert summary["verdicts"]["train/sampler"]["level"] == "small"
    [recommendation] = summary["recommendations"]
    assert recommendation["kind"] == "correction" and recommendation["params"]["meets_rule"]
    ranked = recommendation["params"]["ranked"]
    assert recommendation["params"]["ess"] == ranked[0]["ess"] >= max(r["ess"] for r in ranked if r["meets_rule"])


def test_recommend_prints_a_real_config(results, capsys) -> None:
    from mismatch import frameworks

    assert main(["recommend", str(results), "--for", "trl==1.16.0", "--json"]) == 0
    advice = json.loads(capsys.readouterr().out)
    mode = advice["recommendations"][0]["params"]["mode"]  # the best TRL 1.16.0 can express
    assert advice["release"] == "1.16.0" and mode in frameworks.module("trl")._EXACT
    assert advice["logged"]["metrics"]["sampling/importance_sampling_ratio/max"] is not None
    assert main(["recommend", str(results), "--for", "trl==1.16.0"]) == 0
    out = capsys.readouterr().out
    assert f"vllm_importance_sampling_mode: {frameworks.module('trl')._EXACT[mode][0]}" in out and "trl 1.16.0 logs: sampling/" in out.replace("\n#   ", " ")
    # Only the snippet (pipeable into a file), each recommendation once, lines wrapped.
    assert out.count("# correction: ") == 1 and out.startswith("# mismatch recommend --for trl==1.16.0\n")
    assert max(map(len, out.splitlines())) <= 100
    assert main(["recommend", str(results), "--for", "verl", "--json"]) == 0
    config = yaml.safe_load(json.loads(capsys.readouterr().out)["config"])
    assert isinstance(config["algorithm"]["rollout_correction"]["rollout_is_threshold"], float)
    assert main(["recommend", str(results), "--for", "nope"]) == 2
    assert "unknown framework 'nope'" in capsys.readouterr().err


def test_gate_exit_codes_and_junit(results, tmp_path, capsys) -> None:
    junit = tmp_path / "gate.xml"
    assert main(["gate", str(results), "--max", "kl_k3=1", "--junit", str(junit)]) == 0
    suite = ET.parse(junit).getroot().find("testsuite")
    assert suite.get("failures") == "0" and int(suite.get("tests")) >= 3
    assert main(["gate", str(results), "--max", "train/infer.kl_k3=1e-9", "--junit", str(junit)]) == 1
    assert ET.parse(junit).getroot().find("testsuite").get("failures") == "1"
    capsys.readouterr()
    assert main(["gate", str(results), "--max", "kl=1"]) == 2
    assert capsys.readouterr().err.startswith("mismatch: error: --max kl=1: unknown metric 'kl' (valid: ")
    assert main(["gate", str(results), "--baseline", str(results), "--max-drift", "5"]) == 0


def test_probe_command_reports_every_family(tiny_checkpoint, tmp_path, capsys) -> None:
    out = tmp_path / "probes.json"
    assert main(["probe", str(tiny_checkpoint), "--device", "cpu", "--out", str(out)]) == 0
    payload = json.loads(out.read_text())
    families = {r["family"] for r in payload["results"]}
    assert {"matmul", "attention", "norm", "softmax", "reductions"} <= families
    applicable = [r for r in payload["results"] if r["applicable"]]
    assert applicable and all(0.0 <= r["bitwise_equal_frac"] <= 1.0 for r in applicable)
    assert "batch_size" in capsys.readouterr().out


def test_layers_and_weights_commands_name_a_planted_fault(tiny_checkpoint, sampled_rollouts, tmp_path,
                                                         capsys) -> None:
    import shutil

    from safetensors.torch import load_file, save_file

    faulty = tmp_path / "faulty"
    shutil.copytree(tiny_checkpoint, faulty)
    tensors = load_file(faulty / "model.safetensors")
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = tensors[name] * 1.1
    save_file(tensors, faulty / "model.safetensors", metadata={"format": "pt"})

    assert main(["weights", str(tiny_checkpoint), str(faulty), "--fail-on-diff"]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"{name}: ") and "20/21 shared tensors bitwise equal" in out

    assert main(["layers", str(tiny_checkpoint), "--rollouts", str(sampled_rollouts), "--a",
                 f"hf:dtype=float32,checkpoint={faulty}", "--b", "hf:dtype=float32", "--max-tokens",
                 "256", "--json"]) == 0
    found = json.loads(capsys.readouterr().out)
    assert (found["layers"]["jump_layer"], found["layers"]["jump_block"]) == (1, "mlp")
    worst = found["kernels"]["by_module"][0]
    assert worst["name"].endswith("layers.1.mlp.down_proj") and worst["rel_error"] > 0


def _copy_with(results, tmp_path, name, edit):
    import shutil

    copy = tmp_path / name
    shutil.copytree(results, copy)
    summary = json.loads((copy / "summary.json").read_text())
    edit(summary)
    (copy / "summary.json").write_text(json.dumps(summary))
    return copy


def test_gate_drift_and_fail_closed_cases_through_the_cli(results, tmp_path, capsys) -> None:
    def halve_baseline(summary):
        summary["pairs"]["train/sampler"]["kl_k3"] /= 2  # today's run is then 100% worse

    baseline = _copy_with(results, tmp_path, "baseline", halve_baseline)
    junit = tmp_path / "drift.xml"
    assert main(["gate", str(results), "--baseline", str(baseline), "--max-drift", "50",
                 "--junit", str(junit)]) == 1
    failures = [case for case in ET.parse(junit).getroot().iter("testcase") if case.find("failure") is not None]
    assert [case.get("name") for case in failures] == ["train/sampler.kl_k3 drift"]

    cases = {
        "null_metric": lambda s: s["pairs"]["train/sampler"].update(kl_k3=None),   # NaN on disk
        # Both counts: n_rollouts > n_tokens is a summary no run writes, refused (tests/test_faults_small.py).
        "no_tokens": lambda s: s["pairs"]["train/infer"].update(n_tokens=0, n_rollouts=0),
        "old_schema": lambda s: s.update(schema="mismatch.summary/v0"),
    }
    for name, edit in cases.items():
        broken = _copy_with(results, tmp_path, name, edit)
        junit = tmp_path / f"{name}.xml"
        code = main(["gate", str(broken), "--max", "kl_k3=1", "--max", "train/infer.kl_k3=1",
                     "--junit", str(junit)])
        assert code == 1, name  # fails closed: what cannot be checked does not pass
        suite = ET.parse(junit).getroot().find("testsuite")
        assert int(suite.get("failures")) >= 1, name
    capsys.readouterr()
    # A pair the results do not have: the thresholds name something that is not there (exit 2).
    broken = _copy_with(results, tmp_path, "missing_pair", lambda s: s["pairs"].pop("train/infer"))
    assert main(["gate", str(broken), "--max", "train/infer.kl_k3=1"]) == 2
    assert capsys.readouterr().err == ("mismatch: error: gate: the results have no pair 'train/infer' "
                                       "(pairs: train/sampler, infer/sampler)\n")


def test_shipped_ci_thresholds_gate_the_demo_results(results) -> None:
    from conftest import REPO

    thresholds = REPO / "examples/ci/thresholds.toml"
    assert main(["gate", str(results), "--thresholds", str(thresholds)]) == 0
    assert main(["gate", str(results), "--thresholds", str(thresholds), "--baseline", str(results)]) == 0


def test_help_follows_click_conventions(capsys) -> None:
    from mismatch import __version__

    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"mismatch {__version__}\n"
    assert main([]) == 2  # bare: the help, and no empty error line after it
    captured = capsys.readouterr()
    assert "Usage: mismatch [OPTIONS] COMMAND" in captured.out + captured.err
    assert "mismatch: error:" not in captured.err
    assert main(["gate", "--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())  # as read, whatever the column wrapping
    assert "([max], [min], max_drift_pct)" in text and "Allowed % worsening" in text and "%%" not in text
    assert "<bool>" not in text and "RESULTS" in text
    assert main(["--help"]) == 0
    assert "stored:NAME, python:MODULE:CALLABLE" in " ".join(capsys.readouterr().out.split())


def test_localization_that_cannot_run_is_refused_up_front(tmp_path, capsys) -> None:
    from mismatch.localize import localized_what
    from test_golden import GOLDEN, stored_checkpoint

    checkpoint = stored_checkpoint(tmp_path / "ckpt")
    code = main(["audit", str(checkpoint), "--rollouts", str(GOLDEN / "rollouts.jsonl"), "--out", str(tmp_path / "o"),
                 "--train", "stored:trainer", "--infer", "vllm:dtype=bfloat16", "--localize"])
    assert code == 2 and not (tmp_path / "o").exists()
    assert capsys.readouterr().err.startswith("mismatch: error: --localize: the layer and kernel localizers hook "
                                              "torch models (hf, hf-decode); 'stored:trainer' is 'stored'.")
    assert main(["layers", str(checkpoint), "--rollouts", str(GOLDEN / "rollouts.jsonl"),
                 "--a", "vllm:dtype=bfloat16", "--b", "hf"]) == 2
    assert "'vllm:dtype=bfloat16' is 'vllm'" in capsys.readouterr().err
    # What did run is said, and what was skipped with its reason.
    from mismatch.results.section_records import Localization
    from mismatch.results.summary_model import from_builtins

    found = {"layers": {"by_layer": []}, "kernels": {"skipped": "needs two `hf` configs"}}
    assert localized_what(from_builtins(found, Localization)) == [
        "layers: both configs agree bit for bit at every layer", "kernels: skipped: needs two `hf` configs"]


def test_commands_that_would_do_nothing_say_so_and_exit_2(tmp_path, capsys) -> None:
    from test_golden import GOLDEN, stored_checkpoint

    checkpoint = stored_checkpoint(tmp_path / "ckpt")
    assert main(["drift", str(checkpoint), "--rollouts", str(GOLDEN / "rollouts.jsonl")]) == 2
    assert "no rollout carries `messages`, so there is nothing to re-render" in capsys.readouterr().err
    diff_dir = tmp_path / "diff"
    diff_dir.mkdir()
    (diff_dir / "summary.json").write_text(json.dumps({"schema": "mismatch.summary/v1", "command": "diff",
                                                       "pairs": {}}))
    assert main(["recommend", str(diff_dir)]) == 2
    assert "a `mismatch diff` results dir; recommend reads an audit's" in capsys.readouterr().err


def test_recommend_reads_probes_that_show_batch_variance(results, tmp_path, capsys) -> None:
    probes = tmp_path / "probes.json"
    probes.write_text(json.dumps({"results": [
        {"source": "batch_size", "applicable": True, "bitwise_equal_frac": 0.93, "family": "matmul"}]}))
    assert main(["recommend", str(results), "--probes", str(probes), "--json"]) == 0
    kinds = [r["kind"] for r in json.loads(capsys.readouterr().out)["recommendations"]]
    assert kinds == ["batch_invariant", "correction"]  # the cause's fix first, the correction meanwhile
    (tmp_path / "bad.json").write_text("[1, 2]")
    assert main(["recommend", str(results), "--probes", str(tmp_path / "bad.json")]) == 2
    assert "not a `mismatch probe --out` file" in capsys.readouterr().err


def test_report_and_import_speak_json(results, tmp_path, capsys) -> None:
    assert main(["report", str(results), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"report": str(results / "index.html")}
    example = {"prompt_ids": [1, 2], "prompt_mask": [0, 0], "completion_ids": [3, 4],
               "completion_mask": [1, 1], "completion_logprobs": [-0.5, -0.25]}
    dump = tmp_path / "examples.jsonl"
    dump.write_text(json.dumps(example) + "\n")
    out = tmp_path / "out.jsonl"
    assert main(["import", "prime-rl", str(dump), "--out", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"out": str(out), "num_rollouts": 1}


def test_json_stdout_holds_only_the_json(tmp_path, capsys, monkeypatch) -> None:
    """Whatever runs inside a --json command and prints (vLLM logs to stdout) lands on stderr."""
    import importlib

    from test_golden import GOLDEN, stored_checkpoint

    audit_module = importlib.import_module("mismatch.pipeline.audit")

    analyze = audit_module.analyze_audit

    def noisy(*args, **kwargs):
        print("INFO some dependency chatter")
        return analyze(*args, **kwargs)

    monkeypatch.setattr(audit_module, "analyze_audit", noisy)
    checkpoint = stored_checkpoint(tmp_path / "ckpt")
    assert main(["audit", str(checkpoint), "--rollouts", str(GOLDEN / "rollouts.jsonl"), "--out", str(tmp_path / "o"),
                 "--train", "stored:trainer", "--infer", "stored:engine", "--json"]) == 0
    captured = capsys.readouterr()
    assert json.loads(captured.out)["schema"] == "mismatch.summary/v1"
    assert "INFO some dependency chatter" in captured.err


def test_dependency_warnings_go_to_a_log_in_the_results_dir(tmp_path, capsys, monkeypatch) -> None:
    import importlib
    import warnings

    from test_golden import GOLDEN, stored_checkpoint

    audit_module = importlib.import_module("mismatch.pipeline.audit")
    analyze = audit_module.analyze_audit

    def warns(*args, **kwargs):
        warnings.warn("some dependency's FutureWarning", FutureWarning, stacklevel=1)
        return analyze(*args, **kwargs)

    monkeypatch.setattr(audit_module, "analyze_audit", warns)
    checkpoint = stored_checkpoint(tmp_path / "ckpt")
    args = ["audit", str(checkpoint), "--rollouts", str(GOLDEN / "rollouts.jsonl"), "--train", "stored:trainer",
            "--infer", "stored:engine"]
    assert main([*args, "--out", str(tmp_path / "o")]) == 0
    err = capsys.readouterr().err
    assert "FutureWarning" not in err and f"dependency messages: {tmp_path / 'o' / 'dependencies.log'}" in err
    assert "some dependency's FutureWarning" in (tmp_path / "o" / "dependencies.log").read_text()
    # A run that fails leaves no log behind.
    (tmp_path / "bad.jsonl").write_text("{}\n")
    before = set(tmp_path.iterdir())
    assert main(["audit", str(checkpoint), "--rollouts", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "x")]) == 2
    assert set(tmp_path.iterdir()) == before


def test_audit_probe_feeds_the_probes_to_the_recommendations(tiny_checkpoint, tmp_path) -> None:
    from mismatch.advise.readers import batch_variant_from_probes
    from mismatch.results.summary_model import probe_results

    example = Path(__file__).resolve().parents[1] / "examples" / "rollouts.jsonl"
    assert main(["audit", str(tiny_checkpoint), "--rollouts", str(example), "--train", "sampler", "--infer",
                 "sampler", "--probe", "--out", str(tmp_path / "o")]) == 0
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    results = summary["probes"]["results"]
    assert results and {"source", "bitwise_equal_frac", "applicable"} <= set(results[0])
    kinds = [r["kind"] for r in summary["recommendations"]]
    assert ("batch_invariant" in kinds) == bool(batch_variant_from_probes(probe_results(results)))
