"""prime-rl: a trainer TOML (`uv run trainer @ train.toml`) or an rl TOML (`uv run rl @ rl.toml`: [trainer],
[orchestrator], [inference]) as the trainer's forward (an hf spec) and its vLLM server (a vllm spec).

Read from prime-rl at commit 559b44772e471d1538537b8805cc77f3824a5e64 (no release on the package index);
`configs/X.py` is packages/prime-rl-configs/src/prime_rl/configs/X.py, other paths are under src/prime_rl/.
The trainer scores no old log-probs of its own (its ratio is against the sampler's, trainer/rl/train.py:342,
:461-464): the train side is its one forward per micro-batch. It has no tensor parallelism (ModelConfig: cp, ep).
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mismatch.errors import SpecError
from mismatch.frameworks.configs.loading import text, toml_table
from mismatch.frameworks.configs.derived import Derived, Deriving, Machine, Setting, Side

RELEASE = "559b44772e471d1538537b8805cc77f3824a5e64"
SUBSET = f"built-in subset of prime-rl {RELEASE[:12]}'s keys (prime-rl not installed)"
OWN = "prime-rl (installed)"
DTYPES = ("bfloat16", "float32")
# The keys mapped, under their table, with the release's defaults and kinds (a tuple: a Literal's values; a
# frozenset: a table's `type`). The subset ignores other keys; prime-rl refuses them (BaseConfig extra="forbid",
# pydantic_config cli.py:95-97) except in [inference.vllm] (extra="allow", configs/inference.py:55).
TRAINER: dict[str, tuple[Any, Any]] = {  # configs/trainer.py, line:
    "model.optimization_dtype": ("float32", DTYPES), "model.reduce_dtype": ("float32", DTYPES),  # :233, :236
    "model.attn": ("auto", ("flash_attention_2", "flash_attention_3", "flash_attention_4", "auto")),  # :22, :185
    "model.impl": ("auto", ("hf", "custom", "auto")), "model.seq_len": (2048, "int"),  # :230, :182
    "model.cp": (1, "int"), "model.cp_style": ("ring", ("ring", "ulysses")),  # :224, :227
    "model.ep": ("auto", "int|auto"),  # :212
    "model.fused_lm_head_token_chunk_size": (8192, "int|disabled"),  # :262
    "model.moe_router_dtype": ("float32", DTYPES), "model.compile": (True, "on"),  # :239, :188 (on unless "None")
    "model.quantization": (None, frozenset({"fp8", "mxfp8"})), "model.lora": (None, "lora"),  # :248, :256 (:104, :107)
    "matmul_precision": ("high", ("highest", "high", "medium")), "enable_router_replay": (False, "bool"),  # :631, :637
}
INFERENCE: dict[str, tuple[Any, Any]] = {  # configs/inference.py, line:
    "vllm.dtype": ("auto", ("auto", "float16", "bfloat16", "float32")), "vllm.max_model_len": (None, "int?"),  # :60 :63
    "vllm.enforce_eager": (False, "bool"), "vllm.rope_scaling": (None, "any?"),  # :66, :81
    "vllm.tensor_parallel_size": (1, "int"), "vllm.data_parallel_size": (1, "int"),  # :84, :87
    "vllm.seed": (0, "int"),  # :99
    "vllm.gpu_memory_utilization": (0.9, "float"), "vllm.enable_prefix_caching": (None, "bool?"),  # :102, :105
    "vllm.quantization": (None, "str?"), "vllm.enable_lora": (False, "bool"),  # :108, :111
    "vllm.enable_expert_parallel": (False, "bool"), "vllm.enable_return_routed_experts": (False, "bool"),  # :129, :141
    "enable_fp32_lm_head": (True, "bool"), "enable_fp32_router_logits": (True, "bool"),  # :466, :469
    "kv_cache_offload": (None, frozenset({"native", "mooncake"})),  # :460
}
ORCHESTRATOR: dict[str, tuple[Any, Any]] = {  # configs/orchestrator.py:520, :47, :55
    "seq_len": (2048, "int"), "train.sampling.temperature": (1.0, "float"), "train.sampling.extra_body": ({}, "dict")}
DEPLOYMENT: dict[str, tuple[Any, Any]] = {  # configs/rl.py:294 (:178, :198), :173, :183
    "type": ("single_node", ("single_node", "multi_node")), "gpus_per_node": (8, "int"), "num_infer_gpus": (1, "int")}
# VllmConfig's typed fields (configs/inference.py:57-141); any other [inference.vllm] key passes to vLLM.
VLLM_TYPED = frozenset({key.removeprefix("vllm.") for key in INFERENCE if key.startswith("vllm.")} | {
    "model", "trust_remote_code", "chat_template", "tool_call_parser", "reasoning_parser", "data_parallel_size_local",
    "data_parallel_rpc_port", "api_server_count", "max_loras", "max_cpu_loras", "max_lora_rank", "lora_target_modules",
    "all2all_backend", "enable_eplb", "enable_dbo"})
# vLLM args that are options of mismatch's vllm engine under the same name.
ENGINE_ARGS = ("max_model_len", "enable_prefix_caching", "seed", "logprobs_mode", "max_num_seqs",
               "max_num_batched_tokens", "enable_chunked_prefill", "kv_cache_dtype", "kv_cache_memory_bytes")
# Sampling args that change which tokens come out, not a scored token's log-prob.
UNSCORED = frozenset({"return_token_ids", "skip_special_tokens", "stop", "stop_token_ids", "ignore_eos", "n",
                      "min_tokens", "max_tokens", "seed", "logprobs", "top_logprobs", "include_stop_str_in_output"})
SAMPLER_NOTE = ("the engine replay scores raw log-probs; the sampler's processing is replayed from each rollout's "
                "meta.sampler")


@dataclass(kw_only=True, slots=True, frozen=True)
class Read:
    """The config as prime-rl sees it: each mapped key's effective value under its own name."""

    loader: str
    kind: str             # "rl" or "trainer"
    has_inference: bool   # an rl config's [inference]: the rl entrypoint starts the server
    values: dict[str, Any]

    def tkey(self, key: str) -> str:
        return f"trainer.{key}" if self.kind == "rl" else key

    def trainer(self, key: str) -> Any:
        return self.values[self.tkey(key)]


