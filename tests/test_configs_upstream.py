"""The frameworks' own example scripts and configs, read as a user passes them to `--train FRAMEWORK:FILE`.

tests/data/upstream/FRAMEWORK/ holds each repository's examples (COMMIT names the repository and
commit; vendor.py there made them, with each shell script's launch line as `set -x` prints it in
NAME.sh.cmdline). Every file either derives or is refused with one line naming the file; a
hand-checked subset asserts what it derives (the keys that decide a log-prob).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from mismatch.errors import SpecError
from mismatch.frameworks.configs import read_config
from mismatch.frameworks.configs.derived import Derived, Machine

UPSTREAM = Path(__file__).parent / "data" / "upstream"
READER = {"verl": "verl", "openrlhf": "openrlhf", "slime": "slime", "prime-rl": "prime-rl", "open-r1": "trl",
          "trl": "trl"}
CPU = Machine()
# How many files of each corpus derive, as read when the corpus was vendored: a reader that starts
# refusing (or accepting) a whole family of files changes it.
DERIVED = {"verl": 81, "openrlhf": 14, "slime": 91, "prime-rl": 21, "open-r1": 8, "trl": 1}


def corpus(name: str) -> list[Path]:
    root = UPSTREAM / name
    return sorted(p for p in root.rglob("*") if p.is_file() and p.name != "COMMIT")


def derive(name: str, relative: str) -> Derived:
    return read_config(READER[name], UPSTREAM / name / relative, CPU)


def settings(derived: Derived, side: str = "train") -> dict[str, object]:
    return {s.key: s.value for s in derived.settings if s.side == side}


@pytest.mark.parametrize("name", list(READER))
def test_every_upstream_file_derives_or_is_refused_in_one_line(name: str) -> None:
    assert (UPSTREAM / name / "COMMIT").read_text().count(" ") == 2  # repository, ref, commit
    derived, refused = 0, 0
    for path in corpus(name):
        try:
            read_config(READER[name], path, CPU)
            derived += 1
        except SpecError as error:  # anything else is a traceback: the test fails on it
            message = str(error)
            assert "\n" not in message and str(path) in message, message
            refused += 1
    assert derived == DERIVED[name], (derived, refused)


# --- verl (v0.9.0 examples, read against verl 0.9.1's keys) ------------------------------------------

MEGATRON = ("examples/grpo_trainer/run_qwen3_8b_megatron.sh.cmdline",
            "examples/ppo_trainer/run_qwen3_8b_megatron.sh.cmdline",
            "examples/gpg_trainer/run_qwen3_8b_megatron.sh.cmdline")


@pytest.mark.parametrize("relative", MEGATRON)
def test_verl_megatron_scripts_derive_megatron_with_their_parallel_layout(relative: str) -> None:
    text = (UPSTREAM / "verl" / relative).read_text()
    words = text.split()
    assert "model_engine=megatron" in words and not any("actor.strategy=" in w for w in words)  # the group alone
    derived = derive("verl", relative)
    train = settings(derived)
    assert train["actor_rollout_ref.actor.strategy"] == "megatron"
    for size in ("tensor_model_parallel_size", "pipeline_model_parallel_size"):
        flag = f"actor_rollout_ref.actor.megatron.{size}="
        given = next(word for word in words if word.startswith(flag)).partition("=")[2]
        assert train[f"actor_rollout_ref.actor.megatron.{size}"] == int(given)


def test_verl_megatron_hand_checked_table() -> None:
    derived = derive("verl", MEGATRON[0])
    train = settings(derived)
    assert (train["actor_rollout_ref.actor.megatron.tensor_model_parallel_size"],
            train["actor_rollout_ref.actor.megatron.pipeline_model_parallel_size"]) == (2, 2)
    assert derived.specs["train"] == "hf:dtype=bfloat16,attn=sdpa,packing=varlen,temperature=1.0,batch_tokens=24576"
    assert derived.model == "Qwen/Qwen3-8B"


def test_verl_router_replay_example_derives_routing_replay() -> None:
    derived = derive("verl", "examples/router_replay/run_qwen3_30b_a3b_megatron.sh.cmdline")
    assert "routing=replay" in derived.specs["train"] and "routing=replay" in derived.specs["update"]
    train = settings(derived)
    assert train["actor_rollout_ref.actor.megatron.router_replay.mode"] == "R3"
    assert train["actor_rollout_ref.actor.megatron.override_transformer_config.moe_router_dtype"] == "fp32"
    assert train["actor_rollout_ref.actor.megatron.expert_model_parallel_size"] == 8
    assert settings(derived, "infer")["actor_rollout_ref.rollout.enable_rollout_routing_replay"] is True
    assert settings(derived, "infer")["actor_rollout_ref.rollout.gpu_memory_utilization"] == 0.65


def test_verl_bypass_mode_is_named_first_and_the_train_side_is_the_update_forward() -> None:
    derived = derive("verl", "examples/rollout_correction/run_qwen2_5_7b_fsdp.sh.cmdline")
    assert derived.notices and derived.notices[0].startswith("bypass mode (algorithm.rollout_correction.bypass_mode=true)")
    assert derived.specs["train"] == derived.specs["update"]
    assert derived.framework_settings == {"rollout_is": "sequence", "rollout_is_threshold": 2.0}


def test_verl_script_and_its_set_x_line_agree_where_the_script_has_no_shell_variable() -> None:
    relative = "examples/ppo_trainer/run_qwen3_8b_megatron.sh"
    with pytest.raises(SpecError, match="holds a shell variable: give the command line as it ran"):
        derive("verl", relative)
    assert derive("verl", relative + ".cmdline").specs["train"].startswith("hf:")


@pytest.mark.parametrize(("relative", "message"), [
    ("examples/sft/gsm8k/run_qwen_megatron_fsdp.sh.cmdline", "not a verl PPO config: the command line launches "
                                                             "verl.trainer.sft_trainer"),
    ("examples/tutorial/skypilot/verl-grpo.yaml", "not a verl config: no actor_rollout_ref, algorithm or trainer"),
    ("examples/ascend_extras/grpo_trainer/run_qwen3_32b_mindspeed.sh.cmdline",
     "model_engine group has no option 'mindspeed'"),
])
def test_verl_files_that_are_no_ppo_run_are_refused_for_what_they_are(relative: str, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        derive("verl", relative)


def test_verl_current_ulysses_key_and_model_dtype_are_read(tmp_path: Path) -> None:
    path = tmp_path / "run.cmdline"
    path.write_text("python3 -m verl.trainer.main_ppo actor_rollout_ref.rollout.name=vllm "
                    "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=2 "
                    "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=2 "
                    "actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size=4 "
                    "actor_rollout_ref.actor.fsdp_config.model_dtype=bf16 ~actor_rollout_ref.model.override_config\n")
    train = {s.key: s for s in read_config("verl", path, CPU).settings if s.side == "train"}
    assert train["actor_rollout_ref.actor.fsdp_config.ulysses_sequence_parallel_size"].value == 4
    assert "keeps the weights in bfloat16, not fp32" in train["actor_rollout_ref.actor.fsdp_config.model_dtype"].note
    assert "FSDP keeps bfloat16 weights" in train["actor_rollout_ref.actor.fsdp_config.mixed_precision.param_dtype"].note


# --- OpenRLHF (v0.11.0 examples) ---------------------------------------------------------------------

@pytest.mark.parametrize(("script", "kind", "threshold"), [
    ("train_ppo_ray_hybrid_engine.sh", "tis", [0.5, 5.0]),
    ("train_dapo_ray_hybrid_engine.sh", "tis", [0.5, 5.0]),
    ("train_prorlv2_math_hybrid_engine.sh", "icepop", [0.5, 5.0]),
    ("train_reinforce_baseline_ray_agent_async.sh", "icepop", [0.5, 5.0]),
    ("train_reinforce_baseline_hybrid_engine.sh", "icepop", [0.5, 5.0]),
])
def test_openrlhf_0110_correction_derives_processed_logprobs_and_the_correction_as_set(script: str, kind: str,
                                                                                       threshold: list[float]) -> None:
    for relative in (f"examples/scripts/{script}", f"examples/scripts/{script}.cmdline"):
        derived = derive("openrlhf", relative)
        assert "logprobs_mode=processed_logprobs" in derived.specs["infer"], relative
        assert derived.framework_settings == {"is_correction_enable": True, "is_correction_type": kind,
                                              "is_correction_threshold": threshold}


def test_openrlhf_without_the_correction_stays_raw() -> None:
    derived = derive("openrlhf", "examples/scripts/train_ppo_with_reward_fn.sh.cmdline")
    assert "logprobs_mode=raw_logprobs" in derived.specs["infer"] and not derived.framework_settings


def test_openrlhf_sft_script_is_refused_for_what_it_is() -> None:
    with pytest.raises(SpecError, match="not an OpenRLHF PPO config: it launches openrlhf.cli.train_sft"):
        derive("openrlhf", "examples/scripts/train_sft.sh")


# --- TRL and open-r1 -------------------------------------------------------------------------------

def test_open_r1_grpo_recipe_derives_and_names_its_model() -> None:
    derived = derive("open-r1", "recipes/Qwen2.5-1.5B-Instruct/grpo/config_demo.yaml")
    assert derived.model == "Qwen/Qwen2.5-1.5B-Instruct"
    assert derived.specs["train"].startswith("hf:dtype=bfloat16")


@pytest.mark.parametrize(("name", "relative", "message"), [
    ("open-r1", "recipes/OlympicCoder-7B/sft/config_v00.00.yaml", "not a trl GRPO config: it sets packing"),
    ("open-r1", "recipes/accelerate_configs/zero3.yaml", "an accelerate launch config"),
    ("trl", "examples/accelerate_configs/fsdp2.yaml", "an accelerate launch config"),
])
def test_trl_sft_and_accelerate_configs_are_refused(name: str, relative: str, message: str) -> None:
    with pytest.raises(SpecError, match=message):
        derive(name, relative)


# --- prime-rl and slime ----------------------------------------------------------------------------

def test_prime_rl_and_slime_examples_name_their_model() -> None:
    assert derive("prime-rl", "examples/basic/reverse-text/rl.toml").model == "PrimeIntellect/Qwen3-0.6B-Reverse-Text-SFT"
    assert derive("slime", "scripts/run-qwen3-4B.sh.cmdline").model == "/root/Qwen3-4B"  # --hf-checkpoint
