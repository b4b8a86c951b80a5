"""verl: the trainer's old-log-prob forward and the vLLM rollout server, as its PPO config sets them.

The file is a verl config: the composed YAML Hydra saves (`outputs/.../.hydra/config.yaml`), a YAML
of overrides on top of the release's default, or the run script's command line
(`python3 -m verl.trainer.main_ppo key=value ...`). With verl and omegaconf installed it is read
the release's way: OmegaConf merges it into the release's own generated default
(verl/trainer/config/_generated_ppo_trainer.yaml, or _generated_ppo_megatron_trainer.yaml) in
struct mode, so a key verl does not have is refused as verl refuses it, and the `${oc.select:...}`
interpolations resolve as verl's do. Without them, the keys below are read from the file with
verl 0.9.1's defaults (the records' own), and other keys are ignored. Either way the keys read are
decoded once into the typed records below (VerlConfig), which the derivation reads.

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
from typing import Annotated, Any, NamedTuple

import msgspec
from msgspec import UNSET, UnsetType

from mismatch.errors import SpecError
from mismatch.frameworks.configs.derived import Derived, Deriving, Machine, Side
from mismatch.frameworks.configs.hydra_overrides import ENGINE_STRATEGY, GROUP_CHOICES, from_overrides
from mismatch.frameworks.configs.kinds import verl_yaml_or_refused
from mismatch.frameworks.configs.loading import decoded, text, yaml_value

NAME = "verl"
VERSION = "0.9.1"
ARR = "actor_rollout_ref"
ROLLOUT = f"{ARR}.rollout"
ACTOR = f"{ARR}.actor"

# The keys read here, as typed records with verl 0.9.1's defaults (trainer/config/_generated_ppo_trainer.yaml,
# line; the Megatron ones from _generated_ppo_megatron_trainer.yaml), decoded once from the composed config.
# Other keys are ignored (the release's own merge refuses unknown ones where verl is installed).


class _Record(msgspec.Struct, frozen=True, kw_only=True):
    pass


class MixedPrecision(_Record):
    param_dtype: str = "bf16"  # transformer_impl.py:391-403: bf16 when unset


class FsdpConfig(_Record):  # FSDPEngineConfig (workers/config/engine.py)
    mixed_precision: MixedPrecision | None = None  # :291
    model_dtype: str = "fp32"                                                                       # :37
    ulysses_sequence_parallel_size: int = 1                                                         # :41


class RouterReplay(_Record):
    mode: str = "disabled"  # megatron yaml :85-89 (EngineRouterReplayConfig)


class TransformerOverrides(_Record):
    moe_router_dtype: str | None = None


class Megatron(_Record):  # _generated_ppo_megatron_trainer.yaml
    tensor_model_parallel_size: int = 1                                                             # :49
    pipeline_model_parallel_size: int = 1
    context_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    dtype: str = "bfloat16"                                                                         # :84
    router_replay: RouterReplay = msgspec.field(default_factory=RouterReplay)
    override_transformer_config: TransformerOverrides = msgspec.field(default_factory=TransformerOverrides)


class Batching(NamedTuple):
    """One forward's micro-batch keys (prepare_micro_batches, engine/utils.py:92-130), under `prefix`."""

    prefix: str                   # e.g. actor_rollout_ref.rollout.log_prob_
    max_token_len_per_gpu: int
    micro_batch_size: int | None
    micro_batch_size_per_gpu: int | None


class Actor(_Record):
    strategy: str = "fsdp"                                                                          # :79
    use_dynamic_bsz: bool = False                                                                   # :83
    ppo_micro_batch_size: int | None = None                                                         # :81
    ppo_micro_batch_size_per_gpu: int | None = None                                                 # :82
    ppo_max_token_len_per_gpu: int = 16384                                                          # :84
    fsdp_config: FsdpConfig = msgspec.field(default_factory=FsdpConfig)
    ulysses_sequence_parallel_size: int = 1         # :178 (deprecated; the engine reads fsdp_config's)
    megatron: Megatron = msgspec.field(default_factory=Megatron)

    def batching(self) -> Batching:  # the policy update's forward
        return Batching(f"{ACTOR}.ppo_", self.ppo_max_token_len_per_gpu, self.ppo_micro_batch_size,
                        self.ppo_micro_batch_size_per_gpu)


