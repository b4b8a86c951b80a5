"""OpenRLHF: the command line of `python -m openrlhf.cli.train_ppo_ray` (a file of that command line, or a
script as examples/scripts/ ships them) as the actor's two log-prob forwards (hf specs) and its vLLM engines.

Read from OpenRLHF 0.11.2 (the PyPI wheel; paths are inside it, openrlhf/...). The actor scores old log-probs in
the experience maker's micro-batches (--rollout.*) and new ones in the policy update's (--train.*): one model,
its fp32 logits divided by the rollout temperature; the vLLM engines get fixed args of OpenRLHF's own besides
the --vllm.* flags. A script is read, not run: each `NAME=( ... )` array's tokens, and the `train_ppo_ray` line
(backslash continuations joined, `${NAME[@]}` replaced by that array; an array the file lacks is reported);
variables stay as written. Without that line, the file's arrays in order, or the whole file as one command line.

train_ppo_ray.py builds its parser inline under `if __name__ == "__main__":` (cli/train_ppo_ray.py:197-627), so
it cannot be imported: where openrlhf is installed, those statements (with the module's standard-library
imports) are run up to its parse_args, and the command line parsed by that parser, which refuses an unknown flag
(parse_args, :627). Else the built-in subset below parses the flags mapped and ignores the others, but refuses an
undotted flag as OpenRLHF does (every flag but --local_rank and --use_ms is dotted since 0.10.2). Either way the
__main__ block's rewrites of the mapped flags follow (`effective`).
"""

from __future__ import annotations

import argparse
import ast
import importlib.metadata
import importlib.util
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mismatch.errors import SpecError
from mismatch.frameworks.configs import scripts
from mismatch.frameworks.configs.loading import text as config_text
from mismatch.frameworks.configs.scripts import flag_value
from mismatch.frameworks.configs.derived import Derived, Deriving, Machine, Setting, Side

RELEASE = "0.11.2"
SUBSET = f"built-in subset of openrlhf {RELEASE}'s keys (openrlhf not installed)"
OWN = ("openrlhf {} (installed): the argparse parser of openrlhf/cli/train_ppo_ray.py's __main__ block, "
       "built up to its parse_args")
SWITCH: dict[str, Any] = {"action": "store_true", "default": False}
# The flags mapped, as cli/train_ppo_ray.py (0.11.2) declares them (line of the flag).
FLAGS: dict[str, dict[str, Any]] = {
    "--actor.num_nodes": {"type": int, "default": 1},  # :213
    "--actor.num_gpus_per_node": {"type": int, "default": 8},  # :214
    "--vllm.num_engines": {"type": int, "default": None},  # :231-233
    "--vllm.tensor_parallel_size": {"type": int, "default": 1},  # :234-239
    "--vllm.enable_prefix_caching": SWITCH, "--vllm.enforce_eager": SWITCH,  # :242, :243
    "--vllm.gpu_memory_utilization": {"type": float, "default": 0.95},  # :250-255
    "--algo.advantage.is_correction_level": {"type": str, "default": "off", "choices": ["off", "token", "seq"]},  # :260
    "--ds.param_dtype": {"type": str, "default": "bf16", "choices": ["bf16", "fp16"]},  # :330-336
    "--ds.attn_implementation": {"type": str, "default": "flash_attention_2"},  # :342-347
    "--ds.experts_implementation": {"type": str, "default": None,
                                    "choices": ["eager", "batched_mm", "grouped_mm", "deepgemm"]},  # :348-354
    "--ds.use_liger_kernel": SWITCH,  # :355
    "--ds.tensor_parallel_size": {"type": int, "default": 1},  # :372
    "--ds.packing_samples": SWITCH, "--train.dynamic_batch_enable": SWITCH,  # :375, :378
    "--rollout.max_tokens_per_gpu": {"type": int, "default": None},  # :379
    "--train.max_tokens_per_gpu": {"type": int, "default": 16192},  # :380
    "--ds.load_in_4bit": SWITCH, "--ds.lora.rank": {"type": int, "default": 0},  # :383, :384
    "--rollout.micro_batch_size": {"type": int, "default": 1},  # :396
    "--data.max_len": {"type": int, "default": 2048},  # :398
    "--train.micro_batch_size": {"type": int, "default": 1},  # :412
    "--rollout.top_p": {"type": float, "default": 1.0},  # :417
    "--rollout.temperature": {"type": float, "default": 1.0},  # :418
    "--train.seed": {"type": int, "default": 42}, "--train.full_determinism_enable": SWITCH,  # :419, :420-425
    "--ds.ring_attn_size": {"type": int, "default": 1},  # :545
}
MAPPED = tuple(flag[2:] for flag in FLAGS)  # argparse's dest: the flag without its dashes, dots kept
# OpenRLHF 0.11.0's correction flags (cli/train_ppo_ray.py:257-271 @ v0.11.0), which 0.11.2 replaced by
# --algo.advantage.is_correction_level/_mode/_gating: its example scripts pass them, and with
# is_correction_enable 0.11.0 asks vLLM for processed log-probs (:78). The subset reads both families.
FLAGS_0110: dict[str, dict[str, Any]] = {
    "--algo.advantage.is_correction_enable": SWITCH,
    "--algo.advantage.is_correction_type": {"type": str, "default": "tis", "choices": ["tis", "icepop", "seq-mask-tis"]},
    "--algo.advantage.is_correction_threshold": {"type": float, "nargs": "+", "default": [0.5, 5.0]},
}
UNDOTTED = ("--local_rank", "--use_ms")  # :326, :625
SAMPLER_NOTE = ("the engine replay scores raw log-probs; the sampler's processing is replayed from each rollout's "
                "meta.sampler")


