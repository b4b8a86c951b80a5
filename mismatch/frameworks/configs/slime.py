"""slime: the command line of `train.py` (Megatron-LM's flags, slime's, SGLang's under `--sglang-`), in a file of
that command line or a `scripts/run-*.sh`, as the trainer's log-prob forward (an hf spec) and its SGLang engines
(a vllm spec: the nearest engine that runs in-process).

Read from slime at commit 624b824a898ab0ec1fcb4d373004c7f3852bf515 (no release on the package index), which pins
SGLang 0.5.15.post1 and Megatron-LM 1dcf0dafa884 (docker/Dockerfile:1, :7; docker/README.md). Paths are slime's
(slime/...) unless marked `sglang:` (sglang 0.5.15.post1, sglang/...) or `megatron:` (Megatron-LM at 1dcf0daf).

A script is read, not run (the shell is slime's only loader): the tokens of each `NAME=( ... )` array, and the
`python3 train.py ...` line (backslash continuations joined) with each `${NAME[@]}` replaced by that array. An
array the file does not define (sourced from another script) is reported, not read; variables stay as written.
Without a train.py line, the file's arrays in order; without arrays either, the whole file as one command line.
slime parses with parse_known_args (Megatron's ignore_unknown_args, utils/arguments.py:1615-1624 and
backends/megatron_utils/arguments.py:195; SGLang's known-args parser, backends/sglang_utils/arguments.py:203-226),
so an unknown or misspelt flag is ignored, here as there.
"""

from __future__ import annotations

import argparse
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any


from mismatch.errors import SpecError
from mismatch.frameworks.configs import scripts
from mismatch.frameworks.configs.loading import text as config_text, yaml_value
from mismatch.frameworks.configs.scripts import flag_value
from mismatch.frameworks.configs.derived import Derived, Deriving, Machine, Setting, Side

RELEASE = "624b824a898ab0ec1fcb4d373004c7f3852bf515"
SUBSET = f"built-in subset of slime {RELEASE[:12]}'s keys (slime not installed)"
OWN = ("slime {} (installed): slime.utils.arguments.get_slime_extra_args_provider; Megatron-LM's and SGLang's "
       "flags by the built-in subset")


def _count(text: str) -> int:
    """SGLang's human_readable_int: 32768, 32k, 32Ki (sglang: srt/utils/common.py:2816-2850)."""
    found = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)?", text.strip())
    if found is None or ("." in found[1] and (found[2] or "").endswith("i")):
        raise ValueError(text)
    scale = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    return int(float(found[1]) * scale.get(found[2], 1)) if found[2] else int(found[1])