class ModelOverrides(_Record):
    attn_implementation: str = "flash_attention_2"  # workers/config/model.py:185


class Model(_Record):  # model/hf_model.yaml
    path: str | None = None  # verl's is a placeholder (~/models/deepseek-llm-7b-chat): none unless the file names one
    use_remove_padding: bool = True                                                                 # :446
    override_config: ModelOverrides = msgspec.field(default_factory=ModelOverrides)                 # :443
    use_fused_kernels: bool = False                                                                 # :453


class EngineKwargs(_Record):
    vllm: dict[str, Any] | None = None  # :332 (vLLM's own args: an open set)


class Rollout(_Record):
    name: str | None = "???"                                                                        # :293 (mandatory)
    temperature: Annotated[float, msgspec.Meta(gt=0)] = 1.0  # :297; the actor divides its logits by it
    top_k: int = -1                                                                                 # :298
    top_p: float = 1.0                                                                              # :299
    seed: int = 42                                                                                  # :301
    dtype: str = "bfloat16"                                                                         # :304
    gpu_memory_utilization: float = 0.5                                                             # :305
    enforce_eager: bool = False                                                                     # :307
    tensor_model_parallel_size: int = 2                                                             # :310
    max_num_batched_tokens: int = 8192                                                              # :314
    max_model_len: int | None = None                                                                # :315
    max_num_seqs: int = 256                                                                         # :316
    enable_chunked_prefill: bool = True                                                             # :317
    enable_prefix_caching: bool = True                                                              # :318
    logprobs_mode: str | None = "processed_logprobs"                                                # :319
    log_prob_micro_batch_size: int | None = None                                                    # :323
    log_prob_micro_batch_size_per_gpu: int | None = None                                            # :324
    # :325-326 are ${oc.select:actor_rollout_ref.actor.<key>,...}: UNSET here means the actor's value
    log_prob_use_dynamic_bsz: bool | UnsetType = UNSET
    log_prob_max_token_len_per_gpu: int | UnsetType = UNSET
    engine_kwargs: EngineKwargs = msgspec.field(default_factory=EngineKwargs)                       # :332
    enable_rollout_routing_replay: bool = False                                                     # :382


class ActorRolloutRef(_Record):
    actor: Actor = msgspec.field(default_factory=Actor)
    model: Model = msgspec.field(default_factory=Model)
    rollout: Rollout = msgspec.field(default_factory=Rollout)


class RolloutCorrection(_Record):  # trainer/config/algorithm.py:179-184
    rollout_is: str | None = None                                                                   # :851
    rollout_is_threshold: float | str = 2.0                                                         # :852
    bypass_mode: bool = False                                                                       # :855


class Algorithm(_Record):
    rollout_correction: RolloutCorrection = msgspec.field(default_factory=RolloutCorrection)


class VerlConfig(_Record):
    """The composed config's keys read here."""

    actor_rollout_ref: ActorRolloutRef = msgspec.field(default_factory=ActorRolloutRef)
    algorithm: Algorithm = msgspec.field(default_factory=Algorithm)

    @property
    def actor(self) -> Actor:
        return self.actor_rollout_ref.actor

    @property
    def rollout(self) -> Rollout:
        return self.actor_rollout_ref.rollout

    @property
    def model(self) -> Model:
        return self.actor_rollout_ref.model

    def log_prob_dynamic(self) -> bool:
        """rollout.log_prob_use_dynamic_bsz, the actor's use_dynamic_bsz unless set (:325)."""
        own = self.rollout.log_prob_use_dynamic_bsz
        return self.actor.use_dynamic_bsz if own is UNSET else own

    def log_prob_batching(self) -> Batching:  # the old-log-prob forward (engine_workers.py:616-636)
        own = self.rollout.log_prob_max_token_len_per_gpu
        return Batching(f"{ROLLOUT}.log_prob_", self.actor.ppo_max_token_len_per_gpu if own is UNSET else own,
                        self.rollout.log_prob_micro_batch_size, self.rollout.log_prob_micro_batch_size_per_gpu)


