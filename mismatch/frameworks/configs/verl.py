"""verl: the trainer's old-log-prob forward and the vLLM rollout server, as its PPO config sets them.

The file is a verl config: the composed YAML Hydra saves (`outputs/.../.hydra/config.yaml`), a YAML
of overrides on top of the release's default, or the run script's command line
(`python3 -m verl.trainer.main_ppo key=value ...`). With verl and omegaconf installed it is read
the release's way: OmegaConf merges it into the release's own generated default
(verl/trainer/config/_generated_ppo_trainer.yaml, or _generated_ppo_megatron_trainer.yaml) in
struct mode, so a key verl does not have is refused as verl refuses it, and the `${oc.select:...}`
interpolations resolve as verl's do. Without them, the keys below are read from the file with
verl 0.9.1's defaults (DEFAULTS), and other keys are ignored.

Read from verl 0.9.1 (PyPI wheel; verl-project/verl): what the old-log-prob forward does is in
workers/engine_workers.py (the micro-batch settings it hands the engine), workers/engine/utils.py
(prepare_micro_batches) and workers/engine/fsdp/transformer_impl.py (dtype, packing, temperature);
the vLLM server's engine args in workers/rollout/vllm_rollout/vllm_async_server.py:325-349.
A run script's overrides are read by hydra_overrides.py (`model_engine=megatron` selects Megatron's
defaults, as verl's defaults list does); router replay (workers/config/engine.py:55-71) becomes
routing=replay; rollout_correction.bypass_mode (trainer/config/algorithm.py:127-131) makes the
train side the policy update's forward, said first (verl never recomputes old log-probs then).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import re
from pathlib import Path
from typing import Any

from mismatch.errors import SpecError
from mismatch.frameworks.configs.derived import Derived, Deriving, Machine, Side
from mismatch.frameworks.configs.hydra_overrides import ENGINE_STRATEGY, GROUP_CHOICES, from_overrides
from mismatch.frameworks.configs.kinds import verl_yaml_or_refused
from mismatch.frameworks.configs.loading import text, yaml_value

NAME = "verl"
VERSION = "0.9.1"
ARR = "actor_rollout_ref"
ROLLOUT = f"{ARR}.rollout"
ACTOR = f"{ARR}.actor"

# verl 0.9.1's defaults for the keys read here (trainer/config/_generated_ppo_trainer.yaml, line):
# a string "${oc.select:KEY,DEFAULT}" or "${KEY}" is the interpolation that yaml has.
DEFAULTS: dict[str, Any] = {
    f"{ACTOR}.strategy": "fsdp",                                                          # :79
    f"{ACTOR}.use_dynamic_bsz": False,                                                    # :83
    f"{ACTOR}.ppo_micro_batch_size": None,                                                # :81
    f"{ACTOR}.ppo_micro_batch_size_per_gpu": None,                                        # :82
    f"{ACTOR}.ppo_max_token_len_per_gpu": 16384,                                          # :84
    f"{ACTOR}.fsdp_config.mixed_precision": None,              # FSDPEngineConfig (workers/config/engine.py:291)
    f"{ACTOR}.fsdp_config.model_dtype": "fp32",                                           # :37
    f"{ACTOR}.fsdp_config.ulysses_sequence_parallel_size": 1,                             # :41
    f"{ACTOR}.ulysses_sequence_parallel_size": 1,                  # :178 (deprecated; the engine reads fsdp_config's)
    f"{ACTOR}.megatron.expert_model_parallel_size": 1,   # _generated_ppo_megatron_trainer.yaml
    f"{ACTOR}.megatron.router_replay.mode": "disabled",  # ibid.:85-89 (EngineRouterReplayConfig)
    f"{ACTOR}.megatron.override_transformer_config": {},  # ibid.
    f"{ARR}.model.path": "~/models/deepseek-llm-7b-chat",                                 # model/hf_model.yaml
    f"{ACTOR}.megatron.tensor_model_parallel_size": 1,   # _generated_ppo_megatron_trainer.yaml:49
    f"{ACTOR}.megatron.pipeline_model_parallel_size": 1,  # ibid.
    f"{ACTOR}.megatron.context_parallel_size": 1,         # ibid.
    f"{ACTOR}.megatron.dtype": "bfloat16",                # ibid.:84
    f"{ARR}.model.use_remove_padding": True,                                              # :446
    f"{ARR}.model.override_config": {},                                                   # :443
    f"{ARR}.model.use_fused_kernels": False,                                              # :453
    f"{ROLLOUT}.name": "???",                                                             # :293 (mandatory)
    f"{ROLLOUT}.temperature": 1.0,                                                        # :297
    f"{ROLLOUT}.top_k": -1,                                                               # :298
    f"{ROLLOUT}.top_p": 1,                                                                # :299
    f"{ROLLOUT}.seed": 42,                                                                # :301
    f"{ROLLOUT}.dtype": "bfloat16",                                                       # :304
    f"{ROLLOUT}.enforce_eager": False,                                                    # :307
    f"{ROLLOUT}.tensor_model_parallel_size": 2,                                           # :310
    f"{ROLLOUT}.max_num_batched_tokens": 8192,                                            # :314
    f"{ROLLOUT}.max_model_len": None,                                                     # :315
    f"{ROLLOUT}.max_num_seqs": 256,                                                       # :316
    f"{ROLLOUT}.enable_chunked_prefill": True,                                            # :317
    f"{ROLLOUT}.enable_prefix_caching": True,                                             # :318
    f"{ROLLOUT}.logprobs_mode": "processed_logprobs",                                     # :319
    f"{ROLLOUT}.log_prob_micro_batch_size": None,                                         # :323
    f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu": None,                                 # :324
    f"{ROLLOUT}.log_prob_use_dynamic_bsz": f"${{oc.select:{ACTOR}.use_dynamic_bsz,false}}",            # :325
    f"{ROLLOUT}.log_prob_max_token_len_per_gpu": f"${{oc.select:{ACTOR}.ppo_max_token_len_per_gpu,16384}}",  # :326
    f"{ROLLOUT}.engine_kwargs": {},                                                       # :332
    f"{ROLLOUT}.gpu_memory_utilization": 0.5,                                             # :305
    f"{ROLLOUT}.enable_rollout_routing_replay": False,                                    # :382
    "algorithm.rollout_correction.rollout_is": None,                                      # :851
    "algorithm.rollout_correction.rollout_is_threshold": 2.0,                             # :852
    "algorithm.rollout_correction.bypass_mode": False,                                    # :855
}

_SELECT = re.compile(r"^\$\{oc\.select:([^,}]+),([^}]*)\}$")
_REFERENCE = re.compile(r"^\$\{([A-Za-z0-9_.]+)\}$")



class Config:
    """The config's values by dotted key: the file's, else verl's default."""

    def __init__(self, values: dict[str, Any], defaults: dict[str, Any], file: str = "") -> None:
        self.values, self.defaults, self.file = values, defaults, file

    def get(self, key: str, seen: tuple[str, ...] = ()) -> Any:
        if key in seen:  # ${a} -> ${b} -> ${a}: OmegaConf refuses it too (InterpolationResolutionError)
            raise SpecError(f"{self.file}: {key}: the interpolation refers back to itself ({' -> '.join((*seen, key))})")
        found, value = _walk(self.values, key)
        if not found:
            value = self.defaults.get(key)
        return self._resolved(value, (*seen, key))

    def _resolved(self, value: Any, seen: tuple[str, ...]) -> Any:
        """The two interpolations verl's defaults use for these keys, as OmegaConf resolves them."""
        if not isinstance(value, str):
            return value
        if match := _SELECT.match(value):
            found, selected = _walk(self.values, match.group(1))
            return self._resolved(selected, seen) if found else _yaml_value(match.group(2))
        if match := _REFERENCE.match(value):
            return self.get(match.group(1), seen)
        if value.startswith("${") and value.endswith("}"):  # a resolver (oc.env, oc.decode...): not read here
            raise SpecError(f"{self.file}: {seen[-1] if seen else 'a key'}={value}: an interpolation the built-in reader does not "
                            "resolve; give the composed config (outputs/.../.hydra/config.yaml)")
        return value