@dataclass(kw_only=True, slots=True, frozen=True)
class Read:
    """The command line as OpenRLHF sees it: each mapped flag's value under its argparse dest."""

    loader: str
    argv: tuple[str, ...]
    values: dict[str, Any]     # after the __main__ block's rewrites
    rewrites: dict[str, str]   # dest -> which rewrite set it (for the notes)
    unread: tuple[str, ...]    # arrays the train_ppo_ray line names and the file does not define


def derive(path: Path, machine: Machine) -> Derived:
    """The hf specs of the actor's old- and new-log-prob forwards and the vllm spec of its rollout engines."""
    read = read_config(path)
    d = Deriving(framework="openrlhf", file=str(path), loader=read.loader)
    d.model = flag_value(read.argv, "--actor.model_name_or_path")  # cli/train_ppo_ray.py:69
    _train(d, read, machine)
    for name in read.unread:
        d.cannot("train", f"${{{name}[@]}}", None, "an array the file does not define (sourced from another "
                 "script?): its flags are not read")
    d.fork("update", "train", frozenset({"micro_batch", "batch_tokens"}))
    for side in ("train", "update"):
        _batches(d, read, side)
    _infer(d, read.values, machine)
    return d.derived()


def read_config(path: Path) -> Read:
    """The file's command line parsed by OpenRLHF's own parser where openrlhf is installed, else by the subset."""
    text = config_text(path, "OpenRLHF")
    argv, unread = command_line(path, text)
    if not unread and not any(token.startswith("--") for token in argv):  # defaults for a file that is no config
        raise SpecError(f"{path}: not an OpenRLHF config: no train_ppo_ray command line and no --flags")
    loader, built = own_parser()
    if built is None:
        _refuse_undotted(path, argv)
        built = subset_parser()
    namespace = vars(_parse(path, built, argv, known_only=loader.startswith("built-in")))
    values, rewrites = effective(path, {dest: namespace[dest] for dest in MAPPED})
    if namespace.get("algo.advantage.is_correction_enable"):  # 0.11.0's family, only where the file uses it
        values.update({flag[2:]: namespace.get(flag[2:]) for flag in FLAGS_0110})
    return Read(loader=loader, argv=tuple(argv), values=values, rewrites=rewrites, unread=unread)