_SELECT = re.compile(r"^\$\{oc\.select:([^,}]+),([^}]*)\}$")
_REFERENCE = re.compile(r"^\$\{([A-Za-z0-9_.]+)\}$")



class Interpolations:
    """The built-in reader's OmegaConf stand-in: a dotted key's value, the file's else verl's default,
    with the two interpolations verl's defaults use resolved as OmegaConf resolves them."""

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


def _put(tree: dict[str, Any], key: str, value: Any) -> None:
    *parents, last = key.split(".")
    for part in parents:
        tree = tree.setdefault(part, {})
    tree[last] = value


def _leaves(kind: type[msgspec.Struct], prefix: str = "") -> list[str]:
    """The dotted keys of a record's fields, nested records walked into (a dict or an optional record is one key)."""
    keys = []
    for field in msgspec.structs.fields(kind):
        if isinstance(field.type, type) and issubclass(field.type, msgspec.Struct):
            keys += _leaves(field.type, f"{prefix}{field.encode_name}.")
        else:
            keys.append(prefix + field.encode_name)
    return keys


def _flat(tree: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict) and value:
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


KEYS = _leaves(VerlConfig)
WANTED = ((f"{ROLLOUT}.temperature", "a positive number"),)
# The records' defaults by dotted key, for an interpolation that refers to a key the file leaves out.
DEFAULTS = _flat(msgspec.to_builtins(VerlConfig()))


def _yaml_value(text: str, where: str = "override") -> Any:
    return yaml_value(text.strip(), where, NAME) if text.strip() else None


def derive(path: Path, machine: Machine) -> Derived:
    config, loader = load(path)
    deriving = Deriving(framework=NAME, file=str(path), loader=loader)
    deriving.model = config.model.path  # compared with the checkpoint by the audit
    _bypass(config, deriving)
    _trainer(config, deriving, machine)
    _engine(config, deriving, machine)
    return deriving.derived()


def load(path: Path) -> tuple[VerlConfig, str]:
    """The config and how it was read: the release's own OmegaConf merge where verl is installed."""
    user = _user_config(path)
    found = importlib.util.find_spec("verl")
    if found is not None and found.submodule_search_locations and importlib.util.find_spec("omegaconf"):
        version = importlib.metadata.version("verl")
        package = Path(next(iter(found.submodule_search_locations)))
        return _with_omegaconf(path, user, package), f"verl {version} (installed): OmegaConf over its default config"
    return _built_in(path, user), f"built-in subset of verl {VERSION}'s keys (verl not installed)"


def _built_in(path: Path, user: dict[str, Any]) -> VerlConfig:
    """The keys read here that the file sets, their interpolations resolved, decoded over the records'
    defaults; the `model_engine` group's choice sets the actor's strategy unless the file does."""
    engine, strategy = _chosen_strategy(user), f"{ACTOR}.strategy"
    resolver = Interpolations(user, {**DEFAULTS, strategy: engine}, str(path))
    tree: dict[str, Any] = {}
    for key in KEYS:
        if _walk(user, key)[0] or key == strategy:
            _put(tree, key, resolver.get(key))
    return decoded(_nulls_as_defaults(tree, VerlConfig), VerlConfig, path, WANTED)


# Keys whose null the reader has always taken as verl's default (a parallel size of 1, replay
# "disabled"): verl's own code tests them for truth (`if sp > 1` after `or 1`, `mode or "disabled"`).
NULL_AS_DEFAULT = {"ulysses_sequence_parallel_size", "tensor_model_parallel_size", "pipeline_model_parallel_size",
                   "context_parallel_size", "expert_model_parallel_size", "mode"}