def _walk(tree: Any, key: str) -> tuple[bool, Any]:
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return False, None
        tree = tree[part]
    return True, tree


def _yaml_value(text: str, where: str = "override") -> Any:
    return yaml_value(text.strip(), where, NAME) if text.strip() else None


def derive(path: Path, machine: Machine) -> Derived:
    config, loader = load(path)
    deriving = Deriving(framework=NAME, file=str(path), loader=loader)
    _model(config, deriving)
    _bypass(config, deriving)
    _trainer(config, deriving, machine)
    _engine(config, deriving, machine)
    return deriving.derived()


def load(path: Path) -> tuple[Config, str]:
    """The config and how it was read: the release's own OmegaConf merge where verl is installed."""
    user = _user_config(path)
    found = importlib.util.find_spec("verl")
    if found is not None and found.submodule_search_locations and importlib.util.find_spec("omegaconf"):
        version = importlib.metadata.version("verl")
        package = Path(next(iter(found.submodule_search_locations)))
        return _with_omegaconf(path, user, package), f"verl {version} (installed): OmegaConf over its default config"
    return Config(user, _defaults(user), str(path)), f"built-in subset of verl {VERSION}'s keys (verl not installed)"


def _defaults(user: dict[str, Any]) -> dict[str, Any]:
    """DEFAULTS with the `model_engine` group's choice applied: the actor's strategy it selects."""
    engine = user.get(GROUP_CHOICES, {}).get("model_engine", "dp")
    return {**DEFAULTS, f"{ACTOR}.strategy": ENGINE_STRATEGY[engine]}


