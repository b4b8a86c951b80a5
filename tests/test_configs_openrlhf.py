"""OpenRLHF's train_ppo_ray command lines as engine specs (mismatch/frameworks/configs/openrlhf.py): the actor's
old- and new-log-prob forwards as hf specs, the vLLM engines as a vllm spec, each flag's fate, checked against
OpenRLHF 0.11.2's own parser and validation (tests/release_drivers/openrlhf_trainer_config.py)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import releases

from mismatch.engines import check_spec
from mismatch.errors import SpecError
from mismatch.frameworks.configs import read_config, resolve
from mismatch.frameworks.configs import openrlhf as reader
from mismatch.frameworks.configs.derived import Derived, Machine

DATA = Path(__file__).parent / "data" / "configs" / "openrlhf"
HYBRID = DATA / "train_ppo_ray_hybrid_engine.sh"  # examples/scripts/, trimmed (the file says how)
AGENT = DATA / "train_reinforce_baseline_ray_agent_async.sh"  # examples/scripts/, trimmed: bash arrays
LINE = DATA / "every_flag.cmdline"  # one command line, every mapped flag off its default
CPU = Machine(gpus=0)
GPUS = Machine(gpus=8, flash_attn=True)


def statuses(derived: Derived) -> dict[tuple[str, str], str]:
    return {(s.side, s.key): s.status for s in derived.settings}


def setting(derived: Derived, side: str, key: str) -> Any:
    return next(s for s in derived.settings if (s.side, s.key) == (side, key))


def written(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_the_hybrid_engine_example_derives_the_actors_forwards_and_vllms_engines() -> None:
    derived = reader.derive(HYBRID, CPU)
    assert derived.loader == "built-in subset of openrlhf 0.11.2's keys (openrlhf not installed)"
    # --train.dynamic_batch_enable: --rollout.max_tokens_per_gpu takes --train.max_tokens_per_gpu's 16384
    assert derived.specs == {
        "train": "hf:dtype=bfloat16,attn=sdpa,packing=varlen,temperature=1.0,batch_tokens=16384",
        "update": "hf:dtype=bfloat16,attn=sdpa,packing=varlen,temperature=1.0,batch_tokens=16384",
        "infer": "vllm:dtype=bfloat16,tensor_parallel_size=1,enable_prefix_caching=false,enforce_eager=true,"
                 "max_model_len=2048,seed=42,logprobs_mode=processed_logprobs"}
    found = statuses(derived)
    for key in ("--ds.param_dtype", "--ds.packing_samples", "--rollout.temperature"):
        assert found[("train", key)] == found[("update", key)] == "reproduced", key
    assert found[("train", "--ds.attn_implementation")] == "approximated"
    assert found[("train", "--rollout.max_tokens_per_gpu")] == found[("update", "--train.max_tokens_per_gpu")] \
        == "approximated"
    assert "--train.max_tokens_per_gpu's (cli/train_ppo_ray.py:695-697)" in \
        setting(derived, "train", "--rollout.max_tokens_per_gpu").note
    assert found[("infer", "--vllm.tensor_parallel_size")] == found[("infer", "--vllm.gpu_memory_utilization")] \
        == "approximated"
    assert found[("infer", "--algo.advantage.is_correction_level")] == found[("infer", "--data.max_len")] \
        == "reproduced"
    assert found[("infer", "--rollout.temperature")] == found[("infer", "--rollout.top_p")] == "approximated"
    assert "--rollout.temperature=1.0 → temperature=1.0 (the actor divides the fp32 logits by it before the " \
           "log-softmax (models/actor.py:267-271; trainer/ray/ppo_actor.py:525))" in \
           [s.line() for s in derived.settings]


def test_the_agent_example_is_read_through_its_arrays() -> None:
    derived = reader.derive(AGENT, CPU)
    # ring attention 2: the micro-batch budgets count before the ring splits a row (seqlen_balancing.py:237)
    assert derived.specs["train"] == "hf:dtype=bfloat16,attn=sdpa,packing=varlen,temperature=1.0,batch_tokens=65536"
    assert derived.specs["update"] == "hf:dtype=bfloat16,attn=sdpa,packing=varlen,temperature=1.0,batch_tokens=32384"
    assert "max_model_len=74240," in derived.specs["infer"]
    found = statuses(derived)
    assert found[("train", "--ds.ring_attn_size")] == found[("update", "--ds.ring_attn_size")] == "approximated"
    assert found[("train", "${LOG_ARGS[@]}")] == "not reproduced"  # named on the train_ppo_ray line, not defined


def test_a_command_line_file_maps_every_flag_off_its_default() -> None:
    derived = reader.derive(LINE, CPU)
    assert derived.specs == {
        "train": "hf:dtype=float16,attn=eager,packing=pad,temperature=0.7,micro_batch=4",
        "update": "hf:dtype=float16,attn=eager,packing=pad,temperature=0.7,micro_batch=2",
        # vLLM's dtype is OpenRLHF's fixed bfloat16 (vllm_engine.py:273), whatever --ds.param_dtype
        "infer": "vllm:dtype=bfloat16,tensor_parallel_size=1,enable_prefix_caching=true,enforce_eager=true,"
                 "max_model_len=4096,seed=7,logprobs_mode=processed_logprobs"}
    found = statuses(derived)
    assert found[("train", "--rollout.micro_batch_size")] == "reproduced"
    assert found[("update", "--train.micro_batch_size")] == "approximated"  # shuffled each epoch
    assert found[("train", "--ds.lora.rank")] == found[("train", "--ds.use_liger_kernel")] == "approximated"
    assert found[("train", "--ds.experts_implementation")] == found[("train", "--train.full_determinism_enable")] \
        == "approximated"
    assert "while the trainer computes in fp16" in setting(derived, "infer", "vLLM dtype").note
    tp = setting(derived, "infer", "--vllm.tensor_parallel_size")
    assert tp.value == 4 and "add `,tensor_parallel_size=4` on a machine with 4 GPUs" in tp.note


def test_the_main_blocks_rewrites_are_applied_and_named(tmp_path: Path) -> None:
    line = written(tmp_path, "ring.cmdline", "--ds.ring_attn_size 2 --vllm.num_engines 1 --ds.attn_implementation "
                   "sdpa --ds.tensor_parallel_size 2 --algo.advantage.is_correction_level off\n")
    derived = reader.derive(line, GPUS)
    assert derived.specs["train"] == "hf:dtype=bfloat16,attn=flash_attention_2,packing=varlen,temperature=1.0," \
                                     "micro_batch=1"
    assert "set by --ds.ring_attn_size > 1" in setting(derived, "train", "--ds.packing_samples").note
    assert "set by --ds.packing_samples" in setting(derived, "train", "--ds.attn_implementation").note
    found = statuses(derived)
    assert found[("update", "--train.micro_batch_size")] == "reproduced"  # no shuffle with ring attention
    assert found[("train", "--ds.tensor_parallel_size")] == "approximated"
    assert found[("infer", "--algo.advantage.is_correction_level")] == "approximated"
    assert "logprobs_mode=raw_logprobs" in derived.specs["infer"]
    no_engines = reader.derive(written(tmp_path, "none.cmdline", "--rollout.temperature 0\n"), CPU)
    assert statuses(no_engines)[("infer", "--vllm.num_engines")] == "not reproduced"
    assert statuses(no_engines)[("train", "--rollout.temperature")] == "not reproduced"
    assert "temperature=" not in no_engines.specs["train"]


def test_a_script_is_read_as_its_arrays_and_its_train_ppo_ray_line(tmp_path: Path) -> None:
    script = written(tmp_path, "run.sh", 'A=(\n   # --ds.param_dtype fp16\n   --rollout.micro_batch_size 2  # two\n)\n'
                     'UNUSED=(--ds.param_dtype fp16)\n# python3 -m openrlhf.cli.train_ppo_ray --ds.param_dtype fp16\n'
                     'ray job submit -- python3 -m openrlhf.cli.train_ppo_ray \\\n   "${A[@]}" \\\n'
                     '   ${B[@]} --ckpt.path "${SAVE}/ckpt"\necho --ds.param_dtype fp16\n')
    assert reader.command_line(script, script.read_text()) == (
        ["--rollout.micro_batch_size", "2", "--ckpt.path", "${SAVE}/ckpt"], ("B",))
    arrays = written(tmp_path, "arrays.sh", "A=(--ds.param_dtype fp16)\nB=(\n  --train.seed 3\n)\n")
    assert reader.command_line(arrays, arrays.read_text()) == (["--ds.param_dtype", "fp16", "--train.seed", "3"], ())
    flags = written(tmp_path, "flags.txt", "--vllm.num_engines 2 \\\n  --vllm.enforce_eager  # comment\n")
    assert reader.command_line(flags, flags.read_text()) == (["--vllm.num_engines", "2", "--vllm.enforce_eager"], ())
    assert reader.derive(script, CPU).specs["train"].endswith(",micro_batch=2")


def test_what_this_machine_can_run_is_reproduced_not_approximated() -> None:
    cpu, gpu = reader.derive(HYBRID, CPU), reader.derive(HYBRID, GPUS)
    assert "attn=flash_attention_2" in gpu.specs["train"] and "attn=sdpa" in cpu.specs["train"]
    assert "tensor_parallel_size=2," in gpu.specs["infer"] and "gpu_memory_utilization=0.5" in gpu.specs["infer"]
    for side, key in (("train", "--ds.attn_implementation"), ("update", "--ds.attn_implementation"),
                      ("infer", "--vllm.tensor_parallel_size"), ("infer", "--vllm.gpu_memory_utilization")):
        assert statuses(cpu)[(side, key)] == "approximated" and statuses(gpu)[(side, key)] == "reproduced", key
    line_cpu, line_gpu = statuses(reader.derive(LINE, CPU)), reader.derive(LINE, GPUS)
    assert line_cpu[("infer", "--vllm.enforce_eager")] == "approximated"  # no CUDA graphs on CPU
    assert statuses(line_gpu)[("infer", "--vllm.enforce_eager")] == "reproduced"
    assert "enforce_eager=false" in line_gpu.specs["infer"]


def test_the_spec_picks_a_side_and_overrides_options() -> None:
    resolved = resolve(f"openrlhf:{HYBRID},side=infer,tensor_parallel_size=2", "train", CPU)
    assert resolved.spec.startswith("vllm:dtype=bfloat16,tensor_parallel_size=2,")
    assert resolved.from_config["framework"] == "openrlhf" and resolved.from_config["side"] == "infer"
    assert resolve(f"openrlhf:{LINE},side=update", "train", CPU).spec.endswith(",micro_batch=2")
    assert resolve(f"openrlhf:{LINE}", "train", CPU).spec.endswith(",micro_batch=4")


@pytest.mark.parametrize(("text", "message"), [
    ("--train.micro_batch_size eight\n", "argument --train.micro_batch_size: invalid int value: 'eight'"),
    ("--ds.param_dtype fp32\n", "argument --ds.param_dtype: invalid choice: 'fp32'"),
    ("--rollout.temperature\n", "argument --rollout.temperature: expected one argument"),
    ("--micro_train_batch_size 4\n", "unrecognized arguments: --micro_train_batch_size (OpenRLHF 0.11.2 refuses it"),
    ("--ds.packing_samples\n", "--ds.packing_samples needs --vllm.num_engines > 0"),
    ("--ds.tensor_parallel_size 2 --ds.param_dtype fp16\n", "--ds.tensor_parallel_size=2 needs --ds.param_dtype bf16"),
    ("A=(\n  --ds.packing_samples\n  --rollout.top_p '0.9\n)\n", ":1: A=(: invalid shell syntax: No closing quotation"),
    ("A=(\n  --ds.packing_samples\n", ":1: A=(: the array is not closed"),
    ("set -x\npython3 -m openrlhf.cli.train_ppo_ray \\\n  --rollout.top_p \"0.9\n",
     ":2: invalid shell syntax: No closing quotation"),
])
def test_a_bad_command_line_is_one_line_naming_the_file_and_flag(tmp_path: Path, text: str, message: str) -> None:
    path = written(tmp_path, "bad.sh", text)
    with pytest.raises(SpecError, match=re.escape(message)) as raised:
        read_config("openrlhf", path, CPU)
    assert str(raised.value).startswith(f"{path}") and "\n" not in str(raised.value)


def test_an_unreadable_file_is_one_line(tmp_path: Path) -> None:
    binary = tmp_path / "binary.sh"
    binary.write_bytes(b"\xff\xfe--ds.packing_samples")
    with pytest.raises(SpecError, match=f"^{binary}: not an OpenRLHF config \\(not UTF-8 text: byte 0\\)$"):
        reader.derive(binary, CPU)


def test_check_spec_accepts_every_derived_spec() -> None:
    for path in (HYBRID, AGENT, LINE):
        for machine in (CPU, GPUS):
            derived = reader.derive(path, machine)
            assert set(derived.specs) == {"train", "update", "infer"}
            for spec in derived.specs.values():
                check_spec(spec)  # mismatch's engines (and vLLM's arg schema) accept them


# Command lines for OpenRLHF's own parser to read too, beside the three files: the defaults, the __main__
# block's rewrites, abbreviations (argparse's, in OpenRLHF's parser as in the subset), a misspelt dotted flag
# (OpenRLHF refuses it, the subset ignores it) and five it refuses.
VARIANTS: dict[str, str] = {
    "empty": "# the defaults (one flag at its default: a file with no flag is no config)\n--train.seed 42\n",
    "rewrites": "--ds.ring_attn_size 2 --vllm.num_engines 1 --ds.attn_implementation sdpa "
                "--train.dynamic_batch_enable --train.max_tokens_per_gpu 4096\n",
    "abbreviated": "--vllm.num_eng 3 --train.micro_batch 2 --rollout.temp 0.5\n",
    "unknown": "--rollout.temprature 0.7\n",
    "bad_int": "--train.micro_batch_size eight\n", "bad_choice": "--ds.param_dtype fp32\n",
    "bad_undotted": "--micro_train_batch_size 4\n", "bad_packing": "--ds.packing_samples\n",
    "bad_tp": "--ds.tensor_parallel_size 2 --ds.param_dtype fp16\n",
}


@pytest.fixture(scope="module")
def release_answers(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, dict[str, Any]]]:
    """Each file read by OpenRLHF 0.11.2's own parser and validation in one subprocess: {name: (path, answer)}."""
    try:
        releases.install("openrlhf", reader.RELEASE)
    except Exception as exc:  # noqa: BLE001 - only a failed install skips
        pytest.skip(f"openrlhf {reader.RELEASE} could not be installed: {exc}")
    folder = tmp_path_factory.mktemp("openrlhf")
    paths = {"hybrid": HYBRID, "agent": AGENT, "line": LINE,
             **{name: written(folder, f"{name}.cmdline", text) for name, text in VARIANTS.items()}}
    payloads = [{"path": str(path), "argv": reader.command_line(path, path.read_text())[0],
                 "ours": not name.startswith(("bad", "unknown"))} for name, path in paths.items()]
    answers = releases.run_batch("openrlhf", reader.RELEASE, "openrlhf_trainer_config", payloads)
    return {name: (path, answer) for (name, path), answer in zip(paths.items(), answers)}


