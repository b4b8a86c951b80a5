"""A running inference server as an engine: teacher-forced prompt log-probs over HTTP.

Speaks vLLM's OpenAI-compatible `/v1/completions` (token-id prompt + `prompt_logprobs`) and
SGLang's native `/generate` (`input_ids` + `return_logprob`), with the standard library only.
For --distribution K (`top_rows`) the same calls ask each prompt position's top-K too: vLLM's
`prompt_logprobs=K`, SGLang's `top_logprobs_num=K`.
"""

from __future__ import annotations

import http.client
import json
import math
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import numpy as np

from mismatch.engines import answers
from mismatch.engines.contract import Capabilities, ProgressFn, ReplayRequest
from mismatch.engines.distributions import TopRows
from mismatch.engines.spec import EngineSpec, options_from
from mismatch.errors import EngineError, SpecError

APIS = ("auto", "openai", "sglang")
# vLLM's OpenAI server writes -inf as -9999.0 (entrypoints/generate/base/serving.py,
# clamp_prompt_logprobs) and some SGLang versions as -999999999.0: JSON has no -inf.
NEG_INF_FLOOR = -9999.0
T = TypeVar("T")


@dataclass(kw_only=True, slots=True, frozen=True)
class HTTPOptions:
    """Options come from a TOML file (`engine = "http"`): a spec string carries the URL only."""

    url: str = ""                # http://HOST:PORT or http://HOST:PORT/v1
    api: str = "auto"            # openai (vLLM) | sglang | auto: ask GET /v1/models who serves
    model: str | None = None     # served model name (openai); default: the one /v1/models lists
    concurrency: int = 4         # requests in flight (the server batches them)
    timeout: float = 300.0       # seconds for a whole HTTP request, answer included (a deadline)
    retries: int = 3             # extra attempts on connection errors, timeouts and 5xx
    backoff: float = 1.0         # seconds before the first retry, doubled on each next one
    checkpoint: str | None = None  # the weights the server is said to serve (recorded, not loaded)


