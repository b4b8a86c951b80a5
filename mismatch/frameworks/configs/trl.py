"""TRL: a `trl grpo --config FILE` YAML or JSON (flat keys of GRPOConfig and ModelConfig) as the GRPO
trainer's log-prob forward (an `hf` spec) and its sampler (vLLM colocate or server, or the trainer's
own `model.generate` as `hf-decode`).

Every mapping below is read from TRL 1.16.0's source (the wheel on PyPI; paths are inside it). The
trainer scores old and new log-probs with one forward per `per_device_train_batch_size` rows, prompts
left-padded, under accelerate's autocast, through a fused LM head that scales the logits by
1/temperature; the colocated vLLM gets fixed engine args of TRL's own besides the `vllm_*` keys.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any


from mismatch.errors import SpecError
from mismatch.frameworks.configs.kinds import trl_grpo_or_refused
from mismatch.frameworks.configs.loading import text, yaml_node, yaml_value
from mismatch.frameworks.configs.derived import Derived, Deriving, Machine, Setting, Side

RELEASE = "1.16.0"

# The keys this reader maps, with TRL 1.16.0's defaults (the built-in subset reads these and
# ignores every other key, as trl/scripts/grpo.py:181 does: `fail_with_unknown_args=False`;
# `trl grpo` hands such keys to `accelerate launch`, which refuses the ones it does not know).
DEFAULTS: dict[str, Any] = {
    "dtype": "float32",                       # trl/trainer/model_config.py:89-90 (ModelConfig)
    "attn_implementation": None,              # model_config.py:96-97
    "model_init_kwargs": None,                # trl/trainer/grpo_config.py:429-430
    "bf16": None,                             # trl/trainer/base_config.py:68-69; None -> not fp16 (:108)
    "fp16": False,                            # transformers TrainingArguments (training_args.py:878, 5.19.0)
    "per_device_train_batch_size": 8,         # TrainingArguments (training_args.py:775, 5.19.0)
    "gradient_accumulation_steps": 1,         # TrainingArguments (training_args.py:847-848, 5.19.0)
    "generation_batch_size": None,            # grpo_config.py:521-522
    "steps_per_generation": None,             # grpo_config.py:528-529
    "temperature": 1.0,                       # grpo_config.py:532-533
    "top_p": 1.0,                             # grpo_config.py:536-537
    "top_k": 0,                               # grpo_config.py:543-544
    "min_p": None,                            # grpo_config.py:550-551
    "generation_kwargs": None,                # grpo_config.py:557-558
    "repetition_penalty": 1.0,                # grpo_config.py:573-574
    "cache_implementation": None,             # grpo_config.py:581-582
    "use_vllm": False,                        # grpo_config.py:587-588
    "vllm_mode": "colocate",                  # grpo_config.py:594-595
    "vllm_model_impl": "vllm",                # grpo_config.py:604-605
    "vllm_enable_sleep_mode": False,          # grpo_config.py:612-613
    "vllm_gpu_memory_utilization": 0.3,       # grpo_config.py:656-657
    "vllm_max_model_length": None,            # grpo_config.py:664-665
    "vllm_tensor_parallel_size": 1,           # grpo_config.py:671-672
    "cast_lm_head_to_fp32": False,            # grpo_config.py:460-461
    "use_transformers_continuous_batching": False,  # grpo_config.py:1022-1023
    "use_liger_kernel": False,                # base_config.py:91-92
    "pad_to_multiple_of": "auto",             # grpo_config.py:511-512; "auto" -> None off Neuron (:1055-1057)
}
# How each mapped key is typed, as HfArgumentParser converts a YAML string (argparse applies a field's
# type to a string default) and the trainer reads the rest. `num_processes` is accelerate launch's.
KINDS: dict[str, str] = {
    "dtype": "str", "attn_implementation": "str", "model_init_kwargs": "dict", "bf16": "bool",
    "fp16": "bool", "per_device_train_batch_size": "int", "gradient_accumulation_steps": "int",
    "generation_batch_size": "int", "steps_per_generation": "int", "temperature": "float",
    "top_p": "float", "top_k": "int", "min_p": "float", "generation_kwargs": "dict",
    "repetition_penalty": "float", "cache_implementation": "str", "use_vllm": "bool", "vllm_mode": "str",
    "vllm_model_impl": "str", "vllm_enable_sleep_mode": "bool", "vllm_gpu_memory_utilization": "float",
    "vllm_max_model_length": "int", "vllm_tensor_parallel_size": "int", "cast_lm_head_to_fp32": "bool",
    "use_transformers_continuous_batching": "bool", "use_liger_kernel": "bool", "pad_to_multiple_of": "pad",
    "num_processes": "int", "torch_dtype": "str",
}
# trl/trainer/utils.py:1332-1340 (create_model_from_path): any other dtype string is refused.
DTYPES = ("auto", "bfloat16", "float16", "float32")
VLLM_MODES = ("colocate", "server")  # trl/generation/vllm_generation.py:300-370
SAMPLER_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# SamplingParams keys that change which tokens come out but not a scored token's log-prob.
UNSCORED_KWARGS = frozenset({"seed", "n", "max_tokens", "min_tokens", "stop", "stop_token_ids", "ignore_eos",
                             "logprobs", "skip_special_tokens", "detokenize", "max_new_tokens", "do_sample",
                             "use_cache"})
SAMPLER_NOTE = ("the engine replay scores raw log-probs; the sampler's processing is replayed from each "
                "rollout's meta.sampler")
PROCESSED_NOTE = ("TRL asks for processed log-probs (generation/vllm_generation.py:361; trl vllm-serve: "
                  "scripts/vllm_serve.py build_command); vLLM's prompt log-probs are raw in either mode, and "
                  "the sampler's processing is replayed from each rollout's meta.sampler")


@dataclass(kw_only=True, slots=True, frozen=True)
class Read:
    """The config as the trainer sees it: the mapped keys' effective values, and what the file set."""

    loader: str
    values: dict[str, Any]  # key -> effective value (the release's defaults and post-init applied)
    given: dict[str, Any]   # the mapped keys the file sets, typed