_count.__name__ = "human-readable int"  # argparse names the type in its message
SWITCH: dict[str, Any] = {"action": "store_true", "default": False}
# slime's own flags, as slime/utils/arguments.py declares them (line of the flag).
SLIME_FLAGS: dict[str, dict[str, Any]] = {
    "--micro-batch-size": {"type": int, "default": 1},  # :717 (reset_arg over Megatron's)
    "--use-dynamic-batch-size": SWITCH, "--balance-by-flops": SWITCH,  # :747, :731
    "--max-tokens-per-gpu": {"type": int, "default": None},  # :758
    "--log-probs-max-tokens-per-gpu": {"type": int, "default": None},  # :768
    "--log-probs-chunk-size": {"type": int, "default": -1},  # :244
    "--rollout-temperature": {"type": float, "default": 1.0},  # :343
    "--rollout-top-p": {"type": float, "default": 1.0}, "--rollout-top-k": {"type": int, "default": -1},  # :349, :352
    "--rollout-num-gpus-per-engine": {"type": int, "default": 1},  # :56
    "--rollout-external-engine-addrs": {"type": str, "default": None, "nargs": "+"},  # :569
    "--use-rollout-logprobs": SWITCH, "--use-routing-replay": SWITCH, "--use-rollout-routing-replay": SWITCH,
    "--megatron-config-path": {"type": str, "default": None},  # :889 (the others: :1051, :1092, :1098)
    "--custom-config-path": {"type": str, "default": None},  # :1570-1575
}
ATTN_BACKENDS = ("flash", "fused", "unfused", "local", "auto")  # megatron: core/transformer/enums.py:60-67
# Megatron-LM's, generated from its config dataclasses (megatron: training/argument_utils.py:85-94 an enum by
# name, :165-167 a False bool as store_true): core/model_parallel_config.py:23, :31, :42, :48, :75, :109, :112,
# :150; core/transformer/transformer_config.py:112.
MEGATRON_FLAGS: dict[str, dict[str, Any]] = {
    "--tensor-model-parallel-size": {"type": int, "default": 1},
    "--pipeline-model-parallel-size": {"type": int, "default": 1},
    "--sequence-parallel": SWITCH, "--context-parallel-size": {"type": int, "default": 1},
    "--expert-model-parallel-size": {"type": int, "default": 1},
    "--fp16": SWITCH, "--bf16": SWITCH, "--deterministic-mode": SWITCH,
    "--attention-backend": {"type": str, "default": "auto", "choices": ATTN_BACKENDS},
}
# SGLang's ServerArgs under slime's --sglang- prefix (backends/sglang_utils/arguments.py:71-120), as sglang:
# srt/server_args.py declares them (line of the field; bools store_true, srt/arg_groups/arg_utils.py:276-281).
SGLANG_FLAGS: dict[str, dict[str, Any]] = {
    "--sglang-dtype": {"type": str, "default": "auto",
                       "choices": ("auto", "half", "float16", "bfloat16", "float", "float32")},  # :521-536
    "--sglang-kv-cache-dtype": {"type": str, "default": "auto",
                                "choices": ("auto", "fp8_e5m2", "fp8_e4m3", "bf16", "bfloat16", "fp4_e2m1")},  # :558
    "--sglang-context-length": {"type": _count, "default": None},  # :470-477
    "--sglang-max-running-requests": {"type": int, "default": None},  # :635
    "--sglang-chunked-prefill-size": {"type": int, "default": None},  # :655 (-1: off)
    "--sglang-disable-radix-cache": SWITCH, "--sglang-enable-fp32-lm-head": SWITCH,  # :755, :573
    "--sglang-disable-cuda-graph": SWITCH,  # :6260-6264 (deprecated, still honoured: :3214-3216)
    "--sglang-enable-deterministic-inference": SWITCH,  # :2508
    "--sglang-rl-on-policy-target": {"type": str, "default": None, "choices": ("fsdp",)},  # :2512, :272
    "--sglang-attention-backend": {"type": str, "default": None},  # :1277 (choices: :169-196)
    "--sglang-mem-fraction-static": {"type": float, "default": None},  # :631
    "--sglang-pp-size": {"type": int, "default": 1},  # :830
}
ALIASES = {"--sglang-pp-size": ("--sglang-pipeline-parallel-size",)}  # :834
FOREIGN = {**MEGATRON_FLAGS, **SGLANG_FLAGS}
FLAGS = {**SLIME_FLAGS, **FOREIGN}
KWARGS = {flag[2:].replace("-", "_"): kwargs for flag, kwargs in FLAGS.items()}  # by argparse dest
MAPPED = tuple(KWARGS)
SAMPLER_NOTE = ("the engine replay scores raw log-probs; the sampler's processing is replayed from each rollout's "
                "meta.sampler")


@dataclass(kw_only=True, slots=True, frozen=True)
class Read:
    """The command line as slime sees it: each mapped flag's value under its argparse dest."""

    loader: str
    argv: tuple[str, ...]
    values: dict[str, Any]    # after slime's own rewrites (bf16, log_probs_max_tokens_per_gpu, sglang_tp_size...)
    unread: tuple[str, ...]   # arrays the train.py line names and the file does not define
    custom_config: str | None  # --custom-config-path where it could not be read here


def derive(path: Path, machine: Machine) -> Derived:
    """The hf spec slime's Megatron log-prob forward is, and the vllm spec nearest its SGLang engines."""
    read = read_config(path)
    d = Deriving(framework="slime", file=str(path), loader=read.loader)
    d.model = flag_value(read.argv, "--hf-checkpoint")  # the HF checkpoint slime's rollout engines load
    if "--use-tis" in read.argv:  # the TIS the run applies (utils/arguments.py:1061-1079): its metrics' settings
        d.framework_settings = {"use_tis": True, **{name: float(given) for name, flag in
                                (("tis_clip", "--tis-clip"), ("tis_clip_low", "--tis-clip-low"))
                                if (given := flag_value(read.argv, flag)) is not None}}
    _train(d, read.values, machine)
    _train_rest(d, read)
    _infer(d, read.values, machine)
    return d.derived()