def _user_config(path: Path) -> dict[str, Any]:
    """The file as a nested dict: a YAML mapping, or a command line's `key=value` overrides."""
    text = _text(path)
    try:
        loaded = yaml_value(text, path, NAME)
    except SpecError as error:
        if not text.lstrip().startswith(("python", "#", "set ", "export ", "ray ", "torchrun")) or _bounded(error):
            raise
        loaded = None  # a shell script is not YAML: read as a command line below
    if isinstance(loaded, dict):
        return verl_yaml_or_refused(path, loaded)
    return from_overrides(path, text)


def _bounded(error: SpecError) -> bool:
    return any(word in str(error) for word in ("aliases", "nested", "values with its aliases", "tag"))


def _text(path: Path) -> str:
    return text(path, NAME)


def _with_omegaconf(path: Path, user: dict[str, Any], package: Path) -> Config:
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    groups = user.pop(GROUP_CHOICES, {})
    strategy = _walk(user, f"{ACTOR}.strategy")[1] or ENGINE_STRATEGY[groups.get("model_engine", "dp")]
    name = "_generated_ppo_megatron_trainer.yaml" if strategy == "megatron" else "_generated_ppo_trainer.yaml"
    try:
        default = OmegaConf.load(package / "trainer" / "config" / name)
        OmegaConf.set_struct(default, True)  # as Hydra composes it: a key verl lacks is an error
        merged = OmegaConf.merge(default, OmegaConf.create(user))
        values = OmegaConf.to_container(merged, resolve=True)
    except OmegaConfBaseException as exc:
        raise SpecError(f"{path}: verl refuses the config: {str(exc).splitlines()[0]}") from None
    return Config(values, {}, str(path))


DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _model(config: Config, deriving: Deriving) -> None:
    """The model the config names (model/hf_model.yaml `path`), compared with the checkpoint by the audit;
    none where the file leaves verl's placeholder default."""
    found, _ = _walk(config.values, f"{ARR}.model.path")
    path = config.get(f"{ARR}.model.path") if found else None
    deriving.model = str(path) if path is not None else None


def _bypass(config: Config, deriving: Deriving) -> None:
    """rollout_correction.bypass_mode (trainer/config/algorithm.py:127-131; ray_trainer.py:1575-1583): verl
    never recomputes old log-probs, it reuses the rollout's as old_log_prob; the ratio the loss sees is the
    update forward's log-probs over the sampler's. The train side then replays the update forward."""
    level = config.get("algorithm.rollout_correction.rollout_is")
    if level in ("token", "sequence"):  # the IS weights the run logs rollout_corr/ metrics with (--for verl names)
        deriving.framework_settings = {"rollout_is": level, "rollout_is_threshold":
                                       config.get("algorithm.rollout_correction.rollout_is_threshold")}
    key = "algorithm.rollout_correction.bypass_mode"
    if config.get(key):
        deriving.bypass = True
        deriving.notice(f"bypass mode ({key}=true): verl trains on the rollout's log-probs as old log-probs and never "
                        "recomputes them; the train side replays the policy update's forward (actor.ppo_* "
                        "micro-batches), the pair the run's ratio really compares with the sampler")
        deriving.same("train", key, True, note="no old-log-prob forward in the run: the train side is the update's")


