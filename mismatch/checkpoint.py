"""Loading a checkpoint directory safely: config facts, tokenizer and torch model.

Every engine that runs transformers goes through here, so the safety rules live in one place:
safetensors only (never unpickle a `.bin`), no remote code, no hub access.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import msgspec

from mismatch.errors import CheckpointError

DTYPES = ("auto", "float32", "bfloat16", "float16")
# What users type for them (torch's and vLLM's short names).
DTYPE_ALIASES = {"bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32"}


def normalize_dtype(name: str) -> str:
    """A `dtype=` option as one of DTYPES (aliases resolved); anything else is a CheckpointError."""
    resolved = DTYPE_ALIASES.get(name, name)
    if resolved not in DTYPES:
        raise CheckpointError(f"unknown dtype {name!r} (expected one of: {', '.join(DTYPES)}; "
                              f"or {', '.join(DTYPE_ALIASES)})")
    return resolved


class TextConfig(msgspec.Struct, frozen=True, kw_only=True):
    """The keys read from config.json, or from a multimodal config's `text_config`, as transformers
    names them; unknown keys ignored, a missing one None (the model does not say)."""

    max_position_embeddings: int | None = None
    n_positions: int | None = None        # GPT-2's context
    seq_length: int | None = None         # ChatGLM's, Qwen-1's
    attn_logit_softcapping: float | None = None  # Gemma-2's


class ModelConfig(TextConfig, frozen=True, kw_only=True):
    model_type: str | None = None
    architectures: list[str] | None = None
    name_or_path: str | None = msgspec.field(default=None, name="_name_or_path")  # the name it was saved from
    vocab_size: int | None = None
    hidden_size: int | None = None
    num_attention_heads: int | None = None
    dtype: str | None = None
    torch_dtype: str | None = None        # transformers < 4.56 wrote the dtype under this name
    text_config: TextConfig | None = None
    # MoE: Qwen-MoE's num_experts, Mixtral's num_local_experts, DeepSeek's n_routed_experts; the top-k;
    # the layers that stay dense (DeepSeek-V3's first_k_dense_replace, Qwen-MoE's step and list)
    num_experts: int | None = None
    num_local_experts: int | None = None
    n_routed_experts: int | None = None
    num_experts_per_tok: int | None = None
    num_hidden_layers: int | None = None
    first_k_dense_replace: int | None = None
    decoder_sparse_step: int | None = None
    mlp_only_layers: list[int] | None = None

    def scopes(self) -> tuple[TextConfig, ...]:
        """Where a text model's key may be: the top level first, then the text_config."""
        return (self, self.text_config) if self.text_config is not None else (self,)


def model_config(config: object, where: Path) -> ModelConfig:
    """config.json's parsed JSON as a ModelConfig (JSON's own types: no coercion); a key of the wrong
    type is one CheckpointError naming it."""
    try:
        return msgspec.convert(config, ModelConfig)
    except msgspec.ValidationError as exc:
        message, _, at = str(exc).partition(" - at `$.")
        key = at.rstrip("`")
        if key == "vocab_size":  # `"vocab_size": true` must not pass as a vocab of 1
            raise CheckpointError(f"{where}: vocab_size missing or not a positive integer") from None
        raise CheckpointError(f"{where}: {key or 'config'}: {message[0].lower()}{message[1:]}") from None


@dataclass(kw_only=True, slots=True, frozen=True)
class CheckpointInfo:
    path: Path
    model_type: str
    vocab_size: int
    dtype: str  # the dtype the weights were saved in, as named in config.json
    max_positions: int | None = None  # the context the model was built for (config.json), if it says
    num_experts: int | None = None    # routed experts per MoE layer (config.json), None for a dense model
    moe_layers: int | None = None     # layers with a router (an MoE), as the model builds them
    experts_per_token: int | None = None  # top-k
    attn_softcap: float | None = None  # attention logit soft-capping (Gemma-2), which sdpa ignores


