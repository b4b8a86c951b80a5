"""slime's train.py command lines as engine specs (mismatch/frameworks/configs/slime.py): the Megatron log-prob
forward as an hf spec, the SGLang engines as the nearest vllm spec, each flag's fate, checked against slime's own
parser and validation at the vendored commit (tests/release_drivers/slime_trainer_config.py)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import releases

from mismatch.engines import check_spec
from mismatch.errors import SpecError
from mismatch.frameworks.configs import read_config, resolve
from mismatch.frameworks.configs import slime as reader
from mismatch.frameworks.configs.derived import Derived, Machine

DATA = Path(__file__).parent / "data" / "configs" / "slime"
MIS = DATA / "run-qwen3-4b-mis.sh"  # examples/train_infer_mismatch_helper/run-qwen3-4b-mis.sh, trimmed
REPRO = DATA / "run-qwen2.5-0.5B-reproducibility.sh"  # scripts/run-qwen2.5-0.5B-reproducibility.sh, trimmed
LINE = DATA / "fp16_static.cmdline"  # one command line, every mapped flag off its default
CPU = Machine(gpus=0)
GPUS = Machine(gpus=8, flash_attn=True)


def statuses(derived: Derived) -> dict[tuple[str, str], str]:
    return {(s.side, s.key): s.status for s in derived.settings}


def written(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_the_mis_example_script_derives_megatrons_forward_and_sglangs_engine() -> None:
    derived = reader.derive(MIS, CPU)
    assert derived.loader == "built-in subset of slime 624b824a898a's keys (slime not installed)"
    assert derived.specs == {
        # --max-tokens-per-gpu 9216 x CP 2: one micro-batch's tokens before CP splits it
        "train": "hf:dtype=bfloat16,attn=sdpa,packing=varlen,batch_tokens=18432,temperature=1.0",
        "infer": "vllm:dtype=auto,tensor_parallel_size=1,pipeline_parallel_size=1,enable_prefix_caching=true,"
                 "enforce_eager=true"}
    found = statuses(derived)
    assert found[("train", "--bf16")] == found[("train", "variable_seq_lengths")] == "reproduced"
    assert found[("train", "--rollout-temperature")] == "reproduced"
    for key in ("--attention-backend", "--max-tokens-per-gpu", "--tensor-model-parallel-size",
                "--context-parallel-size", "--sequence-parallel"):
        assert found[("train", key)] == "approximated", key
    # mis.yaml is read from slime's checkout; MODEL_ARGS comes from a sourced script
    assert found[("train", "--custom-config-path")] == found[("train", "${MODEL_ARGS[@]}")] == "not reproduced"
    assert found[("infer", "rollout engine")] == found[("infer", "--sglang-mem-fraction-static")] == "approximated"
    assert found[("infer", "--sglang-chunked-prefill-size")] == "approximated"  # SGLang's own by GPU memory
    assert found[("infer", "--rollout-temperature")] == found[("infer", "--rollout-top-p")] == "approximated"
    assert found[("infer", "--sglang-disable-radix-cache")] == "reproduced"
    lines = [s.line() for s in derived.settings]
    assert "--rollout-temperature=1.0 → temperature=1.0 (the trainer divides the fp32 logits by it before the " \
           "log-softmax (backends/megatron_utils/loss.py:540-543))" in lines


def test_the_reproducibility_script_names_what_no_engine_option_reproduces() -> None:
    derived = reader.derive(REPRO, CPU)
    assert derived.specs["train"] == "hf:dtype=bfloat16,attn=sdpa,packing=varlen,batch_tokens=9216,temperature=1.0"
    found = statuses(derived)
    assert found[("infer", "--sglang-enable-deterministic-inference")] == "not reproduced"
    assert found[("infer", "--sglang-attention-backend")] == found[("train", "--deterministic-mode")] == "approximated"
    assert ("train", "--sequence-parallel") not in found  # Megatron turns it off at TP 1


def test_a_command_line_file_maps_every_flag_off_its_default() -> None:
    derived = reader.derive(LINE, CPU)
    assert derived.specs == {
        "train": "hf:dtype=float16,attn=eager,packing=varlen,micro_batch=4,temperature=0.7,routing=replay",
        # --fp16 wins over --sglang-dtype (sglang_engine.py:571-572); TP = 4 GPUs per engine / PP 2
        "infer": "vllm:dtype=float16,tensor_parallel_size=1,pipeline_parallel_size=1,enable_prefix_caching=false,"
                 "enable_chunked_prefill=true,max_num_batched_tokens=4096,max_num_seqs=64,max_model_len=32768,"
                 "enforce_eager=true,kv_cache_dtype=fp8_e4m3"}
    found = statuses(derived)
    assert found[("train", "--rollout-top-p")] == "not reproduced"  # the trainer's nucleus renormalization
    assert found[("train", "--use-rollout-logprobs")] == found[("train", "--micro-batch-size")] == "reproduced"
    assert found[("train", "--pipeline-model-parallel-size")] == "approximated"
    assert found[("infer", "--rollout-num-gpus-per-engine")] == found[("infer", "--sglang-pp-size")] == "approximated"
    assert found[("infer", "--sglang-rl-on-policy-target")] == found[("infer", "--sglang-enable-fp32-lm-head")] \
        == "not reproduced"
    tp = next(s for s in derived.settings if s.key == "--rollout-num-gpus-per-engine")
    assert tp.value == 4 and "add `,tensor_parallel_size=2` on a machine with 2 GPUs" in tp.note


def test_a_script_is_read_as_its_arrays_and_its_train_py_line(tmp_path: Path) -> None:
    script = written(tmp_path, "run.sh", 'source "${SCRIPT_DIR}/models/x.sh"\nPERF_ARGS=(\n   # --micro-batch-size 1\n'
                     '   --micro-batch-size 2   # two\n   --max-tokens-per-gpu 512)\nONE=(--rollout-temperature 0.5)\n'
                     'UNUSED=(--fp16)\n# python3 train.py --fp16\nray job submit -- python3 train.py \\\n'
                     '   --colocate \\\n   ${MODEL_ARGS[@]} \\\n   "${PERF_ARGS[@]}" ${ONE[@]} --wandb-key ${KEY}\n'
                     'echo --bf16\n')
    argv, unread = reader.command_line(script, script.read_text())
    assert argv == ["--colocate", "--micro-batch-size", "2", "--max-tokens-per-gpu", "512", "--rollout-temperature",
                    "0.5", "--wandb-key", "${KEY}"]
    assert unread == ("MODEL_ARGS",)
    arrays = written(tmp_path, "arrays.sh", "A=(--fp16)\nB=(\n  --micro-batch-size 3\n)\n")
    assert reader.command_line(arrays, arrays.read_text()) == (["--fp16", "--micro-batch-size", "3"], ())
    derived = reader.derive(script, CPU)
    assert derived.specs["train"] == "hf:dtype=bfloat16,attn=sdpa,packing=varlen,micro_batch=2,temperature=0.5"
    suffixed = written(tmp_path, "suffixed.cmdline", "--sglang-context-length 32Ki\n")  # SGLang's human_readable_int
    assert "max_model_len=32768" in reader.derive(suffixed, CPU).specs["infer"]


def test_what_this_machine_can_run_is_reproduced_not_approximated() -> None:
    cpu, gpu = statuses(reader.derive(MIS, CPU)), reader.derive(MIS, GPUS)
    assert "attn=flash_attention_2" in gpu.specs["train"] and "enforce_eager=false" in gpu.specs["infer"]
    found = statuses(gpu)
    assert cpu[("train", "--attention-backend")] == "approximated" and found[("train", "--attention-backend")] \
        == "reproduced"
    assert cpu[("infer", "--sglang-disable-cuda-graph")] == "approximated"
    assert found[("infer", "--sglang-disable-cuda-graph")] == "reproduced"
    line = reader.derive(LINE, GPUS)
    assert "tensor_parallel_size=2,pipeline_parallel_size=2," in line.specs["infer"]
    assert statuses(line)[("infer", "--rollout-num-gpus-per-engine")] == "reproduced"


def test_a_custom_config_yaml_overrides_the_command_line_as_slime_sets_it(tmp_path: Path) -> None:
    custom = written(tmp_path, "custom.yaml", "rollout_temperature: 0.8\nmicro_batch_size: 8\ntis_mode: truncate\n")
    line = written(tmp_path, "line.cmdline", f"--rollout-temperature 1.0 --custom-config-path {custom.name}\n")
    derived = reader.derive(line, CPU)  # found beside the command line
    assert derived.specs["train"] == "hf:dtype=bfloat16,attn=sdpa,packing=varlen,micro_batch=8,temperature=0.8"
    assert ("train", "--custom-config-path") not in statuses(derived)


def test_the_spec_picks_a_side_and_overrides_options() -> None:
    resolved = resolve(f"slime:{LINE},side=infer,tensor_parallel_size=2", "train", CPU)
    assert resolved.spec.startswith("vllm:dtype=float16,tensor_parallel_size=2,")
    assert resolved.from_config["framework"] == "slime" and resolved.from_config["side"] == "infer"
    assert resolve(f"slime:{MIS}", "train", CPU).spec.startswith("hf:dtype=bfloat16,")


@pytest.mark.parametrize(("text", "message"), [
    ("--micro-batch-size eight\n", "argument --micro-batch-size: invalid int value: 'eight'"),
    ("--sglang-dtype fp64\n", "argument --sglang-dtype: invalid choice: 'fp64'"),
    ("--rollout-temperature\n", "argument --rollout-temperature: expected one argument"),
    ("--use-dynamic-batch-size\n", "--use-dynamic-batch-size needs --max-tokens-per-gpu"),
    ("--rollout-temperature 0\n", "--rollout-temperature=0.0: must be > 0"),
    ("--rollout-num-gpus-per-engine 3 --sglang-pp-size 2\n", "not divisible by --sglang-pp-size=2"),
    ("--sglang-context-length 32q\n", "argument --sglang-context-length: invalid human-readable int value"),
    ("A=(\n  --fp16\n  --rollout-top-p '0.9\n)\n", ":1: A=(: invalid shell syntax: No closing quotation"),
    ("A=(\n  --fp16\n", ":1: A=(: the array is not closed"),
    ("python3 train.py --bf16 \\\n  --rollout-top-p \"0.9\n", ":1: invalid shell syntax: No closing quotation"),
])
def test_a_bad_command_line_is_one_line_naming_the_file_and_flag(tmp_path: Path, text: str, message: str) -> None:
    path = written(tmp_path, "bad.sh", text)
    with pytest.raises(SpecError, match=re.escape(message)) as raised:
        read_config("slime", path, CPU)
    assert str(raised.value).startswith(f"{path}") and "\n" not in str(raised.value)


def test_a_bad_custom_config_and_an_unreadable_file_are_one_line(tmp_path: Path) -> None:
    custom = written(tmp_path, "custom.yaml", "rollout_temperature: warm\n")
    line = written(tmp_path, "line.cmdline", f"--custom-config-path {custom}\n")
    with pytest.raises(SpecError, match=f"^{custom}: rollout_temperature: expected float, got 'warm'"):
        reader.derive(line, CPU)
    binary = tmp_path / "binary.sh"
    binary.write_bytes(b"\xff\xfe--fp16")
    with pytest.raises(SpecError, match=f"^{binary}: not a slime config \\(not UTF-8 text: byte 0\\)$"):
        reader.derive(binary, CPU)


def test_check_spec_accepts_both_derived_specs() -> None:
    for path in (MIS, REPRO, LINE):
        for machine in (CPU, GPUS):
            derived = reader.derive(path, machine)
            for side in ("train", "infer"):
                check_spec(derived.specs[side])  # mismatch's engines (and vLLM's arg schema) accept them


# Command lines for slime's own parser to read too, beside the three files: the defaults, a custom-config YAML
# that overrides flags, and four it refuses.
VARIANTS: dict[str, str] = {
    "empty": "# the defaults (one flag at its default: a file with no flag is no config)\n--rollout-temperature 1.0\n",
    "custom": "--custom-config-path {custom} --fp16 --micro-batch-size 2\n",
    # a misspelt flag: parse_known_args drops it, in slime as here (the temperature stays 1.0)
    "misspelt": "--rollout-temprature 0.7 --sglang-pipeline-parallel-size 2 --rollout-num-gpus-per-engine 4\n",
    "bad_int": "--micro-batch-size eight\n", "bad_dynamic": "--use-dynamic-batch-size\n",
    "bad_temperature": "--rollout-temperature 0\n", "bad_choice": "--sglang-dtype fp64\n",
}


@pytest.fixture(scope="module")
def release_answers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, Any]]]:
    """Each file read by slime's own parser and validation in one subprocess: {name: (path, answer)}."""
    try:
        releases.install("slime", reader.RELEASE)
    except Exception as exc:  # noqa: BLE001 - only a failed setup skips
        pytest.skip(f"slime's vendored source could not be set up: {exc}")
    folder = tmp_path_factory.mktemp("slime")
    custom = written(folder, "custom.yaml", "rollout_temperature: 0.8\nuse_rollout_logprobs: true\n")
    paths = {"mis": MIS, "repro": REPRO, "line": LINE, **{
        name: written(folder, f"{name}.cmdline", text.format(custom=custom)) for name, text in VARIANTS.items()}}
    payloads = [{"path": str(path), "argv": reader.command_line(path, path.read_text())[0],
                 "ours": not name.startswith("bad")} for name, path in paths.items()]
    answers = releases.run_batch("slime", reader.RELEASE, "slime_trainer_config", payloads)
    return {name: (path, answer) for (name, path), answer in zip(paths.items(), answers)}


