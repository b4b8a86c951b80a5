"""The training path in torch: one teacher-forced full-sequence forward per padded batch.

This is what an FSDP/HF trainer computes for old/new log-probs. Sequences are sorted by length
and packed under a token budget, right-padded with no attention mask: causal attention means a
real position never sees the padding after it, so padding cannot change a real token's result.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from mismatch.checkpoint import CheckpointInfo, checkpoint_info, load_model
from mismatch.engines.contract import Capabilities, ProgressFn, ReplayRequest
from mismatch.engines.logprobs import DEFAULT_CHUNK, token_logprobs
from mismatch.engines.processing import processed_token_logprobs
from mismatch.streams import Sampling
from mismatch.engines.routing import RoutingRecorder, check_mode, forced_routing, routers
from mismatch.streams import StreamRouting
from mismatch.engines.spec import EngineSpec, options_from
from mismatch.errors import SpecError


@dataclass(kw_only=True, slots=True, frozen=True)
class HFOptions:
    dtype: str = "auto"          # auto = the dtype the checkpoint was saved in
    attn: str = "auto"           # auto (sdpa, eager where sdpa drops a feature) | sdpa | eager | flash_attention_2
    device: str = "auto"         # auto = cuda when available, else cpu
    device_map: str | None = None  # e.g. auto: spread a model too big for one GPU (accelerate)
    batch_tokens: int = 16384    # padded tokens per forward (batch rows x longest row)
    chunk: int = DEFAULT_CHUNK   # positions per fp32 log-softmax chunk
    routing: str = "own"         # MoE: own | replay (R3: another pass's experts, engines/routing.py)
    checkpoint: str | None = None  # replay other weights than the audited checkpoint


def resolve_device(name: str) -> str:
    import torch

    if name != "auto":
        return name
    return "cuda" if torch.cuda.is_available() else "cpu"


def pack_batches(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Indices grouped longest-first so each batch's padded size stays under `budget` tokens.

    Sorting first keeps padding small: rows in a batch have similar lengths. A row longer than
    the budget gets a batch of its own rather than an error.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for index in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= budget:
            batches[-1].append(index)
        else:
            batches.append([index])
    return batches


class TorchEngineBase:
    """Model loading, options and throughput bookkeeping shared by the two torch paths; both
    record MoE routing, follow forced experts (routing=replay) and process their last step like
    the sampler's (engines/contract.py)."""

    kind = "?"
    options_cls: type = HFOptions
    capabilities = Capabilities(records_routing=True, forced_experts=True, processing=True)

    def __init__(self, options: Any, checkpoint: str, spec_text: str) -> None:
        self.options = options
        self.spec_text = spec_text
        self.info: CheckpointInfo = checkpoint_info(options.checkpoint or checkpoint)
        self.device = resolve_device(options.device)
        self.model = load_model(self.info, dtype=options.dtype, attn=options.attn, device=self.device,
                                device_map=options.device_map)
        if options.device_map:
            self.device = str(self.model.device)  # inputs go where the embedding landed
        self.decoder = self.model.base_model  # hidden states; lm_head is applied in chunks
        self.lm_head = self.model.get_output_embeddings()
        self.softcap = getattr(self.model.config, "final_logit_softcapping", None)
        check_mode(options.routing, self.model)
        # MoE: each replayed stream's experts (RoutingRecorder), in `routed` after each replay().
        self.recorder = RoutingRecorder(self.model) if routers(self.model) else None
        self.routed: list[StreamRouting] = []
        self.num_scored = 0
        self.num_fed = 0
        self.num_padded = 0
        self.num_forward = 0
        self.seconds = 0.0

    @classmethod
    def from_spec(cls, spec: EngineSpec, checkpoint: str):
        return cls(options_from(cls.options_cls, spec), checkpoint, spec.text)

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind, "spec": self.spec_text, "options": asdict(self.options),
            "checkpoint": str(self.info.path), "dtype": str(self.model.dtype).removeprefix("torch."),
            "attn": self.model.config._attn_implementation,
            **({"routing": {"moe_layers": len(self.recorder.modules), "mode": self.options.routing}}
               if self.recorder is not None else {}),
            "device": self.device, "logprob_semantics": "raw",
            "num_tokens_scored": self.num_scored, "num_tokens_fed": self.num_fed,
            "padding_frac": self.num_padded / max(self.num_fed + self.num_padded, 1),
            "num_tokens_padded": self.num_padded,
            "num_forward_calls": self.num_forward, "seconds": self.seconds,
            "tokens_per_s": self.num_scored / self.seconds if self.seconds else None,
        }

    def recorded_routing(self) -> list[StreamRouting] | None:
        """Each request's routing in the last replay (request order); None for a dense model."""
        return list(self.routed) if self.recorder is not None else None

    def logprobs_of(self, hidden_ND, target_N, processing: Sampling | None = None) -> np.ndarray:
        """The targets' log-probs from their hidden states: raw, or under the sampler's processing
        (the same forward either way: only this last step differs)."""
        if processing is None:
            return token_logprobs(hidden_ND, target_N, self.lm_head, chunk=self.options.chunk,
                                  softcap=self.softcap).numpy()
        return processed_token_logprobs(hidden_ND, target_N, self.lm_head, sampling=processing,
                                        chunk=self.options.chunk, softcap=self.softcap).numpy()

    def _forced_rows(self, forced_experts: Sequence[np.ndarray] | None, request_index: int, start: int,
                     stop: int):
        """The forced experts of positions [start, stop) of a request (routing=replay), or None."""
        if self.options.routing != "replay":
            return None
        if forced_experts is None:
            raise SpecError(f"{self.spec_text}: routing=replay needs another pass's experts to force "
                            "(the audit's --infer, or diff's --reference, replayed by a torch engine)")
        return forced_experts[request_index][start:stop]

    def close(self) -> None:
        if self.recorder is not None:
            self.recorder.close()
        self.model = self.decoder = self.lm_head = None


