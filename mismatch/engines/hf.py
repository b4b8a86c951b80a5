"""The training path in torch: one teacher-forced full-sequence forward per micro-batch.

This is what an FSDP/HF trainer computes for old/new log-probs. By default (`packing=pad`)
sequences are sorted by length and batched under a token budget, right-padded with no attention
mask: causal attention means a real position never sees the padding after it, so padding cannot
change a real token's result. `packing=varlen` is how verl (`use_remove_padding`), slime and
prime-rl feed them: each micro-batch's sequences in one row, positions restarting per sequence,
attention kept within each (transformers finds the sequences from the position ids), no padding.
`micro_batch=N` forms micro-batches of N sequences in order, as a trainer's log-prob micro-batch
size does; `temperature=T` divides the logits by T before the log-softmax, as verl's actor does
(verl 0.9.1: verl/workers/actor/dp_actor.py, `_forward_micro_batch`: `logits.div_(temperature)`).
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
from mismatch.engines.distributions import FullRows
from mismatch.engines.logprobs import DEFAULT_CHUNK, token_logprobs
from mismatch.engines.micro_batches import balanced_by_tokens, first_fit_decreasing, in_order, padded_by_budget
from mismatch.engines.processing import SUPPORT_SOURCES, kept_token_logprobs, processed_token_logprobs
from mismatch.engines.routing import RoutingRecorder, check_mode, forced_routing, routers
from mismatch.engines.spec import EngineSpec, options_from
from mismatch.errors import SpecError
from mismatch.streams import KeptSets, Sampling, StreamRouting


@dataclass(kw_only=True, slots=True, frozen=True)
class HFOptions:
    dtype: str = "auto"          # auto = the dtype the checkpoint was saved in
    attn: str = "auto"           # auto (sdpa, eager where sdpa drops a feature) | sdpa | eager | flash_attention_2
    device: str = "auto"         # auto = cuda when available, else cpu
    device_map: str | None = None  # e.g. auto: spread a model too big for one GPU (accelerate)
    batch_tokens: int = 16384    # tokens per forward: padded (rows x longest row), or packed
    packing: str = "pad"         # pad (right-padded rows) | varlen (one packed row, no padding)
    micro_batch: int = 0         # sequences per forward, in order (0: by the batch_tokens budget)
    balance: str = "verl"        # packed rows under the budget: verl (dynamic bsz) | first_fit (prime-rl)
    temperature: float = 1.0     # the trainer's logits / T before the log-softmax (verl's actor)
    chunk: int = DEFAULT_CHUNK   # positions per fp32 log-softmax chunk
    routing: str = "own"         # MoE: own | replay (R3: another pass's experts, engines/routing.py)
    # own | replay: renormalize over the sampler's kept set (recorded sampling_mask, else the
    # declared top-k/top-p/min-p on this replay's logits), as prime-rl's sampling replay does.
    sampling: str = "own"
    checkpoint: str | None = None  # replay other weights than the audited checkpoint
    # hf records the entropy at each scored position (summary.json strata). It costs three more
    # passes over each chunk's fp32 [chunk, vocab] (benchmarks/RESULTS.md): false spares them.
    entropy: bool = True


def resolve_device(name: str) -> str:
    import torch

    if name != "auto":
        return name
    return "cuda" if torch.cuda.is_available() else "cpu"


PACKINGS = ("pad", "varlen")
SAMPLING_MODES = ("own", "replay")
BALANCES = ("verl", "first_fit")


def micro_batches(lengths: Sequence[int], options: HFOptions) -> list[list[int]]:
    """The requests' micro-batches under the options: `micro_batch` in order, else by the token
    budget (padded: longest first; packed: verl's balanced dynamic batch size, or prime-rl's
    first-fit-decreasing rows)."""
    if options.micro_batch > 0:
        return in_order(len(lengths), options.micro_batch)
    if options.packing == "varlen" and options.balance == "first_fit":
        return first_fit_decreasing(lengths, options.batch_tokens)
    if options.packing == "varlen":
        return balanced_by_tokens(lengths, options.batch_tokens)
    return padded_by_budget(lengths, options.batch_tokens)


def check_packing(options: HFOptions, spec_text: str) -> None:
    """The batching options' values, checked with the spec (before any model loads)."""
    if options.packing not in PACKINGS:
        raise SpecError(f"engine 'hf': option packing={options.packing!r} is not one of: {', '.join(PACKINGS)}")
    if options.balance not in BALANCES:
        raise SpecError(f"engine 'hf': option balance={options.balance!r} is not one of: {', '.join(BALANCES)}")
    for name, value, least in (("micro_batch", options.micro_batch, 0), ("batch_tokens", options.batch_tokens, 1)):
        if value < least:
            raise SpecError(f"engine 'hf': option {name}={value} must be at least {least} ({spec_text})")
    if options.sampling not in SAMPLING_MODES:
        raise SpecError(f"engine 'hf': option sampling={options.sampling!r} is not one of: {', '.join(SAMPLING_MODES)}")
    if not options.temperature > 0:
        raise SpecError(f"engine 'hf': option temperature={options.temperature} must be above 0 ({spec_text})")