def test_the_built_in_subset_reads_each_flag_as_slimes_own_parser_does(release_answers) -> None:
    """slime's own parser and slime_validate_args, on the vendored source, give every mapped flag the value the
    subset gives it (drifted defaults show here); with slime importable, mismatch's reader uses slime's parser."""
    for name, (path, answer) in release_answers.items():
        if name.startswith("bad"):
            continue
        assert "result" in answer, (name, answer)
        subset = reader.read_config(path)
        assert answer["result"]["values"] == subset.values, name
        own = answer["result"]["ours"]
        assert own["loader"].startswith("slime of unknown version (installed): slime.utils.arguments."), own["loader"]
        assert own["values"] == subset.values and own["argv"] == list(subset.argv), name
    misspelt = release_answers["misspelt"][1]["result"]["values"]
    assert (misspelt["rollout_temperature"], misspelt["sglang_tp_size"]) == (1.0, 2)
    custom = release_answers["custom"][1]["result"]["values"]
    assert (custom["rollout_temperature"], custom["use_rollout_logprobs"], custom["bf16"]) == (0.8, True, False)


def test_slime_refuses_what_the_subset_refuses(release_answers) -> None:
    for name, (path, answer) in release_answers.items():
        if name.startswith("bad"):
            assert "refused" in answer, (name, answer)
            with pytest.raises(SpecError):
                reader.read_config(path)