def own_parser() -> tuple[str, argparse.ArgumentParser | None]:
    """train_ppo_ray.py's own parser, built by running its __main__ block's statements up to `args =
    parser.parse_args()`, and the loader line; (SUBSET-like line, None) where that cannot be done."""
    spec = importlib.util.find_spec("openrlhf")  # finds, does not import: openrlhf's modules need Ray
    if spec is None or not spec.submodule_search_locations:
        return SUBSET, None
    version = _version()
    source = Path(list(spec.submodule_search_locations)[0]) / "cli" / "train_ppo_ray.py"
    tree = ast.parse(source.read_text(), str(source)) if source.is_file() else ast.Module(body=[], type_ignores=[])
    main = next((node for node in tree.body if isinstance(node, ast.If)
                 and ast.unparse(node.test) == "__name__ == '__main__'"), None)
    end = next((i for i, node in enumerate(main.body) if isinstance(node, ast.Assign)
                and "parse_args" in ast.unparse(node.value)), None) if main else None
    if main is None or end is None:
        return (f"built-in subset of openrlhf {RELEASE}'s keys (openrlhf {version} installed, its train_ppo_ray.py "
                "builds no parser in its __main__ block)"), None
    imports = [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom)) and _stdlib(node)]
    scope: dict[str, Any] = {"__name__": "openrlhf.cli.train_ppo_ray"}
    try:
        exec(compile(ast.Module(body=[*imports, *main.body[:end]], type_ignores=[]), str(source), "exec"), scope)
        built = scope["parser"]
    except Exception as exc:  # noqa: BLE001 - another release's parser needing more than the standard library
        return (f"built-in subset of openrlhf {RELEASE}'s keys (openrlhf {version} installed, its parser could not "
                f"be built here: {type(exc).__name__}: {exc})"), None
    missing = [dest for dest in MAPPED if dest not in {action.dest for action in built._actions}]
    if missing:  # another release's flags (0.10.4 has no --algo.advantage.is_correction_level)
        return (f"built-in subset of openrlhf {RELEASE}'s keys (openrlhf {version} installed, its train_ppo_ray.py "
                f"has no --{missing[0]})"), None
    return OWN.format(version), built


def _stdlib(node: ast.Import | ast.ImportFrom) -> bool:
    names = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""]
    return all(name.split(".")[0] in sys.stdlib_module_names for name in names)


def _version() -> str:
    try:
        return importlib.metadata.version("openrlhf")
    except importlib.metadata.PackageNotFoundError:  # a source tree on the path
        return "of unknown version"


def subset_parser() -> argparse.ArgumentParser:
    """The mapped flags, in an ArgumentParser configured as train_ppo_ray.py's (:198: abbreviations allowed)."""
    built = argparse.ArgumentParser(prog="train_ppo_ray.py", add_help=False, exit_on_error=False)
    for flag, kwargs in {**FLAGS, **FLAGS_0110}.items():
        built.add_argument(flag, **kwargs)
    return built


def _refuse_undotted(path: Path, argv: list[str]) -> None:
    """OpenRLHF's parse_args refuses a flag it does not declare; of those the subset can tell, the undotted
    ones (a pre-0.10.2 script's --micro_train_batch_size, --bf16)."""
    for token in argv:
        name = token.partition("=")[0]
        if name.startswith("--") and len(name) > 2 and "." not in name and not any(
                flag.startswith(name) for flag in UNDOTTED):
            raise SpecError(f"{path}: unrecognized arguments: {token} (OpenRLHF {RELEASE} refuses it: its flags are "
                            "dotted since 0.10.2, e.g. --train.micro_batch_size)")


def _parse(path: Path, built: argparse.ArgumentParser, argv: list[str], known_only: bool) -> argparse.Namespace:
    """argparse's own message for a bad value or an unknown flag, as one SpecError naming the file and flag."""

    def refuse(message: str) -> None:
        raise SpecError(f"{path}: {message} (OpenRLHF refuses it)")

    built.error = refuse  # type: ignore[method-assign]
    try:
        return built.parse_known_args(argv)[0] if known_only else built.parse_args(argv)
    except argparse.ArgumentError as exc:
        raise SpecError(f"{path}: {exc} (OpenRLHF refuses it)") from None


