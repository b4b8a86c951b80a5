"""Loading a checkpoint directory safely: config facts, tokenizer and torch model.

Every engine that runs transformers goes through here, so the safety rules live in one place:
safetensors only (never unpickle a `.bin`), no remote code, no hub access.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

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
    vocab_size = config.get("vocab_size")
    # bool is an int subclass: `"vocab_size": true` must not pass as a vocab of 1.
    if type(vocab_size) is not int or vocab_size <= 0:
        raise CheckpointError(f"{config_file}: vocab_size missing or not a positive integer")
    dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    return CheckpointInfo(path=root, model_type=str(config.get("model_type", "?")),
                          vocab_size=vocab_size, dtype=str(dtype), max_positions=max_positions(config),
                          num_experts=_num_experts(config), attn_softcap=_attn_softcap(config),
                          **_moe_shape(config))


def _attn_softcap(config: dict) -> float | None:
    for scope in (config, config.get("text_config") if isinstance(config.get("text_config"), dict) else {}):
        value = scope.get("attn_logit_softcapping")
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value:
            return float(value)
    return None


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


def _num_experts(config: dict) -> int | None:
    """Qwen-MoE's num_experts, Mixtral's num_local_experts, DeepSeek's n_routed_experts."""
    for key in ("num_experts", "num_local_experts", "n_routed_experts"):
        value = config.get(key)
        if type(value) is int and value > 1:
            return value
    return None


def _moe_shape(config: dict) -> dict[str, int]:
    """The MoE layer count and top-k a stored routing must have, where config.json says: every
    layer routes (Mixtral) unless the family keeps some dense (transformers' layer constructors:
    DeepSeek-V3's first_k_dense_replace, Qwen-MoE's mlp_only_layers and decoder_sparse_step)."""
    k, layers = config.get("num_experts_per_tok"), config.get("num_hidden_layers")
    if _num_experts(config) is None or type(k) is not int or type(layers) is not int:
        return {}
    dense_first = config.get("first_k_dense_replace")
    step, dense = config.get("decoder_sparse_step"), config.get("mlp_only_layers")
    routed = [i for i in range(layers)
              if not (type(dense_first) is int and i < dense_first)
              and not (type(step) is int and step > 0 and (i + 1) % step)
              and not (isinstance(dense, list) and i in dense)]
    return {"moe_layers": len(routed), "experts_per_token": k}


def max_positions(config: dict) -> int | None:
    """The context length config.json declares (the text model's, for a multimodal config)."""
    for scope in (config, config.get("text_config") if isinstance(config.get("text_config"), dict) else {}):
        for key in ("max_position_embeddings", "n_positions", "seq_length"):
            value = scope.get(key)
            if type(value) is int and value > 0:
                return value
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