def _nulls_as_defaults(tree: Any, record: type[_Record]) -> Any:  # noqa: ANN401 - a parsed config
    """`tree` without the nulls that mean "unset" to verl: a group written `null` (OmegaConf's empty
    node; verl reads it `or {}`) and the NULL_AS_DEFAULT keys; every other null is decoded as written
    (a null temperature stays an error)."""
    if not isinstance(tree, dict):
        return tree
    fields = {field.encode_name: field for field in msgspec.structs.fields(record)}
    kept = {}
    for key, value in tree.items():
        field = fields.get(key)  # None: a key the records do not read, kept for msgspec to ignore
        group = field is not None and isinstance(field.type, type) and issubclass(field.type, _Record)
        if value is None and field is not None and (group or field.name in NULL_AS_DEFAULT):
            continue
        kept[key] = _nulls_as_defaults(value, field.type) if group else value
    return kept


def _chosen_strategy(user: dict[str, Any]) -> str:
    """The actor strategy a command line's `model_engine=OPTION` selects (the group choices taken out)."""
    groups: dict[str, str] = user.pop(GROUP_CHOICES, {})  # group -> option, as the command line gives them
    return ENGINE_STRATEGY[groups.get("model_engine", "dp")]


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


def _with_omegaconf(path: Path, user: dict[str, Any], package: Path) -> VerlConfig:
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    chosen = _chosen_strategy(user)  # before the merge: the group choices are no keys of verl's config
    strategy = _walk(user, f"{ACTOR}.strategy")[1] or chosen
    name = "_generated_ppo_megatron_trainer.yaml" if strategy == "megatron" else "_generated_ppo_trainer.yaml"
    try:
        default = OmegaConf.load(package / "trainer" / "config" / name)
        OmegaConf.set_struct(default, True)  # as Hydra composes it: a key verl lacks is an error
        merged = OmegaConf.merge(default, OmegaConf.create(user))
        values = OmegaConf.to_container(merged, resolve=True)
    except OmegaConfBaseException as exc:
        raise SpecError(f"{path}: verl refuses the config: {str(exc).splitlines()[0]}") from None
    return decoded(_nulls_as_defaults(values, VerlConfig), VerlConfig, path, WANTED)


DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


def _bypass(config: VerlConfig, deriving: Deriving) -> None:
    """rollout_correction.bypass_mode (trainer/config/algorithm.py:127-131; ray_trainer.py:1575-1583): verl
    never recomputes old log-probs, it reuses the rollout's as old_log_prob; the ratio the loss sees is the
    update forward's log-probs over the sampler's. The train side then replays the update forward."""
    correction = config.algorithm.rollout_correction
    if correction.rollout_is in ("token", "sequence"):  # the IS weights the run logs rollout_corr/ metrics with
        deriving.framework_settings = {"rollout_is": correction.rollout_is,
                                       "rollout_is_threshold": correction.rollout_is_threshold}
    key = "algorithm.rollout_correction.bypass_mode"
    if correction.bypass_mode:
        deriving.bypass = True
        deriving.notice(f"bypass mode ({key}=true): verl trains on the rollout's log-probs as old log-probs and never "
                        "recomputes them; the train side replays the policy update's forward (actor.ppo_* "
                        "micro-batches), the pair the run's ratio really compares with the sampler")
        deriving.same("train", key, True, note="no old-log-prob forward in the run: the train side is the update's")