def effective(path: Path, values: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The __main__ block's rewrites of the mapped flags, in its order (cli/train_ppo_ray.py:686-705), and
    DeepspeedStrategy's refusal (utils/deepspeed/deepspeed.py:76-78)."""
    rewrites: dict[str, str] = {}
    if values["ds.ring_attn_size"] > 1 and not values["ds.packing_samples"]:  # :686-689
        values["ds.packing_samples"] = True
        rewrites["ds.packing_samples"] = "set by --ds.ring_attn_size > 1 (cli/train_ppo_ray.py:686-689)"
    if values["train.dynamic_batch_enable"]:
        if not values["ds.packing_samples"]:  # :691-694
            values["ds.packing_samples"] = True
            rewrites["ds.packing_samples"] = "set by --train.dynamic_batch_enable (cli/train_ppo_ray.py:691-694)"
        if values["rollout.max_tokens_per_gpu"] is None:  # :695-697
            values["rollout.max_tokens_per_gpu"] = values["train.max_tokens_per_gpu"]
            rewrites["rollout.max_tokens_per_gpu"] = "--train.max_tokens_per_gpu's (cli/train_ppo_ray.py:695-697)"
    if values["ds.packing_samples"]:
        if "flash_attention" not in values["ds.attn_implementation"]:  # :699-704
            values["ds.attn_implementation"] = "flash_attention_2"
            rewrites["ds.attn_implementation"] = "set by --ds.packing_samples (cli/train_ppo_ray.py:699-704)"
        if not values["vllm.num_engines"] or values["vllm.num_engines"] < 0:  # :705 (None > 0 is a TypeError)
            raise SpecError(f"{path}: --ds.packing_samples needs --vllm.num_engines > 0 (OpenRLHF refuses it: "
                            "cli/train_ppo_ray.py:705)")
    if values["ds.tensor_parallel_size"] > 1 and values["ds.param_dtype"] != "bf16":
        raise SpecError(f"{path}: --ds.tensor_parallel_size={values['ds.tensor_parallel_size']} needs "
                        "--ds.param_dtype bf16 (OpenRLHF refuses it: utils/deepspeed/deepspeed.py:76-78)")
    return values, rewrites


TRAIN_LINE = re.compile(r"^[^#\n]*?\bopenrlhf[./]cli[./]train_ppo_ray(?:\.py)?\b", re.M)


OTHER_ENTRY = re.compile(r"^[^#\n]*?\bopenrlhf[./]cli[./](\w+)", re.M)


def command_line(path: Path, text: str) -> tuple[list[str], tuple[str, ...]]:
    """train_ppo_ray's argv as the file gives it (scripts.py), and the arrays it names but lacks; a script
    that launches another of OpenRLHF's entry points (train_sft, train_rm, ...) is refused."""
    if TRAIN_LINE.search(text) is None and (other := OTHER_ENTRY.search(text)) is not None:
        raise SpecError(f"{path}: not an OpenRLHF PPO config: it launches openrlhf.cli.{other[1]}, not train_ppo_ray")
    argv, unread = scripts.command_line(path, text, TRAIN_LINE)
    if TRAIN_LINE.search(text) is None and argv and not argv[0].startswith("-"):  # `docker run ...`, a helper script
        raise SpecError(f"{path}: not an OpenRLHF PPO config: no openrlhf.cli.train_ppo_ray line, nor a list of its "
                        f"flags (it starts with {argv[0]!r})")
    return argv, unread


def _default(d: Deriving, side: Side, key: str, value: Any, note: str) -> None:
    # a key reproduced by the engine's own behaviour: no option to set
    d.settings.append(Setting(side=side, key=key, value=value, status="reproduced", option=None, note=note))


def _by(read: Read, dest: str) -> str:
    return f"; {read.rewrites[dest]}" if dest in read.rewrites else ""


def _train(d: Deriving, read: Read, machine: Machine) -> None:
    """The actor's forward (models/actor.py:221-300), built by PolicyModelActor (trainer/ray/ppo_actor.py:513-528)
    and run for the old log-probs by its forward() (:618-643) and for the new ones by its training step."""
    v = read.values
    dtype = {"bf16": "bfloat16", "fp16": "float16"}[v["ds.param_dtype"]]
    d.reproduce("train", "--ds.param_dtype", v["ds.param_dtype"], "dtype", dtype,
                note="weights loaded and computed in it (models/actor.py:110-113, :149-157; DeepSpeed keeps fp32 "
                     "master weights for the optimizer only), the logits cast to fp32 (:267)")
    _attention(d, v["ds.attn_implementation"], machine, _by(read, "ds.attn_implementation"))
    if v["ds.packing_samples"]:
        d.reproduce("train", "--ds.packing_samples", True, "packing", "varlen",
                    note="a micro-batch's samples unpadded into one row, attention within each (models/actor.py:"
                         "236-240, models/ring_attn_utils.py unpad_and_slice_tensor)" + _by(read, "ds.packing_samples"))
    else:
        d.reproduce("train", "--ds.packing_samples", False, "packing", "pad",
                    note="right-padded rows (trainer/ppo_utils/experience.py:113), positions from the attention mask "
                         "(models/actor.py:262-263)")
    t = v["rollout.temperature"]
    if t != t or t in (float("inf"), float("-inf")):  # argparse's float takes "nan" and "inf"
        raise SpecError(f"{d.file}: --rollout.temperature={t}: not a finite number")
    if t > 0:
        d.reproduce("train", "--rollout.temperature", t, "temperature", t,
                    note="the actor divides the fp32 logits by it before the log-softmax (models/actor.py:267-271; "
                         "trainer/ray/ppo_actor.py:525)")
    else:
        d.cannot("train", "--rollout.temperature", t, "the actor divides the fp32 logits by it (models/actor.py:"
                 "270-271): no log-probs to replay at a temperature <= 0")
    _parallel(d, v)
    _kernels(d, v)


def _attention(d: Deriving, attn: str, machine: Machine, rewritten: str) -> None:
    here = "flash-attn 2 here" if machine.flash_attn else "flash-attn needs CUDA and the flash_attn package; sdpa here"
    key, nearest = "--ds.attn_implementation", "flash_attention_2" if machine.flash_attn else "sdpa"
    if attn == "flash_attention_2" and machine.flash_attn:
        d.reproduce("train", key, attn, "attn", attn, note=rewritten[2:])
    elif attn == "flash_attention_2":
        d.approximate("train", key, attn, option="attn", option_value="sdpa", note=here + rewritten)
    elif attn in ("sdpa", "eager"):
        d.reproduce("train", key, attn, "attn", attn)
    elif "flash" in attn:  # flash_attention_3, kernels-community/vllm-flash-attn3 (train_ppo_ray.py:346)
        d.approximate("train", key, attn, option="attn", option_value=nearest,
                      note=f"FlashAttention-3 kernels (Hopper); {here}" + rewritten)
    else:
        d.approximate("train", key, attn, option="attn", option_value="sdpa",
                      note=f"transformers' {attn!r} attention; sdpa here")


def _batches(d: Deriving, read: Read, side: Side) -> None:
    """Old log-probs in the experience maker's micro-batches (trainer/ppo_utils/experience_maker.py:44-77), new
    ones in the update's (trainer/ray/ppo_actor.py:153-170, trainer/ppo_utils/replay_buffer.py:73-140)."""
    v, section = read.values, "rollout" if side == "train" else "train"
    ring, tp = v["ds.ring_attn_size"], v["ds.tensor_parallel_size"]
    ranks = max(1, v["actor.num_nodes"] * v["actor.num_gpus_per_node"] // ring // tp)
    if v["train.dynamic_batch_enable"]:
        key = f"{section}.max_tokens_per_gpu"
        tokens = v[key]
        scope = ("the whole rollout batch, the count rounded down to a multiple of the " f"{ranks} data-parallel ranks "
                 "(experience_maker.py:49-69)" if side == "train" else "each optimizer step's --train.batch_size / "
                 f"{ranks} samples on a rank, the count the ranks' largest (replay_buffer.py:91-140)")
        d.approximate(side, f"--{key}", tokens, option="batch_tokens", option_value=tokens * ring * tp,
                      note=f"OpenRLHF counts micro-batches of at most {tokens}" + (f" x {ring * tp} (ring x TP)"
                           if ring * tp > 1 else "") + f" tokens by first-fit in order over {scope}, then splits the "
                           "lengths into that many by Karmarkar-Karp, unchecked against the budget (utils/"
                           "seqlen_balancing.py:234-247, :153-184); hf balances verl's workload estimate under the "
                           "budget, so a sample's neighbours can differ" + _by(read, key))
        return
    key = f"{section}.micro_batch_size"
    n = v[key]
    if side == "train":
        d.reproduce(side, f"--{key}", n, "micro_batch", n, note="consecutive samples of the rollout batch, each "
                    f"micro-batch to one of the {ranks} data-parallel ranks (experience_maker.py:70-76)")
    elif ring == 1 and tp <= 1:
        d.approximate(side, f"--{key}", n, option="micro_batch", option_value=n,
                      note="a rank's samples shuffled each epoch before batching (trainer/ray/ppo_actor.py:158-170); "
                           "hf's neighbours are in file order")
    else:
        d.reproduce(side, f"--{key}", n, "micro_batch", n, note="a rank's samples in order: no shuffle with ring "
                    "attention or DeepSpeed TP (trainer/ray/ppo_actor.py:158-162)")


def _parallel(d: Deriving, v: dict[str, Any]) -> None:
    ring, tp = v["ds.ring_attn_size"], v["ds.tensor_parallel_size"]
    if ring > 1:
        d.approximate("train", "--ds.ring_attn_size", ring,
                      note=f"hf runs each packed row on one device; ring attention splits it over {ring} GPUs "
                           "(utils/deepspeed/deepspeed.py:118-134, models/ring_attn_utils.py), merging partial "
                           "softmaxes (different rounding)")
    if tp > 1:
        d.approximate("train", "--ds.tensor_parallel_size", tp,
                      note=f"hf runs the whole model on one device; DeepSpeed AutoTP={tp} splits each GEMM's "
                           f"reduction over {tp} GPUs (utils/deepspeed/deepspeed.py:389-391; different rounding)")


def _kernels(d: Deriving, v: dict[str, Any]) -> None:
    if v["ds.use_liger_kernel"]:
        d.approximate("train", "--ds.use_liger_kernel", True,
                      note="Liger's Triton kernels (RMSNorm, RoPE, SwiGLU) in place of transformers' modules "
                           "(models/actor.py:136-139): the same math, other rounding; hf runs transformers' own")
    if v["ds.load_in_4bit"]:
        d.cannot("train", "--ds.load_in_4bit", True, "NF4 4-bit weights, bf16 compute (models/actor.py:115-122); "
                 "hf loads the checkpoint's weights unquantized")
    if v["ds.lora.rank"] > 0:
        d.approximate("train", "--ds.lora.rank", v["ds.lora.rank"],
                      note="LoRA adapters beside the frozen weights (models/actor.py:177-188): x·W + (x·A)·B·α/r "
                           "in separate GEMMs; hf runs the checkpoint's weights, the adapter merged into them")
    if v["ds.experts_implementation"] is not None:
        d.approximate("train", "--ds.experts_implementation", v["ds.experts_implementation"],
                      note="transformers' MoE expert kernels by that name (models/actor.py:145-147); hf lets "
                           "transformers pick (grouped_mm where supported, else eager); no effect on a dense model")
    if v["train.full_determinism_enable"]:
        d.approximate("train", "--train.full_determinism_enable", True,
                      note="transformers.enable_full_determinism (utils/deepspeed/deepspeed.py:82-86): torch's "
                           "deterministic algorithms and cuBLAS workspace; the replay runs torch's defaults")


def _infer(d: Deriving, v: dict[str, Any], machine: Machine) -> None:
    """vLLM with the args create_vllm_engines passes (trainer/ray/vllm_engine.py:209-311; train_ppo_ray.py:53-82)."""
    engines = v["vllm.num_engines"]
    if engines:
        _default(d, "infer", "--vllm.num_engines", engines, "independent engines, each request to one "
                 "(trainer/ray/vllm_engine.py:253-306): the replay is one of them")
    else:
        d.cannot("infer", "--vllm.num_engines", engines, "no vLLM engines: OpenRLHF generates with vLLM only "
                 "(trainer/ppo_utils/samples_generator.py:55); the replay takes the other flags as given")
    fp16 = v["ds.param_dtype"] == "fp16"
    d.reproduce("infer", "vLLM dtype", "bfloat16", "dtype", "bfloat16",
                note="fixed by create_vllm_engines (trainer/ray/vllm_engine.py:273)"
                     + (", while the trainer computes in fp16 (--ds.param_dtype fp16)" if fp16 else ""))
    tp = v["vllm.tensor_parallel_size"]
    if tp == 1 or machine.gpus >= tp:
        d.reproduce("infer", "--vllm.tensor_parallel_size", tp, "tensor_parallel_size", tp)
    else:
        d.approximate("infer", "--vllm.tensor_parallel_size", tp, option="tensor_parallel_size", option_value=1,
                      note=f"vLLM runs on one device here; TP={tp} splits each GEMM's reduction (different "
                           f"rounding): add `,tensor_parallel_size={tp}` on a machine with {tp} GPUs")
    d.reproduce("infer", "--vllm.enable_prefix_caching", v["vllm.enable_prefix_caching"], "enable_prefix_caching",
                v["vllm.enable_prefix_caching"])
    if v["vllm.enforce_eager"] or machine.gpus > 0:
        d.reproduce("infer", "--vllm.enforce_eager", v["vllm.enforce_eager"], "enforce_eager", v["vllm.enforce_eager"])
    else:
        d.approximate("infer", "--vllm.enforce_eager", False, option="enforce_eager", option_value=True,
                      note="no CUDA graphs on CPU")
    d.reproduce("infer", "--data.max_len", v["data.max_len"], "max_model_len", v["data.max_len"],
                note="OpenRLHF's max_model_len (cli/train_ppo_ray.py:53, :74; trainer/ray/vllm_engine.py:271)")
    d.reproduce("infer", "--train.seed", v["train.seed"], "seed", v["train.seed"],
                note="engine i is seeded train.seed + i (trainer/ray/vllm_engine.py:269): the replay is engine 0")
    _infer_rest(d, v, machine)


def _infer_rest(d: Deriving, v: dict[str, Any], machine: Machine) -> None:
    memory = v["vllm.gpu_memory_utilization"]
    if machine.gpus > 0:
        d.reproduce("infer", "--vllm.gpu_memory_utilization", memory, "gpu_memory_utilization", memory)
    else:
        d.approximate("infer", "--vllm.gpu_memory_utilization", memory,
                      note="the KV cache's share of GPU memory (how many requests run together, preemption); on CPU "
                           "the replay's own KV-cache budget")
    level = v["algo.advantage.is_correction_level"]
    if v.get("algo.advantage.is_correction_enable"):
        d.reproduce("infer", "--algo.advantage.is_correction_enable", True, "logprobs_mode", "processed_logprobs",
                    note="OpenRLHF 0.11.0's flag: the correction asks vLLM for log-probs after its logits processing "
                         "(cli/train_ppo_ray.py:78 @ v0.11.0); 0.11.2 names it --algo.advantage.is_correction_level")
        for flag in ("is_correction_type", "is_correction_threshold"):
            d.same("train", f"--algo.advantage.{flag}", v[f"algo.advantage.{flag}"],
                   note="the correction the run applies (0.11.0): its metrics are audited with these settings")
        d.framework_settings = {"is_correction_enable": True, "is_correction_type": v["algo.advantage.is_correction_type"],
                                "is_correction_threshold": list(v["algo.advantage.is_correction_threshold"])}
    elif level != "off":
        d.reproduce("infer", "--algo.advantage.is_correction_level", level, "logprobs_mode", "processed_logprobs",
                    note="the correction asks vLLM for log-probs after its logits processing (cli/train_ppo_ray.py:78;"
                         " trainer/ray/vllm_engine.py:293-295)")
    else:
        d.approximate("infer", "--algo.advantage.is_correction_level", level, option="logprobs_mode",
                      option_value="raw_logprobs", note="with the correction off OpenRLHF asks vLLM for no log-probs "
                      "(trainer/ppo_utils/samples_generator.py:206); the replay scores raw ones")
    _default(d, "infer", "vLLM scheduler args", None, "OpenRLHF passes no max_num_seqs, max_num_batched_tokens, "
             "enable_chunked_prefill or kv_cache_dtype (trainer/ray/vllm_engine.py:264-280): vLLM's defaults")
    if v["train.full_determinism_enable"]:
        _default(d, "infer", "--train.full_determinism_enable", True, "VLLM_ENABLE_V1_MULTIPROCESSING=0 (trainer/ray/"
                 "vllm_engine.py:98-100): the engine core in-process, the same kernels")
    d.approximate("infer", "--rollout.temperature", v["rollout.temperature"], note=SAMPLER_NOTE)
    d.approximate("infer", "--rollout.top_p", v["rollout.top_p"],
                  note=SAMPLER_NOTE + "; top_k has no flag: -1 (trainer/ppo_utils/samples_generator.py:199-203), and "
                       "the trainer's log-softmax is over the whole vocabulary (models/actor.py:289)")