class HTTPEngine:
    kind = "http"
    options_cls = HTTPOptions
    # --distribution K: each prompt position's top-K from the server (vLLM: prompt_logprobs=K, up to
    # its --max-logprobs; SGLang: top_logprobs_num=K), checked by `probe_top_logprobs` before replay.
    capabilities = Capabilities(top_logprobs=True)

    def __init__(self, options: HTTPOptions, checkpoint: str, spec_text: str) -> None:
        if not options.url:
            raise SpecError("engine 'http': option url is required "
                            "(e.g. url = \"http://127.0.0.1:8000/v1\")")
        if not options.url.startswith(("http://", "https://")):
            raise SpecError(f"engine 'http': option url={options.url!r} must start with http:// "
                            "or https://")
        if options.api not in APIS:
            raise SpecError(f"engine 'http': option api={options.api!r} is not one of: "
                            f"{', '.join(APIS)}")
        if options.concurrency < 1 or options.retries < 0 or options.timeout <= 0:
            raise SpecError("engine 'http': concurrency must be >= 1, retries >= 0, timeout > 0")
        self.options = options
        self.spec_text = spec_text
        self.checkpoint = str(Path(options.checkpoint or checkpoint))
        self.root = options.url.rstrip("/").removesuffix("/v1")
        self.num_scored = 0
        self.num_requests = 0
        self.num_retries = 0
        self.seconds = 0.0
        self._lock = threading.Lock()  # counters are bumped from the pool's threads
        self.api, self.model, self.server = self._discover()

    @classmethod
    def from_spec(cls, spec: EngineSpec, checkpoint: str) -> HTTPEngine:
        return cls(options_from(HTTPOptions, spec), checkpoint, spec.text)

    def _discover(self) -> tuple[str, str | None, dict[str, Any]]:
        """Resolve api and model from GET /v1/models, which vLLM and SGLang both serve.

        Its `owned_by` tells them apart: "vllm" (vllm/entrypoints/serve/engine/protocol.py,
        ModelCard) vs "sglang" (sglang/srt/entrypoints/openai/protocol.py, ModelCard).
        """
        api, model = self.options.api, self.options.model
        if api == "sglang" or (api == "openai" and model is not None):
            return api, model, {}
        try:
            cards = self._call("GET", "/v1/models", None, answers.ModelList).data
        except answers.OtherShape:
            raise EngineError(f"server at {self.root} answered /v1/models with something that is not a model list") from None
        if not cards:
            raise EngineError(f"server at {self.root} lists no models at /v1/models")
        first = cards[0]
        server = {"owned_by": first.owned_by, "root": first.root, "max_model_len": first.max_model_len,
                  "version": self._version()}
        if api == "auto":
            api = "sglang" if first.owned_by == "sglang" else "openai"
        if model is None and api == "openai":
            if len(cards) > 1:
                names = ", ".join(card.id for card in cards)
                raise EngineError(f"server at {self.root} serves several models ({names}): "
                                  "set model = \"NAME\" in the engine TOML")
            model = first.id
        return api, model, server

    def _version(self) -> str | None:
        """vLLM's GET /version (entrypoints/serve/instrumentator/basic.py: {"version": ...}); None
        where the server has no such route. Part of what a resume must find unchanged."""
        try:
            with urllib.request.urlopen(self.root + "/version", timeout=min(self.options.timeout, 10.0)) as answer:
                return msgspec.json.decode(answer.read(), type=answers.Version).version
        except (urllib.error.URLError, OSError, http.client.HTTPException, msgspec.MsgspecError):
            return None

    def describe(self) -> dict[str, Any]:
        return {
            "kind": self.kind, "spec": self.spec_text, "options": asdict(self.options),
            "url": self.root, "api": self.api, "model": self.model, "server": self.server,
            "checkpoint": self.checkpoint,  # as claimed: the server loaded its own weights
            # vLLM: prompt tokens skip the sampling processors (vllm/config/model.py,
            # logprobs_mode).
            # SGLang: we send temperature 1 and top_p 1, so its temperature scaling and top-p
            # renormalization (logits_processor, compute_temp_top_p_normalized_logprobs) are no-ops.
            "logprob_semantics": "raw",
            "num_tokens_scored": self.num_scored, "num_requests": self.num_requests,
            "num_retries": self.num_retries, "seconds": self.seconds,
            "tokens_per_s": self.num_scored / self.seconds if self.seconds else None,
        }

    def replay(self, requests: Sequence[ReplayRequest], *,
               progress: ProgressFn | None = None) -> list[np.ndarray]:
        results: list[np.ndarray] = [np.empty(0)] * len(requests)
        todo = [i for i, r in enumerate(requests) if r.num_scored > 0]

        def done(i: int, logp: np.ndarray) -> None:
            results[i] = logp
            if progress is not None:
                progress(requests[i].num_scored)

        self._concurrently(todo, lambda i: self._score(requests[i]), done)
        self.num_scored += sum(r.num_scored for r in requests)
        return results

    def _concurrently(self, todo: list[int], call: Callable[[int], Any], done: Callable[[int, Any], None]) -> None:
        """`call(i)` for each index of `todo`, `concurrency` requests in flight, `done(i, answer)` as each
        answers; the first failure cancels what has not started and is raised. Counts the requests and
        their seconds."""
        started = time.perf_counter()
        with ThreadPoolExecutor(max_workers=self.options.concurrency) as pool:
            futures = {pool.submit(call, i): i for i in todo}
            try:
                for future in as_completed(futures):
                    done(futures[future], future.result())
            except BaseException:
                for future in futures:
                    future.cancel()
                raise
        self.seconds += time.perf_counter() - started
        self.num_requests += len(todo)

    def _score(self, request: ReplayRequest) -> np.ndarray:
        tokens = request.tokens.tolist()
        try:
            logp_L = (self._openai if self.api == "openai" else self._sglang)(tokens)
        except (AttributeError, TypeError, KeyError, IndexError) as exc:
            # A body of another shape than the API's (a list, a string, a field of the wrong type).
            raise EngineError(f"server at {self.root} answered a body this API never sends "
                              f"({type(exc).__name__}: {' '.join(str(exc).split())[:120]})") from None
        logp_L[0] = np.nan
        return logp_L[request.score_from:]

    def top_rows(self, requests: Sequence[ReplayRequest], k: int) -> list[TopRows]:
        """Per request, the top-k of each scored position past 0 and the prompt token's log-prob and
        rank (engines/contract.DistributionEngine), the requests `concurrency` at a time."""
        rows = [_top_rows([], [], [], [], k) for _ in requests]
        todo = [i for i, r in enumerate(requests) if len(r.tokens) > max(r.score_from, 1)]
        self._concurrently(todo, lambda i: self._top(requests[i], k), rows.__setitem__)
        return rows

    def _top(self, request: ReplayRequest, k: int) -> TopRows:
        tokens = request.tokens.tolist()
        try:
            rows = (self._openai_top if self.api == "openai" else self._sglang_top)(tokens, k)
        except (AttributeError, TypeError, KeyError, IndexError, ValueError) as exc:
            raise EngineError(f"server at {self.root} answered a body this API never sends "
                              f"({type(exc).__name__}: {' '.join(str(exc).split())[:120]})") from None
        first = max(request.score_from, 1)
        return _top_rows(*(column[first - 1:] for column in rows), k)

    @classmethod
    def probe_top_logprobs(cls, spec: EngineSpec, k: int) -> None:
        """Before any replay (--distribution K): the server gives K log-probs per prompt position,
        asked once on a two-token prompt; else one SpecError naming the server and its reason
        (vLLM refuses K above its --max-logprobs, default 20: vllm/sampling_params.py
        `_validate_logprobs`, "Requested prompt logprobs of K, which is greater than max allowed")."""
        engine = cls.from_spec(spec, checkpoint="")
        try:
            ids, _, _, _ = (engine._openai_top if engine.api == "openai" else engine._sglang_top)([0, 0], k)
            given = len({token for token in ids[0] if token >= 0})
            if given < k:
                raise EngineError(f"it gave {given} log-probs at a prompt position")
        except (EngineError, AttributeError, TypeError, KeyError, IndexError, ValueError) as exc:
            advice = ("start vLLM with --max-logprobs K or more" if engine.api == "openai"
                      else "SGLang's /generate takes top_logprobs_num")
            raise SpecError(f"--distribution {k}: the server at {engine.root} cannot give its top-{k} log-probs "
                            f"per prompt position ({' '.join(str(exc).split())[:300]}); {advice}, or pass a "
                            "smaller K") from None

    def _openai_top(self, tokens: list[int], k: int) -> tuple[list[Any], ...]:
        """vLLM's completion with `prompt_logprobs=k` (as `_openai`): each position past 0 maps
        up to k + 1 token ids (its top-k, and the prompt token where it is not among them) to
        {"logprob", "rank"} (vllm/entrypoints/openai/completion/protocol.py,
        CompletionResponseChoice.prompt_logprobs: list[dict[int, Logprob] | None]; rank counts
        ties in, vllm/v1/sample/ops/logprobs.py). Per position: ids, log-probs, and the prompt
        token's log-prob and rank."""
        body = {"model": self.model, "prompt": tokens, "max_tokens": 1, "prompt_logprobs": k,
                "temperature": 1.0, "top_p": 1.0, "return_token_ids": True}
        choices = self._call("POST", "/v1/completions", body, answers.Completion).choices
        entries = choices[0].prompt_logprobs if choices else None
        if not entries or len(entries) != len(tokens):
            raise EngineError(f"server at {self.root} returned {len(entries or [])} prompt log-prob entries "
                              f"for {len(tokens)} tokens")
        columns: tuple[list[Any], ...] = ([], [], [], [])
        for position in range(1, len(tokens)):
            entry = entries[position] or {}
            own = entry.get(str(tokens[position]))  # token id -> Logprob: a map
            if own is None:
                raise EngineError(f"server at {self.root}: no log-prob for token {tokens[position]} at "
                                  f"position {position}")
            value = _number(own.logprob, self.root, position)
            ids, values = _with_token([int(token) for token in entry],
                                      [_number(item.logprob, self.root, position) for item in entry.values()],
                                      tokens[position], value, k)
            columns[0].append(ids)
            columns[1].append(values)
            columns[2].append(value)
            columns[3].append(float(own.rank) if own.rank is not None else math.nan)
        return columns

    def _sglang_top(self, tokens: list[int], k: int) -> tuple[list[Any], ...]:
        """SGLang's /generate with `top_logprobs_num=k` (sglang 0.5.15.post1,
        sglang/srt/managers/io_struct.py GenerateReqInput): `meta_info.input_top_logprobs` is
        aligned with input_ids like `input_token_logprobs`, entry 0 None, each other a list of k
        [logprob, token_id, text] (tokenizer_manager.py `detokenize_top_logprobs_tokens`; a
        torch.topk of the log-softmax, layers/utils/logprob.py `get_top_logprobs_raw`). SGLang
        reports no rank: the prompt token's is counted in its top-k (ties in, as vLLM counts),
        and unknown (NaN) where it is not among them."""
        body = {"input_ids": tokens, "return_logprob": True, "logprob_start_len": 0, "top_logprobs_num": k,
                "sampling_params": {"max_new_tokens": 1, "temperature": 1.0, "top_p": 1.0}}
        meta = self._call("POST", "/generate", body, answers.Generated).meta_info or answers.MetaInfo()
        own, tops = meta.input_token_logprobs, meta.input_top_logprobs
        if not tops or not own or len(tops) != len(tokens) or len(own) != len(tokens):
            raise EngineError(f"server at {self.root} returned {len(tops or [])} meta_info.input_top_logprobs "
                              f"for {len(tokens)} tokens (top_logprobs_num={k})")
        columns: tuple[list[Any], ...] = ([], [], [], [])
        for position in range(1, len(tokens)):
            triple = own[position]
            if not isinstance(triple, (list, tuple)) or len(triple) < 2 or triple[1] != tokens[position]:
                raise EngineError(f"server at {self.root}: no log-prob for token {tokens[position]} at "
                                  f"position {position} (got {str(triple)[:80]})")
            value = _number(triple[0], self.root, position)
            top = (tops[position] or [])[:k]
            top_ids = [int(entry[1]) for entry in top]
            top_values = [_number(entry[0], self.root, position) for entry in top]
            inside = tokens[position] in top_ids
            ids, values = _with_token(top_ids, top_values, tokens[position], value, k)
            columns[0].append(ids)
            columns[1].append(values)
            columns[2].append(value)
            columns[3].append(float(sum(v >= value for v in top_values)) if inside else math.nan)
        return columns

    def _openai(self, tokens: list[int]) -> np.ndarray:
        """vLLM's CompletionRequest (vllm/entrypoints/openai/completion/protocol.py): `prompt` may
        be a list of token ids; `prompt_logprobs` (vLLM extra, vllm-project/vllm#7453) is the
        number of top log-probs per prompt position, and the prompt token's own is always
        included; max_tokens=0 is only allowed with echo, so one token is sampled and dropped.
        The choice's `prompt_logprobs` is a list aligned with the prompt: None at position 0,
        then {"TOKEN_ID": {"logprob", "rank", "decoded_token"}}.
        """
        body = {"model": self.model, "prompt": tokens, "max_tokens": 1, "prompt_logprobs": 0,
                "temperature": 1.0, "top_p": 1.0, "return_token_ids": True}
        choices = self._call("POST", "/v1/completions", body, answers.Completion).choices
        choice = choices[0] if choices else answers.CompletionChoice()
        prompt_logprobs = choice.prompt_logprobs
        if not prompt_logprobs:
            raise EngineError(
                f"server at {self.root} returned no prompt_logprobs; is it vLLM >= 0.5.5, or did "
                "a proxy drop the extra field? (for SGLang set api = \"sglang\")")
        echoed = choice.prompt_token_ids
        if echoed is not None and echoed != tokens:
            raise EngineError(f"server at {self.root} changed the prompt's token ids "
                              f"({len(tokens)} sent, {len(echoed)} scored)")
        if len(prompt_logprobs) != len(tokens):
            raise EngineError(f"server at {self.root} returned {len(prompt_logprobs)} prompt "
                              f"log-probs for {len(tokens)} tokens")
        logp_L = np.full(len(tokens), np.nan)
        for position in range(1, len(tokens)):
            entry = (prompt_logprobs[position] or {}).get(str(tokens[position]))  # token id -> Logprob: a map
            if entry is None:
                raise EngineError(f"server at {self.root}: no log-prob for token "
                                  f"{tokens[position]} at position {position}")
            logp_L[position] = _number(entry.logprob, self.root, position)
        return logp_L

    def _sglang(self, tokens: list[int]) -> np.ndarray:
        """SGLang's GenerateReqInput (sglang/srt/managers/io_struct.py): `input_ids`,
        `return_logprob`, `logprob_start_len` (0 = from the first prompt token) and
        `sampling_params`. `meta_info.input_token_logprobs` is aligned with
        input_ids[logprob_start_len:] as [logprob, token_id, text] triples, entry 0 None
        (scheduler output processor: `[None] + input_token_logprobs[:-1]`).
        """
        body = {"input_ids": tokens, "return_logprob": True, "logprob_start_len": 0,
                "sampling_params": {"max_new_tokens": 1, "temperature": 1.0, "top_p": 1.0}}
        meta = self._call("POST", "/generate", body, answers.Generated).meta_info or answers.MetaInfo()
        triples = meta.input_token_logprobs
        if not triples:
            raise EngineError(f"server at {self.root} returned no "
                              "meta_info.input_token_logprobs; is it SGLang? "
                              "(for vLLM set api = \"openai\")")
        if len(triples) != len(tokens):
            raise EngineError(f"server at {self.root} returned {len(triples)} input log-probs "
                              f"for {len(tokens)} tokens")
        logp_L = np.full(len(tokens), np.nan)
        for position in range(1, len(tokens)):
            triple = triples[position]
            if not isinstance(triple, (list, tuple)) or len(triple) < 2 or triple[0] is None:
                raise EngineError(f"server at {self.root}: no log-prob at position {position} "
                                  f"(got {str(triple)[:80]})")
            if triple[1] != tokens[position]:  # a log-prob of another token is no answer at all
                raise EngineError(f"server at {self.root}: answered for token {triple[1]!r} at "
                                  f"position {position}, where the prompt has {tokens[position]}")
            logp_L[position] = _number(triple[0], self.root, position)
        return logp_L

    def _call(self, method: str, path: str, body: dict[str, Any] | None, shape: type[T]) -> T:
        """One JSON call, retried with exponential backoff on connection errors, timeouts, 5xx;
        its answer decoded as `shape` (engines/answers.py)."""
        url = self.root + path
        data = None if body is None else json.dumps(body).encode()
        reason = ""
        for attempt in range(self.options.retries + 1):
            if attempt:
                with self._lock:
                    self.num_retries += 1
                time.sleep(self.options.backoff * 2 ** (attempt - 1))
            request = urllib.request.Request(url, data=data, method=method,
                                             headers={"Content-Type": "application/json"})
            try:
                data = _read_by(request, time.monotonic() + self.options.timeout)
            except _DeadlineExpired:
                # Not retried: a server that used the whole deadline once would use it again.
                raise EngineError(f"server at {url} did not answer within timeout = "
                                  f"{self.options.timeout:g} s") from None
            except urllib.error.HTTPError as exc:
                message = _error_message(exc)
                if exc.code < 500:
                    raise EngineError(
                        f"server at {url} answered HTTP {exc.code}: {message}") from None
                reason = f"HTTP {exc.code}: {message}"
            except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
                # refused, reset, timed out, cut off mid-answer
                reason = str(getattr(exc, "reason", exc))
            else:
                return answers.decode(data, url, shape)
        attempts = self.options.retries + 1
        raise EngineError(f"server at {url} unreachable after {attempts} "
                          f"attempt{'s' if attempts > 1 else ''}: {reason}")

    def close(self) -> None:
        pass  # the server is not ours to stop


