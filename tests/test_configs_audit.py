"""An audit as a framework user runs it: `--train FRAMEWORK:CONFIG` and `--for NAME:SETTING=...`.

The config's model is said on the first line (a clear mismatch refused unless --force-model); the
--for settings are an input of the audit: summary.json's framework_settings and framework_metrics
carry them, computed in the audit's own passes (checked here against a separate pass over the
tokens.parquet it wrote); a bad --for value is one line and exit 2 before anything is read.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from mismatch.errors import MismatchError
from mismatch.frameworks import parse_target

REPO = Path(__file__).resolve().parents[1]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mismatch", *args], capture_output=True, text=True, timeout=900,
                          cwd=str(REPO))


@pytest.mark.parametrize(("value", "message"), [
    ("verl:rollout_is_threshold=1_2", "'1_2' is ambiguous: verl reads it as the integer 12 unquoted"),
    ("trl:vllm_importance_sampling_mode=tokens", "'tokens' is not one of: token_truncate"),
])
def test_a_bad_for_value_is_one_line_exit_2_before_anything_is_read(value: str, message: str, tmp_path: Path) -> None:
    out = tmp_path / "audit"
    done = _cli("audit", str(tmp_path / "no-checkpoint"), "--rollouts", str(tmp_path / "none.jsonl"), "--out", str(out),
                "--for", value)
    assert done.returncode == 2, done.stderr
    assert done.stderr.count("\n") == 1 and message in done.stderr and "Traceback" not in done.stderr
    assert not out.exists()


@pytest.mark.parametrize(("value", "parsed"), [
    ("verl:rollout_is_threshold=1.0_2.0", {"rollout_is_threshold": "1.0_2.0"}),
    ("verl:rollout_is_threshold=2", {"rollout_is_threshold": 2.0}),
    ("verl:rollout_is=null", {"rollout_is": None}),
    ("openrlhf:is_correction_threshold=0_2.5", {"is_correction_threshold": [0.0, 2.5]}),
    ("slime:tis_clip=1.5e0,tis_clip_low=0", {"tis_clip": 1.5, "tis_clip_low": 0.0}),
])
def test_the_values_each_release_takes_are_taken(value: str, parsed: dict[str, object]) -> None:
    assert parse_target(value, detect=False).settings == parsed


@pytest.mark.parametrize("value", ["verl:rollout_is=💥", "verl:rollout_is_threshold=nan",
                                   "trl:vllm_importance_sampling_clip_max=1e999", "verl:rollout_is_threshold=1_000",
                                   "verl:rollout_is_threshold=-2", "verl:rollout_is_threshold=0",
                                   "verl:rollout_is_threshold=inf", "verl:rollout_is_threshold=2_1",
                                   "openrlhf:is_correction_threshold=5_0.5", "slime:tis_clip=0",
                                   "areal:upper=1_0", "openrlhf:is_correction_type=bogus"])
def test_values_the_release_refuses_are_refused(value: str) -> None:
    with pytest.raises(MismatchError):
        parse_target(value, detect=False)


def test_openrlhf_09x_gets_its_own_flag_names() -> None:
    from mismatch.frameworks import openrlhf
    from mismatch.frameworks.protocol import Recommendation

    target = parse_target("openrlhf==0.9.10", detect=False)
    assert target.release.version == "0.9.10" and not target.note
    correction = Recommendation(kind="correction", params={"mode": "token_icepop", "low": 0.5, "high": 5.0}, why="x")
    flags = openrlhf.render({"correction": correction}, target)[-1]
    assert flags.split(" \\\n") == ["--enable_vllm_is_correction", "--vllm_is_correction_type icepop",
                                    "--vllm_is_truncated_threshold 0.5 5.0"]


def test_a_config_naming_a_model_of_other_sizes_is_refused_unless_forced(tiny_checkpoint: Path,
                                                                         tmp_path: Path) -> None:
    from mismatch.pipeline.configured import with_configs, with_checkpoint_checks
    from mismatch.pipeline.options import AuditOptions

    other = tmp_path / "other-model"
    other.mkdir()
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "vocab_size": config["vocab_size"] + 64}))
    grpo = tmp_path / "grpo.yaml"
    grpo.write_text(f"model_name_or_path: {other}\n")
    out = tmp_path / "audit"
    done = _cli("audit", str(tiny_checkpoint), "--rollouts", str(REPO / "examples" / "rollouts.jsonl"),
                "--out", str(out), "--train", f"trl:{grpo}")
    assert done.returncode == 2 and done.stderr.count("\n") == 1, done.stderr
    assert f"model: the config's model_name_or_path={other} is not the checkpoint" in done.stderr
    assert f"vocab_size {config['vocab_size'] + 64} vs {config['vocab_size']}" in done.stderr
    assert "--force-model" in done.stderr and not out.exists()
    forced = with_checkpoint_checks(tiny_checkpoint, with_configs(AuditOptions(train=f"trl:{grpo}", force_model=True)))
    assert forced.from_config["train"]["model_check"]["verdict"] == "differs"
    same = tmp_path / "same-model"
    shutil.copytree(tiny_checkpoint, same, ignore=shutil.ignore_patterns("*.safetensors"))
    grpo.write_text(f"model_name_or_path: {same}\n")
    checked = with_checkpoint_checks(tiny_checkpoint, with_configs(AuditOptions(train=f"trl:{grpo}")))
    assert checked.from_config["train"]["model_check"]["verdict"] == "same"
    # A config.json with a size of another type gives nothing both can be read for: not "same".
    (same / "config.json").write_text(json.dumps({**config, "vocab_size": str(config["vocab_size"])}))
    unread = with_checkpoint_checks(tiny_checkpoint, with_configs(AuditOptions(train=f"trl:{grpo}")))
    assert unread.from_config["train"]["model_check"]["verdict"] == "not compared"


def test_audit_says_the_configs_model_first_and_computes_the_for_settings_metrics(tiny_checkpoint: Path,
                                                                                tmp_path: Path) -> None:
    from mismatch.advise.advice import logged_metrics

    rollouts = tmp_path / "rollouts.jsonl"
    rollouts.write_text("".join((REPO / "examples" / "rollouts.jsonl").read_text().splitlines(True)[:3]))
    grpo = tmp_path / "grpo.yaml"
    grpo.write_text("model_name_or_path: Qwen/Qwen3-8B\nper_device_train_batch_size: 4\n")
    out = tmp_path / "audit"
    asked = "trl:vllm_importance_sampling_mode=token_truncate,vllm_importance_sampling_clip_max=1.01"
    done = _cli("audit", str(tiny_checkpoint), "--rollouts", str(rollouts), "--out", str(out),
                "--train", f"trl:{grpo}", "--for", asked)
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[0].startswith(
        f"model: the config trains Qwen/Qwen3-8B (model_name_or_path), the audit replays the checkpoint {tiny_checkpoint}")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["engines"]["train"]["from_config"]["model_check"]["verdict"] == "other name"
    settings = summary["framework_settings"]["trl"]
    assert settings == {"vllm_importance_sampling_correction": True, "vllm_importance_sampling_mode": "token_truncate",
                        "vllm_importance_sampling_clip_max": 1.01, "vllm_importance_sampling_clip_min": None}
    # The audit's own passes computed TRL's metrics at those settings: a separate pass over the tokens it
    # wrote agrees, and at TRL's defaults (sequence_mask, clip 3.0) the numbers differ.
    ours = summary["framework_metrics"]["train/sampler"]["trl"]
    target = parse_target(asked, detect=False)
    again = logged_metrics(out, target)
    assert again is not None and again["settings"] == settings
    assert ours == pytest.approx(again["metrics"], rel=1e-12)
    defaults = logged_metrics(out, parse_target("trl", detect=False))
    assert defaults is not None and defaults["metrics"] != pytest.approx(ours, rel=1e-9)
    assert "vllm_importance_sampling_clip_max=1.01" in done.stdout.replace("\n", " ")


VERL_RUN = ("python3 -m verl.trainer.main_ppo actor_rollout_ref.rollout.name=vllm "
            "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2 "
            "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2 "
            "actor_rollout_ref.rollout.max_model_len={length}\n")


def test_a_config_asking_for_more_context_than_the_checkpoint_is_capped_and_says_so(tiny_checkpoint: Path,
                                                                                    tmp_path: Path) -> None:
    from mismatch.checkpoint import checkpoint_info
    from mismatch.pipeline.configured import with_checkpoint_checks, with_configs
    from mismatch.pipeline.options import AuditOptions

    limit = checkpoint_info(tiny_checkpoint).max_positions
    assert limit is not None
    run = tmp_path / "run.cmdline"
    run.write_text(VERL_RUN.format(length=limit * 4))
    options = with_checkpoint_checks(tiny_checkpoint, with_configs(AuditOptions(train=f"verl:{run}")))
    assert f"max_model_len={limit}" in options.infer and f"max_model_len={limit * 4}" not in options.infer
    notice = options.from_config["infer"]["notices"][-1]
    assert notice.startswith(f"actor_rollout_ref.rollout.max_model_len={limit * 4} asks vLLM for more context than "
                             f"the checkpoint's {limit}")
    run.write_text(VERL_RUN.format(length=limit // 2))  # within the checkpoint's context: as the config says
    options = with_checkpoint_checks(tiny_checkpoint, with_configs(AuditOptions(train=f"verl:{run}")))
    assert f"max_model_len={limit // 2}" in options.infer and not options.from_config["infer"]["notices"]
    # the option on the --train config goes to the rollout engine it derives; the trainer's forward has no limit
    options = with_configs(AuditOptions(train=f"verl:{run},max_model_len=64"))
    assert "max_model_len=64" in options.infer and "max_model_len" not in options.train
    assert with_checkpoint_checks(tiny_checkpoint, options).infer == options.infer  # the user's own: kept


def test_bypass_mode_and_the_model_are_on_the_first_screen_before_the_specs() -> None:
    from rich.console import Console

    from mismatch.cli.printing import print_from_config
    from mismatch.pipeline.configured import config_tables, with_configs
    from mismatch.pipeline.options import AuditOptions

    script = REPO / "tests" / "data" / "upstream" / "verl" / "examples" / "rollout_correction" / "run_qwen2_5_7b_fsdp.sh.cmdline"
    options = with_configs(AuditOptions(train=f"verl:{script}"))
    console = Console(record=True, width=400)
    print_from_config(config_tables(options), console, model="model: (the model line)")
    lines = console.export_text().splitlines()
    assert lines[0] == "model: (the model line)"
    assert lines[1].startswith("note: bypass mode (algorithm.rollout_correction.bypass_mode=true): verl trains on "
                               "the rollout's log-probs")
    assert lines[2].startswith("--train hf:") and options.from_config["train"]["spec"] == options.train


def test_a_configs_own_correction_settings_are_the_audits_unless_for_names_the_framework(tmp_path: Path) -> None:
    from mismatch.errors import SpecError
    from mismatch.pipeline.configured import with_configs
    from mismatch.pipeline.options import AuditOptions

    grpo = tmp_path / "grpo.yaml"
    grpo.write_text("vllm_importance_sampling_mode: token_truncate\nvllm_importance_sampling_clip_max: 2.0\n")
    options = with_configs(AuditOptions(train=f"trl:{grpo}"))
    assert options.framework_settings == {"trl": {"vllm_importance_sampling_mode": "token_truncate",
                                                  "vllm_importance_sampling_clip_max": 2.0}}
    asked = {"trl": {"vllm_importance_sampling_mode": "sequence_mask"}}
    assert with_configs(AuditOptions(train=f"trl:{grpo}", framework_settings=asked)).framework_settings == asked
    grpo.write_text("vllm_importance_sampling_mode: tokens\n")
    with pytest.raises(SpecError, match=r"grpo\.yaml: trl's correction settings: 'tokens' is not one of"):
        with_configs(AuditOptions(train=f"trl:{grpo}"))
    kimi = REPO / "tests" / "data" / "upstream" / "slime" / "scripts" / "run-kimi-k2-Thinking.sh.cmdline"
    assert with_configs(AuditOptions(train=f"slime:{kimi}")).framework_settings == {"slime": {"use_tis": True}}