IS_KEYS = ("vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
           "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min")


def derive(path: Path, machine: Machine) -> Derived:
    """The hf spec the GRPO trainer's log-prob forward is, and the spec of its sampler."""
    read = read_config(path)
    deriving = Deriving(framework="trl", file=str(path), loader=read.loader)
    raw = _load(path)[0]
    model = raw.get("model_name_or_path")  # ModelConfig.model_name_or_path (model_config.py)
    deriving.model = model if isinstance(model, str) else None
    # the IS correction the run applies (grpo_config.py:925-960), under --for trl's names: its metrics' settings
    deriving.framework_settings = {key: raw[key] for key in IS_KEYS if key in raw}
    _train(deriving, read, machine)
    _infer(deriving, read, machine)
    return deriving.derived()


def read_config(path: Path) -> Read:
    """The file read with TRL's own parser where TRL is importable, else with the built-in subset."""
    raw, lines = _load(path)
    given = _typed(path, raw, lines)
    try:
        fields = _own_fields(path, raw)
        loader = f"trl {importlib.metadata.version('trl')} (installed): trl.scripts.grpo make_parser()" \
                 ".parse_args_and_config"
    except ImportError:  # the usual case: mismatch's venv has no trl
        fields = _subset_fields(given)
        loader = f"built-in subset of trl {RELEASE}'s keys (trl not installed)"
    return Read(loader=loader, values=_effective(path, fields, given), given=given)


def _load(path: Path) -> tuple[dict[str, Any], dict[str, int]]:
    """The YAML mapping (JSON is YAML) TrlParser reads with yaml.safe_load (scripts/utils.py:326-329),
    and the line of each top-level key."""
    source = text(path, "trl")
    node = yaml_node(source, path, "trl")
    raw = yaml_value(source, path, "trl")
    if not isinstance(raw, dict):  # TRL's own refusal (scripts/utils.py:328-329)
        raise SpecError(f"{path}: a trl config must be a YAML mapping of keys, got {type(raw).__name__}")
    trl_grpo_or_refused(path, raw)
    lines = {str(key.value): key.start_mark.line + 1 for key, _ in node.value} if node is not None else {}
    return raw, lines