def derive(path: Path, machine: Machine) -> Derived:
    """The hf spec prime-rl's trainer forward is, and the vllm spec of its inference server."""
    read = read_config(path)
    d = Deriving(framework="prime-rl", file=str(path), loader=read.loader)
    raw = toml_table(text(path, "prime-rl"), path, "prime-rl")
    model = raw.get("model") or (raw.get("trainer") or {}).get("model") or {}  # [model] name (configs/model.py)
    d.model = model.get("name") if isinstance(model, dict) and isinstance(model.get("name"), str) else None
    _train(d, read, machine)
    _infer(d, read, machine)
    return d.derived()


def read_config(path: Path) -> Read:
    """The file read with prime-rl's own config classes where they import, else the built-in subset."""
    # prime-rl's loader reads TOML with tomli (pydantic_config cli.py:411-419)
    raw = toml_table(text(path, "prime-rl"), path, "prime-rl")
    kind = "rl" if {"trainer", "orchestrator", "inference"} & raw.keys() else "trainer"
    for section in ("trainer", "orchestrator") if kind == "rl" else ():  # required (configs/rl.py:230, :232)
        if not isinstance(raw.get(section), dict):
            raise SpecError(f"{path}: {section}: an rl config needs a [{section}] table (prime-rl refuses it)")
    data = _propagated(path, raw) if kind == "rl" else {"trainer": raw}
    try:
        loader, trainer, inference = _own(path, data, kind)
    except ImportError:  # the usual case: mismatch's venv has no prime-rl
        loader, trainer, inference = SUBSET, data["trainer"], data.get("inference") or {}
    values = _values(path, kind, trainer, inference)
    if kind == "rl":
        values.update(_orchestrator(path, data))
        values.update(_rl_after(path, data, values))
    return Read(loader=loader, kind=kind, has_inference=kind == "rl" and raw.get("inference") is not None,
                values=values)