def test_the_built_in_subset_reads_each_flag_as_openrlhfs_own_parser_does(release_answers) -> None:
    """OpenRLHF's parser and validation give every mapped flag the value the subset gives it (drifted defaults
    show here); with openrlhf importable, mismatch's reader builds OpenRLHF's own parser and agrees too."""
    for name, (path, answer) in release_answers.items():
        if name.startswith(("bad", "unknown")):
            continue
        assert "result" in answer, (name, answer)
        subset = reader.read_config(path)
        assert answer["result"]["values"] == subset.values and answer["result"]["missing"] == [], name
        own = answer["result"]["ours"]
        assert own["loader"] == "openrlhf 0.11.2 (installed): the argparse parser of openrlhf/cli/train_ppo_ray.py's" \
                                " __main__ block, built up to its parse_args", own["loader"]
        assert own["values"] == subset.values and own["argv"] == list(subset.argv), name
    rewritten = release_answers["rewrites"][1]["result"]["values"]
    assert (rewritten["ds.packing_samples"], rewritten["ds.attn_implementation"]) == (True, "flash_attention_2")
    assert rewritten["rollout.max_tokens_per_gpu"] == 4096
    abbreviated = release_answers["abbreviated"][1]["result"]["values"]
    assert (abbreviated["vllm.num_engines"], abbreviated["train.micro_batch_size"]) == (3, 2)


