"""The recording proxy: an OpenAI-compatible ASGI app (starlette on uvicorn) in front of the engine.

`mismatch record` runs `record(options)`: check the inputs and the upstream, listen, and for each
/v1/chat/completions and /v1/completions request forward it with the dialect's additions
(`dialects`), answer the harness with exactly what it asked for, and hand every sampled
completion to the recorder (`assembly`), whose finished rollouts the writer appends (`writer`).
Every other route (/v1/models, /health, /tokenize, ...) is passed through untouched.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import os
import signal
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import uvicorn
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from mismatch.errors import MismatchError
from mismatch.record.assembly import Exchange, Recorder
from mismatch.record.dialects import (ENDPOINTS, Capture, HarnessRequest, prepare, read_request, request_prompt,
                                      sampling_params)
from mismatch.record.upstream import Upstream, discover, root_url
from mismatch.record.writer import Writer, open_out

SESSION_HEADER = "x-mismatch-session"
# Hop-by-hop headers (RFC 9110 7.6.1) and the ones the HTTP layers set themselves; the harness's
# Authorization is handled on its own (it may be the proxy's token, not the upstream's key).
_REQUEST_SKIP = frozenset({"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "te",
                           "trailer", "transfer-encoding", "upgrade", "host", "content-length",
                           "accept-encoding", "authorization", SESSION_HEADER})
_RESPONSE_SKIP = frozenset({"connection", "keep-alive", "transfer-encoding", "content-length",
                            "content-encoding"})
EXCHANGE_QUEUE = 10_000  # finished completions waiting for the recorder (CPU only, never disk)
GRACEFUL_SECONDS = 30.0  # in-flight requests a SIGTERM lets finish before the final flush
_STOP = object()


@dataclass(kw_only=True, slots=True, frozen=True)
class RecordOptions:
    upstream: str
    out: Path
    host: str = "127.0.0.1"
    port: int = 9000
    idle_seconds: float = 300.0
    api_key_env: str | None = None       # the bearer token harnesses must present to the proxy
    upstream_key_env: str | None = None  # the key the proxy presents to the upstream
    force: bool = False


@dataclass(kw_only=True, slots=True, frozen=True)
class RecordSummary:
    out: Path
    num_rollouts: int
    num_requests: int
    num_unrecorded: int  # answered but not recorded (errors, unsupported options, no token ids)
    stopped_by: str | None


def _secret(name: str | None, flag: str) -> str | None:
    if name is None:
        return None
    value = os.environ.get(name)
    if not value:
        raise MismatchError(f"{flag} {name}: the environment variable {name} is not set")
    return value


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise MismatchError(f"--host {host} --port {port}: cannot listen there ({e.strerror or e})") from None
    # Listening now, before the "recording" line: a harness started on that line queues in the
    # backlog until uvicorn accepts, instead of being refused (a bound socket that does not
    # listen yet refuses connections).
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def _check_out(out: Path, force: bool) -> None:
    if out.exists() and not force:
        raise MismatchError(f"{out}: already exists; pass --force to replace it")
    if out.exists() and not out.is_file():
        raise MismatchError(f"{out}: not a file")
    if not out.parent.is_dir():
        raise MismatchError(f"{out}: no such directory {out.parent}")


def record(options: RecordOptions, announce: Callable[[str], None] = print) -> RecordSummary:
    """Check everything, then serve until SIGINT or SIGTERM; every open conversation is flushed."""
    root_url(options.upstream)
    _check_out(options.out, options.force)
    if options.idle_seconds <= 0:
        raise MismatchError(f"--idle-seconds {options.idle_seconds}: must be > 0")
    token = _secret(options.api_key_env, "--api-key-env")
    upstream_key = _secret(options.upstream_key_env, "--upstream-key-env")
    upstream_auth = {"authorization": f"Bearer {upstream_key}"} if upstream_key else {}
    upstream = discover(options.upstream, upstream_auth)
    sock = _listen(options.host, options.port)
    try:
        fd = open_out(options.out, force=options.force)
    except OSError as e:
        sock.close()
        raise MismatchError(f"{options.out}: cannot write ({e.strerror or e})") from None
    proxy = Proxy(upstream=upstream, fd=fd, token=token, upstream_auth=upstream_auth,
                  forward_auth=token is None and upstream_key is None, idle_seconds=options.idle_seconds)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    announce(f"recording http://{shown}:{port}/v1 -> {upstream.url} ({upstream.engine} "
             f"{upstream.version or ''}; sampled log-probs {upstream.logprobs}: {upstream.logprobs_from}) "
             f"into {options.out}; SIGINT or SIGTERM flushes and stops")
    stopped: list[str] = []
    # uvicorn handles SIGINT/SIGTERM (graceful shutdown, then the lifespan's final flush) and
    # re-raises the signal once done; these handlers receive that and let `record` return.
    saved = {sig: signal.signal(sig, lambda number, _: stopped.append(signal.Signals(number).name))
             for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        config = uvicorn.Config(proxy.app, log_level="warning", access_log=False, lifespan="on",
                                server_header=False, date_header=False,
                                timeout_graceful_shutdown=GRACEFUL_SECONDS)
        uvicorn.Server(config).run(sockets=[sock])
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        sock.close()
    return RecordSummary(out=options.out, num_rollouts=proxy.writer.num_written,
                         num_requests=proxy.recorder.num_exchanges, num_unrecorded=proxy.num_unrecorded,
                         stopped_by=stopped[0] if stopped else None)


class Proxy:
    def __init__(self, *, upstream: Upstream, fd: int, token: str | None, upstream_auth: dict[str, str],
                 forward_auth: bool, idle_seconds: float) -> None:
        self.upstream = upstream
        self.token = token
        self.upstream_auth = upstream_auth
        self.forward_auth = forward_auth
        self.idle_seconds = idle_seconds
        self.recorder = Recorder(run_id=uuid.uuid4().hex[:8], sampler=upstream.sampler(),
                                 upstream=upstream.describe())
        self.writer = Writer(fd)
        self.num_unrecorded = 0
        self.client: httpx.AsyncClient | None = None
        self.exchanges: asyncio.Queue[Any] | None = None
        routes = [Route(path, self.generate, methods=["POST"]) for path in ENDPOINTS]
        routes.append(Route("/{path:path}", self.passthrough,
                            methods=["GET", "POST", "PUT", "PATCH", "DELETE", "OPTIONS", "HEAD"]))
        self.app = Starlette(routes=routes, lifespan=self.lifespan)

    @contextlib.asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        # No read deadline: a long generation is the upstream's to end, and a stream may pause.
        self.client = httpx.AsyncClient(base_url=self.upstream.url, timeout=httpx.Timeout(None, connect=10.0),
                                        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64))
        self.exchanges = asyncio.Queue(maxsize=EXCHANGE_QUEUE)
        self.writer.start()
        assembler = asyncio.get_running_loop().create_task(self._assemble())
        try:
            yield
        finally:
            await self.exchanges.put(_STOP)
            await assembler
            await self.writer.close()
            await self.client.aclose()

    # -- recording ---------------------------------------------------------------------------

    async def _assemble(self) -> None:
        """Exchanges into conversations; idle ones (and at the end all) out to the writer."""
        assert self.exchanges is not None
        loop = asyncio.get_running_loop()
        sweep = min(1.0, self.idle_seconds / 4)
        while True:
            try:
                item = await asyncio.wait_for(self.exchanges.get(), timeout=sweep)
            except asyncio.TimeoutError:  # the builtin TimeoutError from 3.11 on
                item = None
            if item is _STOP:
                break
            if item is not None:  # matching prompts against open conversations is CPU work
                await asyncio.to_thread(self.recorder.add, item, loop.time())
            for conversation in self.recorder.take_idle(loop.time(), self.idle_seconds):
                await self._flush(conversation)
        for conversation in self.recorder.take_all():
            await self._flush(conversation)

    async def _flush(self, conversation: Any) -> None:
        # The tree and its drift diff are CPU work on whole conversations: off the event loop.
        rollout = await asyncio.to_thread(self.recorder.rollout, conversation)
        await self.writer.put(rollout)

    async def _record(self, capture: Capture, body: dict[str, Any], request: HarnessRequest, endpoint: str,
                      session: str | None, started: float) -> None:
        assert self.exchanges is not None
        done = capture.exchanges()
        if not done:
            self.num_unrecorded += 1
            return
        for prompt, choice in done:
            await self.exchanges.put(Exchange(
                prompt=np.asarray(prompt, np.int64), sampled=np.asarray(choice.sampled, np.int64),
                logprobs=choice.logprobs, sampling_mask=choice.sampling_mask or None, endpoint=endpoint,
                messages=request.messages if endpoint == "chat" else None,
                tools=request.tools if endpoint == "chat" else None,
                params=sampling_params(endpoint, body), session=session, started=started,
                seconds=time.time() - started, finish_reason=choice.finish_reason))

    # -- HTTP ----------------------------------------------------------------------------------

    def _refused(self, request: Request) -> Response | None:
        if self.token is None:
            return None
        given = request.headers.get("authorization", "")
        if hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
            return None
        return JSONResponse({"error": {"message": "mismatch record: missing or wrong bearer token",
                                       "type": "authentication_error", "code": 401}}, status_code=401)

    def _headers(self, request: Request) -> dict[str, str]:
        headers = {k: v for k, v in request.headers.items() if k not in _REQUEST_SKIP}
        headers["accept-encoding"] = "identity"  # bodies are edited as bytes: no compression
        if self.forward_auth and "authorization" in request.headers:
            headers["authorization"] = request.headers["authorization"]
        headers.update(self.upstream_auth)
        return headers

    @staticmethod
    def _answer_headers(response: httpx.Response) -> dict[str, str]:
        return {k: v for k, v in response.headers.items() if k not in _RESPONSE_SKIP}

    async def _send(self, request: Request, content: bytes | AsyncIterator[bytes]) -> httpx.Response | Response:
        assert self.client is not None
        path = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        try:
            return await self.client.send(self.client.build_request(request.method, path,
                                                                    headers=self._headers(request),
                                                                    content=content), stream=True)
        except httpx.HTTPError as e:
            return JSONResponse({"error": {"message": f"mismatch record: upstream {self.upstream.url} "
                                                      f"unreachable ({type(e).__name__})",
                                           "type": "upstream_error", "code": 502}}, status_code=502)

    def _relay(self, response: httpx.Response) -> Response:
        return StreamingResponse(response.aiter_raw(), status_code=response.status_code,
                                 headers=self._answer_headers(response), background=BackgroundTask(response.aclose))

    async def passthrough(self, request: Request) -> Response:
        refused = self._refused(request)
        if refused is not None:
            return refused
        response = await self._send(request, request.stream())
        return response if isinstance(response, Response) else self._relay(response)

    async def generate(self, request: Request) -> Response:
        refused = self._refused(request)
        if refused is not None:
            return refused
        started = time.time()
        raw = await request.body()
        body = _strict_json(raw)
        endpoint = ENDPOINTS[request.url.path]
        read = read_request(body)  # once: prepare decides on it, the capture and the record read it
        prepared = None if read is None else prepare(self.upstream.engine, endpoint, body, read)
        response = await self._send(request, raw if prepared is None else json.dumps(prepared[0]).encode())
        if isinstance(response, Response):
            return response
        if prepared is None or response.status_code != 200:
            self.num_unrecorded += 1  # the upstream's errors reach the harness unchanged
            return self._relay(response)
        capture = Capture(self.upstream.engine, endpoint, prepared[1], request_prompt(endpoint, read))
        session = request.headers.get(SESSION_HEADER) or read.user
        record = BackgroundTask(self._record, capture, body, read, endpoint, session, started)
        if not response.headers.get("content-type", "").startswith("text/event-stream"):
            try:
                data = await response.aread()
            finally:
                await response.aclose()
            return Response(capture.body(data), status_code=200, headers=self._answer_headers(response),
                            background=record)
        return StreamingResponse(self._events(response, capture, record), status_code=200,
                                 headers=self._answer_headers(response))

    async def _events(self, response: httpx.Response, capture: Capture, record: BackgroundTask) -> AsyncIterator[bytes]:
        """The upstream's SSE events, one by one, as the harness would have had them; the
        exchange is recorded once the stream has ended (an abandoned stream is not recorded)."""
        pending = b""
        finished = False
        try:
            async for data in response.aiter_raw():
                pending += data
                *events, pending = pending.split(b"\n\n")
                for event in events:
                    out = _event(event, capture)
                    if out is not None:
                        yield out
            if pending:
                yield pending
            finished = True
        finally:
            await response.aclose()
        if finished:
            await record()


def _refuse_constant(word: str) -> Any:
    raise ValueError(word)


def _strict_json(raw: bytes) -> Any:
    """The harness's request body, None when it is no strict JSON: such a request is forwarded as
    sent and not recorded. Python's json takes NaN and Infinity, which the rollouts file cannot
    hold (the writer's JSON is strict: one such value would stop the recording)."""
    try:
        return json.loads(raw, parse_constant=_refuse_constant)
    except (ValueError, RecursionError):  # not JSON, not UTF-8, a bare NaN, too deep
        return None


def _event(event: bytes, capture: Capture) -> bytes | None:
    """One SSE event (without its blank line): `data: {json}` rewritten, anything else as it was."""
    if not event.startswith(b"data: ") or b"\n" in event or event == b"data: [DONE]":
        return event + b"\n\n"
    payload = capture.event(event[len(b"data: "):])
    return None if payload is None else b"data: " + payload + b"\n\n"


__all__ = ["RecordOptions", "RecordSummary", "record"]