def _trainer(config: VerlConfig, deriving: Deriving, machine: Machine) -> None:
    """The actor's compute_log_prob: engine_workers.py:616-636 hands the engine the rollout
    section's log_prob_* settings; prepare_micro_batches (engine/utils.py:92-130) cuts by them."""
    _trainer_model(config, deriving, machine)
    temperature = config.rollout.temperature  # above 0 (NaN refused too): the record's constraint
    # ray_trainer.py:1479 puts rollout.temperature in the batch; transformer_impl.py:1386/:1483
    # divide the logits by it before the log-softmax.
    deriving.reproduce("train", f"{ROLLOUT}.temperature", temperature, "temperature", temperature,
                       note="the actor divides its logits by the rollout temperature")
    # The policy update's forward: the same model and scaling in the actor's own micro-batches
    # (engine_workers.py:626-628: ppo_max_token_len_per_gpu, ppo_micro_batch_size_per_gpu).
    deriving.fork("update", "train", frozenset({"micro_batch", "batch_tokens"}))
    _routing(config, deriving)
    dynamic = config.log_prob_dynamic()
    if dynamic != config.actor.use_dynamic_bsz:  # engine_workers.py:616 asserts they agree
        raise SpecError(f"{deriving.file}: {ROLLOUT}.log_prob_use_dynamic_bsz={str(dynamic).lower()} but "
                        f"{ACTOR}.use_dynamic_bsz={str(not dynamic).lower()}: verl's workers refuse the two to differ")
    _batches(deriving, "train", dynamic, config.log_prob_batching())
    _batches(deriving, "update", dynamic, config.actor.batching())


def _trainer_model(config: VerlConfig, deriving: Deriving, machine: Machine) -> None:
    actor, model = config.actor, config.model
    if actor.strategy == "megatron":
        _megatron(actor.megatron, deriving)
    else:
        if actor.strategy not in ("fsdp", "fsdp2"):
            deriving.approximate("train", f"{ACTOR}.strategy", actor.strategy,
                                 note=f"{actor.strategy} runs verl's own model code; hf runs the transformers model")
        fsdp = actor.fsdp_config
        # transformer_impl.py:391-403: param_dtype (bf16 when unset), and forward_step runs under
        # torch.autocast(param_dtype) (:1555-1565) unless that is fp32.
        param = (fsdp.mixed_precision or MixedPrecision()).param_dtype
        dtype = DTYPES.get(param, param)
        # fsdp_config.model_dtype is the dtype the weights are loaded and kept in (transformer_impl.py:
        # torch_dtype=model_dtype): fp32 by default, so the "FSDP keeps fp32 weights" note holds only then.
        kept = DTYPES.get(fsdp.model_dtype, "float32")
        if kept != "float32":
            deriving.approximate("train", f"{ACTOR}.fsdp_config.model_dtype", fsdp.model_dtype,
                                 note=f"FSDP loads and keeps the weights in {kept}, not fp32")
        if dtype == "float32":
            deriving.reproduce("train", f"{ACTOR}.fsdp_config.mixed_precision.param_dtype", param, "dtype", dtype)
        else:
            deriving.approximate("train", f"{ACTOR}.fsdp_config.mixed_precision.param_dtype", param,
                                 note=f"FSDP keeps {kept} weights, casts them to {param} and runs under "
                                      f"torch.autocast; a {dtype} model here: autocast's fp32 ops run in {dtype}",
                                 option="dtype", option_value=dtype)
    _attention(model.override_config.attn_implementation, deriving, machine)
    packed = model.use_remove_padding
    deriving.reproduce("train", f"{ARR}.model.use_remove_padding", packed, "packing", "varlen" if packed else "pad",
                       note="sequences packed into one row, no padding" if packed else "")
    # fsdp_config's is the engine's (workers/config/engine.py); the other is deprecated
    for key, sp in ((f"{ACTOR}.fsdp_config.ulysses_sequence_parallel_size",
                     actor.fsdp_config.ulysses_sequence_parallel_size),
                    (f"{ACTOR}.ulysses_sequence_parallel_size", actor.ulysses_sequence_parallel_size)):
        if sp > 1:
            deriving.approximate("train", key, sp,
                                 note="Ulysses splits each sequence's attention heads over GPUs; hf runs it whole")
            break
    if model.use_fused_kernels:
        deriving.cannot("train", f"{ARR}.model.use_fused_kernels", True,
                        note="verl's fused linear-cross-entropy log-prob kernel; hf takes the log-softmax of full logits")