def checkpoint_info(path: str | Path) -> CheckpointInfo:
    """Read the facts an audit needs before loading weights (vocab size above all)."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{root}: checkpoint directory not found")
    config_file = root / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{root}: not a checkpoint (no config.json)")
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{config_file}: invalid JSON: {exc}") from None
    except RecursionError:  # the C decoder recurses once per level of [ or {
        raise CheckpointError(f"{config_file}: invalid JSON: arrays/objects nested too deeply") from None
    except ValueError as exc:  # an integer literal longer than sys.get_int_max_str_digits()
        raise CheckpointError(f"{config_file}: invalid JSON: {_first_line(exc)}") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_file}: must be a JSON object")
    _check_weights(root)
    model = model_config(config, config_file)
    if model.vocab_size is None or model.vocab_size <= 0:
        raise CheckpointError(f"{config_file}: vocab_size missing or not a positive integer")
    return CheckpointInfo(path=root, model_type=model.model_type if model.model_type is not None else "?",
                          vocab_size=model.vocab_size,
                          dtype=model.dtype or model.torch_dtype or "float32", max_positions=max_positions(model),
                          num_experts=_num_experts(model), attn_softcap=_attn_softcap(model), **_moe_shape(model))


def _attn_softcap(model: ModelConfig) -> float | None:
    return next((float(scope.attn_logit_softcapping) for scope in model.scopes() if scope.attn_logit_softcapping),
                None)


# transformers' sdpa path accepts and ignores attention logit soft-capping
# (integrations/sdpa_attention.py has no softcap); eager and flash_attention_2 apply it.
IGNORES_SOFTCAP = ("sdpa",)


def resolve_attn(attn: str, info: CheckpointInfo) -> str:
    """The attention implementation to load: `auto` picks sdpa unless the model uses a feature sdpa
    would silently drop (soft-capping: then eager); one the user named that drops it is refused,
    since the replay would not be the model."""
    if attn == "auto":
        return "eager" if info.attn_softcap or not _supports_sdpa(info.model_type) else "sdpa"
    if attn in IGNORES_SOFTCAP and info.attn_softcap:
        raise CheckpointError(f"{info.path}: attn={attn} ignores this model's attention logit soft-capping "
                              f"(attn_logit_softcapping={info.attn_softcap:g}), so the replay would not be the "
                              "model; use attn=eager, or leave attn unset (auto picks eager here)")
    return attn


def _supports_sdpa(model_type: str) -> bool:
    """Does transformers' causal LM class for `model_type` take sdpa? gpt-oss's does not (its sinks
    join the softmax: transformers 5.19 GptOssPreTrainedModel._supports_sdpa = False), and loading it
    with sdpa fails."""
    import importlib

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    if name is None:
        return True
    try:
        module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    except ImportError:
        return True
    return bool(getattr(getattr(module, name, None), "_supports_sdpa", True))


def _num_experts(model: ModelConfig) -> int | None:
    """The routed experts per MoE layer, under whichever name the family gives them; None for a dense model."""
    return next((n for n in (model.num_experts, model.num_local_experts, model.n_routed_experts)
                 if n is not None and n > 1), None)


def _moe_shape(model: ModelConfig) -> dict[str, int]:
    """The MoE layer count and top-k a stored routing must have, where config.json says: every
    layer routes (Mixtral) unless the family keeps some dense (transformers' layer constructors:
    DeepSeek-V3's first_k_dense_replace, Qwen-MoE's mlp_only_layers and decoder_sparse_step)."""
    k, layers = model.num_experts_per_tok, model.num_hidden_layers
    if _num_experts(model) is None or k is None or layers is None:
        return {}
    dense_first, step, dense = model.first_k_dense_replace or 0, model.decoder_sparse_step, model.mlp_only_layers or []
    routed = [i for i in range(layers)
              if i >= dense_first and not (step is not None and step > 0 and (i + 1) % step) and i not in dense]
    return {"moe_layers": len(routed), "experts_per_token": k}


def max_positions(model: ModelConfig) -> int | None:
    """The context length config.json declares (the text model's, for a multimodal config)."""
    for scope in model.scopes():
        for value in (scope.max_position_embeddings, scope.n_positions, scope.seq_length):
            if value is not None and value > 0:
                return value
    return None


def declared_context(checkpoint: Path) -> int | None:
    """max_positions of the checkpoint's config.json; None where it cannot be read (the checkpoint's own
    checks name what is wrong with it)."""
    try:
        return max_positions(model_config(json.loads((checkpoint / "config.json").read_text()), checkpoint))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError, CheckpointError):
        return None


