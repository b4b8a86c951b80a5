"""`--train verl:CONFIG`: a verl config read as the trainer replay and the vLLM replay it sets up.

The built-in subset (verl not installed) is held to the release's own reading: the same files read
in a subprocess with verl 0.9.1 and omegaconf on the path (the installed loader merges into the
release's own default config) must derive the same specs and the same table.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import releases
from mismatch.engines import check_spec
from mismatch.errors import SpecError
from mismatch.frameworks.configs import read_config, resolve
from mismatch.frameworks.configs.derived import Machine

DATA = Path(__file__).parent / "data" / "configs" / "verl"
REPO = Path(__file__).resolve().parents[1]
CPU = Machine()
ROLLOUT = "actor_rollout_ref.rollout"


def _statuses(derived) -> dict[str, str]:
    return {s.key: s.status for s in derived.settings}


def test_a_users_overrides_derive_the_trainer_and_engine_replays() -> None:
    derived = read_config("verl", DATA / "overrides.yaml", CPU)
    assert derived.specs["train"] == "hf:dtype=bfloat16,attn=sdpa,packing=varlen,temperature=0.7,micro_batch=8"
    assert derived.specs["infer"].startswith("vllm:dtype=bfloat16,enable_prefix_caching=false,")
    assert "tensor_parallel_size=1" in derived.specs["infer"] and "logprobs_mode=processed_logprobs" in derived.specs["infer"]
    statuses = _statuses(derived)
    assert statuses[f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu"] == "reproduced"
    assert statuses["actor_rollout_ref.model.use_remove_padding"] == "reproduced"
    assert statuses[f"{ROLLOUT}.tensor_model_parallel_size"] == "approximated"  # TP 4 on no GPU
    assert statuses["actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype"] == "approximated"
    assert "built-in subset" in derived.loader
    for side in ("train", "infer"):
        check_spec(derived.specs[side])  # mismatch's engines (and vLLM's arg schema) accept them


def test_the_policy_updates_forward_is_its_own_side() -> None:
    """verl#6280: old log-probs in the rollout section's micro-batches, new ones in the actor's."""
    derived = read_config("verl", DATA / "overrides.yaml", CPU)
    assert derived.specs["update"] == "hf:dtype=bfloat16,attn=sdpa,packing=varlen,temperature=0.7,micro_batch=4"
    update = [s for s in derived.settings if s.side == "update"]
    assert [s.key for s in update if s.option == "micro_batch=4"] == ["actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu"]
    assert len(update) == len([s for s in derived.settings if s.side == "train"])  # dtype, attn, ... as the trainer's


def test_the_run_scripts_command_line_is_read_as_hydra_overrides() -> None:
    derived = read_config("verl", DATA / "run_qwen3_4b_fsdp.cmdline", CPU)
    # use_dynamic_bsz with log_prob_max_token_len_per_gpu=4096: the token budget, verl's balancing
    assert derived.specs["train"] == "hf:dtype=bfloat16,attn=sdpa,packing=varlen,temperature=1.0,batch_tokens=4096"
    assert "enable_chunked_prefill=false" in derived.specs["infer"]


def test_what_this_machine_can_run_is_reproduced_not_approximated() -> None:
    gpu = read_config("verl", DATA / "overrides.yaml", Machine(gpus=8, flash_attn=True))
    assert "attn=flash_attention_2" in gpu.specs["train"]
    assert "tensor_parallel_size=4" in gpu.specs["infer"] and "enforce_eager=false" in gpu.specs["infer"]
    statuses = _statuses(gpu)
    assert statuses[f"{ROLLOUT}.tensor_model_parallel_size"] == "reproduced"
    assert statuses[f"{ROLLOUT}.enforce_eager"] == "reproduced"


def test_the_spec_picks_a_side_and_overrides_options(tmp_path: Path) -> None:
    resolved = resolve(f"verl:{DATA / 'overrides.yaml'},side=infer,tensor_parallel_size=2", "train", CPU)
    assert resolved.spec.startswith("vllm:") and "tensor_parallel_size=2," in resolved.spec
    assert resolved.from_config["overrides"] == {"tensor_parallel_size": "2"}
    assert resolved.from_config["side"] == "infer"
    assert resolve(f"verl:{DATA / 'overrides.yaml'}", "infer", CPU).spec.startswith("vllm:")
    with pytest.raises(SpecError, match="side='engine'"):
        resolve(f"verl:{DATA / 'overrides.yaml'},side=engine", "train", CPU)