def _values(path: Path, kind: str, trainer: dict[str, Any], inference: dict[str, Any]) -> dict[str, Any]:
    """The mapped keys off the file's tables (the release's defaults filling in) or off the release's
    validated config dumped whole."""
    values = _typed(path, trainer, TRAINER, "trainer." if kind == "rl" else "")
    values.update(_typed(path, inference, INFERENCE, "inference."))
    values.update(_pass_through(inference.get("vllm") or {}))
    if values["inference.kv_cache_offload"] is not None:  # configs/inference.py:517-525
        if values["inference.vllm.enable_prefix_caching"] is False:
            raise SpecError(f"{path}: inference.kv_cache_offload: needs enable_prefix_caching (prime-rl refuses it)")
        if "enable_prefix_caching" not in (inference.get("vllm") or {}):
            values["inference.vllm.enable_prefix_caching"] = True
    return values


def _own(path: Path, data: dict[str, Any], kind: str) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """[trainer] and [inference] validated by prime-rl's classes and dumped whole. An rl config's sections
    get the classes RLConfig gives them (configs/rl.py:230, :234), not RLConfig, which needs verifiers."""
    import pydantic
    from prime_rl.configs.inference import InferenceConfig  # ImportError: prime-rl not installed
    from prime_rl.configs.trainer import TrainerConfig

    section = "trainer" if kind == "rl" else ""
    try:  # as the trainer's `cli(TrainerConfig, ["@", path])` validates the file's table
        trainer = TrainerConfig.model_validate(data["trainer"]).model_dump()
        section = "inference"
        inference = InferenceConfig.model_validate(data.get("inference") or {}).model_dump()
    except pydantic.ValidationError as exc:
        error = exc.errors()[0]
        key = ".".join(str(part) for part in (section, *error["loc"]) if part != "")
        raise SpecError(f"{path}: {key or 'config'}: {error['msg']} (prime-rl refuses it)") from None
    if kind == "trainer":
        return f"{OWN}: prime_rl.configs.trainer.TrainerConfig", trainer, inference
    return (f"{OWN}: TrainerConfig and InferenceConfig on [trainer] and [inference]; [orchestrator] and the shared "
            "keys by the built-in subset (RLConfig needs verifiers)"), trainer, inference


def _propagated(path: Path, raw: dict[str, Any]) -> dict[str, Any]:
    """RLConfig's shared `seq_len` into both sections that do not set it, and its refusal of differing
    values (configs/rl.py:379-386; utils/validation.py:51-65, :135, :181-189)."""
    if raw.get("seq_len") is None:
        return raw
    data = copy.deepcopy(raw)
    for section, table in (("trainer.model", data["trainer"].setdefault("model", {})),
                           ("orchestrator", data["orchestrator"])):
        if not isinstance(table, dict):
            raise SpecError(f"{path}: {section}: expected a table, got {table!r}")
        if table.get("seq_len") is not None and table["seq_len"] != raw["seq_len"]:
            raise SpecError(f"{path}: seq_len: set, and {section}.seq_len differs (prime-rl refuses it)")
        table.setdefault("seq_len", raw["seq_len"])
    return data


def _typed(path: Path, table: dict[str, Any], fields: dict[str, tuple[Any, Any]], prefix: str) -> dict[str, Any]:
    """Each key's value converted as pydantic would, or the release's default; one SpecError (file, key)
    for a value of the wrong type."""
    values = {}
    for key, (default, kind) in fields.items():
        node, parts = table, key.split(".")
        for depth, part in enumerate(parts):
            if node is not KeyError and not isinstance(node, dict):
                raise SpecError(f"{path}: {prefix}{'.'.join(parts[:depth])}: expected a table, got {node!r}")
            node = KeyError if node is KeyError else node.get(part, KeyError)
        try:
            values[prefix + key] = default if node is KeyError else convert(kind, default, node)
        except (TypeError, ValueError) as exc:
            raise SpecError(f"{path}: {prefix}{key}: {exc}") from None
    return values