def read_config(path: Path) -> Read:
    """The file's command line parsed by slime's own parser where slime imports, else by the built-in subset."""
    text = config_text(path, "slime")
    argv, unread = command_line(path, text)
    if not unread and not any(token.startswith("--") for token in argv):  # defaults for a file that is no config
        raise SpecError(f"{path}: not a slime config: no train.py command line and no --flags")
    try:
        from slime.utils.arguments import get_slime_extra_args_provider
    except ImportError:  # the usual case: slime needs SGLang and Ray; mismatch's venv has neither
        loader, built = SUBSET, parser(SLIME_FLAGS)
    else:
        loader, built = OWN.format(_version()), get_slime_extra_args_provider()(parser({}))
    namespace = vars(_parse(path, built, argv))
    values, missing = effective(path, {dest: namespace[dest] for dest in MAPPED})
    return Read(loader=loader, argv=tuple(argv), values=values, unread=unread, custom_config=missing)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:  # setup.py's (0.3.1 at this commit); a source tree on the path has none
        return version("slime")
    except PackageNotFoundError:
        return "of unknown version"


def parser(own_flags: dict[str, dict[str, Any]]) -> argparse.ArgumentParser:
    """Megatron's and SGLang's flags of the subset, and `own_flags` (slime's, where its provider is not used).
    Megatron's parser takes no abbreviations (megatron: training/arguments.py:89-90)."""
    built = argparse.ArgumentParser(prog="train.py", add_help=False, allow_abbrev=False, exit_on_error=False)
    for flag, kwargs in {**FOREIGN, **own_flags}.items():
        built.add_argument(flag, *ALIASES.get(flag, ()), **kwargs)
    return built


def _parse(path: Path, built: argparse.ArgumentParser, argv: list[str]) -> argparse.Namespace:
    """argparse's own message for a bad value, as one SpecError naming the file and the flag."""
    for action in built._actions:  # --rollout-batch-size and the like are the launcher's, not the log-probs'
        action.required = False

    def refuse(message: str) -> None:
        raise SpecError(f"{path}: {message} (slime refuses it)")

    built.error = refuse  # type: ignore[method-assign]
    try:
        return built.parse_known_args(argv)[0]
    except argparse.ArgumentError as exc:
        raise SpecError(f"{path}: {exc} (slime refuses it)") from None