@pytest.mark.parametrize(("text", "message"), [
    ("actor_rollout_ref:\n  rollout:\n    name: vllm\n    log_prob_micro_batch_size_per_gpu: eight\n",
     "log_prob_micro_batch_size_per_gpu='eight' is not an integer"),
    ("actor_rollout_ref:\n  actor:\n    ppo_micro_batch_size_per_gpu: 4\n  rollout:\n"
     "    log_prob_micro_batch_size_per_gpu: 8\n", "rollout.name is mandatory"),
    ("actor_rollout_ref:\n  rollout:\n    name: vllm\n", "log_prob_micro_batch_size_per_gpu is not set"),
    ("actor_rollout_ref:\n  actor:\n    use_dynamic_bsz: true\n  rollout:\n    name: vllm\n"
     "    log_prob_use_dynamic_bsz: false\n", "refuse the two to differ"),
    ("python3 -m verl.trainer.main_ppo actor_rollout_ref.rollout.name=${INFER_BACKEND}\n", "shell variable"),
    ("just: [unclosed\n", r"bad.yaml:2: invalid YAML in the verl config"),
    # the keys read are decoded once into typed records: a value of another type names its key and value
    ("actor_rollout_ref:\n  rollout:\n    name: vllm\n    log_prob_micro_batch_size_per_gpu: 8\n"
     "    enforce_eager: maybe\n", "actor_rollout_ref.rollout.enforce_eager='maybe' is not true or false"),
    ("actor_rollout_ref:\n  actor:\n    fsdp_config:\n      mixed_precision: bf16\n",
     "actor_rollout_ref.actor.fsdp_config.mixed_precision='bf16' is not a mapping"),
    ("python3 -m verl.trainer.main_ppo actor_rollout_ref.rollout.temperature=0\n",
     "actor_rollout_ref.rollout.temperature=0 is not a positive number"),
])
def test_a_bad_config_is_one_line_naming_the_file_and_key(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    with pytest.raises(SpecError, match=message) as raised:
        read_config("verl", path, CPU)
    assert str(path) in str(raised.value) and "\n" not in str(raised.value)


def test_a_null_group_or_parallel_size_reads_as_verls_default_and_a_null_temperature_is_refused(tmp_path: Path) -> None:
    """verl reads a null group `or {}` and a null parallel size or replay mode as unset: the
    derivation equals the one of the file without those keys. A null temperature is no default."""
    base = ("actor_rollout_ref:\n  actor:\n    ppo_micro_batch_size_per_gpu: 4\n  rollout:\n    name: vllm\n"
            "    log_prob_micro_batch_size_per_gpu: 8\n")
    nulls = ("actor_rollout_ref:\n  actor:\n    ppo_micro_batch_size_per_gpu: 4\n"
             "    ulysses_sequence_parallel_size: null\n    megatron:\n      router_replay: null\n"
             "      override_transformer_config: null\n      context_parallel_size: null\n"
             "  model:\n    override_config: null\n  rollout:\n    name: vllm\n"
             "    log_prob_micro_batch_size_per_gpu: 8\n    engine_kwargs: null\n    tensor_model_parallel_size: null\n")
    (tmp_path / "base.yaml").write_text(base)
    (tmp_path / "nulls.yaml").write_text(nulls)
    read = [read_config("verl", tmp_path / name, CPU) for name in ("base.yaml", "nulls.yaml")]
    assert [(s.key, s.status, s.value) for s in read[0].settings] == [(s.key, s.status, s.value) for s in read[1].settings]
    (tmp_path / "t.yaml").write_text(base + "    temperature: null\n")
    with pytest.raises(SpecError, match="temperature"):
        read_config("verl", tmp_path / "t.yaml", CPU)


def _installed_reading(files: list[Path]) -> list[dict]:
    """Each file derived in a subprocess where verl 0.9.1 and omegaconf are importable."""
    paths = releases.install("verl", "0.9.1")
    script = ("import json, sys\nfrom pathlib import Path\n"
              "from mismatch.frameworks.configs import read_config\nfrom mismatch.frameworks.configs.derived import Machine\n"
              "from mismatch.errors import SpecError\nout = []\n"
              "for f in sys.argv[1:]:\n"
              "    try:\n        d = read_config('verl', Path(f), Machine())\n"
              "        out.append({'loader': d.loader, 'specs': d.specs, 'settings': [s.to_dict() for s in d.settings]})\n"
              "    except SpecError as exc:\n        out.append({'refused': str(exc)})\n"
              "print(json.dumps(out))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), *map(str, paths)]), "PYTHONNOUSERSITE": "1"}
    done = subprocess.run([sys.executable, "-c", script, *map(str, files)], capture_output=True, text=True, env=env,
                          timeout=120, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_the_built_in_subset_reads_as_the_release_does(tmp_path: Path) -> None:
    unknown = tmp_path / "unknown.yaml"
    unknown.write_text("actor_rollout_ref:\n  actor:\n    ppo_micro_batch_size_per_gpu: 4\n  rollout:\n    name: vllm\n"
                       "    log_prob_micro_batch_size_per_gpu: 8\n    temprature: 0.7\n")
    files = [DATA / "overrides.yaml", DATA / "run_qwen3_4b_fsdp.cmdline", unknown]
    installed = _installed_reading(files)
    for path, answer in zip(files[:2], installed):
        subset = read_config("verl", path, CPU)
        assert answer["loader"].startswith("verl 0.9.1 (installed)")
        assert answer["specs"] == subset.specs
        assert answer["settings"] == [s.to_dict() for s in subset.settings]
    # a key verl lacks: the release's struct-mode merge refuses it; the subset ignores it
    assert "temprature" in installed[2]["refused"]
    assert "temperature=1.0," in read_config("verl", unknown, CPU).specs["train"]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mismatch", *args], capture_output=True, text=True, timeout=600,
                          cwd=str(REPO))


def test_audit_on_a_verl_config_prints_what_it_derived_and_answers_with_its_key(tiny_checkpoint: Path,
                                                                               tmp_path: Path) -> None:
    rollouts = tmp_path / "rollouts.jsonl"
    rollouts.write_text("".join((REPO / "examples" / "rollouts.jsonl").read_text().splitlines(True)[:3]))
    out = tmp_path / "audit"
    # As a verl user writes it: no --infer, so the config's vLLM rollout server is replayed too.
    done = _cli("audit", str(tiny_checkpoint), "--rollouts", str(rollouts), "--out", str(out),
                "--train", f"verl:{DATA / 'overrides.yaml'}")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "--train hf:dtype=bfloat16,attn=sdpa,packing=varlen,temperature=0.7,micro_batch=8"
    assert "read with: built-in subset of verl 0.9.1's keys" in lines[1]
    assert any(line.startswith("  approximated: actor_rollout_ref.model.override_config.attn_implementation="
                               "flash_attention_2 → attn=sdpa") for line in lines)
    # The example's rollouts were sampled at temperature 1 (raw); the config scales the actor's
    # logits by 0.7: the answer names that, and the config key to set.
    answer = next(line for line in lines if line.startswith("answer: "))
    assert "temperature 0.7" in answer and "the trainer's temperature: 1" in answer
    summary = json.loads((out / "summary.json").read_text())
    import jsonschema

    jsonschema.validate(summary, json.loads((REPO / "mismatch" / "data" / "summary.schema.json").read_text()))
    table = summary["engines"]["train"]["from_config"]
    assert table["framework"] == "verl" and table["side"] == "train"
    infer = summary["engines"]["infer"]
    assert infer["kind"] == "vllm" and infer["from_config"]["side"] == "infer"
    assert infer["spec"] == next(line for line in lines if line.startswith("--infer ")).removeprefix("--infer ")
    assert any("tensor_model_parallel_size=4 → tensor_parallel_size=1" in line for line in lines)
    assert summary["engines"]["train"]["spec"] == table["spec"]
    assert summary["diagnosis"]["causes"][0]["where"]["config_key"] == f"{ROLLOUT}.temperature"
    assert summary["recommendations"][0]["kind"] == "match_temperature"


def test_a_bad_verl_config_is_exit_2_before_anything_is_written(tiny_checkpoint: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("actor_rollout_ref:\n  rollout:\n    name: vllm\n")
    out = tmp_path / "audit"
    done = _cli("audit", str(tiny_checkpoint), "--rollouts", str(REPO / "examples" / "rollouts.jsonl"),
                "--out", str(out), "--train", f"verl:{bad}")
    assert done.returncode == 2
    assert done.stderr.strip().count("\n") == 0 and "log_prob_micro_batch_size_per_gpu" in done.stderr
    assert not out.exists()


@pytest.mark.parametrize(("trainer_t", "declared", "fires"), [
    (0.7, {"logprobs": "raw", "temperature": 0.7}, True),        # the trainer scales, the stored are raw
    (0.7, {"logprobs": "processed", "temperature": 0.7}, False),  # both at 0.7: like for like
    (0.7, {"logprobs": "processed", "temperature": 1.0}, True),
    (1.0, {"logprobs": "processed", "temperature": 0.7}, False),  # a raw trainer: processed_logprobs' case
    (0.7, {"temperature": 0.7}, False),                           # undeclared semantics: not judged
])
def test_the_trainer_temperature_cause_fires_only_on_a_real_difference(trainer_t, declared, fires) -> None:
    from mismatch.advise.log_prob_semantics import trainer_temperature
    from mismatch.results.summary_model import partial_summary

    summary = partial_summary({"engines": {"train": {"kind": "hf", "spec": "hf", "options": {"temperature": trainer_t}},
                                           "sampler": {"meta": declared}}, "pairs": {}})
    assert (trainer_temperature(summary, {}) is not None) == fires


def test_upstream_megatron_and_bypass_scripts_read_as_the_release_does() -> None:
    """The group override `model_engine=megatron` merges into verl 0.9.1's own megatron default (no "not in
    struct"), and the subset derives the same specs and table as the release's OmegaConf merge."""
    upstream = Path(__file__).parent / "data" / "upstream" / "verl" / "examples"
    files = [upstream / "grpo_trainer" / "run_qwen3_8b_megatron.sh.cmdline",
             upstream / "rollout_correction" / "run_qwen2_5_7b_fsdp.sh.cmdline",
             upstream / "grpo_trainer" / "run_qwen3_8b_fsdp.sh.cmdline"]
    for path, answer in zip(files, _installed_reading(files)):
        assert "refused" not in answer, answer
        subset = read_config("verl", path, CPU)
        assert answer["loader"].startswith("verl 0.9.1 (installed)")
        assert answer["specs"] == subset.specs
        assert answer["settings"] == [s.to_dict() for s in subset.settings]