class _DeadlineExpired(Exception):
    pass


def _read_by(request: urllib.request.Request, deadline: float) -> bytes:
    """The whole answer, or _DeadlineExpired once `deadline` passes between two reads. The socket
    timeout alone bounds one read, so a server dripping a byte at a time would never time out;
    a silent one is still cut by the socket timeout (the time left when the request started)."""
    def remaining() -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise _DeadlineExpired
        return left

    with urllib.request.urlopen(request, timeout=remaining()) as response:
        chunks = []
        while chunk := response.read1(1 << 16):
            chunks.append(chunk)
            remaining()
        return b"".join(chunks)


def _with_token(ids: list[int], values: list[float], token: int, value: float, k: int) -> tuple[list[int], list[float]]:
    """At most k + 1 entries, the prompt token among them: a position's k best (the first k the
    server listed, without the prompt token) and the prompt token itself."""
    kept = [(i, v) for i, v in zip(ids, values) if i != token][:k]
    kept.append((token, value))
    return [i for i, _ in kept], [v for _, v in kept]


def _top_rows(ids: list[list[int]], logp: list[list[float]], sampled_logp: list[float],
              sampled_rank: list[float], k: int) -> TopRows:
    """Positions' top entries as TopRows: k + 1 slots (padding id -1), the prompt token always there
    (added in the last slot where the server's top-k leaves it out)."""
    num_rows = len(ids)
    ids_CK = np.full((num_rows, k + 1), -1, dtype=np.int64)
    logp_CK = np.full((num_rows, k + 1), -np.inf)
    for row in range(num_rows):
        width = min(len(ids[row]), k + 1)
        ids_CK[row, :width], logp_CK[row, :width] = ids[row][:width], logp[row][:width]
    return TopRows(ids_CK=ids_CK, logp_CK=logp_CK, sampled_logp_C=np.asarray(sampled_logp, dtype=np.float64),
                   sampled_rank_C=np.asarray(sampled_rank, dtype=np.float64), k=k)


def _number(value: Any, root: str, position: int) -> float:
    """A log-prob from a server's JSON; vLLM's -9999 floor is probability 0 (-inf). Whether it is
    a valid log-prob (<= 0, not NaN) is checked for every engine at one boundary (mismatch/replay/checks.py)."""
    # A positive integer past float64's range is no log-prob either (float() raises OverflowError).
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (
            isinstance(value, int) and value > sys.float_info.max):
        raise EngineError(f"server at {root}: log-prob at position {position} is not a number "
                          f"({str(value)[:40]})")
    return -math.inf if value <= NEG_INF_FLOOR else float(value)


def _error_message(exc: urllib.error.HTTPError) -> str:
    """The server's own one-line reason: vLLM and SGLang answer {"error": {"message": ...}}."""
    try:
        payload = json.loads(exc.read().decode("utf-8") or "{}")
    except (ValueError, RecursionError, OSError):  # not JSON, not UTF-8, too deep: the status's reason
        return str(exc.reason)
    error = payload.get("error", payload) if isinstance(payload, dict) else payload
    message = error.get("message", error) if isinstance(error, dict) else error
    return " ".join(str(message).split())[:300]
