"""TRL's `trl grpo --config FILE` as engine specs (mismatch/frameworks/configs/trl.py): the trainer's
log-prob forward as an hf spec, its sampler as a vllm (or hf-decode) spec, each key's fate, checked
against TRL 1.16.0's own parser (tests/release_drivers/trl_trainer_config.py)."""

from __future__ import annotations

import json
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import releases

from mismatch.engines import check_spec
from mismatch.errors import SpecError
from mismatch.frameworks.configs import resolve
from mismatch.frameworks.configs import trl as reader
from mismatch.frameworks.configs.derived import Derived, Machine

DATA = Path(__file__).parent / "data" / "configs" / "trl"
COLOCATE = DATA / "grpo_vllm_colocate.yaml"
GENERATE = DATA / "grpo_generate.json"
CPU = Machine(gpus=0)
GPUS = Machine(gpus=8, flash_attn=True)

# Configs beside the two examples, for the release's parser to read too: every mapped key's default,
# YAML strings the parser converts, generation_kwargs as JSON text, server mode, and the dtype keys
# TRL 1.16.0 ignores.
VARIANTS: dict[str, dict[str, Any]] = {
    "defaults": {"model_name_or_path": "Qwen/Qwen2-0.5B-Instruct"},
    "server": {"use_vllm": True, "vllm_mode": "server", "fp16": True, "bf16": "false", "top_k": "20",
               "per_device_train_batch_size": "3", "steps_per_generation": 2, "num_generations": 2,
               "generation_kwargs": '{"temperature": 0.7, "min_p": 0.05, "presence_penalty": 0.5}',
               "pad_to_multiple_of": 64, "model_init_kwargs": {"dtype": "auto", "use_kernels": True},
               "vllm_model_impl": "transformers"},
    "ignored_dtypes": {"torch_dtype": "bfloat16", "model_init_kwargs": {"torch_dtype": "bfloat16"},
                       "use_liger_kernel": True, "use_transformers_continuous_batching": True,
                       "cache_implementation": "static", "attn_implementation": "kernels-community/flash-attn2"},
}


def statuses(derived: Derived) -> dict[tuple[str, str], str]:
    return {(s.side, s.key): s.status for s in derived.settings}


def variant(tmp_path: Path, name: str) -> Path:
    path = tmp_path / f"{name}.yaml"
    path.write_text(json.dumps(VARIANTS[name]))  # JSON is YAML: TrlParser reads either
    return path


def test_the_docs_colocate_example_derives_the_trainer_and_its_vllm():
    derived = reader.derive(COLOCATE, GPUS)
    assert derived.loader == "built-in subset of trl 1.16.0's keys (trl not installed)"
    assert derived.specs == {
        "train": "hf:dtype=bfloat16,attn=flash_attention_2,packing=pad,micro_batch=4,temperature=0.9",
        # max_num_seqs: 4 per device x TP 2 x steps_per_generation 8 (= gradient_accumulation_steps)
        "infer": "vllm:tensor_parallel_size=2,max_num_seqs=64,max_num_batched_tokens=4096,"
                 "logprobs_mode=processed_logprobs,dtype=auto,max_model_len=2048,gpu_memory_utilization=0.3,"
                 "enforce_eager=false"}
    found = statuses(derived)
    assert found[("train", "dtype")] == found[("train", "bf16")] == "reproduced"
    assert found[("train", "pad_to_multiple_of")] == "approximated"  # left-padded prompts, masked
    assert found[("train", "per_device_train_batch_size")] == found[("train", "temperature")] == "reproduced"
    assert found[("infer", "temperature")] == found[("infer", "top_p")] == "approximated"
    assert found[("infer", "vllm_colocate.logprobs_mode")] == "reproduced"
    lines = [s.line() for s in derived.settings]
    assert "vllm_colocate.max_num_batched_tokens=4096 → max_num_batched_tokens=4096 (fixed by TRL " \
           "(generation/vllm_generation.py:359))" in lines


