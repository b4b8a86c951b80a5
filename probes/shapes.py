"""The model's own shapes, which probes run their ops at: kernels pick tiles and code paths by shape.

Read from a checkpoint's config.json (no weights are loaded) or given by hand for tests.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from mismatch.checkpoint import checkpoint_info
from mismatch.errors import CheckpointError


@dataclass(kw_only=True, slots=True, frozen=True)
class ProbeShapes:
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tokens: int = 64  # rows per op: a short prefill; batch and chunk variations split these

    def __post_init__(self) -> None:
        assert self.num_heads % self.num_kv_heads == 0, "grouped-query heads must divide evenly"
        assert self.tokens >= 8 and self.tokens % 4 == 0, "chunk variations split tokens into 4"


def shapes_from_checkpoint(path: str | Path, *, tokens: int = 64) -> ProbeShapes:
    info = checkpoint_info(path)  # validates the directory with the project's one set of rules
    config = json.loads((info.path / "config.json").read_text())
    missing = [key for key in ("hidden_size", "num_attention_heads", "intermediate_size") if key not in config]
    if missing:
        raise CheckpointError(f"{info.path / 'config.json'}: no {missing[0]!r}; probes need a decoder "
                              "config (hidden_size, num_attention_heads, intermediate_size)")
    num_heads = int(config["num_attention_heads"])
    hidden = int(config["hidden_size"])
    return ProbeShapes(hidden=hidden, num_heads=num_heads,
                       num_kv_heads=int(config.get("num_key_value_heads") or num_heads),
                       head_dim=int(config.get("head_dim") or hidden // num_heads),
                       intermediate=int(config["intermediate_size"]), vocab=info.vocab_size,
                       tokens=tokens)


def randn(*shape: int, gen: torch.Generator, device: torch.device, scale: float = 1.0) -> torch.Tensor:
    """fp32 normal values drawn on the CPU, so CPU and CUDA runs probe the very same inputs."""
    return (torch.randn(shape, generator=gen) * scale).to(device)