def _typed(path: Path, raw: dict[str, Any], lines: dict[str, int]) -> dict[str, Any]:
    """Each mapped key the file sets, converted as HfArgumentParser would; one SpecError (file, line,
    key) for a value of the wrong type."""
    given: dict[str, Any] = {}
    for key, kind in KINDS.items():
        if key not in raw:
            continue
        where = f"{path}:{lines[key]}" if key in lines else str(path)
        try:
            given[key] = _converted(kind, raw[key])
            _check_value(key, given[key])
        except (TypeError, ValueError) as exc:
            raise SpecError(f"{where}: {key}: {exc}") from None
    return given


def _converted(kind: str, value: Any) -> Any:
    if value is None:
        return None
    if kind == "bool":
        return _bool(value)
    if kind in ("int", "float"):
        return _number(kind, value)
    if kind == "pad":  # int, or "auto"/"none"/a number as a string (grpo_config.py:1051-1054)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str):
            return value if value == "auto" else None if value.lower() in ("none", "null") else _number("int", value)
        raise TypeError(f"expected an integer or 'auto', got {value!r}")
    if kind == "dict":  # a dict, or its JSON text (TrainingArguments' _VALID_DICT_FIELDS)
        parsed = json.loads(value) if isinstance(value, str) else value
        if not isinstance(parsed, dict):
            raise TypeError(f"expected a mapping, got {value!r}")
        return parsed
    if not isinstance(value, str):
        raise TypeError(f"expected a string, got {value!r}")
    return value


def _bool(value: Any) -> bool:
    """transformers' string_to_bool (hf_argparser.py:36-46)."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("yes", "true", "t", "y", "1", "no", "false", "f", "n", "0"):
        return value.lower() in ("yes", "true", "t", "y", "1")
    raise TypeError(f"expected true or false, got {value!r}")


def _number(kind: str, value: Any) -> int | float:
    if isinstance(value, str):
        return int(value) if kind == "int" else float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind == "int" and isinstance(value, float)):
        raise TypeError(f"expected {'an integer' if kind == 'int' else 'a number'}, got {value!r}")
    return value if kind == "int" else float(value)


def _check_value(key: str, value: Any) -> None:
    """The values TRL itself refuses later, when the trainer starts: refused here, before a replay."""
    init = value if key == "model_init_kwargs" and value else {}
    dtype = init.get("dtype", value if key == "dtype" else None)
    if dtype is not None and dtype not in DTYPES:  # trl/trainer/utils.py:1333-1340
        raise ValueError(f"dtype {dtype!r} is not one of: {', '.join(DTYPES)}")
    if key == "generation_kwargs" and value:
        for name in SAMPLER_KEYS:
            if name in value:
                _number("int" if name == "top_k" else "float", value[name])


@contextmanager
def _environment_kept() -> Iterator[None]:
    """TrlParser exports a config's `env:` and TrainingArguments its precision into os.environ."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _own_fields(path: Path, raw: dict[str, Any]) -> dict[str, Any]:
    """The fields after TRL's own parser (`trl grpo`'s four dataclasses and their post-init)."""
    from trl.scripts.grpo import make_parser  # ImportError: not installed

    with tempfile.TemporaryDirectory() as tmp, _environment_kept():
        # output_dir so nothing is written; use_cpu because TrainingArguments refuses bf16 on a machine
        # without a GPU otherwise (training_args.py _validate_args), and the config is for another one.
        args = ["--config", str(path), "--output_dir", tmp] + ([] if "use_cpu" in raw else ["--use_cpu", "true"])
        try:
            parsed = make_parser().parse_args_and_config(args, fail_with_unknown_args=False)
        except (SystemExit, ValueError, TypeError) as exc:
            message = str(exc).splitlines()[0] if str(exc) else repr(exc)
            raise SpecError(f"{path}: trl refused the config: {message}") from None
    _, training, model, _ = parsed
    fields = {key: getattr(training, key) for key in DEFAULTS if key not in ("dtype", "attn_implementation")}
    return {**fields, "dtype": model.dtype, "attn_implementation": model.attn_implementation}