def test_use_vllm_false_samples_with_the_trainers_own_generate_as_hf_decode():
    derived = reader.derive(GENERATE, CPU)
    # float32 weights (model_init_kwargs) under bf16 autocast (bf16 defaults to true): bf16 approximates
    assert derived.specs == {"train": "hf:dtype=bfloat16,attn=sdpa,packing=pad,micro_batch=2,temperature=1.0",
                             "infer": "hf-decode:dtype=bfloat16,attn=sdpa"}
    found = statuses(derived)
    assert found[("train", "model_init_kwargs.dtype")] == found[("train", "bf16")] == "approximated"
    assert found[("train", "cast_lm_head_to_fp32")] == found[("infer", "cast_lm_head_to_fp32")] == "not reproduced"
    assert found[("infer", "use_vllm")] == "approximated"
    assert found[("infer", "top_k")] == "approximated"
    dtype_note = next(s.note for s in derived.settings if s.key == "model_init_kwargs.dtype")
    assert dtype_note.startswith("TRL loads float32 weights and autocasts the forward to bfloat16")


def test_server_mode_and_generation_kwargs(tmp_path: Path):
    derived = reader.derive(variant(tmp_path, "server"), CPU)
    # fp16 autocast over the checkpoint's dtype; the server's engine args are not in the config
    assert derived.specs == {"train": "hf:dtype=float16,attn=auto,packing=pad,micro_batch=3,temperature=1.0",
                             "infer": "vllm:logprobs_mode=processed_logprobs,enforce_eager=true"}
    found = statuses(derived)
    assert found[("infer", "vllm_mode")] == "approximated"
    assert found[("infer", "generation_kwargs.temperature")] == "approximated"
    assert found[("infer", "generation_kwargs.min_p")] == "not reproduced"
    assert found[("infer", "generation_kwargs")] == "not reproduced"  # presence_penalty
    assert found[("train", "model_init_kwargs.use_kernels")] == "not reproduced"
    assert ("infer", "vllm_model_impl") not in found  # a colocate key: the server has its own
    assert next(s for s in derived.settings if s.key == "generation_kwargs").value == {"presence_penalty": 0.5}


def test_dtype_keys_trl_ignores_are_named_not_replayed(tmp_path: Path):
    derived = reader.derive(variant(tmp_path, "ignored_dtypes"), CPU)
    assert derived.specs == {"train": "hf:dtype=bfloat16,attn=sdpa,packing=pad,micro_batch=8,temperature=1.0",
                             "infer": "hf-decode:dtype=bfloat16,attn=sdpa"}
    found = statuses(derived)
    assert found[("train", "torch_dtype")] == found[("train", "model_init_kwargs.torch_dtype")] == "not reproduced"
    assert found[("train", "dtype")] == "approximated"  # float32 weights: torch_dtype changed nothing
    assert found[("train", "use_liger_kernel")] == found[("infer", "cache_implementation")] == "not reproduced"
    assert found[("infer", "use_transformers_continuous_batching")] == "approximated"
    assert found[("infer", "bf16")] == "reproduced"  # generate_batch casts the model to bf16 itself


def test_machine_decides_flash_attention_tensor_parallelism_and_cuda_graphs():
    cpu, gpus = reader.derive(COLOCATE, CPU), reader.derive(COLOCATE, GPUS)
    machine_keys = [("train", "attn_implementation"), ("infer", "vllm_tensor_parallel_size"),
                    ("infer", "vllm_colocate.enforce_eager"), ("infer", "vllm_gpu_memory_utilization")]
    assert [statuses(cpu)[key] for key in machine_keys] == ["approximated"] * 4
    assert [statuses(gpus)[key] for key in machine_keys] == ["reproduced"] * 4
    assert cpu.specs["train"] == "hf:dtype=bfloat16,attn=sdpa,packing=pad,micro_batch=4,temperature=0.9"
    assert cpu.specs["infer"] == ("vllm:tensor_parallel_size=1,max_num_seqs=64,max_num_batched_tokens=4096,"
                                  "logprobs_mode=processed_logprobs,dtype=auto,max_model_len=2048,enforce_eager=true")
    tp = next(s for s in cpu.settings if s.key == "vllm_tensor_parallel_size")
    assert "add `,tensor_parallel_size=2` on a machine with 2 GPUs" in tp.note
    one_gpu = reader.derive(COLOCATE, Machine(gpus=1))  # CUDA graphs, but one GPU is not TP=2
    assert statuses(one_gpu)[("infer", "vllm_tensor_parallel_size")] == "approximated"
    assert statuses(one_gpu)[("infer", "vllm_colocate.enforce_eager")] == "reproduced"


def test_check_spec_accepts_every_derived_spec(tmp_path: Path):
    paths = [COLOCATE, GENERATE, *(variant(tmp_path, name) for name in VARIANTS)]
    for path in paths:
        for machine in (CPU, GPUS):
            derived = reader.derive(path, machine)
            for side in ("train", "infer"):
                check_spec(derived.specs[side])