def test_openrlhf_refuses_what_the_subset_refuses(release_answers) -> None:
    for name, (path, answer) in release_answers.items():
        if name.startswith("bad"):
            assert "refused" in answer, (name, answer)
            with pytest.raises(SpecError):
                reader.read_config(path)
    path, answer = release_answers["unknown"]
    assert "unrecognized arguments: --rollout.temprature" in answer["refused"]
    assert reader.read_config(path).values["rollout.temperature"] == 1.0  # the subset ignores an unmapped flag


def test_with_openrlhf_installed_its_own_parser_refuses_an_unknown_flag(tmp_path: Path, monkeypatch) -> None:
    try:
        folders = releases.install("openrlhf", reader.RELEASE)
    except Exception as exc:  # noqa: BLE001 - only a failed install skips
        pytest.skip(f"openrlhf {reader.RELEASE} could not be installed: {exc}")
    monkeypatch.syspath_prepend(str(folders[0]))  # found, never imported: the reader reads train_ppo_ray.py
    path = written(tmp_path, "misspelt.cmdline", "--vllm.num_engines 2 --rollout.temprature 0.7\n")
    with pytest.raises(SpecError, match=f"^{path}: unrecognized arguments: --rollout.temprature 0.7 "
                                        r"\(OpenRLHF refuses it\)$"):
        reader.read_config(path)
    assert reader.read_config(LINE).loader.startswith("openrlhf 0.11.2 (installed): ")


def test_an_older_installed_release_leaves_the_subset_in_charge(tmp_path: Path) -> None:
    """OpenRLHF 0.10.4 has no --algo.advantage.is_correction_level: the reader reads with the subset there."""
    older = releases.RELEASES["openrlhf"][-1]
    try:
        releases.install("openrlhf", older)
    except Exception as exc:  # noqa: BLE001 - only a failed install skips
        pytest.skip(f"openrlhf {older} could not be installed: {exc}")
    path = written(tmp_path, "empty.cmdline", "# the defaults\n--train.seed 42\n")
    answer = releases.run("openrlhf", older, "openrlhf_trainer_config", {"path": str(path), "argv": [], "ours": True})
    assert answer["missing"] == ["algo.advantage.is_correction_level"]
    assert answer["ours"]["loader"] == (f"built-in subset of openrlhf 0.11.2's keys (openrlhf {older} installed, its "
                                        "train_ppo_ray.py has no --algo.advantage.is_correction_level)")
    values = reader.read_config(path).values
    assert answer["ours"]["values"] == values
    assert {k: v for k, v in answer["values"].items()} == {k: v for k, v in values.items() if k in answer["values"]}
