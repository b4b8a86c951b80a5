"""prime-rl's trainer and rl TOMLs as engine specs (mismatch/frameworks/configs/prime_rl.py): the trainer's
forward as an hf spec, its vLLM server as a vllm spec, each key's fate, checked against prime-rl's own config
classes at the vendored commit (tests/release_drivers/prime_rl_trainer_config.py)."""

from __future__ import annotations

import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import releases

from mismatch.engines import check_spec
from mismatch.errors import SpecError
from mismatch.frameworks.configs import prime_rl as reader
from mismatch.frameworks.configs import resolve
from mismatch.frameworks.configs.derived import Derived, Machine

DATA = Path(__file__).parent / "data" / "configs" / "prime_rl"
HENDRYCKS = DATA / "hendrycks_sanity_rl.toml"    # examples/basic/hendrycks-sanity/rl.toml, trimmed
NEMOTRON = DATA / "nemotron_3_super_swe_rl.toml"  # examples/advanced/nemotron-3-super/swe.toml, trimmed
TRAIN = DATA / "reverse_text_train.toml"         # k8s/prime-rl/examples/reverse-text/train.toml
CPU = Machine(gpus=0)
GPUS = Machine(gpus=8, flash_attn=True)

# Configs beside the examples, for the release's classes to read too: the trainer's keys off their
# defaults (text the release converts, "None" as null, a LoRA table), an rl config setting every mapped
# inference key (pass-through vLLM args in kebab-case and as JSON text, a KV offload whose prefix caching
# is explicitly null), per-env sampling, and an rl config with no [inference].
VARIANTS: dict[str, str] = {
    "trainer_keys": """matmul_precision = "highest"
[model]
optimization_dtype = "bfloat16"
reduce_dtype = "bfloat16"
attn = "flash_attention_2"
impl = "hf"
seq_len = "4096"
ep = 1
fused_lm_head_token_chunk_size = "disabled"
moe_router_dtype = "bfloat16"
compile = "None"
lora = {rank = 8, alpha = 16}
""",
    "rl_keys": """seq_len = 4096
[deployment]
num_train_gpus = 2
num_infer_gpus = 4
[trainer.model]
impl = "custom"
attn = "flash_attention_2"
cp = 2
ep = 4
quantization = {type = "fp8"}
[orchestrator.train.sampling]
temperature = 0.7
extra_body = {repetition_penalty = 1.1}
[[orchestrator.train.source]]
name = "math"
[[orchestrator.train.source]]
name = "code"
sampling = {temperature = 1.2, extra_body = {min_p = 0.05}}
[inference]
enable_fp32_lm_head = false
enable_fp32_router_logits = false
kv_cache_offload = {type = "native", cpu = {num_bytes = 1000000}}
[inference.vllm]
dtype = "bfloat16"
tensor_parallel_size = 2
enforce_eager = true
seed = 7
enable_prefix_caching = "None"
rope_scaling = {rope_type = "yarn", factor = 4.0, original_max_position_embeddings = 32768}
max-num-seqs = 64
max_num_batched_tokens = "8192"
kv_cache_dtype = "fp8"
logprobs_mode = "raw_logprobs"
pipeline_parallel_size = 2
compilation_config = '{"cudagraph_mode": "NONE"}'
""",
    "rl_no_inference": """[trainer]
enable_router_replay = true
[trainer.model]
attn = "flash_attention_2"
[orchestrator]
seq_len = 1024
[orchestrator.train.sampling]
temperature = 0.6
""",
}


def statuses(derived: Derived) -> dict[tuple[str, str], str]:
    return {(s.side, s.key): s.status for s in derived.settings}


def setting(derived: Derived, side: str, key: str) -> Any:
    return next(s for s in derived.settings if s.side == side and s.key == key)


def variant(folder: Path, name: str) -> Path:
    path = folder / f"{name}.toml"
    path.write_text(VARIANTS[name])
    return path