def _subset_fields(given: dict[str, Any]) -> dict[str, Any]:
    """The defaults with the file's values, and the post-init steps that decide a mapped value."""
    fields = {**DEFAULTS, **{key: value for key, value in given.items() if key in DEFAULTS}}
    if fields["bf16"] is None:  # base_config.py:108
        fields["bf16"] = not fields["fp16"]
    pad = fields["pad_to_multiple_of"]
    fields["pad_to_multiple_of"] = None if pad == "auto" else pad  # grpo_config.py:1055-1057 (not Neuron)
    return fields


def _effective(path: Path, fields: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """What the trainer reads: model_init_kwargs as `trl grpo` merges them (scripts/grpo.py:112-120),
    and steps_per_generation at the launch's world size (grpo_config.py:1097-1117)."""
    init = {"attn_implementation": fields["attn_implementation"], "dtype": fields["dtype"],
            **(fields["model_init_kwargs"] or {})}
    values = {key: fields[key] for key in DEFAULTS
              if key not in ("model_init_kwargs", "generation_batch_size", "steps_per_generation")}
    values.update(dtype=init.get("dtype"), attn_implementation=init.get("attn_implementation"),
                  use_kernels=bool(init.get("use_kernels", False)), init_torch_dtype=init.get("torch_dtype"),
                  num_processes=given.get("num_processes", 1), torch_dtype=given.get("torch_dtype"))
    values["steps_per_generation"] = _steps_per_generation(path, given, values)
    return values


def _steps_per_generation(path: Path, given: dict[str, Any], values: dict[str, Any]) -> int:
    size, steps = given.get("generation_batch_size"), given.get("steps_per_generation")
    world_batch = values["per_device_train_batch_size"] * values["num_processes"]
    if size is None and steps is None:
        return values["gradient_accumulation_steps"]
    if size is not None and steps is not None:
        raise SpecError(f"{path}: generation_batch_size and steps_per_generation cannot both be set (as trl refuses)")
    if steps is not None:
        return steps
    if size % world_batch:
        raise SpecError(f"{path}: generation_batch_size ({size}) must be divisible by the global batch size "
                        f"({world_batch}), as trl refuses")
    return size // world_batch


def _train(d: Deriving, read: Read, machine: Machine) -> None:
    v = read.values
    _dtype(d, "train", read)
    _attn(d, "train", read, machine)
    d.approximate("train", "pad_to_multiple_of", v["pad_to_multiple_of"], option="packing", option_value="pad",
                  note="TRL left-pads each prompt to the batch's longest and right-pads completions "
                       "(grpo_trainer.py:2443-2459), then runs the forward with the attention mask and no "
                       "position ids, so a shorter prompt's tokens sit at shifted positions (the same attention "
                       "in exact arithmetic under RoPE, other rounding); hf pads on the right, unmasked")
    n = v["per_device_train_batch_size"]
    d.reproduce("train", "per_device_train_batch_size", n, "micro_batch", n,
                note="old log-probs: the local generation batch in order, n rows per forward "
                     "(grpo_trainer.py:1440-1445, 2505, 2646-2651); the loss forward takes each shuffled "
                     "micro-batch of n whole (:1543, :3030). Rollouts must be in the trainer's order")
    t = v["temperature"]
    d.reproduce("train", "temperature", t, "temperature", t,
                note="the fused LM head scales the fp32 logits by 1/T before its log-softmax "
                     "(grpo_trainer.py:1068-1071; kernels/chunked_logprob.py:75, :335) in 32768-wide vocabulary "
                     "tiles with an online log-sum-exp; hf divides by T and runs log_softmax (last-bit differences)")
    if v["cast_lm_head_to_fp32"]:
        d.cannot("train", "cast_lm_head_to_fp32", True,
                 "TRL casts the LM head and its input to fp32 (grpo_trainer.py:1012-1047; trainer/utils.py "
                 "add_fused_lm_head); hf projects the LM head in the model's dtype")
    else:
        _as_default(d, "train", "cast_lm_head_to_fp32", False, "the LM head runs in the compute dtype, as hf's does")
    _kernels(d, "train", v)


def _dtype(d: Deriving, side: Side, read: Read) -> None:
    """Weights in model_init_kwargs' dtype (float32 unless set: trainer/utils.py:1332), the forward under
    accelerate's autocast to bf16 or fp16 (grpo_trainer.py:1497, TrainingArguments' mixed precision)."""
    v, init = read.values, read.given.get("model_init_kwargs") or {}
    weights = v["dtype"] or "auto"  # None: transformers 5 takes the checkpoint's (grpo_trainer.py:171-174)
    key = "model_init_kwargs.dtype" if "dtype" in init else "dtype"
    mixed = "bfloat16" if v["bf16"] else "float16" if v["fp16"] else None
    precision = "bf16" if v["bf16"] or not v["fp16"] else "fp16"
    if mixed is None or mixed == weights:
        d.reproduce(side, key, weights, "dtype", weights)
        d.reproduce(side, precision, v[precision], "dtype", weights,
                    note="no mixed precision" if mixed is None else "autocast to the weights' own dtype")
    else:
        exact = " (exact where the checkpoint is saved in it)" if weights == "auto" else ""
        d.approximate(side, key, weights, option="dtype", option_value=mixed,
                      note=f"TRL loads {weights} weights and autocasts the forward to {mixed}: matmuls in {mixed}, "
                           f"norms, softmax and residual adds in fp32; hf runs the whole model in {mixed}{exact}. "
                           "Under DeepSpeed accelerate skips autocast and DeepSpeed casts the weights itself")
        d.approximate(side, precision, True, option="dtype", option_value=mixed,
                      note=f"accelerate's {precision} autocast over {weights} weights")
    if side == "train" and "torch_dtype" in init and "dtype" not in init:
        d.cannot(side, "model_init_kwargs.torch_dtype", init["torch_dtype"],
                 f"ignored: trl passes dtype={weights} to from_pretrained (scripts/grpo.py:112-120), which "
                 "prefers dtype to the deprecated torch_dtype; the model loads in the dtype above")
    if side == "train" and v["torch_dtype"] is not None:
        d.cannot(side, "torch_dtype", v["torch_dtype"],
                 f"not a key of trl {RELEASE} (ModelConfig's is `dtype`): `trl grpo` refuses it (accelerate launch: "
                 "unrecognized argument) and trl/scripts/grpo.py ignores it; the model loads in the dtype above")


def _attn(d: Deriving, side: Side, read: Read, machine: Machine) -> None:
    impl = read.values["attn_implementation"]
    init = read.given.get("model_init_kwargs") or {}
    key = "model_init_kwargs.attn_implementation" if "attn_implementation" in init else "attn_implementation"
    if impl is None:
        d.reproduce(side, key, None, "attn", "auto", note="TRL leaves it to transformers: sdpa where the model has it")
    elif impl in ("sdpa", "eager") or (impl == "flash_attention_2" and machine.flash_attn):
        d.reproduce(side, key, impl, "attn", impl)
    elif impl == "flash_attention_2":
        d.approximate(side, key, impl, option="attn", option_value="sdpa",
                      note="flash-attn needs CUDA and the flash_attn package; sdpa here")
    else:
        d.approximate(side, key, impl, option="attn", option_value="sdpa",
                      note=f"{impl} is not an attention of mismatch's torch engines; sdpa here")


def _kernels(d: Deriving, side: Side, v: dict[str, Any]) -> None:
    if v["use_liger_kernel"]:
        d.cannot(side, "use_liger_kernel", True, "Liger's Triton kernels replace the model's RMSNorm, RoPE and "
                 "SwiGLU (grpo_trainer.py:1051-1066); hf runs transformers' own layers")
    if v["use_kernels"]:
        d.cannot(side, "model_init_kwargs.use_kernels", True,
                 "Hub kernels replace the model's layers at load; hf runs transformers' own layers")


def _as_default(d: Deriving, side: Side, key: str, value: Any, note: str) -> None:
    """A key reproduced by the engine's own default: no option to set."""
    d.settings.append(Setting(side=side, key=key, value=value, status="reproduced", option=None, note=note))


def _infer(d: Deriving, read: Read, machine: Machine) -> None:
    v = read.values
    if not v["use_vllm"]:
        _generate(d, read, machine)
    elif v["vllm_mode"] not in VLLM_MODES:  # trl's own refusal (generation/vllm_generation.py:369-370)
        raise SpecError(f"{d.file}: vllm_mode: must be either 'server' or 'colocate', got {v['vllm_mode']!r}")
    elif v["vllm_mode"] == "server":
        _server(d, v, machine)
    else:
        _colocate(d, v, machine)
    _sampler(d, v)


def _generate(d: Deriving, read: Read, machine: Machine) -> None:
    """use_vllm false: the trainer's own model samples (grpo_trainer.py:1784-1876)."""
    v = read.values
    d.kinds["infer"] = "hf-decode"
    if v["use_transformers_continuous_batching"]:
        key, value, dtype = (("bf16", True, "bfloat16") if v["bf16"] else ("fp16", True, "float16") if v["fp16"]
                             else ("dtype", v["dtype"] or "auto", v["dtype"] or "auto"))
        d.approximate("infer", "use_transformers_continuous_batching", True,
                      note="transformers' generate_batch (paged attention, continuous batching) samples; "
                           "hf-decode prefills each prompt and decodes it alone with a KV cache")
        d.reproduce("infer", key, value, "dtype", dtype,
                    note="generate_batch casts the model to that dtype first (grpo_trainer.py:1797-1800)")
    else:
        d.approximate("infer", "use_vllm", False,
                      note="the sampler is the trainer's model.generate, prompts left-padded in one batch "
                           "(grpo_trainer.py:1813-1876); hf-decode prefills each prompt and decodes it alone with a "
                           "KV cache. The model's forward carries accelerate's autocast, as the trainer's does")
        _dtype(d, "infer", read)
    _attn(d, "infer", read, machine)
    if v["cache_implementation"] is not None:
        d.cannot("infer", "cache_implementation", v["cache_implementation"],
                 "hf-decode decodes with transformers' DynamicCache")
    if v["cast_lm_head_to_fp32"]:
        d.cannot("infer", "cast_lm_head_to_fp32", True,
                 "generate runs the fp32-cast LM head (grpo_trainer.py:1012-1047); hf-decode's runs in the "
                 "model's dtype")
    _kernels(d, "infer", v)


def _colocate(d: Deriving, v: dict[str, Any], machine: Machine) -> None:
    """The LLM(...) TRL builds in the trainer's process (generation/vllm_generation.py:347-364)."""
    tp = v["vllm_tensor_parallel_size"]
    if machine.gpus >= tp:
        d.reproduce("infer", "vllm_tensor_parallel_size", tp, "tensor_parallel_size", tp)
    else:
        d.approximate("infer", "vllm_tensor_parallel_size", tp, option="tensor_parallel_size", option_value=1,
                      note=f"vLLM runs on one device here; TP={tp} splits each GEMM's reduction (different "
                           f"rounding): add `,tensor_parallel_size={tp}` on a machine with {tp} GPUs")
    seqs = v["per_device_train_batch_size"] * tp * v["steps_per_generation"]
    d.reproduce("infer", "vllm_colocate.max_num_seqs", seqs, "max_num_seqs", seqs,
                note="per_device_train_batch_size x vllm_tensor_parallel_size x steps_per_generation "
                     f"(grpo_trainer.py:1124-1126; steps_per_generation={v['steps_per_generation']})")
    d.reproduce("infer", "vllm_colocate.max_num_batched_tokens", 4096, "max_num_batched_tokens", 4096,
                note="fixed by TRL (generation/vllm_generation.py:359)")
    d.reproduce("infer", "vllm_colocate.logprobs_mode", "processed_logprobs", "logprobs_mode", "processed_logprobs",
                note=PROCESSED_NOTE)
    d.reproduce("infer", "vllm_colocate.dtype", "auto", "dtype", "auto",
                note="TRL passes no dtype: vLLM takes the checkpoint's; prefix caching, chunked prefill and "
                     "kv_cache_dtype are vLLM's defaults too")
    if v["vllm_max_model_length"] is not None:
        d.reproduce("infer", "vllm_max_model_length", v["vllm_max_model_length"], "max_model_len",
                    v["vllm_max_model_length"])
    else:
        _as_default(d, "infer", "vllm_max_model_length", None, "vLLM takes the model's context length")
    _memory(d, v["vllm_gpu_memory_utilization"], machine)
    _eager(d, "vllm_colocate.enforce_eager", machine)
    _colocate_rest(d, v)


def _colocate_rest(d: Deriving, v: dict[str, Any]) -> None:
    d.approximate("infer", "vllm_colocate.distributed_executor_backend", "external_launcher",
                  note="one engine per trainer rank, launched by torchrun/accelerate (vllm_generation.py:355); "
                       "the replay runs vLLM's own executor over the same kernels")
    impl = v["vllm_model_impl"]
    if impl == "vllm":
        _as_default(d, "infer", "vllm_model_impl", impl, "vLLM's default picks its own implementation too")
    else:
        d.cannot("infer", "vllm_model_impl", impl, "mismatch's vllm engine has no model_impl option: vLLM's own "
                 "implementation of the model is replayed, not transformers'")
    if v["vllm_enable_sleep_mode"]:
        d.approximate("infer", "vllm_enable_sleep_mode", True,
                      note="sleep level 2 drops the weights between generations and TRL pushes the trainer's again "
                           "(vllm_generation.py:365-368); the replay loads the checkpoint once")


def _server(d: Deriving, v: dict[str, Any], machine: Machine) -> None:
    d.approximate("infer", "vllm_mode", "server", option="logprobs_mode", option_value="processed_logprobs",
                  note="the server's engine args are its own command line (trl vllm-serve / vllm serve), not this "
                       "config: vLLM's defaults with trl vllm-serve's processed log-probs are replayed. Pass the "
                       "server's flags as spec options (e.g. `,tensor_parallel_size=2`), or --infer "
                       "http://HOST:PORT to score with the server itself. " + PROCESSED_NOTE)
    _eager(d, "vllm_server.enforce_eager", machine)  # trl vllm-serve: enforce_eager=False (vllm_serve.py:142-143)


def _memory(d: Deriving, fraction: float, machine: Machine) -> None:
    if machine.gpus > 0:
        d.reproduce("infer", "vllm_gpu_memory_utilization", fraction, "gpu_memory_utilization", fraction)
    else:
        d.approximate("infer", "vllm_gpu_memory_utilization", fraction,
                      note="the KV-cache size (preemption, batch composition); on CPU mismatch's 2 GiB KV cache")


def _eager(d: Deriving, key: str, machine: Machine) -> None:
    if machine.gpus > 0:
        d.reproduce("infer", key, False, "enforce_eager", False, note="CUDA graphs, as TRL leaves vLLM's default")
    else:
        d.approximate("infer", key, False, option="enforce_eager", option_value=True, note="no CUDA graphs on CPU")


def _sampler(d: Deriving, v: dict[str, Any]) -> None:
    """The sampling params TRL passes (vllm_generation.py:617-625, 662-672; GenerationConfig at
    grpo_trainer.py:1155-1173), generation_kwargs overriding them."""
    extra = dict(v["generation_kwargs"] or {})
    for name in SAMPLER_KEYS:
        key = f"generation_kwargs.{name}" if name in extra else name
        value = extra.pop(name, v[name])
        if name in ("min_p", "repetition_penalty") and value not in (None, 0, 0.0, 1.0):
            d.cannot("infer", key, value, f"mismatch replays temperature, top-k and top-p only; {name} is not "
                     "replayed, so processed log-probs differ where it changes the distribution")
        else:
            d.approximate("infer", key, value, note=SAMPLER_NOTE)
    scored = {key: value for key, value in extra.items() if key not in UNSCORED_KWARGS}
    if scored:
        d.cannot("infer", "generation_kwargs", scored,
                 "passed to the sampler as given; mismatch replays temperature, top-k and top-p only")


__all__ = ["DEFAULTS", "KINDS", "RELEASE", "Read", "derive", "read_config"]