class TorchEngineBase:
    """Model loading, options and throughput bookkeeping shared by the two torch paths; both
    record MoE routing, follow forced experts (routing=replay) and process their last step like
    the sampler's (engines/contract.py)."""

    kind = "?"
    options_cls: type = HFOptions
    capabilities = Capabilities(records_routing=True, forced_experts=True, processing=True,
                                full_distribution=True)

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
        self.entropy: list[np.ndarray] | None = None  # each request's, after a replay that records it
        self.support_counts = np.zeros(len(SUPPORT_SOURCES), dtype=np.int64)  # sampling=replay: rows per source
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
            "device": self.device,
            "logprob_semantics": "kept_set" if self.options.sampling == "replay" else "raw",
            **({"sampling_replay": dict(zip(SUPPORT_SOURCES, self.support_counts.tolist()))}
               if self.options.sampling == "replay" else {}),
            "num_tokens_scored": self.num_scored, "num_tokens_fed": self.num_fed,
            "padding_frac": self.num_padded / max(self.num_fed + self.num_padded, 1),
            "num_tokens_padded": self.num_padded,
            "num_forward_calls": self.num_forward, "seconds": self.seconds,
            "tokens_per_s": self.num_scored / self.seconds if self.seconds else None,
        }

    def recorded_routing(self) -> list[StreamRouting] | None:
        """Each request's routing in the last replay (request order); None for a dense model."""
        return list(self.routed) if self.recorder is not None else None

    def recorded_entropy(self) -> list[np.ndarray] | None:
        """Each request's entropy per scored token in the last raw replay (None after a processed one)."""
        return list(self.entropy) if self.entropy is not None else None

    def logprobs_of(self, hidden_ND, target_N, processing: Sampling | None = None,
                    entropy_N: Any = None,
                    support: tuple[KeptSets | None, Sampling | None, np.ndarray] | None = None) -> np.ndarray:
        """The targets' log-probs from their hidden states: raw (and their distributions' entropy
        into `entropy_N`, when given), under the sampler's processing, or renormalized over the
        sampler's kept set (`support`: the rows' recorded sets, the declared truncation and which rows
        were sampled; sampling=replay). The same forward every way: only this last step differs."""
        if support is not None and processing is None:
            logp_N, source_N = kept_token_logprobs(hidden_ND, target_N, self.lm_head, kept=support[0],
                                                   truncation=support[1], sampled=support[2],
                                                   temperature=getattr(self.options, "temperature", 1.0),
                                                   chunk=self.options.chunk, softcap=self.softcap)
            self.support_counts += np.bincount(source_N, minlength=len(SUPPORT_SOURCES))
            return logp_N.numpy()
        if processing is None:
            return token_logprobs(hidden_ND, target_N, self.lm_head, chunk=self.options.chunk,
                                  softcap=self.softcap, entropy_N=entropy_N).numpy()
        return processed_token_logprobs(hidden_ND, target_N, self.lm_head, sampling=processing,
                                        chunk=self.options.chunk, softcap=self.softcap).numpy()

    def _support(self, request: ReplayRequest, first: int, stop: int) -> dict[str, Any]:
        """logprobs_of's `support` for the request's positions [first, stop) under sampling=replay."""
        if self.options.sampling != "replay":
            return {}
        kept = request.kept
        offset = request.score_from
        return {"support": (kept.slice(first - offset, stop - offset) if kept is not None else None,
                            request.truncation, request.generated[first:stop])}

    def full_rows(self, hidden_ND) -> FullRows:
        """The whole next-token distribution of these rows (--distribution): the same fp32
        log-softmax of the same lm_head output as `token_logprobs`, over every token (the trainer's
        temperature applied, as its log-probs are); the caller feeds a chunk of rows at a time."""
        import torch

        with torch.inference_mode():
            logits_CV = self.lm_head(hidden_ND).float()
            if self.softcap is not None:
                logits_CV = torch.tanh(logits_CV / self.softcap) * self.softcap
            temperature = getattr(self.options, "temperature", 1.0)
            if temperature != 1.0:
                logits_CV = logits_CV / temperature
            return FullRows(logp_CV=torch.log_softmax(logits_CV, dim=-1).cpu())

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
    check_options = staticmethod(check_packing)
    # The trainer's entropy at each position, for summary.json `strata` (trend: is the growth in
    # high-entropy tokens?). hf-decode records none: it is the sampler's path, not the trainer's.
    capabilities = Capabilities(records_routing=True, forced_experts=True, processing=True, records_entropy=True,
                                full_distribution=True)

    def scored_hidden(self, request: ReplayRequest, forced_experts: np.ndarray | None = None):
        """The hidden states that predict the request's scored tokens past position 0 (--distribution,
        the truncation estimate): the request forwarded alone (CPU matmuls were batch-invariant here;
        MACHINE.md); under routing=replay, with `forced_experts` (its positions' experts) as replay() is."""
        import torch

        ids_1L = torch.from_numpy(request.tokens)[None].to(self.device)
        with torch.inference_mode(), self._forcing([request], [0], None,
                                                        None if forced_experts is None else [forced_experts]):
            hidden_LD = self.decoder(input_ids=ids_1L).last_hidden_state[0]
        if self.recorder is not None:
            self.recorder.take()  # this pass's routing is not the replay's: dropped
        first = max(request.score_from, 1)
        return hidden_LD[first - 1: len(request.tokens) - 1]

    def replay(self, requests: Sequence[ReplayRequest], *, progress: ProgressFn | None = None,
               forced_experts: Sequence[np.ndarray] | None = None,
               processing: Sampling | None = None) -> list[np.ndarray]:
        import torch

        if processing is None and self.options.temperature != 1.0 and self.options.sampling != "replay":
            processing = Sampling(temperature=self.options.temperature)  # the trainer's own scaling
        results: list[np.ndarray] = [np.empty(0)] * len(requests)
        self.routed = [None] * len(requests)  # type: ignore[list-item]
        self.entropy = ([np.empty(0)] * len(requests) if processing is None and self.options.entropy
                        and self.options.sampling != "replay" else None)
        started = time.perf_counter()
        for batch in micro_batches([len(r.tokens) for r in requests], self.options):
            forward = self._forward_packed if self.options.packing == "varlen" else self._forward_padded
            with torch.inference_mode():
                hidden = forward(requests, batch, forced_experts)
                for index, hidden_LD in zip(batch, hidden):
                    results[index] = self._score(hidden_LD, requests[index], processing, self.entropy, index)
            self.num_forward += 1
            scored = sum(requests[i].num_scored for i in batch)
            self.num_scored += scored
            if progress is not None:
                progress(scored)
        self.seconds += time.perf_counter() - started
        return results

    def _forward_padded(self, requests: Sequence[ReplayRequest], batch: list[int],
                        forced_experts: Sequence[np.ndarray] | None) -> list[Any]:
        """The batch right-padded to its longest row: each request's hidden states [L, D]."""
        import torch

        width = max(len(requests[index].tokens) for index in batch)
        ids_BL = torch.zeros((len(batch), width), dtype=torch.long)
        for row, index in enumerate(batch):
            tokens = requests[index].tokens
            ids_BL[row, : len(tokens)] = torch.from_numpy(tokens)
        with self._forcing(requests, batch, width, forced_experts):
            hidden_BLD = self.decoder(input_ids=ids_BL.to(self.device)).last_hidden_state
        lengths = [len(requests[index].tokens) for index in batch]
        if self.recorder is not None:
            experts, margin = self.recorder.take()
            self._keep_routing(batch, lengths, experts.reshape(len(batch), width, *experts.shape[1:]),
                               margin.reshape(len(batch), width, -1))
        self.num_fed += sum(lengths)
        self.num_padded += len(batch) * width - sum(lengths)
        return [hidden_BLD[row, :length] for row, length in enumerate(lengths)]

    def _forward_packed(self, requests: Sequence[ReplayRequest], batch: list[int],
                        forced_experts: Sequence[np.ndarray] | None) -> list[Any]:
        """The batch as one row, positions restarting per request: transformers builds the
        block-diagonal causal mask from the position ids (masking_utils.find_packed_sequence_indices),
        but only without a KV cache, so none is made (with one, every sequence would attend to the
        ones before it)."""
        import torch

        lengths = [len(requests[index].tokens) for index in batch]
        ids_1T = torch.from_numpy(np.concatenate([requests[index].tokens for index in batch]))[None]
        positions_1T = torch.from_numpy(np.concatenate([np.arange(length) for length in lengths]))[None]
        with self._forcing(requests, batch, None, forced_experts):
            hidden_TD = self.decoder(input_ids=ids_1T.to(self.device), position_ids=positions_1T.to(self.device),
                                     use_cache=False).last_hidden_state[0]
        if self.recorder is not None:
            experts, margin = self.recorder.take()
            cuts = np.cumsum(lengths)[:-1]
            self._keep_routing(batch, lengths, np.split(experts, cuts), np.split(margin.reshape(len(experts), -1), cuts))
        self.num_fed += sum(lengths)
        return list(torch.split(hidden_TD, lengths))

    def _keep_routing(self, batch: list[int], lengths: list[int], experts: Any, margin: Any) -> None:
        """Each request's routing into `routed` (`experts[row]`, `margin[row]`: its positions, padded
        or not): padding dropped, and each stream's last position too (it predicts nothing
        scored), as hf-decode, which never feeds it."""
        for row, (index, length) in enumerate(zip(batch, lengths)):
            self.routed[index] = StreamRouting(experts=experts[row][: length - 1].copy(),
                                               margin=margin[row][: length - 1].copy())

    def _forcing(self, requests: Sequence[ReplayRequest], batch: list[int], width: int | None,
                 forced_experts: Sequence[np.ndarray] | None):
        """routing=replay: the batch's forced experts, as the routers see its positions: rows of
        `width` (padding sent anywhere: its outputs are never read), or one packed row (width
        None); each stream's last position, which predicts nothing scored, sent anywhere too."""
        if self.options.routing != "replay":
            return nullcontext()
        import torch

        rows = [self._forced_rows(forced_experts, index, 0, len(requests[index].tokens) - 1) for index in batch]
        layers, k = rows[0].shape[1:]
        lengths = [len(requests[index].tokens) for index in batch]
        slots = [width] * len(batch) if width is not None else lengths
        forced = np.zeros((sum(slots), layers, k), dtype=np.int64)
        for start, experts in zip(np.cumsum([0, *slots[:-1]]), rows):
            forced[start: start + len(experts)] = experts
        return forced_routing(self.model, torch.from_numpy(forced))

    def _score(self, hidden_LD, request: ReplayRequest, processing: Sampling | None,
               entropy: list[np.ndarray] | None = None, index: int = 0) -> np.ndarray:
        """The request's log-probs; with `entropy`, its entropies go to entropy[index] (aligned)."""
        import torch

        # Hidden state at j predicts token j+1; position 0 has no prediction.
        first = max(request.score_from, 1)
        tokens = torch.from_numpy(request.tokens)
        entropy_N = torch.empty(len(request.tokens) - first, dtype=torch.float64) if entropy is not None else None
        logp = self.logprobs_of(hidden_LD[first - 1: len(request.tokens) - 1], tokens[first:], processing, entropy_N,
                                **self._support(request, first, len(request.tokens)))
        if request.score_from == 0:
            logp = np.concatenate([[np.nan], logp])
        if entropy is not None:
            entropy[index] = np.concatenate([[np.nan], entropy_N.numpy()]) if request.score_from == 0 \
                else entropy_N.numpy()
        return logp