def convert(kind: Any, default: Any, value: Any) -> Any:
    """A TOML value as the release's field takes it; "None" is null (pydantic_config cli.py:99-108)."""
    if value is None or value == "None":
        if kind == "on" or default is None:  # the Optional fields: default None, or compile's
            return False if kind == "on" else None
        raise TypeError("expected a value, got None")
    if isinstance(kind, frozenset):
        if not isinstance(value, dict) or value.get("type") not in kind:
            raise ValueError(f"expected a table whose type is one of {', '.join(sorted(kind))}, got {value!r}")
        return value["type"]
    if isinstance(kind, tuple):
        if value not in kind:
            raise ValueError(f"expected one of {', '.join(map(repr, kind))}, got {value!r}")
        return value
    base = kind.removesuffix("?")
    if base in ("int|auto", "int|disabled"):
        return value if value == base.partition("|")[2] else _number("int", value)
    if base in ("int", "float"):
        return _number(base, value)
    if base == "bool":
        return _bool(value)
    if base in ("str", "dict", "on", "lora") and not isinstance(value, str if base == "str" else dict):
        raise TypeError(f"expected {'a string' if base == 'str' else 'a table'}, got {value!r}")
    if base == "lora":
        return {"rank": _number("int", value.get("rank", 16)), "alpha": _number("float", value.get("alpha", 32.0))}
    return True if base == "on" else value


def _number(kind: str, value: Any) -> int | float:
    """pydantic's lax number: an int (or an integral float) for int, any number for float, or its text."""
    if isinstance(value, str):
        try:
            value = int(value) if kind == "int" else float(value)
        except ValueError:
            pass
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            kind == "int" and isinstance(value, float) and not value.is_integer()):
        raise TypeError(f"expected {'an integer' if kind == 'int' else 'a number'}, got {value!r}")
    return int(value) if kind == "int" else float(value)


def _bool(value: Any) -> bool:
    """pydantic's lax bool: true/false, 0/1 and its words."""
    word = str(value).lower() if isinstance(value, (str, int)) else None
    if word in ("0", "off", "f", "false", "n", "no", "1", "on", "t", "true", "y", "yes"):
        return word in ("1", "on", "t", "true", "y", "yes")
    raise TypeError(f"expected true or false, got {value!r}")


def _pass_through(vllm: dict[str, Any]) -> dict[str, Any]:
    """[inference.vllm]'s untyped keys as VllmConfig hands them to vLLM: kebab-case to snake_case, text
    JSON-parsed (configs/inference.py:144-161), nulls dropped (:601-603); processed log-probs unless
    `logprobs_mode` is set (:611-613)."""
    extra = {}
    for key, value in vllm.items():
        if key not in VLLM_TYPED:
            try:
                value = json.loads(value) if isinstance(value, str) else value
            except json.JSONDecodeError:
                pass
            extra[key.replace("-", "_")] = value
    extra = {key: value for key, value in extra.items() if value is not None and value != "None"}
    return {"inference.vllm.logprobs_mode": extra.pop("logprobs_mode", "processed_logprobs"),
            "inference.vllm.extra": extra}


def _orchestrator(path: Path, data: dict[str, Any]) -> dict[str, Any]:
    """[orchestrator]'s seq_len and each train env's sampling: its own keys over the group's
    (configs/orchestrator.py:280-289), top_k -1, min_p 0 and return_token_ids unless set (:647-654)."""
    orch = data["orchestrator"]
    values = _typed(path, orch, ORCHESTRATOR, "orchestrator.")
    values.update(_typed(path, data.get("deployment") or {}, DEPLOYMENT, "deployment."))
    group = {"temperature": (values["orchestrator.train.sampling.temperature"], "float"),
             "extra_body": (values["orchestrator.train.sampling.extra_body"], "dict")}
    sources, envs = orch.get("train", {}).get("source", []), []  # a table: `train` checked by _typed
    for index, source in enumerate(sources if isinstance(sources, list) else [None]):
        if not isinstance(source, dict) or not isinstance(source.get("sampling", {}), dict):
            raise SpecError(f"{path}: orchestrator.train.source: expected an array of tables, got {sources!r}")
        name = str(source.get("name") or f"#{index}")
        own = _typed(path, source.get("sampling", {}), group, at := f"orchestrator.train.source[{name}].sampling.")
        envs.append({"name": name, "temperature": own[at + "temperature"],
                     "extra_body": {"top_k": -1, "min_p": 0.0, "return_token_ids": True, **own[at + "extra_body"]}})
    values["orchestrator.train.source"] = envs
    return values