def test_the_hendrycks_example_derives_the_trainer_and_its_vllm_server():
    derived = reader.derive(HENDRYCKS, GPUS)
    assert derived.loader == "built-in subset of prime-rl 559b44772e47's keys (prime-rl not installed)"
    assert derived.specs == {
        # the orchestrator's seq_len packs (8192); the trainer's 16384 is its limit
        "train": "hf:dtype=bfloat16,attn=flash_attention_2,packing=varlen,balance=first_fit,batch_tokens=8192,temperature=1.0",
        "infer": "vllm:dtype=auto,tensor_parallel_size=1,enforce_eager=false,gpu_memory_utilization=0.9,"
                 "max_model_len=8192,seed=0,logprobs_mode=processed_logprobs"}
    found = statuses(derived)
    assert found[("train", "trainer.model.optimization_dtype")] == "approximated"  # fp32 masters, bf16 compute
    assert found[("train", "trainer.model.attn")] == "approximated"  # auto: FA3 on Hopper
    assert found[("train", "micro_batches")] == "reproduced"
    assert found[("train", "orchestrator.seq_len")] == found[("train", "packer")] == "reproduced"  # balance=first_fit
    assert found[("train", "orchestrator.train.sampling.temperature")] == "reproduced"
    assert found[("train", "trainer.model.compile")] == found[("infer", "inference.enable_fp32_lm_head")] \
        == "not reproduced"
    assert found[("infer", "inference.vllm.logprobs_mode")] == "reproduced"
    assert found[("infer", "orchestrator.train.sampling.extra_body.top_k")] == "approximated"
    # [deployment] num_infer_gpus = 4 at TP 1: RLConfig fills 4 data-parallel replicas (configs/rl.py:666-673)
    dp = setting(derived, "infer", "inference.vllm.data_parallel_size")
    assert (dp.value, dp.status) == (4, "approximated")


def test_the_nemotron_example_names_what_the_replay_cannot_run():
    derived = reader.derive(NEMOTRON, GPUS)
    assert derived.specs == {
        "train": "hf:dtype=bfloat16,attn=flash_attention_2,packing=varlen,balance=first_fit,batch_tokens=131072,temperature=1.0,"
                 "routing=replay",
        "infer": "vllm:dtype=auto,tensor_parallel_size=8,enforce_eager=false,gpu_memory_utilization=0.9,"
                 "max_model_len=131072,enable_prefix_caching=true,seed=0,logprobs_mode=processed_logprobs"}
    found = statuses(derived)
    assert found[("train", "trainer.model.attn")] == "approximated"  # flash_attention_3: FA2 here
    assert found[("train", "trainer.model.cp")] == found[("train", "trainer.model.ep")] == "approximated"
    assert found[("train", "trainer.model.impl")] == "not reproduced"  # prime-rl's own modeling code
    assert found[("train", "trainer.enable_router_replay")] == "reproduced"
    assert found[("infer", "inference.vllm.enable_expert_parallel")] == "approximated"
    assert "ulysses all-to-alls the heads" in setting(derived, "train", "trainer.model.cp").note


def test_a_trainer_config_has_no_temperature_and_the_default_server():
    derived = reader.derive(TRAIN, CPU)
    assert derived.specs == {
        "train": "hf:dtype=bfloat16,attn=sdpa,packing=varlen,balance=first_fit,batch_tokens=2048,temperature=1.0",
        "infer": "vllm:dtype=auto,tensor_parallel_size=1,enforce_eager=true,seed=0,logprobs_mode=processed_logprobs"}
    found = statuses(derived)
    assert found[("train", "model.seq_len")] == found[("train", "temperature")] == "approximated"
    assert found[("infer", "inference")] == found[("infer", "orchestrator.train.sampling")] == "approximated"
    assert "add `,temperature=T`" in setting(derived, "train", "temperature").note


