"""Bring your own trainer: a `python:MODULE:CALLABLE` engine around a plain torch module.

    mismatch audit CKPT --rollouts R.jsonl --train python:examples/custom_engine.py:make_engine --out DIR
    mismatch audit CKPT --rollouts R.jsonl --train python:examples/custom_engine.py:make_engine,dtype=bfloat16 --out DIR

Options after the first comma are passed to `make_engine`, typed by its annotations.

Replace `load_module` with your trainer's model (a Megatron or TorchTitan module, an FSDP-wrapped
model): anything that maps token ids [1, L] to logits [1, L, V] in the precision you train in.
The engine protocol is one method, `replay(requests, progress=None)`, returning per request the
float64 log-probs of tokens[score_from:] (NaN for position 0); `describe()`/`close()` are optional.
"""

from __future__ import annotations

import numpy as np
import torch


class TorchModuleEngine:
    def __init__(self, module: torch.nn.Module, name: str) -> None:
        self.module = module.eval()
        self.name = name

    def describe(self) -> dict:
        return {"module": self.name, "logprob_semantics": "raw"}

    def replay(self, requests, progress=None) -> list[np.ndarray]:
        results = []
        for request in requests:
            ids_1L = torch.from_numpy(request.tokens)[None]
            with torch.inference_mode():
                logits_LV = self.module(ids_1L)[0].float()
            logp_L = torch.log_softmax(logits_LV[:-1], dim=-1).gather(1, ids_1L[0, 1:, None])[:, 0]
            logp = np.concatenate([[np.nan], logp_L.double().numpy()])  # position 0: no prediction
            results.append(logp[request.score_from:])
            if progress is not None:
                progress(request.num_scored)
        return results


class LogitsOnly(torch.nn.Module):
    """A plain module: ids -> logits (stands in for your trainer's forward)."""

    def __init__(self, causal_lm: torch.nn.Module) -> None:
        super().__init__()
        self.causal_lm = causal_lm

    def forward(self, ids_BL: torch.Tensor) -> torch.Tensor:
        return self.causal_lm(input_ids=ids_BL).logits


def load_module(checkpoint: str, dtype: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=getattr(torch, dtype),
                                                 use_safetensors=True, local_files_only=True)
    return LogitsOnly(model)


def make_engine(checkpoint: str, dtype: str = "float32") -> TorchModuleEngine:
    """The factory mismatch calls: `factory(checkpoint, **options from the TOML)`."""
    return TorchModuleEngine(load_module(checkpoint, dtype), name=f"LogitsOnly({dtype})")
