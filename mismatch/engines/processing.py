"""The sampler's logit processing (temperature, top-k, top-p) as a torch engine applies it to its
last step, so the trainer's log-probs can be compared like for like with processed stored ones.

`Sampling` is plain data in mismatch.streams (read from meta.sampler, checked by the alignment
analysis); the torch math here imports torch lazily.
"""

from __future__ import annotations

from mismatch.streams import Sampling  # noqa: F401  (plain data: what the engine is asked to apply)


def kept_mask(logits_CV, sampling: Sampling):
    """bool [C, V]: the tokens the sampler's truncation keeps (min-p, then top-k, then top-p, on
    logits already at its temperature), as vLLM applies them (sampler.py step 7).

    min-p keeps p >= min_p * max p (vllm/v1/sample/logits_processor/builtin.py MinPLogitsProcessor);
    top-k keeps the k largest; top-p keeps the smallest set of largest-probability tokens whose
    mass reaches p (always at least one), each on what the step before kept.
    """
    import torch

    keep_CV = torch.ones_like(logits_CV, dtype=torch.bool)
    if sampling.min_p > 0.0:
        probs_CV = torch.softmax(logits_CV, dim=-1)
        keep_CV &= probs_CV >= probs_CV.amax(dim=-1, keepdim=True) * sampling.min_p
    if 0 < sampling.top_k < logits_CV.shape[-1]:
        kth_C1 = torch.topk(logits_CV.masked_fill(~keep_CV, float("-inf")), sampling.top_k, dim=-1).values[:, -1:]
        keep_CV &= logits_CV >= kth_C1
    if sampling.top_p < 1.0:
        sorted_CV, order_CV = torch.sort(logits_CV.masked_fill(~keep_CV, float("-inf")), dim=-1, descending=True)
        probs_CV = torch.softmax(sorted_CV, dim=-1)
        drop_CV = (probs_CV.cumsum(-1) - probs_CV) >= sampling.top_p  # the first has mass_before 0: kept
        keep_CV &= ~torch.zeros_like(drop_CV).scatter(-1, order_CV, drop_CV)
    return keep_CV


def processed_logprobs(logits_CV, sampling: Sampling):
    """log-softmax of the logits after the sampler's processing; filtered-out tokens get -inf.

    fp32 throughout, as a sampler computes them. Temperature divides the logits (exactly the
    toy harness's `logits / T`), then `kept_mask` truncates.
    """
    import torch

    logits_CV = logits_CV.float()
    if sampling.temperature != 1.0:
        logits_CV = logits_CV / sampling.temperature
    if sampling.truncates:
        logits_CV = logits_CV.masked_fill(~kept_mask(logits_CV, sampling), float("-inf"))
    return torch.log_softmax(logits_CV, dim=-1)


def processed_token_logprobs(hidden_ND, target_N, lm_head, *, sampling: Sampling, chunk: int = 512,
                             softcap: float | None = None):
    """`mismatch.engines.logprobs.token_logprobs` under the sampler's processing (float64 on the CPU).

    Same chunking and fp32 upcast as the raw path, so at temperature 1 with no top-k/top-p the
    numbers are the raw ones bit for bit.
    """
    import torch

    num_rows = hidden_ND.shape[0]
    logp_N = torch.empty(num_rows, dtype=torch.float64)
    for start in range(0, num_rows, chunk):
        stop = min(start + chunk, num_rows)
        logits_CV = lm_head(hidden_ND[start:stop]).float()
        if softcap is not None:  # part of the model, applied before any sampling processing
            logits_CV = torch.tanh(logits_CV / softcap) * softcap
        logp_CV = processed_logprobs(logits_CV, sampling)
        picked_C = logp_CV.gather(1, target_N[start:stop, None].to(logp_CV.device)).squeeze(1)
        logp_N[start:stop] = picked_C.to("cpu", torch.float64)
    return logp_N