def test_every_trainer_key_off_its_default(tmp_path: Path):
    derived = reader.derive(variant(tmp_path, "trainer_keys"), GPUS)
    assert derived.specs["train"] == "hf:dtype=bfloat16,attn=flash_attention_2,packing=varlen,balance=first_fit,batch_tokens=4096," \
                                     "temperature=1.0"
    found = statuses(derived)
    assert found[("train", "model.optimization_dtype")] == found[("train", "model.attn")] == "reproduced"
    assert found[("train", "model.impl")] == found[("train", "model.fused_lm_head_token_chunk_size")] == "reproduced"
    assert found[("train", "model.lora")] == "not reproduced"
    for key in ("model.compile", "model.cp", "model.ep", "model.moe_router_dtype", "matmul_precision"):
        assert ("train", key) not in found, key  # off: nothing the replay does otherwise


def test_an_rl_config_setting_every_inference_key(tmp_path: Path):
    derived = reader.derive(variant(tmp_path, "rl_keys"), GPUS)
    assert derived.specs["infer"] == (
        "vllm:dtype=bfloat16,tensor_parallel_size=2,pipeline_parallel_size=2,enforce_eager=true,"
        "gpu_memory_utilization=0.9,seed=7,logprobs_mode=raw_logprobs,max_num_seqs=64,max_num_batched_tokens=8192,"
        "kv_cache_dtype=fp8")
    # the KV offload turns prefix caching on only where the config leaves it unset (configs/inference.py:522)
    assert setting(derived, "infer", "inference.vllm.enable_prefix_caching").option is None
    found = statuses(derived)
    for key in ("inference.vllm.rope_scaling", "inference.kv_cache_offload", "inference.vllm"):
        assert found[("infer", key)] == "not reproduced", key
    assert setting(derived, "infer", "inference.vllm").value == {"compilation_config": {"cudagraph_mode": "NONE"}}
    assert setting(derived, "infer", "inference.vllm.data_parallel_size").value == 2  # 4 GPUs at TP 2
    assert ("infer", "inference.enable_fp32_lm_head") not in found
    # two envs, two temperatures: one hf temperature cannot score both
    assert found[("train", "orchestrator.train.source[*].sampling.temperature")] == "not reproduced"
    assert "temperature=" not in derived.specs["train"]
    assert found[("infer", "orchestrator.train.source[math].sampling.extra_body")] == "not reproduced"
    assert setting(derived, "infer", "orchestrator.train.source[code].sampling.extra_body").value == {"min_p": 0.05}
    assert found[("train", "trainer.model.quantization")] == "not reproduced"


def test_an_rl_config_without_inference(tmp_path: Path):
    derived = reader.derive(variant(tmp_path, "rl_no_inference"), CPU)
    assert derived.specs["train"] == "hf:dtype=bfloat16,attn=sdpa,packing=varlen,balance=first_fit,batch_tokens=1024," \
                                     "temperature=0.6,routing=replay"
    assert setting(derived, "infer", "inference").value is None
    assert "started apart" in setting(derived, "infer", "inference").note


def test_machine_decides_flash_attention_tensor_parallelism_and_cuda_graphs(tmp_path: Path):
    path = variant(tmp_path, "rl_no_inference")
    path.write_text(path.read_text() + "[deployment]\nnum_infer_gpus = 4\n[inference.vllm]\n"
                    "tensor_parallel_size = 4\n")
    cpu, gpus = reader.derive(path, CPU), reader.derive(path, GPUS)
    keys = [("train", "trainer.model.attn"), ("infer", "inference.vllm.tensor_parallel_size"),
            ("infer", "inference.vllm.enforce_eager"), ("infer", "inference.vllm.gpu_memory_utilization")]
    assert [statuses(cpu)[key] for key in keys] == ["approximated"] * 4
    assert [statuses(gpus)[key] for key in keys] == ["reproduced"] * 4
    assert cpu.specs["infer"].startswith("vllm:dtype=auto,tensor_parallel_size=1,enforce_eager=true,")
    note = setting(cpu, "infer", "inference.vllm.tensor_parallel_size").note
    assert "add `,tensor_parallel_size=4` on a machine with 4 GPUs" in note
    assert setting(cpu, "train", "trainer.model.attn").note.endswith("flash-attn needs CUDA and the flash_attn "
                                                                     "package; sdpa here")
    two = reader.derive(path, Machine(gpus=2))  # CUDA graphs, but not 4 GPUs
    assert statuses(two)[("infer", "inference.vllm.tensor_parallel_size")] == "approximated"
    assert statuses(two)[("infer", "inference.vllm.enforce_eager")] == "reproduced"