class HFEngine(TorchEngineBase):
    kind = "hf"
    options_cls = HFOptions

    def replay(self, requests: Sequence[ReplayRequest], *, progress: ProgressFn | None = None,
               forced_experts: Sequence[np.ndarray] | None = None,
               processing: Sampling | None = None) -> list[np.ndarray]:
        import torch

        results: list[np.ndarray] = [np.empty(0)] * len(requests)
        self.routed = [None] * len(requests)  # type: ignore[list-item]
        started = time.perf_counter()
        for batch in pack_batches([len(r.tokens) for r in requests], self.options.batch_tokens):
            width = len(requests[batch[0]].tokens)
            ids_BL = torch.zeros((len(batch), width), dtype=torch.long)
            for row, index in enumerate(batch):
                tokens = requests[index].tokens
                ids_BL[row, : len(tokens)] = torch.from_numpy(tokens)
            with torch.inference_mode(), self._forcing(requests, batch, width, forced_experts):
                hidden_BLD = self.decoder(input_ids=ids_BL.to(self.device)).last_hidden_state
                for row, index in enumerate(batch):
                    results[index] = self._score(hidden_BLD[row], requests[index], processing)
            if self.recorder is not None:
                self._keep_routing(requests, batch, width)
            self.num_forward += 1
            self.num_fed += sum(len(requests[i].tokens) for i in batch)
            self.num_padded += len(batch) * width - sum(len(requests[i].tokens) for i in batch)
            scored = sum(requests[i].num_scored for i in batch)
            self.num_scored += scored
            if progress is not None:
                progress(scored)
        self.seconds += time.perf_counter() - started
        return results

    def _keep_routing(self, requests: Sequence[ReplayRequest], batch: list[int], width: int) -> None:
        """The batch's routing into `routed`, row by row: padding dropped, and each stream's last
        position too (it predicts nothing scored), as hf-decode, which never feeds it."""
        experts, margin = self.recorder.take()
        experts = experts.reshape(len(batch), width, *experts.shape[1:])
        margin = margin.reshape(len(batch), width, -1)
        for row, index in enumerate(batch):
            fed = len(requests[index].tokens) - 1
            self.routed[index] = StreamRouting(experts=experts[row, :fed].copy(), margin=margin[row, :fed].copy())

    def _forcing(self, requests: Sequence[ReplayRequest], batch: list[int], width: int,
                 forced_experts: Sequence[np.ndarray] | None):
        """routing=replay: the batch's forced experts, padding rows sent anywhere (their outputs
        are never read), flattened as the routers see the batch."""
        if self.options.routing != "replay":
            return nullcontext()
        import torch

        rows = [self._forced_rows(forced_experts, index, 0, len(requests[index].tokens) - 1) for index in batch]
        layers, k = rows[0].shape[1:]
        forced = np.zeros((len(batch), width, layers, k), dtype=np.int64)
        for row, experts in enumerate(rows):
            forced[row, : len(experts)] = experts
        return forced_routing(self.model, torch.from_numpy(forced.reshape(len(batch) * width, layers, k)))

    def _score(self, hidden_LD, request: ReplayRequest, processing: Sampling | None) -> np.ndarray:
        import torch

        # Hidden state at j predicts token j+1; position 0 has no prediction.
        first = max(request.score_from, 1)
        tokens = torch.from_numpy(request.tokens)
        logp = self.logprobs_of(hidden_LD[first - 1: len(request.tokens) - 1], tokens[first:], processing)
        if request.score_from == 0:
            logp = np.concatenate([[np.nan], logp])
        return logp