def effective(path: Path, values: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """slime's parse_args rewrites of the mapped flags, in its order (utils/arguments.py:1600-1643), and the
    --custom-config-path file where it is not found here."""
    values["bf16"] = not values["fp16"]  # backends/megatron_utils/arguments.py:157
    if not 0 < values["rollout_temperature"] < float("inf"):  # nan too  # utils/arguments.py:1770-1774
        raise SpecError(f"{path}: --rollout-temperature={values['rollout_temperature']}: must be > 0 (slime "
                        "refuses it)")
    if values["use_dynamic_batch_size"]:  # :1867-1870
        if values["max_tokens_per_gpu"] is None:
            raise SpecError(f"{path}: --use-dynamic-batch-size needs --max-tokens-per-gpu (slime refuses it)")
        if values["log_probs_max_tokens_per_gpu"] is None:
            values["log_probs_max_tokens_per_gpu"] = values["max_tokens_per_gpu"]
    if values["use_rollout_routing_replay"]:  # :2010-2011
        values["use_routing_replay"] = True
    missing = _custom_config(path, values)
    if values["fp16"] and values["bf16"]:  # megatron: training/arguments.py:701-702, after the custom config
        raise SpecError(f"{path}: --custom-config-path: fp16 with bf16 (Megatron refuses it)")
    if values["tensor_model_parallel_size"] == 1:  # megatron: training/arguments.py:903-911
        values["sequence_parallel"] = False
    gpus, pp = values["rollout_num_gpus_per_engine"], values["sglang_pp_size"]
    if gpus % pp:  # backends/sglang_utils/arguments.py:173-181
        raise SpecError(f"{path}: --rollout-num-gpus-per-engine={gpus} is not divisible by --sglang-pp-size={pp} "
                        "(slime refuses it)")
    values["sglang_tp_size"] = gpus // pp
    return values, missing


def _custom_config(path: Path, values: dict[str, Any]) -> str | None:
    """The YAML's keys set on args as they are (utils/arguments.py:2013-2019), the mapped ones type-checked. Its
    path is as slime's working directory sees it: tried as given, then beside the command-line file."""
    given = values["custom_config_path"]
    if given is None:
        return None
    found = next((p for p in (Path(given), path.parent / given) if p.is_file()), None)
    if found is None:
        return given
    data = yaml_value(config_text(found, "slime --custom-config-path"), found, "slime --custom-config-path") or {}
    if not isinstance(data, dict):
        raise SpecError(f"{found}: --custom-config-path: expected a mapping of argument names, got {data!r}")
    for key, value in data.items():
        if key not in values:
            continue  # slime sets every key; the unmapped ones decide no log-prob
        kwargs = KWARGS[key]
        kind = bool if kwargs.get("action") else int if kwargs["type"] is _count else kwargs["type"]
        number = kind is float and isinstance(value, int)
        if value is not None and (isinstance(value, bool) != (kind is bool) or not (isinstance(value, kind) or number)):
            raise SpecError(f"{found}: {key}: expected {kind.__name__}, got {value!r} (slime sets it unchecked, and "
                            "its use would fail)")
        values[key] = value
    return None


TRAIN_LINE = re.compile(r"^[^#\n]*?\btrain(?:_async)?\.py\b", re.M)


def command_line(path: Path, text: str) -> tuple[list[str], tuple[str, ...]]:
    """train.py's argv as the file gives it (scripts.py), and the arrays it names but lacks."""
    return scripts.command_line(path, text, TRAIN_LINE)


def _default(d: Deriving, side: Side, key: str, value: Any, note: str) -> None:
    # a key reproduced by the engine's own behaviour: no option to set
    d.settings.append(Setting(side=side, key=key, value=value, status="reproduced", option=None, note=note))


def _train(d: Deriving, v: dict[str, Any], machine: Machine) -> None:
    """The old-log-prob forward: Megatron's forward_only over the training micro-batches (backends/megatron_utils/
    actor.py:474-486, model.py:348-508), log-probs by get_log_probs_and_entropy (loss.py:516-600)."""
    if v["fp16"]:
        d.reproduce("train", "--fp16", True, "dtype", "float16", note="fp16 weights and compute (Megatron's "
                    "Float16Module), fp32 main weights in the optimizer")
    else:
        d.reproduce("train", "--bf16", True, "dtype", "bfloat16", note="slime trains in bf16 unless --fp16 "
                    "(backends/megatron_utils/arguments.py:157): bf16 weights and compute, fp32 main weights in the "
                    "optimizer")
    _attention(d, v["attention_backend"], machine)
    d.reproduce("train", "variable_seq_lengths", True, "packing", "varlen",
                note="always (backends/megatron_utils/arguments.py:81-82): a micro-batch's samples in one THD row, "
                     "attention within each (backends/megatron_utils/data.py:76-107)")
    _micro_batches(d, v)
    t = v["rollout_temperature"]
    d.reproduce("train", "--rollout-temperature", t, "temperature", t,
                note="the trainer divides the fp32 logits by it before the log-softmax "
                     "(backends/megatron_utils/loss.py:540-543)")
    if v["rollout_top_p"] < 1.0:
        d.cannot("train", "--rollout-top-p", v["rollout_top_p"],
                 "the trainer takes each position's log-softmax over the nucleus SGLang sampled from, sent with each "
                 "sample (backends/megatron_utils/loss.py:83-95; utils/ppo_utils.py:255-270); hf scores the whole "
                 "vocabulary")
    _default(d, "train", "--log-probs-chunk-size", v["log_probs_chunk_size"],
             "the log-softmax is per position, so scoring the logits in chunks changes no value "
             "(utils/ppo_utils.py:718-763)")
    _parallel(d, v)


def _attention(d: Deriving, backend: str, machine: Machine) -> None:
    here = "flash-attn 2 here" if machine.flash_attn else "flash-attn needs CUDA and the flash_attn package; sdpa here"
    what = {"flash": "Transformer Engine's flash-attention", "fused": "cuDNN's fused attention (Transformer Engine)",
            "auto": "auto: Transformer Engine picks flash-attention, cuDNN fused or unfused attention by GPU and "
                    "shape (megatron: core/transformer/transformer_config.py:112-116)",
            "unfused": "softmax(QKᵀ)V in separate kernels", "local": "Megatron's own PyTorch attention"}[backend]
    if backend == "flash" and machine.flash_attn:
        d.reproduce("train", "--attention-backend", backend, "attn", "flash_attention_2", note=what)
    elif backend in ("unfused", "local"):
        d.approximate("train", "--attention-backend", backend, option="attn", option_value="eager",
                      note=f"{what}; hf's eager attention computes the same, with other kernels")
    else:
        d.approximate("train", "--attention-backend", backend, option="attn",
                      option_value="flash_attention_2" if machine.flash_attn else "sdpa", note=f"{what}; {here}")


def _micro_batches(d: Deriving, v: dict[str, Any]) -> None:
    """The micro-batches are the training step's, scheduled once per rollout (ray/rollout.py:757-816,
    utils/dp_schedule.py:82-209) and used by the log-prob forward too (backends/megatron_utils/actor.py:426-486)."""
    if not v["use_dynamic_batch_size"]:
        n = v["micro_batch_size"]
        d.reproduce("train", "--micro-batch-size", n, "micro_batch", n,
                    note="samples in order within each step of --global-batch-size rollouts (utils/dp_schedule.py:"
                         "77-79), dealt round-robin to the data-parallel ranks (:198): hf's neighbours where a step's "
                         f"sample count is a multiple of {n}")
        return
    tokens, cp = v["max_tokens_per_gpu"], v["context_parallel_size"]
    how = ("balanced by estimated FLOPs without the token cap (--balance-by-flops, utils/dp_schedule.py:67-75)"
           if v["balance_by_flops"] else "first-fit in sample order (utils/dp_schedule.py:76; utils/"
           "seqlen_balancing.py:180-198), the largest split until their count is a multiple of the data-parallel "
           "size (dp_schedule.py:167-176)")
    d.approximate("train", "--max-tokens-per-gpu", tokens, option="batch_tokens", option_value=tokens * cp,
                  note=f"slime packs each step's samples into micro-batches of at most {tokens}"
                       + (f" x CP {cp} tokens (dp_schedule.py:117-120), each split over the CP ranks" if cp > 1 else
                          " tokens") + f", {how}; hf packs under the same budget as verl's dynamic batch size does "
                       "(Karmarkar-Karp), so a sample's neighbours can differ")
    if v["log_probs_max_tokens_per_gpu"] != tokens:
        _default(d, "train", "--log-probs-max-tokens-per-gpu", v["log_probs_max_tokens_per_gpu"],
                 f"read nowhere at {RELEASE[:7]} (only defaulted, utils/arguments.py:1869-1870): the log-prob "
                 "forward runs the training micro-batches")


def _parallel(d: Deriving, v: dict[str, Any]) -> None:
    tp, pp, cp, ep = (v[f"{name}_parallel_size"] for name in ("tensor_model", "pipeline_model", "context",
                                                               "expert_model"))
    for key, size, note in (
            ("--tensor-model-parallel-size", tp, f"TP={tp} splits each GEMM's reduction over {tp} GPUs and "
             "all-reduces the partial sums (different rounding)"),
            ("--pipeline-model-parallel-size", pp, f"PP={pp} runs the layers in {pp} stages, activations passed "
             "between them as they are (the same arithmetic)"),
            ("--context-parallel-size", cp, f"CP={cp} splits each sample into 2x{cp} zigzag chunks "
             "(backends/megatron_utils/cp_utils.py:179), ring attention merging partial softmaxes (different "
             "rounding)"),
            ("--expert-model-parallel-size", ep, f"EP={ep} shards the experts, tokens sent all-to-all, each expert "
             "GEMM over other rows than hf's; no effect on a dense model")):
        if size > 1:
            d.approximate("train", key, size, note=f"hf runs the whole model on one device; {note}")
    if v["sequence_parallel"]:
        d.approximate("train", "--sequence-parallel", True, note="norms on sequence shards, all-gathers and "
                      "reduce-scatters in place of TP's all-reduces (other reduction order); hf runs on one device")
    if v["deterministic_mode"]:
        d.approximate("train", "--deterministic-mode", True, note="Megatron's deterministic kernels (megatron: "
                      "core/model_parallel_config.py:150): run-to-run stable, still other kernels than hf's")


def _train_rest(d: Deriving, r: Read) -> None:
    v = r.values
    if v["use_rollout_logprobs"]:
        _default(d, "train", "--use-rollout-logprobs", True,
                 "the old log-probs are the engine's: slime runs no old-log-prob forward (backends/megatron_utils/"
                 "actor.py:473-475); the train replay stands for the policy update's, in the same micro-batches")
    if v["use_rollout_routing_replay"]:
        d.reproduce("train", "--use-rollout-routing-replay", True, "routing", "replay",
                    note="the trainer forces the experts SGLang routed to (backends/megatron_utils/actor.py:430-431, "
                         ":476-478); the replay forces those recorded with each rollout")
    elif v["use_routing_replay"]:
        _default(d, "train", "--use-routing-replay", True, "the old-log-prob forward routes on its own and records "
                 "(backends/megatron_utils/actor.py:479-480); the update replays it")
    for key, value, note in (
            ("--megatron-config-path", v["megatron_config_path"], "the actor's Megatron overrides in that YAML "
             "(ray/placement_group.py:165-168) are not read: the command line's values are replayed"),
            ("--custom-config-path", r.custom_config, "not found here (as given, nor beside the command line): its "
             "keys, which override the command line's (utils/arguments.py:2013-2019), are not read")):
        if value is not None:
            d.cannot("train", key, value, note)
    for name in r.unread:
        d.cannot("train", f"${{{name}[@]}}", None, "an array the file does not define (sourced from another "
                 "script?): its flags are not read")


def _infer(d: Deriving, v: dict[str, Any], machine: Machine) -> None:
    """vLLM with the args of slime's SGLang servers (backends/sglang_utils/sglang_engine.py:506-619)."""
    d.kinds["infer"] = "vllm"
    external = v["rollout_external_engine_addrs"]
    d.approximate("infer", "--rollout-external-engine-addrs" if external else "rollout engine",
                  external or "sglang", note="SGLang does not run in-process; vLLM with the same args. For SGLang "
                  "itself, serve it and pass --infer http://HOST:PORT")
    if v["fp16"]:
        d.reproduce("infer", "--fp16", True, "dtype", "float16",
                    note="an fp16 trainer serves SGLang in fp16 (backends/sglang_utils/sglang_engine.py:571-572)")
    else:
        dtype = {"half": "float16", "float": "float32"}.get(v["sglang_dtype"], v["sglang_dtype"])
        d.reproduce("infer", "--sglang-dtype", v["sglang_dtype"], "dtype", dtype,
                    note="auto: bf16 for a bf16 checkpoint (sglang: srt/server_args.py:521-536), as vLLM's auto"
                    if dtype == "auto" else "")
    gpus, tp, pp = v["rollout_num_gpus_per_engine"], v["sglang_tp_size"], v["sglang_pp_size"]
    for option, key, value, size in (("tensor_parallel_size", "--rollout-num-gpus-per-engine", gpus, tp),
                                     ("pipeline_parallel_size", "--sglang-pp-size", pp, pp)):
        if size == 1 or machine.gpus >= size:
            d.reproduce("infer", key, value, option, size, note="" if gpus == tp or option[0] == "p" else
                        "TP = GPUs per engine / PP (backends/sglang_utils/arguments.py:173-181)")
        else:
            how = "split each GEMM's reduction (different rounding)" if option[0] == "t" else "run the layers in stages"
            d.approximate("infer", key, value, option=option, option_value=1,
                          note=f"vLLM runs on one device here; {size} ranks {how}: add `,{option}={size}` on a "
                               f"machine with {size} GPUs")
    d.reproduce("infer", "--sglang-disable-radix-cache", v["sglang_disable_radix_cache"], "enable_prefix_caching",
                not v["sglang_disable_radix_cache"])
    _infer_batching(d, v, machine)
    _infer_kernels(d, v)
    for key, value in (("--rollout-temperature", v["rollout_temperature"]), ("--rollout-top-p", v["rollout_top_p"]),
                       ("--rollout-top-k", v["rollout_top_k"])):
        d.approximate("infer", key, value, note=SAMPLER_NOTE + ("; SGLang returns log-probs of logits / T "
                      "(sglang: srt/layers/sampler.py:179-195)" if key == "--rollout-temperature" else ""))


def _infer_batching(d: Deriving, v: dict[str, Any], machine: Machine) -> None:
    chunk = v["sglang_chunked_prefill_size"]
    if chunk is None:
        d.approximate("infer", "--sglang-chunked-prefill-size", None,
                      note="SGLang picks it by GPU memory (8192 on an H100 or H200; sglang: srt/server_args.py:"
                           "3469-3556); vLLM's default chunking here")
    elif chunk == -1:
        d.reproduce("infer", "--sglang-chunked-prefill-size", chunk, "enable_chunked_prefill", False)
    else:
        d.reproduce("infer", "--sglang-chunked-prefill-size", chunk, "enable_chunked_prefill", True)
        d.reproduce("infer", "--sglang-chunked-prefill-size", chunk, "max_num_batched_tokens", chunk,
                    note="SGLang's prefill chunk as vLLM's tokens per step")
    for key, option in (("--sglang-max-running-requests", "max_num_seqs"),
                        ("--sglang-context-length", "max_model_len")):
        value = v[key[2:].replace("-", "_")]
        if value is not None:
            d.reproduce("infer", key, value, option, value)
    if v["sglang_disable_cuda_graph"] or machine.gpus > 0:
        d.reproduce("infer", "--sglang-disable-cuda-graph", v["sglang_disable_cuda_graph"], "enforce_eager",
                    v["sglang_disable_cuda_graph"])
    else:
        d.approximate("infer", "--sglang-disable-cuda-graph", False, option="enforce_eager", option_value=True,
                      note="no CUDA graphs on CPU")
    if v["sglang_mem_fraction_static"] is not None:
        d.approximate("infer", "--sglang-mem-fraction-static", v["sglang_mem_fraction_static"],
                      note="the KV-cache pool's share of GPU memory (batch sizes, preemption): not vLLM's "
                           "gpu_memory_utilization, which counts activations too; vLLM's default here")


KV_DTYPES = {"bf16": "bfloat16", "bfloat16": "bfloat16", "fp8_e5m2": "fp8_e5m2", "fp8_e4m3": "fp8_e4m3"}


def _infer_kernels(d: Deriving, v: dict[str, Any]) -> None:
    kv = v["sglang_kv_cache_dtype"]
    if kv == "auto":
        _default(d, "infer", "--sglang-kv-cache-dtype", kv, "the model's dtype, as vLLM's auto")
    elif kv in KV_DTYPES:
        d.reproduce("infer", "--sglang-kv-cache-dtype", kv, "kv_cache_dtype", KV_DTYPES[kv])
    else:
        d.cannot("infer", "--sglang-kv-cache-dtype", kv, "an FP4 KV cache; vLLM has no such kv_cache_dtype")
    if v["sglang_attention_backend"] is not None:
        d.approximate("infer", "--sglang-attention-backend", v["sglang_attention_backend"],
                      note="SGLang's attention kernels; vLLM picks its own backend")
    for key, note in (
            ("sglang_enable_deterministic_inference", "SGLang's batch-invariant kernels (sglang: srt/server_args.py:"
             "2508-2511); vLLM switches its own on by the environment, not an engine option: set "
             "VLLM_BATCH_INVARIANT=1 for the replay"),
            ("sglang_rl_on_policy_target", "SGLang's log-probs as log_softmax of bf16 logits / T, to match an FSDP "
             "trainer (sglang: srt/layers/sampler.py:146-154); vLLM has no such mode"),
            ("sglang_enable_fp32_lm_head", "fp32 logits out of SGLang's LM head (sglang: srt/server_args.py:573); "
             "vLLM's come out in the model's dtype")):
        if v[key]:
            d.cannot("infer", f"--{key.replace('_', '-')}", v[key], note)