def test_check_spec_accepts_every_derived_spec(tmp_path: Path):
    for path in (HENDRYCKS, NEMOTRON, TRAIN, *(variant(tmp_path, name) for name in VARIANTS)):
        for machine in (CPU, GPUS):
            derived = reader.derive(path, machine)
            for side in ("train", "infer"):
                check_spec(derived.specs[side])


def test_resolve_names_the_side_and_keeps_the_table():
    resolved = resolve(f"prime-rl:{HENDRYCKS},side=infer,max_num_seqs=8", "train", CPU)
    assert resolved.spec == ("vllm:dtype=auto,tensor_parallel_size=1,enforce_eager=true,max_model_len=8192,seed=0,"
                             "logprobs_mode=processed_logprobs,max_num_seqs=8")
    assert resolved.from_config["framework"] == "prime-rl" and resolved.from_config["side"] == "infer"


# (file text, our message, whether the release's classes refuse it too: None where only RLConfig or the
# orchestrator's classes, which the driver cannot load, would)
BAD: list[tuple[str, str, bool | None]] = [
    ("[model\nattn = 1\n", ": invalid TOML in the prime-rl config: Expected ']' at the end of a table declaration "
                            "(at line 1, column 7)", True),
    ("[model]\ncp = \"two\"\n", ": model.cp: expected an integer, got 'two'", True),
    ("[model]\nattn = \"sdpa\"\n", ": model.attn: expected one of 'flash_attention_2', 'flash_attention_3', "
                                   "'flash_attention_4', 'auto', got 'sdpa'", True),
    ("[model]\ncompile = 3\n", ": model.compile: expected a table, got 3", True),
    ("model = \"Qwen/Qwen3-0.6B\"\n", ": model: expected a table, got 'Qwen/Qwen3-0.6B'", True),
    ("[trainer.model]\nquantization = {type = \"int4\"}\n[orchestrator]\n",
     ": trainer.model.quantization: expected a table whose type is one of fp8, mxfp8, got {'type': 'int4'}", True),
    ("[trainer]\n[orchestrator]\n[inference.vllm]\nenforce_eager = \"maybe\"\n",
     ": inference.vllm.enforce_eager: expected true or false, got 'maybe'", True),
    ("[trainer]\n[orchestrator]\n[inference]\nkv_cache_offload = {type = \"native\", cpu = {num_bytes = 1}}\n"
     "[inference.vllm]\nenable_prefix_caching = false\n",
     ": inference.kv_cache_offload: needs enable_prefix_caching (prime-rl refuses it)", True),
    ("seq_len = 4096\n[trainer.model]\nseq_len = 2048\n[orchestrator]\n",
     ": seq_len: set, and trainer.model.seq_len differs (prime-rl refuses it)", True),
    ("[trainer]\n[inference]\n", ": orchestrator: an rl config needs a [orchestrator] table", None),
    ("[trainer]\n[orchestrator.train.sampling]\ntemperature = \"hot\"\n",
     ": orchestrator.train.sampling.temperature: expected a number, got 'hot'", None),
    ("[deployment]\nnum_infer_gpus = 3\n[trainer]\n[orchestrator]\n[inference.vllm]\ntensor_parallel_size = 2\n",
     ": deployment.num_infer_gpus (3) must be divisible by inference.vllm.tensor_parallel_size (2)", None),
]


