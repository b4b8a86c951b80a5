"""Memory-bounded extraction of per-token log-probs from a model's final hidden states.

Engines call this after their forward pass; it never materializes fp32 `[tokens, vocab]`
for more than `chunk` positions at a time, so a 32k-token sequence with a 32k vocab stays small.
"""

from __future__ import annotations

import torch
from torch import nn

DEFAULT_CHUNK = 512


def token_logprobs(hidden_ND: torch.Tensor, target_N: torch.Tensor, lm_head: nn.Module, *,
                   chunk: int = DEFAULT_CHUNK, softcap: float | None = None,
                   entropy_N: torch.Tensor | None = None) -> torch.Tensor:
    """log p(target_N[i] | hidden_ND[i]) for every row, as float64 on the CPU.

    The logits come out of `lm_head` in the model's dtype and are upcast to fp32 before the
    log-softmax, as HF's `CausalLM` loss and the RL trainers built on it do; only `chunk`
    rows of fp32 logits exist at any time. `entropy_N` (float64, one per row), when given, is
    filled with each row's entropy -Σ p log p in nats, from the same fp32 log-softmax: the
    distribution is normalized anyway, so its entropy costs one more pass over the chunk.
    """
    assert hidden_ND.dim() == 2 and target_N.dim() == 1 and hidden_ND.shape[0] == target_N.shape[0]
    num_rows = hidden_ND.shape[0]
    logp_N = torch.empty(num_rows, dtype=torch.float64)
    for start in range(0, num_rows, chunk):
        stop = min(start + chunk, num_rows)
        logits_CV = lm_head(hidden_ND[start:stop]).float()
        if softcap is not None:  # Gemma-2 style final-logit soft-capping is part of the model
            logits_CV = torch.tanh(logits_CV / softcap) * softcap
        logp_CV = torch.log_softmax(logits_CV, dim=-1)
        picked_C = logp_CV.gather(1, target_N[start:stop, None].to(logp_CV.device)).squeeze(1)
        logp_N[start:stop] = picked_C.to("cpu", torch.float64)
        if entropy_N is not None:
            probs_CV = logp_CV.exp()
            # A probability that underflowed to 0 adds 0 (p·log p → 0), not 0 · -inf = NaN.
            terms_CV = torch.where(probs_CV > 0, probs_CV * logp_CV, torch.zeros_like(logp_CV))
            entropy_N[start:stop] = (-terms_CV.sum(-1)).to("cpu", torch.float64)
            del probs_CV, terms_CV
        del logits_CV, logp_CV
    return logp_N