def _check_weights(root: Path) -> None:
    """Safetensors or nothing: a `.bin`/`.pt` is a pickle, and unpickling runs the file's code."""
    if not any(root.glob("*.safetensors")):
        if any(root.glob("*.bin")) or any(root.glob("*.pt")):
            raise CheckpointError(f"{root}: weights are pickle files (.bin/.pt); mismatch loads "
                                  "safetensors only (convert with save_pretrained(safe_serialization=True))")
        raise CheckpointError(f"{root}: no *.safetensors weights")


def _first_line(exc: BaseException) -> str:
    """An exception's message as one line of at most 300 characters."""
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip()) or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def torch_dtype(name: str, info: CheckpointInfo):
    """Map an engine's `dtype=` option to a torch dtype; `auto` keeps the saved dtype."""
    import torch

    name = normalize_dtype(name)
    resolved = info.dtype if name == "auto" else name
    dtype = getattr(torch, resolved, None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:  # only `auto` gets here
        raise CheckpointError(f"{info.path / 'config.json'}: dtype {resolved!r} is not a floating-point "
                              "torch dtype (pass dtype=float32 or bfloat16 in the engine spec)")
    return dtype


def load_model(info: CheckpointInfo, *, dtype: str, attn: str, device: str,
               device_map: str | None = None):
    """A causal LM in eval mode with gradients off, loaded offline from safetensors.

    `device_map` (e.g. "auto", needs accelerate) spreads a model too big for one GPU over all of
    them; the model then stays where transformers placed it.

    Refuses (CheckpointError, one line) whatever transformers cannot load from the directory, and
    a load that would leave weights randomly initialized (missing, or shaped unlike config.json).
    """
    from huggingface_hub.errors import StrictDataclassError
    from safetensors import SafetensorError
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    _check_weights(info.path)  # again: `info` may be older than the directory's contents
    torch_dt = torch_dtype(dtype, info)
    attn = resolve_attn(attn, info)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its multi-line load report would bury our one-line error
    try:
        model, loading = AutoModelForCausalLM.from_pretrained(
            info.path, dtype=torch_dt, attn_implementation=attn, use_safetensors=True,
            trust_remote_code=False, local_files_only=True, output_loading_info=True,
            ignore_mismatched_sizes=True,  # reported below, with the shapes, instead of a RuntimeError
            **({"device_map": device_map} if device_map else {}))
    # What a broken or foreign checkpoint makes transformers raise: bad config values, unknown
    # model types or remote code (ValueError), unreadable or truncated files (OSError, SafetensorError).
    except (OSError, ValueError, TypeError, KeyError, RuntimeError, SafetensorError, StrictDataclassError) as exc:
        raise CheckpointError(f"{info.path}: cannot load the model: {_first_line(exc)}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    mismatched = sorted(loading.get("mismatched_keys") or [])
    if mismatched:
        key, shape_ckpt, shape_model = mismatched[0]
        raise CheckpointError(f"{info.path}: weight {key} has shape {list(shape_ckpt)} but config.json "
                              f"implies {list(shape_model)}{_more(len(mismatched), 'mismatched')}")
    missing = sorted(loading.get("missing_keys") or [])
    if missing:
        raise CheckpointError(f"{info.path}: weight {missing[0]} is missing from the safetensors files"
                              f"{_more(len(missing), 'missing')}; refusing to replay random weights")
    # transformers already drops the extras it knows to be harmless (`_keys_to_ignore_on_load_unexpected`);
    # any other saved weight the model does not use means config.json describes another model.
    unexpected = sorted(loading.get("unexpected_keys") or [])
    if unexpected:
        raise CheckpointError(f"{info.path}: weight {unexpected[0]} is not used by the model config.json "
                              f"describes{_more(len(unexpected), 'unused')}")
    if not device_map:
        model.to(device)
    model.eval()
    model.requires_grad_(False)
    return model


def _more(count: int, what: str) -> str:
    return "" if count == 1 else f" (first of {count} {what})"


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