@pytest.mark.parametrize("text, message, _release", BAD)
def test_bad_input_is_one_spec_error_naming_file_and_key(tmp_path: Path, text: str, message: str, _release: Any):
    path = tmp_path / "rl.toml"
    path.write_text(text)
    with pytest.raises(SpecError) as caught:
        reader.derive(path, CPU)
    assert str(caught.value).startswith(f"{path}") and message in str(caught.value), str(caught.value)
    assert "\n" not in str(caught.value)


def test_an_unreadable_file_is_one_spec_error(tmp_path: Path):
    with pytest.raises(SpecError, match=r"cannot read the prime-rl config: Is a directory"):
        reader.derive(tmp_path, CPU)


# --- prime-rl's own config classes -------------------------------------------------------------------------


@cache
def _release_answers(payloads: tuple[tuple[str, bool], ...]) -> list[dict[str, Any]]:
    try:
        releases.install("prime-rl", reader.RELEASE)
    except (subprocess.CalledProcessError, OSError) as exc:
        pytest.skip(f"prime-rl's config dependencies could not be installed: {exc}")
    return releases.run_batch("prime-rl", reader.RELEASE, "prime_rl_trainer_config",
                              [{"path": path, "ours": ours} for path, ours in payloads])


@pytest.fixture(scope="module")
def release_paths(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ...]:
    folder = tmp_path_factory.mktemp("prime-rl-variants")
    return (HENDRYCKS, NEMOTRON, TRAIN, *(variant(folder, name) for name in VARIANTS))


def test_the_release_reads_every_mapped_key_as_the_subset_does(release_paths: tuple[Path, ...]):
    """Our built-in subset (prime-rl is not installed here) against prime-rl's own classes: a drifted
    default or a conversion we do otherwise shows as a differing key. The driver answers every trainer and
    inference key but those RLConfig's after-validators rewrite, and the orchestrator's seq_len."""
    answers = _release_answers(tuple((str(path), True) for path in release_paths))
    for path, answer in zip(release_paths, answers, strict=True):
        assert "result" in answer, f"{path.name}: {answer}"
        theirs, read = answer["result"]["values"], reader.read_config(path)
        assert read.loader.startswith("built-in subset of prime-rl 559b44772e47")
        ours = {key: read.values[key] for key in theirs}
        assert ours == theirs, f"{path.name}: " + ", ".join(
            f"{key} ours {ours[key]!r} prime-rl's {theirs[key]!r}" for key in theirs if ours[key] != theirs[key])
        assert {key for key in read.values if key.startswith(("trainer.", "model.", "inference."))} - set(theirs) <= {
            "inference.vllm.data_parallel_size", "inference.vllm.enable_lora",
            "inference.vllm.enable_return_routed_experts"} or answer["result"]["kind"] == "trainer"


def test_with_prime_rl_importable_the_reader_uses_its_classes(release_paths: tuple[Path, ...]):
    answers = _release_answers(tuple((str(path), True) for path in release_paths))
    for path, answer in zip(release_paths, answers, strict=True):
        ours, theirs = answer["result"]["ours"], answer["result"]["values"]
        kind = answer["result"]["kind"]
        assert ours["loader"] == ("prime-rl (installed): prime_rl.configs.trainer.TrainerConfig" if kind == "trainer"
                                  else "prime-rl (installed): TrainerConfig and InferenceConfig on [trainer] and "
                                       "[inference]; [orchestrator] and the shared keys by the built-in subset "
                                       "(RLConfig needs verifiers)"), path.name
        assert {key: ours["values"][key] for key in theirs} == theirs, path.name
        assert ours["values"] == reader.read_config(path).values, path.name  # the same after RLConfig's rewrites


def test_the_release_refuses_what_the_subset_refuses(tmp_path: Path):
    checked = [(text, message) for text, message, release in BAD if release]
    paths = []
    for index, (text, _) in enumerate(checked):
        paths.append(tmp_path / f"bad{index}.toml")
        paths[-1].write_text(text)
    for path, (_, message), answer in zip(paths, checked, _release_answers(tuple((str(p), False) for p in paths)),
                                          strict=True):
        assert "refused" in answer, f"{message}: prime-rl accepted it: {answer}"