def _int(path: str, key: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError(f"{path}: {key}={value!r} is not an integer")
    return value


def _number(path: str, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value or value <= 0:
        raise SpecError(f"{path}: {key}={value!r} is not a positive number")
    return float(value)


def _trainer(config: Config, deriving: Deriving, machine: Machine) -> None:
    """The actor's compute_log_prob: engine_workers.py:616-636 hands the engine the rollout
    section's log_prob_* settings; prepare_micro_batches (engine/utils.py:92-130) cuts by them."""
    _trainer_model(config, deriving, machine)
    temperature = _number(deriving.file, f"{ROLLOUT}.temperature", config.get(f"{ROLLOUT}.temperature"))
    # ray_trainer.py:1479 puts rollout.temperature in the batch; transformer_impl.py:1386/:1483
    # divide the logits by it before the log-softmax.
    deriving.reproduce("train", f"{ROLLOUT}.temperature", temperature, "temperature", float(temperature),
                       note="the actor divides its logits by the rollout temperature")
    # The policy update's forward: the same model and scaling in the actor's own micro-batches
    # (engine_workers.py:626-628: ppo_max_token_len_per_gpu, ppo_micro_batch_size_per_gpu).
    deriving.fork("update", "train", frozenset({"micro_batch", "batch_tokens"}))
    _routing(config, deriving)
    _batches(config, deriving, "train", ROLLOUT, "log_prob_")
    _batches(config, deriving, "update", ACTOR, "ppo_")


def _trainer_model(config: Config, deriving: Deriving, machine: Machine) -> None:
    strategy = config.get(f"{ACTOR}.strategy")
    if strategy == "megatron":
        _megatron(config, deriving)
    else:
        if strategy not in ("fsdp", "fsdp2"):
            deriving.approximate("train", f"{ACTOR}.strategy", strategy,
                                 note=f"{strategy} runs verl's own model code; hf runs the transformers model")
        mixed = config.get(f"{ACTOR}.fsdp_config.mixed_precision") or {}
        # transformer_impl.py:391-403: param_dtype (bf16 when unset), and forward_step runs under
        # torch.autocast(param_dtype) (:1555-1565) unless that is fp32.
        param = str(mixed.get("param_dtype", "bf16"))
        dtype = DTYPES.get(param, param)
        # fsdp_config.model_dtype is the dtype the weights are loaded and kept in (transformer_impl.py:
        # torch_dtype=model_dtype): fp32 by default, so the "FSDP keeps fp32 weights" note holds only then.
        kept = DTYPES.get(str(config.get(f"{ACTOR}.fsdp_config.model_dtype")), "float32")
        if kept != "float32":
            deriving.approximate("train", f"{ACTOR}.fsdp_config.model_dtype",
                                 config.get(f"{ACTOR}.fsdp_config.model_dtype"),
                                 note=f"FSDP loads and keeps the weights in {kept}, not fp32")
        if dtype == "float32":
            deriving.reproduce("train", f"{ACTOR}.fsdp_config.mixed_precision.param_dtype", param, "dtype", dtype)
        else:
            deriving.approximate("train", f"{ACTOR}.fsdp_config.mixed_precision.param_dtype", param,
                                 note=f"FSDP keeps {kept} weights, casts them to {param} and runs under "
                                      f"torch.autocast; a {dtype} model here: autocast's fp32 ops run in {dtype}",
                                 option="dtype", option_value=dtype)
    _attention(config, deriving, machine)
    packed = bool(config.get(f"{ARR}.model.use_remove_padding"))
    deriving.reproduce("train", f"{ARR}.model.use_remove_padding", packed, "packing", "varlen" if packed else "pad",
                       note="sequences packed into one row, no padding" if packed else "")
    for key in (f"{ACTOR}.fsdp_config.ulysses_sequence_parallel_size", f"{ACTOR}.ulysses_sequence_parallel_size"):
        sp = config.get(key)  # fsdp_config's is the engine's (workers/config/engine.py); the other is deprecated
        if sp and sp > 1:
            deriving.approximate("train", key, sp,
                                 note="Ulysses splits each sequence's attention heads over GPUs; hf runs it whole")
            break
    if config.get(f"{ARR}.model.use_fused_kernels"):
        deriving.cannot("train", f"{ARR}.model.use_fused_kernels", True,
                        note="verl's fused linear-cross-entropy log-prob kernel; hf takes the log-softmax of full logits")


def _megatron(config: Config, deriving: Deriving) -> None:
    deriving.approximate("train", f"{ACTOR}.strategy", "megatron",
                         note="Megatron-Core with Transformer Engine kernels; hf runs the transformers model")
    dtype = str(config.get(f"{ACTOR}.megatron.dtype"))
    deriving.reproduce("train", f"{ACTOR}.megatron.dtype", dtype, "dtype", dtype)
    for name, what in (("tensor_model_parallel_size", "splits each GEMM's reduction over GPUs"),
                       ("pipeline_model_parallel_size", "splits the layers over GPUs"),
                       ("context_parallel_size", "splits each sequence's attention over GPUs"),
                       ("expert_model_parallel_size", "splits the experts over GPUs (all-to-all dispatch)")):
        size = config.get(f"{ACTOR}.megatron.{name}")
        if size and size > 1:
            deriving.approximate("train", f"{ACTOR}.megatron.{name}", size,
                                 note=f"hf runs the whole model on one device; {name}={size} {what} (other rounding)")
        else:  # listed even at 1: a Megatron run's parallel layout is on the first screen
            deriving.same("train", f"{ACTOR}.megatron.{name}", size, note="one device, as here")
    router = (config.get(f"{ACTOR}.megatron.override_transformer_config") or {}).get("moe_router_dtype")
    if router is not None:
        deriving.approximate("train", f"{ACTOR}.megatron.override_transformer_config.moe_router_dtype", router,
                             note="Megatron computes the MoE gate in this dtype; hf's router runs in the model's "
                                  "dtype (no effect on a dense model)")


def _routing(config: Config, deriving: Deriving) -> None:
    """verl's router replay (workers/config/engine.py:55-71, EngineRouterReplayConfig): R3 forces, in the
    trainer's forwards, the experts vLLM routed to (rollout.enable_rollout_routing_replay makes vLLM return
    them, vllm_async_server.py:438); R2 records the old-log-prob forward's experts and forces them in the update."""
    mode = config.get(f"{ACTOR}.megatron.router_replay.mode") or "disabled"
    returned = bool(config.get(f"{ROLLOUT}.enable_rollout_routing_replay"))
    if returned:
        deriving.same("infer", f"{ROLLOUT}.enable_rollout_routing_replay", True,
                      note="vLLM returns each token's experts with the rollout")
    if mode == "R3" or (mode == "disabled" and returned and config.get(f"{ACTOR}.strategy") != "megatron"):
        for side in ("train", "update"):
            deriving.reproduce(side, f"{ACTOR}.megatron.router_replay.mode", mode, "routing", "replay",
                               note="the trainer forces the experts vLLM routed to; the replay forces those recorded "
                                    "with each rollout")
    elif mode == "R2":
        deriving.reproduce("update", f"{ACTOR}.megatron.router_replay.mode", mode, "routing", "replay",
                           note="the update forces the experts the old-log-prob forward routed to; the replay forces "
                                "those recorded with each rollout")
        deriving.same("train", f"{ACTOR}.megatron.router_replay.mode", mode,
                      note="R2: the old-log-prob forward routes freely and records its experts")


def _attention(config: Config, deriving: Deriving, machine: Machine) -> None:
    # workers/config/model.py:185: override_config.attn_implementation, flash_attention_2 by default.
    attn = (config.get(f"{ARR}.model.override_config") or {}).get("attn_implementation", "flash_attention_2")
    key = f"{ARR}.model.override_config.attn_implementation"
    if attn == "flash_attention_2" and not machine.flash_attn:
        deriving.approximate("train", key, attn, option="attn", option_value="sdpa",
                             note="flash-attn needs CUDA and the flash_attn package; sdpa here")
    else:
        deriving.reproduce("train", key, attn, "attn", attn)


def _batches(config: Config, deriving: Deriving, side: Side, section: str, prefix: str) -> None:
    """One forward's micro-batches: `{prefix}max_token_len_per_gpu` under dynamic bsz, else
    `{prefix}micro_batch_size_per_gpu` (prepare_micro_batches, engine/utils.py:92-130)."""
    dynamic = bool(config.get(f"{ROLLOUT}.log_prob_use_dynamic_bsz"))
    if dynamic != bool(config.get(f"{ACTOR}.use_dynamic_bsz")):  # engine_workers.py:616 asserts they agree
        raise SpecError(f"{deriving.file}: {ROLLOUT}.log_prob_use_dynamic_bsz={str(dynamic).lower()} but "
                        f"{ACTOR}.use_dynamic_bsz={str(not dynamic).lower()}: verl's workers refuse the two to differ")
    if dynamic:
        key = f"{section}.{prefix}max_token_len_per_gpu"
        budget = _int(deriving.file, key, config.get(key))
        deriving.reproduce(side, key, budget, "batch_tokens", budget,
                           note="verl's balanced dynamic batch size (rearrange_micro_batches), over the whole file "
                                "rather than each GPU's share")
        return
    if config.get(f"{section}.{prefix}micro_batch_size") is not None:  # utils/config.py:150-160 refuses it
        raise SpecError(f"{deriving.file}: {section}.{prefix}micro_batch_size is deprecated and refused by verl; "
                        f"set {section}.{prefix}micro_batch_size_per_gpu")
    key = f"{section}.{prefix}micro_batch_size_per_gpu"
    if config.get(key) is None:  # utils/config.py:153-154 and engine_workers.py:636: verl refuses it too
        raise SpecError(f"{deriving.file}: {key} is not set (verl needs it unless use_dynamic_bsz is true)")
    size = _int(deriving.file, key, config.get(key))
    deriving.reproduce(side, key, size, "micro_batch", size,
                       note="in order over the whole file; verl first splits the batch over its GPUs")


def _engine(config: Config, deriving: Deriving, machine: Machine) -> None:
    """The vLLM server's engine args (vllm_async_server.py:325-349), engine_kwargs.vllm last."""
    name = config.get(f"{ROLLOUT}.name")
    if name in ("???", None):
        raise SpecError(f"{deriving.file}: {ROLLOUT}.name is mandatory in verl's config (vllm or sglang)")
    if name != "vllm":
        deriving.approximate("infer", f"{ROLLOUT}.name", name,
                             note=f"{name} does not run in-process; vLLM with the same args. For {name} itself, "
                                  "serve it and pass --infer http://HOST:PORT")
    for key, option in (("dtype", "dtype"), ("enable_prefix_caching", "enable_prefix_caching"),
                        ("enable_chunked_prefill", "enable_chunked_prefill"),
                        ("max_num_batched_tokens", "max_num_batched_tokens"), ("max_num_seqs", "max_num_seqs"),
                        ("logprobs_mode", "logprobs_mode"), ("seed", "seed")):
        deriving.reproduce("infer", f"{ROLLOUT}.{key}", config.get(f"{ROLLOUT}.{key}"), option,
                           config.get(f"{ROLLOUT}.{key}"))
    if (length := config.get(f"{ROLLOUT}.max_model_len")) is not None:
        deriving.reproduce("infer", f"{ROLLOUT}.max_model_len", length, "max_model_len", length)
    memory = config.get(f"{ROLLOUT}.gpu_memory_utilization")
    deriving.same("infer", f"{ROLLOUT}.gpu_memory_utilization", memory,
                  note="the KV-cache share of GPU memory: it decides batch sizes and preemption, not one "
                       "sequence's log-probs; the replay's engine sizes its own cache")
    _parallel_and_graphs(config, deriving, machine)
    for key, identity in (("temperature", 1.0), ("top_k", -1), ("top_p", 1.0)):
        if (value := config.get(f"{ROLLOUT}.{key}")) != identity and not (key == "top_k" and value == 0):
            deriving.approximate("infer", f"{ROLLOUT}.{key}", value,
                                 note="the engine replay scores raw log-probs; the sampler's processing is replayed "
                                      "from each rollout's meta.sampler")
    extra = (config.get(f"{ROLLOUT}.engine_kwargs") or {}).get("vllm") or {}
    for key, value in extra.items():
        if value is not None:
            deriving.cannot("infer", f"{ROLLOUT}.engine_kwargs.vllm.{key}", value,
                            note="passed to vLLM by verl; add it to the --infer spec if mismatch's vllm engine has it")


def _parallel_and_graphs(config: Config, deriving: Deriving, machine: Machine) -> None:
    tp = _int(deriving.file, f"{ROLLOUT}.tensor_model_parallel_size", config.get(f"{ROLLOUT}.tensor_model_parallel_size"))
    if tp <= max(machine.gpus, 1):
        deriving.reproduce("infer", f"{ROLLOUT}.tensor_model_parallel_size", tp, "tensor_parallel_size", tp)
    else:
        deriving.approximate("infer", f"{ROLLOUT}.tensor_model_parallel_size", tp,
                             option="tensor_parallel_size", option_value=1,
                             note=f"{machine.gpus} GPU(s) here; TP={tp} splits each GEMM's reduction. "
                                  f"On {tp} GPUs add ,tensor_parallel_size={tp}")
    eager = bool(config.get(f"{ROLLOUT}.enforce_eager"))
    if eager or machine.gpus > 0:
        deriving.reproduce("infer", f"{ROLLOUT}.enforce_eager", eager, "enforce_eager", eager)
    else:
        deriving.approximate("infer", f"{ROLLOUT}.enforce_eager", eager, option="enforce_eager", option_value=True,
                             note="CUDA graphs need a GPU; eager here")