def test_resolve_names_the_side_and_keeps_the_table():
    resolved = resolve(f"trl:{COLOCATE},side=infer,max_num_seqs=8", "train", CPU)
    assert resolved.spec.startswith("vllm:tensor_parallel_size=1,max_num_seqs=8,")
    assert resolved.from_config["framework"] == "trl" and resolved.from_config["side"] == "infer"


@pytest.mark.parametrize("text, message", [
    ("use_vllm: true\nvllm_mode: [colocate\n", ":3: invalid YAML in the trl config: expected ',' or ']'"),
    ("use_vllm: true\nper_device_train_batch_size: [4]\n",
     ":2: per_device_train_batch_size: expected an integer, got [4]"),
    ("temperature: 0.7\nuse_vllm: maybe\n", ":2: use_vllm: expected true or false, got 'maybe'"),
    ("dtype: bf16\n", ":1: dtype: dtype 'bf16' is not one of: auto, bfloat16, float16, float32"),
    ("model_init_kwargs: {dtype: half}\n", ":1: model_init_kwargs: dtype 'half' is not one of"),
    ("generation_kwargs: '{\"top_k\": \"x\"'\n", ":1: generation_kwargs: "),
    ("- use_vllm\n", ": a trl config must be a YAML mapping of keys, got list"),
    ("generation_batch_size: 12\nper_device_train_batch_size: 8\n",
     ": generation_batch_size (12) must be divisible by the global batch size (8)"),
    ("use_vllm: true\nvllm_mode: remote\n", ": vllm_mode: must be either 'server' or 'colocate', got 'remote'"),
])
def test_bad_input_is_one_spec_error_naming_file_and_key(tmp_path: Path, text: str, message: str):
    path = tmp_path / "grpo.yaml"
    path.write_text(text)
    with pytest.raises(SpecError) as caught:
        reader.derive(path, CPU)
    assert str(caught.value).startswith(f"{path}") and message in str(caught.value), str(caught.value)
    assert "\n" not in str(caught.value)


def test_an_unreadable_file_is_one_spec_error(tmp_path: Path):
    with pytest.raises(SpecError, match=r"cannot read the trl config: Is a directory"):
        reader.derive(tmp_path, CPU)


# --- the release's own parser ------------------------------------------------------------------


@cache
def _release_answers(paths: tuple[Path, ...]) -> list[dict[str, Any]]:
    try:
        releases.install("trl", reader.RELEASE)
    except (subprocess.CalledProcessError, OSError) as exc:
        pytest.skip(f"trl {reader.RELEASE} could not be installed: {exc}")
    payloads = [{"path": str(path), "ours": True} for path in paths]
    return releases.run_batch("trl", reader.RELEASE, "trl_trainer_config", payloads)


@pytest.fixture(scope="module")
def release_paths(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ...]:
    folder = tmp_path_factory.mktemp("trl-variants")
    return (COLOCATE, GENERATE, *(variant(folder, name) for name in VARIANTS))


def test_the_release_parser_reads_every_mapped_key_as_the_subset_does(release_paths: tuple[Path, ...]):
    """Our built-in subset (TRL is not installed here) against TRL 1.16.0's own `trl grpo` parser:
    a drifted default or a conversion we do differently shows as a differing key."""
    for path, answer in zip(release_paths, _release_answers(release_paths), strict=True):
        assert "result" in answer, f"{path.name}: {answer}"
        theirs = answer["result"]["trl"]
        read = reader.read_config(path)
        assert read.loader.startswith("built-in subset of trl 1.16.0")
        assert read.values == theirs, f"{path.name}: " + ", ".join(
            f"{key} ours {read.values.get(key)!r} trl's {theirs.get(key)!r}"
            for key in sorted(set(read.values) | set(theirs)) if read.values.get(key) != theirs.get(key))
    colocate = _release_answers(release_paths)[0]["result"]
    assert colocate["accelerate_args"] == ["num_processes"]  # no field of trl's: accelerate launch's


def test_with_trl_installed_the_reader_uses_trls_own_parser(release_paths: tuple[Path, ...]):
    for path, answer in zip(release_paths, _release_answers(release_paths), strict=True):
        ours = answer["result"]["ours"]
        assert ours["loader"] == ("trl 1.16.0 (installed): trl.scripts.grpo "
                                  "make_parser().parse_args_and_config"), path.name
        assert ours["values"] == answer["result"]["trl"], path.name