def _megatron(megatron: Megatron, deriving: Deriving) -> None:
    deriving.approximate("train", f"{ACTOR}.strategy", "megatron",
                         note="Megatron-Core with Transformer Engine kernels; hf runs the transformers model")
    deriving.reproduce("train", f"{ACTOR}.megatron.dtype", megatron.dtype, "dtype", megatron.dtype)
    for name, size, what in (
            ("tensor_model_parallel_size", megatron.tensor_model_parallel_size,
             "splits each GEMM's reduction over GPUs"),
            ("pipeline_model_parallel_size", megatron.pipeline_model_parallel_size, "splits the layers over GPUs"),
            ("context_parallel_size", megatron.context_parallel_size, "splits each sequence's attention over GPUs"),
            ("expert_model_parallel_size", megatron.expert_model_parallel_size,
             "splits the experts over GPUs (all-to-all dispatch)")):
        if size > 1:
            deriving.approximate("train", f"{ACTOR}.megatron.{name}", size,
                                 note=f"hf runs the whole model on one device; {name}={size} {what} (other rounding)")
        else:  # listed even at 1: a Megatron run's parallel layout is on the first screen
            deriving.same("train", f"{ACTOR}.megatron.{name}", size, note="one device, as here")
    if (router := megatron.override_transformer_config.moe_router_dtype) is not None:
        deriving.approximate("train", f"{ACTOR}.megatron.override_transformer_config.moe_router_dtype", router,
                             note="Megatron computes the MoE gate in this dtype; hf's router runs in the model's "
                                  "dtype (no effect on a dense model)")


def _routing(config: VerlConfig, deriving: Deriving) -> None:
    """verl's router replay (workers/config/engine.py:55-71, EngineRouterReplayConfig): R3 forces, in the
    trainer's forwards, the experts vLLM routed to (rollout.enable_rollout_routing_replay makes vLLM return
    them, vllm_async_server.py:438); R2 records the old-log-prob forward's experts and forces them in the update."""
    mode = config.actor.megatron.router_replay.mode
    returned = config.rollout.enable_rollout_routing_replay
    if returned:
        deriving.same("infer", f"{ROLLOUT}.enable_rollout_routing_replay", True,
                      note="vLLM returns each token's experts with the rollout")
    if mode == "R3" or (mode == "disabled" and returned and config.actor.strategy != "megatron"):
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


def _attention(attn: str, deriving: Deriving, machine: Machine) -> None:
    key = f"{ARR}.model.override_config.attn_implementation"
    if attn == "flash_attention_2" and not machine.flash_attn:
        deriving.approximate("train", key, attn, option="attn", option_value="sdpa",
                             note="flash-attn needs CUDA and the flash_attn package; sdpa here")
    else:
        deriving.reproduce("train", key, attn, "attn", attn)


def _batches(deriving: Deriving, side: Side, dynamic: bool, batching: Batching) -> None:
    """One forward's micro-batches: `{prefix}max_token_len_per_gpu` under dynamic bsz, else
    `{prefix}micro_batch_size_per_gpu` (prepare_micro_batches, engine/utils.py:92-130)."""
    if dynamic:
        key = f"{batching.prefix}max_token_len_per_gpu"
        deriving.reproduce(side, key, batching.max_token_len_per_gpu, "batch_tokens", batching.max_token_len_per_gpu,
                           note="verl's balanced dynamic batch size (rearrange_micro_batches), over the whole file "
                                "rather than each GPU's share")
        return
    if batching.micro_batch_size is not None:  # utils/config.py:150-160 refuses it
        raise SpecError(f"{deriving.file}: {batching.prefix}micro_batch_size is deprecated and refused by verl; "
                        f"set {batching.prefix}micro_batch_size_per_gpu")
    key, size = f"{batching.prefix}micro_batch_size_per_gpu", batching.micro_batch_size_per_gpu
    if size is None:  # utils/config.py:153-154 and engine_workers.py:636: verl refuses it too
        raise SpecError(f"{deriving.file}: {key} is not set (verl needs it unless use_dynamic_bsz is true)")
    deriving.reproduce(side, key, size, "micro_batch", size,
                       note="in order over the whole file; verl first splits the batch over its GPUs")


