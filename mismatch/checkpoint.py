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


@dataclass(kw_only=True, slots=True, frozen=True)
class CheckpointInfo:
    path: Path
    model_type: str
    vocab_size: int
    dtype: str  # the dtype the weights were saved in, as named in config.json


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
    if not any(root.glob("*.safetensors")):
        if any(root.glob("*.bin")) or any(root.glob("*.pt")):
            raise CheckpointError(f"{root}: weights are pickle files (.bin/.pt); mismatch loads "
                                  "safetensors only (convert with save_pretrained(safe_serialization=True))")
        raise CheckpointError(f"{root}: no *.safetensors weights")
    vocab_size = config.get("vocab_size")
    if not isinstance(vocab_size, int) or vocab_size <= 0:
        raise CheckpointError(f"{config_file}: vocab_size missing or not a positive integer")
    dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    return CheckpointInfo(path=root, model_type=str(config.get("model_type", "?")),
                          vocab_size=vocab_size, dtype=str(dtype))


def torch_dtype(name: str, info: CheckpointInfo):
    """Map an engine's `dtype=` option to a torch dtype; `auto` keeps the saved dtype."""
    import torch

    if name not in DTYPES:
        raise CheckpointError(f"unknown dtype {name!r} (expected one of: {', '.join(DTYPES)})")
    resolved = info.dtype if name == "auto" else name
    return getattr(torch, resolved)


def load_model(info: CheckpointInfo, *, dtype: str, attn: str, device: str):
    """A causal LM in eval mode with gradients off, loaded offline from safetensors."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        info.path, dtype=torch_dtype(dtype, info), attn_implementation=attn,
        use_safetensors=True, trust_remote_code=False, local_files_only=True)
    model.to(device).eval()
    model.requires_grad_(False)
    return model


def load_tokenizer(path: str | Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
