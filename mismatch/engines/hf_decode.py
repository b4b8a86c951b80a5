"""The inference path in torch: prompts prefilled, sampled tokens decoded one by one with a KV cache.

This is how a serving engine produced the sampler's log-probs, so replaying it against the `hf`
full forward reproduces the prefill/decode mismatch with no GPU. `prefill=none` decodes every
token alone instead.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np

from mismatch.engines.contract import ProgressFn, ReplayRequest
from mismatch.engines.hf import SAMPLING_MODES, TorchEngineBase
from mismatch.engines.logprobs import DEFAULT_CHUNK
from mismatch.engines.routing import forced_routing
from mismatch.errors import SpecError
from mismatch.streams import Sampling, StreamRouting

PREFILL_MODES = ("prompt", "none")


@dataclass(kw_only=True, slots=True, frozen=True)
class HFDecodeOptions:
    dtype: str = "auto"
    attn: str = "auto"           # as HFOptions.attn
    device: str = "auto"
    device_map: str | None = None  # e.g. auto: spread a model too big for one GPU (accelerate)
    prefill: str = "prompt"      # prompt: feed each prompt run in one forward; none: token by token
    chunk: int = DEFAULT_CHUNK
    routing: str = "own"         # MoE: own | replay (R3: another pass's experts, engines/routing.py)
    sampling: str = "own"        # own | replay: as HFOptions.sampling
    # Linear attention (gated DeltaNet, KDA): the dtype the recurrent state is kept in between forwards,
    # as a serving engine's state cache (vLLM's mamba_ssm_cache_dtype); auto: as transformers (float32).
    state_dtype: str = "auto"
    checkpoint: str | None = None


def feed_chunks(generated: np.ndarray, *, prefill: bool) -> list[tuple[int, int]]:
    """Input ranges [start, stop) fed per forward, as a sampler feeds them.

    A sampler must stop feeding right before every token it samples (it needs the logits there),
    so a chunk ends at input j whenever token j+1 was generated. The last token is never fed.
    """
    num_inputs = len(generated) - 1
    if not prefill:
        return [(j, j + 1) for j in range(num_inputs)]
    chunks: list[tuple[int, int]] = []
    start = 0
    for j in range(num_inputs):
        if generated[j + 1] or j == num_inputs - 1:
            chunks.append((start, j + 1))
            start = j + 1
    return chunks


def round_states(cache, state_dtype: str) -> None:
    """Round every linear-attention layer's recurrent state in `cache` to `state_dtype`, in place
    (its storage keeps transformers' float32): the state a cache of that dtype would carry into the
    next forward. `auto` leaves it."""
    import torch

    if state_dtype == "auto":
        return
    dtype = getattr(torch, state_dtype)
    for layer in cache.layers:
        for state in (getattr(layer, "recurrent_states", None) or {}).values():
            if state is not None:
                state.copy_(state.to(dtype))


class DecodeSession:
    """One KV-cached stream: feed token chunks, get their final hidden states back."""

    def __init__(self, model, device: str, state_dtype: str = "auto") -> None:
        from transformers import DynamicCache

        self.decoder = model.base_model
        self.device = device
        self.cache = DynamicCache(config=model.config)
        self.state_dtype = state_dtype
        # transformers 5.20+ renamed `past_key_values` to `cache` (the old name warns until 5.40).
        params = inspect.signature(self.decoder.forward).parameters
        self.cache_kwarg = "cache" if "cache" in params else "past_key_values"

    def feed(self, ids: np.ndarray):
        """Hidden states [len(ids), D] of the fed tokens, extending the cache."""
        import torch

        ids_1L = torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64))[None].to(self.device)
        with torch.inference_mode():
            out = self.decoder(input_ids=ids_1L, use_cache=True, **{self.cache_kwarg: self.cache})
            round_states(self.cache, self.state_dtype)
        return out.last_hidden_state[0]


class HFDecodeEngine(TorchEngineBase):
    kind = "hf-decode"
    options_cls = HFDecodeOptions

    @staticmethod
    def check_options(options: HFDecodeOptions, spec_text: str) -> None:
        """The options' values, checked with the spec (before any model loads)."""
        if options.prefill not in PREFILL_MODES:
            raise SpecError(f"engine 'hf-decode': option prefill={options.prefill!r} is not one of: "
                            f"{', '.join(PREFILL_MODES)}")
        if options.sampling not in SAMPLING_MODES:
            raise SpecError(f"engine 'hf-decode': option sampling={options.sampling!r} is not one of: "
                            f"{', '.join(SAMPLING_MODES)}")
        if options.state_dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise SpecError(f"engine 'hf-decode': option state_dtype={options.state_dtype!r} is not one of: "
                            "auto, float32, bfloat16, float16")

    def __init__(self, options: HFDecodeOptions, checkpoint: str, spec_text: str) -> None:
        self.check_options(options, spec_text)
        super().__init__(options, checkpoint, spec_text)

    def replay(self, requests: Sequence[ReplayRequest], *, progress: ProgressFn | None = None,
               forced_experts: Sequence[np.ndarray] | None = None,
               processing: Sampling | None = None) -> list[np.ndarray]:
        started = time.perf_counter()
        results = []
        self.routed = []
        for index, request in enumerate(requests):
            results.append(self._replay_one(request, index, forced_experts, processing))
            if self.recorder is not None:
                experts, margin = self.recorder.take()
                self.routed.append(StreamRouting(experts=experts, margin=margin))
            self.num_scored += request.num_scored
            self.num_fed += len(request.tokens) - 1
            if progress is not None:
                progress(request.num_scored)
        self.seconds += time.perf_counter() - started
        return results

    def scored_hidden(self, request: ReplayRequest, forced_experts: np.ndarray | None = None):
        """The hidden states that predict the request's scored tokens past position 0, fed as the
        replay feeds them (prefill, then one token at a time with the KV cache; --distribution, the
        truncation estimate); under routing=replay, with `forced_experts` (its positions' experts)."""
        import torch

        tokens = request.tokens
        session = DecodeSession(self.model, self.device, self.options.state_dtype)
        rows = []
        for start, stop in feed_chunks(request.generated, prefill=self.options.prefill == "prompt"):
            forced = self._forced_rows(None if forced_experts is None else [forced_experts], 0, start, stop)
            with forced_routing(self.model, torch.from_numpy(forced)) if forced is not None else nullcontext():
                rows.append(session.feed(tokens[start:stop]))
        if self.recorder is not None:
            self.recorder.take()  # this pass's routing is not the replay's: dropped
        hidden_LD = torch.cat(rows)  # inputs 0..L-2: row i predicts token i+1
        first = max(request.score_from, 1)
        return hidden_LD[first - 1:]

    def _replay_one(self, request: ReplayRequest, index: int, forced_experts: Sequence[np.ndarray] | None,
                    processing: Sampling | None) -> np.ndarray:
        import torch

        tokens = request.tokens
        logp_L = np.full(len(tokens), np.nan)
        session = DecodeSession(self.model, self.device, self.options.state_dtype)
        for start, stop in feed_chunks(request.generated, prefill=self.options.prefill == "prompt"):
            forced = self._forced_rows(forced_experts, index, start, stop)
            with forced_routing(self.model, torch.from_numpy(forced)) if forced is not None else nullcontext():
                hidden_CD = session.feed(tokens[start:stop])
            self.num_forward += 1
            first = max(start, request.score_from - 1)  # inputs whose next token is scored
            if first >= stop:
                continue
            targets = torch.from_numpy(tokens[first + 1: stop + 1])
            rows = hidden_CD[first - start:]
            # A sampler computes logits for the sampled position alone; do the same for the last
            # row so a replay of the sampler's own config reproduces its numbers exactly.
            logp_L[first + 1: stop] = self.logprobs_of(rows[:-1], targets[:-1], processing,
                                                       **self._support(request, first + 1, stop))
            logp_L[stop] = self.logprobs_of(rows[-1:], targets[-1:], processing,
                                            **self._support(request, stop, stop + 1))[0]
        return logp_L[request.score_from:]