def _rl_after(path: Path, data: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
    """RLConfig's after-validators on mapped inference keys: LoRA (configs/rl.py:576-578), router replay
    (:588-597), data-parallel replicas from [deployment] (:666-673 on one node, :735-742 on many)."""
    if data.get("inference") is None:
        return {}
    out: dict[str, Any] = {"inference.vllm.enable_lora": True} if values["trainer.model.lora"] is not None else {}
    out.update({"inference.vllm.enable_return_routed_experts": True} if values["trainer.enable_router_replay"] else {})
    tp, dp = values["inference.vllm.tensor_parallel_size"], values["inference.vllm.data_parallel_size"]
    gpus, per_node = values["deployment.num_infer_gpus"], values["deployment.gpus_per_node"] // max(tp, 1)
    if values["deployment.type"] == "single_node" and gpus != dp * tp:
        if gpus % tp:
            raise SpecError(f"{path}: deployment.num_infer_gpus ({gpus}) must be divisible by "
                            f"inference.vllm.tensor_parallel_size ({tp}), as prime-rl asserts (configs/rl.py:670)")
        out["inference.vllm.data_parallel_size"] = gpus // tp
    elif values["deployment.type"] == "multi_node" and dp == 1 and per_node > 1 \
            and not values["inference.vllm.enable_expert_parallel"]:
        out["inference.vllm.data_parallel_size"] = per_node
    return out


def _train(d: Deriving, r: Read, machine: Machine) -> None:
    key, weights = r.tkey("model.optimization_dtype"), r.trainer("model.optimization_dtype")
    if weights == "bfloat16":
        d.reproduce("train", key, weights, "dtype", "bfloat16",
                    note="bf16 weights (trainer/model.py:1332), computing in bf16 (MixedPrecisionPolicy, :824)")
    else:
        d.approximate("train", key, weights, option="dtype", option_value="bfloat16",
                      note="prime-rl keeps fp32 master weights (trainer/model.py:1332) and FSDP2 casts them to bf16 "
                           "for each forward (MixedPrecisionPolicy(param_dtype=bfloat16), :824); hf loads the "
                           "checkpoint in bf16: the same weights where it is saved in bf16")
    _default(d, "train", r.tkey("model.reduce_dtype"), r.trainer("model.reduce_dtype"),
             "the gradients' all-reduce dtype (trainer/model.py:824): no part of the forward")
    impl = r.trainer("model.attn")
    what = "auto: FA4 on SM100, FA3 on SM90, else FA2 (trainer/model.py:1293-1311)" if impl == "auto" else impl
    if impl == "flash_attention_2" and machine.flash_attn:
        d.reproduce("train", r.tkey("model.attn"), impl, "attn", impl)
    else:
        d.approximate("train", r.tkey("model.attn"), impl, option="attn",
                      option_value="flash_attention_2" if machine.flash_attn else "sdpa",
                      note=f"{what}; " + ("flash-attn 2 here (other kernels)" if machine.flash_attn else
                                          "flash-attn needs CUDA and the flash_attn package; sdpa here"))
    d.reproduce("train", "micro_batches", "packed", "packing", "varlen",
                note="whole samples in one row, positions restarting per sample (trainer/batch.py:545-617, :803-805)")
    key = "orchestrator.seq_len" if r.kind == "rl" else "model.seq_len"
    # trainer/batch.py:637-665: first-fit-decreasing under the orchestrator's seq_len (orchestrator/
    # packing.py:28-35); the rows split for several data-parallel ranks (:667-689) are not one replay's.
    d.reproduce("train", "packer", "first-fit-decreasing", "balance", "first_fit", note="on one data-parallel rank")
    if r.kind == "rl":
        d.reproduce("train", key, r.values[key], "batch_tokens", r.values[key])
    else:
        d.approximate("train", key, r.values[key], option="batch_tokens", option_value=r.values[key],
                      note="the orchestrator's seq_len (its own config, at most this) packs the rows")
    _temperature(d, r)
    _parallel(d, r)
    _kernels(d, r)


def _default(d: Deriving, side: Side, key: str, value: Any, note: str) -> None:
    # a key reproduced by the engine's own default: no option to set
    d.settings.append(Setting(side=side, key=key, value=value, status="reproduced", option=None, note=note))


def _envs(r: Read) -> list[tuple[str, dict[str, Any]]]:
    """(key prefix, sampling) of each train env, or one for all where they sample alike."""
    envs = r.values["orchestrator.train.source"] or [
        {"name": "", "temperature": r.values["orchestrator.train.sampling.temperature"],
         "extra_body": r.values["orchestrator.train.sampling.extra_body"]}]
    if len({json.dumps([env["temperature"], env["extra_body"]], sort_keys=True) for env in envs}) == 1:
        return [("orchestrator.train.sampling", envs[0])]
    return [(f"orchestrator.train.source[{env['name']}].sampling", env) for env in envs]


def _temperature(d: Deriving, r: Read) -> None:
    """The trainer divides each token's logits by its env's sampling temperature, sent with the micro-batch
    (orchestrator/train_sink.py:255-264; trainer/rl/train.py:415-442)."""
    if r.kind == "trainer":
        d.approximate("train", "temperature", None, option="temperature", option_value=1.0,
                      note="the orchestrator's sampling temperature comes with each micro-batch "
                           "(orchestrator/train_sink.py:255-264), not in a trainer config: add `,temperature=T`")
        return
    temps = {prefix: env["temperature"] for prefix, env in _envs(r)}
    if len(set(temps.values())) > 1 or min(temps.values()) <= 0:  # 0: greedy, and the trainer divides by it
        d.cannot("train", "orchestrator.train.source[*].sampling.temperature", temps,
                 "each env's tokens are scaled by its own temperature; hf takes one above 0: audit each env's "
                 "rollouts with `,temperature=T`")
        return
    prefix, t = next(iter(temps.items()))
    d.reproduce("train", f"{prefix}.temperature", t, "temperature", t,
                note="logits / T in fp32 before the log-softmax (models/layers/lm_head.py:54, :135; the vanilla head: "
                     "trainer/rl/train.py:441)")


def _parallel(d: Deriving, r: Read) -> None:
    cp, style, ep = r.trainer("model.cp"), r.trainer("model.cp_style"), r.trainer("model.ep")
    if cp > 1:
        how = "ring attention merges partial softmaxes" if style == "ring" else "ulysses all-to-alls the heads"
        d.approximate("train", r.tkey("model.cp"), cp, note=f"hf runs each packed row whole on one device; CP={cp} "
                      f"splits it over {cp} GPUs (trainer/rl/train.py:383-399): {how} (different rounding)")
    if ep != 1:
        d.approximate("train", r.tkey("model.ep"), ep,
                      note="MoE only (auto: min(FSDP group, 8) ranks, configs/trainer.py:212-213): experts sharded "
                           "over ranks, tokens sent all-to-all, each expert GEMM over other rows than hf's; no effect "
                           "on a dense model")


def _kernels(d: Deriving, r: Read) -> None:
    impl, chunk = r.trainer("model.impl"), r.trainer("model.fused_lm_head_token_chunk_size")
    if impl == "hf":
        _default(d, "train", r.tkey("model.impl"), impl, "transformers' model, as hf runs")
    else:
        (d.cannot if impl == "custom" else d.approximate)(
            "train", r.tkey("model.impl"), impl, ("" if impl == "custom" else "custom where prime-rl has the "
            "architecture, else hf: ") + "prime-rl's own modeling code (trainer/models/, trainer/model.py:725-758); "
            "hf runs transformers'")
    if r.trainer("model.compile"):
        d.cannot("train", r.tkey("model.compile"), True, "torch.compile of each transformer block "
                 "(trainer/model.py:1396-1397): inductor fuses norms and pointwise ops (other rounding); hf runs eager")
    if chunk == "disabled":
        _default(d, "train", r.tkey("model.fused_lm_head_token_chunk_size"), chunk,
                 "the vanilla LM head: fp32 logits / T, log-softmax (trainer/rl/train.py:436-442), as hf's")
    else:
        d.approximate("train", r.tkey("model.fused_lm_head_token_chunk_size"), chunk,
                      note=f"the fused LM head (models/layers/lm_head.py:89-156): {chunk} tokens at a time, a bf16 "
                           "GEMM per 8192-wide vocabulary tile upcast to fp32 and folded by an online log-sum-exp; hf "
                           "projects `chunk` rows and runs a full-vocabulary fp32 log-softmax (last-bit differences)")
    for key, note in (("model.quantization", "FP8 / MXFP8 training GEMMs (trainer/model.py:1197); hf's are bf16"),
                      ("model.lora", "prime-rl adds LoRA adapters to the frozen weights; the replay runs the "
                                     "checkpoint's weights: audit a merged checkpoint")):
        if r.trainer(key) is not None:
            d.cannot("train", r.tkey(key), r.trainer(key), note)
    for key, off, note in (("model.moe_router_dtype", "bfloat16", "fp32 MoE gates (model.impl=custom, trainer/model.py"
                            ":863-872); hf's router runs in the model's dtype; no effect on a dense model"),
                           ("matmul_precision", "highest", "fp32 matmuls in TF32 (high) or bf16 (medium) "
                            "(trainer/rl/train.py:120): the fp32 MoE gates only; hf's run at torch's default")):
        if r.trainer(key) != off:
            d.approximate("train", r.tkey(key), r.trainer(key), note=note)
    if r.trainer("enable_router_replay"):
        d.reproduce("train", r.tkey("enable_router_replay"), True, "routing", "replay",
                    note="the trainer forces the experts vLLM routed to (trainer/rl/train.py:349-360); the replay "
                         "forces those recorded with each rollout")


def _infer(d: Deriving, r: Read, machine: Machine) -> None:
    """vLLM as prime-rl's server starts it: `vllm serve` with InferenceConfig.to_namespace()
    (inference/vllm/server.py:224-228; configs/inference.py:590-629)."""
    v = {key.removeprefix("inference."): value for key, value in r.values.items() if key.startswith("inference.")}
    how = ("the rl entrypoint serves vLLM behind its router (configs/inference.py:440), the orchestrator sending "
           "requests concurrently" if r.has_inference else "the server is started apart, with args this config "
           "does not hold (configs/rl.py:234-235): prime-rl's InferenceConfig defaults are replayed")
    d.approximate("infer", "inference", "vllm serve" if r.has_inference else None,
                  note=f"{how}; the replay runs vLLM in-process with those engine args (other batch compositions). "
                       "Pass --infer http://HOST:PORT to score with the server itself")
    d.reproduce("infer", "inference.vllm.dtype", v["vllm.dtype"], "dtype", v["vllm.dtype"])
    extra = dict(v["vllm.extra"])
    for option, size in (("tensor_parallel_size", v["vllm.tensor_parallel_size"]),
                         ("pipeline_parallel_size", extra.pop("pipeline_parallel_size", None))):
        if size is not None and (size == 1 or machine.gpus >= size):
            d.reproduce("infer", f"inference.vllm.{option}", size, option, size)
        elif size is not None:
            d.approximate("infer", f"inference.vllm.{option}", size, option=option, option_value=1,
                          note=f"vLLM runs on one device here; {size} ranks split each GEMM's reduction (different "
                               f"rounding): add `,{option}={size}` on a machine with {size} GPUs")
    for name, cpu, note in (("enforce_eager", True, "no CUDA graphs on CPU"), ("gpu_memory_utilization", None,
                             "the KV-cache size (preemption, batch composition); on CPU mismatch's 2 GiB KV cache")):
        if machine.gpus > 0 or v[f"vllm.{name}"] is True:
            d.reproduce("infer", f"inference.vllm.{name}", v[f"vllm.{name}"], name, v[f"vllm.{name}"])
        else:
            d.approximate("infer", f"inference.vllm.{name}", v[f"vllm.{name}"], option=name if cpu else None,
                          option_value=cpu, note=note)
    for name in ENGINE_ARGS:
        value = v.get(f"vllm.{name}", extra.pop(name, None))
        if value is not None:
            d.reproduce("infer", f"inference.vllm.{name}", value, name, value,
                        note=PROCESSED_NOTE if value == "processed_logprobs" else "")
        elif name in ("max_model_len", "enable_prefix_caching"):
            _default(d, "infer", f"inference.vllm.{name}", None, "vLLM's default")
    _infer_rest(d, v, extra)
    _sampler(d, r)


PROCESSED_NOTE = ("prime-rl's default unless set (configs/inference.py:611-613); vLLM's prompt log-probs are raw in "
                  "either mode, and the sampler's processing is replayed from each rollout's meta.sampler")


def _infer_rest(d: Deriving, v: dict[str, Any], extra: dict[str, Any]) -> None:
    """The server's keys that no option of mismatch's vllm engine reproduces."""
    if v["vllm.data_parallel_size"] > 1:
        d.approximate("infer", "inference.vllm.data_parallel_size", v["vllm.data_parallel_size"],
                      note="each replica batches its own share of the requests; the replay runs one engine")
    for key, note in (("vllm.quantization", "online quantization; the replay runs the checkpoint's weights as saved"),
                      ("vllm.rope_scaling", "a RoPE scaling override; the replay runs the checkpoint's own"),
                      ("vllm.enable_lora", "vLLM applies the trainer's LoRA adapter; the replay runs the checkpoint"),
                      ("enable_fp32_lm_head", "prime-rl's patch computes vLLM's LM head as a bf16 x bf16 -> fp32 GEMM "
                                              "(inference/patches.py:658-718); the replay's runs in the model's dtype"),
                      ("kv_cache_offload", "KV blocks offloaded and read back by a connector; the replay has none")):
        if v[key] not in (None, False):
            d.cannot("infer", f"inference.{key}", v[key], note)
    for key, note in (("vllm.enable_expert_parallel", "experts sharded over the DP ranks, tokens sent all-to-all"),
                      ("enable_fp32_router_logits", "fp32 router logits, DeepSeek-family gates only "
                                                    "(configs/inference.py:469-470)")):
        if v[key]:
            d.approximate("infer", f"inference.{key}", True,
                          note=f"{note}; the replay runs vLLM's own MoE; no effect on a dense model")
    if extra:
        d.cannot("infer", "inference.vllm", extra, "passed to vllm serve as given and no option of mismatch's vllm "
                 "engine: not replayed (no matter where it does not change the computation)")


def _sampler(d: Deriving, r: Read) -> None:
    """Each train env's sampling args: temperature, top_p 1.0 (configs/orchestrator.py:58-70) and extra_body
    (top_k -1 and min_p 0 unless set, :647-654)."""
    if r.kind == "trainer":
        d.approximate("infer", "orchestrator.train.sampling", None, note="not in a trainer config; " + SAMPLER_NOTE)
        return
    for prefix, env in _envs(r):
        d.approximate("infer", f"{prefix}.temperature", env["temperature"], note=SAMPLER_NOTE)
        body = {key: value for key, value in env["extra_body"].items() if key not in UNSCORED}
        for name in ("top_k", "min_p"):  # a min_p above 0 stays in `body`: not replayed
            if name in body and (name == "top_k" or body[name] == 0):
                d.approximate("infer", f"{prefix}.extra_body.{name}", body.pop(name), note=SAMPLER_NOTE)
        if body:
            d.cannot("infer", f"{prefix}.extra_body", body, "sent to the sampler as given; mismatch replays "
                     "temperature, top-k and top-p only")
    d.approximate("infer", "orchestrator.train.sampling.top_p", 1.0,
                  note="fixed by prime-rl (configs/orchestrator.py:62); " + SAMPLER_NOTE)
