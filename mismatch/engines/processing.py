"""The sampler's logit processing (temperature, min-p, top-k, top-p) as a torch engine applies it to
its last step, so the trainer's log-probs can be compared like for like with processed stored ones,
or renormalized over the sampler's kept set (`sampling=replay`).

`Sampling` is plain data in mismatch.streams (read from meta.sampler, checked by the alignment
analysis); the torch math here imports torch lazily.
"""

from __future__ import annotations

import numpy as np

from mismatch.streams import KeptSets, Sampling


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


# How `sampling=replay` renormalized each scored token: over the kept set the rollouts recorded,
# over the one their declared truncation gives on this replay's own logits, or not at all.
SUPPORT_SOURCES = ("recorded", "declared", "full")


def kept_token_logprobs(hidden_ND, target_N, lm_head, *, kept: KeptSets | None, truncation: Sampling | None,
                        sampled: np.ndarray | None = None, temperature: float = 1.0, chunk: int = 512,
                        softcap: float | None = None):
    """The targets' log-probs renormalized over the sampler's kept set (`sampling=replay`):
    log p(t) - log sum_{k in kept} p(k), where p is this replay's own distribution (at the
    trainer's `temperature`), so its ratio to processed stored log-probs carries no kept mass.

    Row i's set is `kept`'s row i where recorded, else, where the token was sampled (`sampled`, bool
    [N]; all when None), `truncation` (min-p/top-k/top-p) applied to this replay's logits, else the
    whole vocabulary (a prompt token was never truncated). The target always counts as kept: a recorded set
    holds it (rules.check_sampling_mask) and a recomputed one that misses it (the two sides' numerics
    straddle the cut) would make its log-prob -inf, a ratio no correction can take.
    Returns (float64 [N], int8 [N] index into SUPPORT_SOURCES).
    """
    import torch

    num_rows = hidden_ND.shape[0]
    logp_N = torch.empty(num_rows, dtype=torch.float64)
    source_N = np.full(num_rows, SUPPORT_SOURCES.index("full"), dtype=np.int8)
    recorded_N = kept.recorded if kept is not None else np.zeros(num_rows, dtype=bool)
    declared_N = (np.ones(num_rows, dtype=bool) if sampled is None else np.asarray(sampled, dtype=bool)) \
        if truncation is not None else np.zeros(num_rows, dtype=bool)
    for start in range(0, num_rows, chunk):
        stop = min(start + chunk, num_rows)
        logits_CV = lm_head(hidden_ND[start:stop]).float()
        if softcap is not None:
            logits_CV = torch.tanh(logits_CV / softcap) * softcap
        if temperature != 1.0:
            logits_CV = logits_CV / temperature
        keep_CV = torch.ones_like(logits_CV, dtype=torch.bool)
        declared_C = declared_N[start:stop]
        if declared_C.any():
            keep_CV = torch.where(torch.from_numpy(declared_C)[:, None].to(keep_CV.device),
                                  kept_mask(logits_CV, truncation), keep_CV)
        recorded_C = recorded_N[start:stop]
        if recorded_C.any():
            part = kept.slice(start, stop)
            rows = np.repeat(np.arange(stop - start), np.diff(part.offsets))
            from_record_CV = torch.zeros_like(keep_CV)
            from_record_CV[torch.from_numpy(rows), torch.from_numpy(part.ids.astype(np.int64))] = True
            keep_CV = torch.where(torch.from_numpy(recorded_C)[:, None].to(keep_CV.device), from_record_CV, keep_CV)
        targets_C = target_N[start:stop].to(logits_CV.device)
        keep_CV[torch.arange(stop - start, device=keep_CV.device), targets_C] = True
        logp_CV = torch.log_softmax(logits_CV.masked_fill(~keep_CV, float("-inf")), dim=-1)
        logp_N[start:stop] = logp_CV.gather(1, targets_C[:, None]).squeeze(1).to("cpu", torch.float64)
        source_N[start:stop][declared_C] = SUPPORT_SOURCES.index("declared")
        source_N[start:stop][recorded_C] = SUPPORT_SOURCES.index("recorded")
    return logp_N, source_N