def _engine(config: VerlConfig, deriving: Deriving, machine: Machine) -> None:
    """The vLLM server's engine args (vllm_async_server.py:325-349), engine_kwargs.vllm last."""
    rollout = config.rollout
    if rollout.name in ("???", None):
        raise SpecError(f"{deriving.file}: {ROLLOUT}.name is mandatory in verl's config (vllm or sglang)")
    if rollout.name != "vllm":
        deriving.approximate("infer", f"{ROLLOUT}.name", rollout.name,
                             note=f"{rollout.name} does not run in-process; vLLM with the same args. For "
                                  f"{rollout.name} itself, serve it and pass --infer http://HOST:PORT")
    for key, value in (("dtype", rollout.dtype), ("enable_prefix_caching", rollout.enable_prefix_caching),
                       ("enable_chunked_prefill", rollout.enable_chunked_prefill),
                       ("max_num_batched_tokens", rollout.max_num_batched_tokens),
                       ("max_num_seqs", rollout.max_num_seqs), ("logprobs_mode", rollout.logprobs_mode),
                       ("seed", rollout.seed)):
        deriving.reproduce("infer", f"{ROLLOUT}.{key}", value, key, value)
    if rollout.max_model_len is not None:
        deriving.reproduce("infer", f"{ROLLOUT}.max_model_len", rollout.max_model_len, "max_model_len",
                           rollout.max_model_len)
    deriving.same("infer", f"{ROLLOUT}.gpu_memory_utilization", rollout.gpu_memory_utilization,
                  note="the KV-cache share of GPU memory: it decides batch sizes and preemption, not one "
                       "sequence's log-probs; the replay's engine sizes its own cache")
    _parallel_and_graphs(rollout, deriving, machine)
    for key, value, identity in (("temperature", rollout.temperature, 1.0), ("top_k", rollout.top_k, -1),
                                 ("top_p", rollout.top_p, 1.0)):
        if value != identity and not (key == "top_k" and value == 0):
            deriving.approximate("infer", f"{ROLLOUT}.{key}", value,
                                 note="the engine replay scores raw log-probs; the sampler's processing is replayed "
                                      "from each rollout's meta.sampler")
    for key, value in (rollout.engine_kwargs.vllm or {}).items():  # vLLM's args: an open set
        if value is not None:
            deriving.cannot("infer", f"{ROLLOUT}.engine_kwargs.vllm.{key}", value,
                            note="passed to vLLM by verl; add it to the --infer spec if mismatch's vllm engine has it")


def _parallel_and_graphs(rollout: Rollout, deriving: Deriving, machine: Machine) -> None:
    tp = rollout.tensor_model_parallel_size
    if tp <= max(machine.gpus, 1):
        deriving.reproduce("infer", f"{ROLLOUT}.tensor_model_parallel_size", tp, "tensor_parallel_size", tp)
    else:
        deriving.approximate("infer", f"{ROLLOUT}.tensor_model_parallel_size", tp,
                             option="tensor_parallel_size", option_value=1,
                             note=f"{machine.gpus} GPU(s) here; TP={tp} splits each GEMM's reduction. "
                                  f"On {tp} GPUs add ,tensor_parallel_size={tp}")
    eager = rollout.enforce_eager
    if eager or machine.gpus > 0:
        deriving.reproduce("infer", f"{ROLLOUT}.enforce_eager", eager, "enforce_eager", eager)
    else:
        deriving.approximate("infer", f"{ROLLOUT}.enforce_eager", eager, option="enforce_eager", option_value=True,
                             note="CUDA graphs need a GPU; eager here")
