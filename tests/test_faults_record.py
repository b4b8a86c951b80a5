"""The fault sweep of issue 31, area C: `mismatch record` keeps every sampled token whatever its
log-prob says, and an engine's bad answer (an http:// server's, a `python:` engine's) is one line
and exit 2. Each test reproduced its fault on the code before the fix.
"""

from __future__ import annotations

import http.client
import json
import signal
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from mismatch.cli import main
from mismatch.engines import load_engine
from mismatch.errors import EngineError
from mismatch.streams import ReplayRequest
from test_golden import stored_checkpoint
from test_record import recording

# ---------------------------------------------------------------------------------------------
# A loopback stand-in for vLLM's OpenAI server (vllm 0.32 chat/completions with return_token_ids
# and logprobs), writing its JSON as Python's json module does: NaN and -Infinity as bare words,
# None as null. Without the options it writes those fields as null, as vLLM does.

SAMPLED = [20, 21, 22, 23, 24, 25]
FINITE = [-0.5, None, -0.25, -0.125, -1.0, -2.0]  # index 1 gets the value under test
BAD_VALUES = {"nan": float("nan"), "-inf": float("-inf"), "null": None}


def _compact(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), allow_nan=True).encode()


def _prompt_ids(body: dict[str, Any]) -> list[int]:
    text = body["messages"][-1]["content"] if "messages" in body else body["prompt"]
    return [1, *(3 + ord(c) % 90 for c in text)]


def _logprobs_of(body: dict[str, Any]) -> list[Any]:
    bad = BAD_VALUES[(body["messages"][-1]["content"] if "messages" in body else body["prompt"]).split()[0]]
    return [bad if value is None else value for value in FINITE]


def _chat_body(body: dict[str, Any]) -> bytes:
    ids, logps = body.get("return_token_ids"), body.get("logprobs")
    content = [{"token": chr(97 + i), "logprob": lp, "bytes": [97 + i], "top_logprobs": []}
               for i, lp in enumerate(_logprobs_of(body))]
    return _compact({"id": "chatcmpl-1", "object": "chat.completion", "created": 0, "model": "tiny",
                     "choices": [{"index": 0, "message": {"role": "assistant", "content": "abcdef"},
                                  "logprobs": {"content": content} if logps else None,
                                  "finish_reason": "stop", "token_ids": SAMPLED if ids else None}],
                     "usage": {"prompt_tokens": 3, "completion_tokens": 6},
                     "prompt_token_ids": _prompt_ids(body) if ids else None})


def _chat_events(body: dict[str, Any]) -> list[bytes]:
    ids, logps = body.get("return_token_ids"), body.get("logprobs")
    head = {"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "tiny"}
    events = [{**head, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None}],
               "prompt_token_ids": _prompt_ids(body) if ids else None}]
    for i, (token, lp) in enumerate(zip(SAMPLED, _logprobs_of(body))):
        entry = {"token": chr(97 + i), "logprob": lp, "bytes": [97 + i], "top_logprobs": []}
        events.append({**head, "choices": [{"index": 0, "delta": {"content": chr(97 + i)},
                                            "logprobs": {"content": [entry]} if logps else None,
                                            "finish_reason": "stop" if i == len(SAMPLED) - 1 else None,
                                            "token_ids": [token] if ids else None}]})
    return [b"data: " + _compact(event) + b"\n\n" for event in events] + [b"data: [DONE]\n\n"]


def _completions_body(body: dict[str, Any]) -> bytes:
    ids, logps = body.get("return_token_ids"), body.get("logprobs") is not None
    return _compact({"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "tiny",
                     "choices": [{"index": 0, "text": "abcdef", "finish_reason": "stop",
                                  "logprobs": {"tokens": list("abcdef"), "token_logprobs": _logprobs_of(body),
                                               "top_logprobs": None, "text_offset": list(range(6))}
                                  if logps else None,
                                  "prompt_token_ids": _prompt_ids(body) if ids else None,
                                  "token_ids": SAMPLED if ids else None}]})


class _FakeVLLM(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/v1/models":
            return self._send(200, b'{"object":"list","data":[{"id":"tiny","object":"model","owned_by":"vllm"}]}')
        self._send(404, b'{"detail":"Not Found"}')

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
        if self.path == "/v1/completions":
            return self._send(200, _completions_body(body))
        if not body.get("stream"):
            return self._send(200, _chat_body(body))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()  # no length: the stream ends when the connection closes (HTTP/1.0)
        for event in _chat_events(body):
            self.wfile.write(event)
            self.wfile.flush()

    def _send(self, status: int, data: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@contextmanager
def _serve(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _post(url: str, body: dict[str, Any]) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=30) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except http.client.IncompleteRead as e:  # a stream the proxy broke off
        return -1, e.partial


CASES = [(endpoint, stream, value) for endpoint, stream in (("chat", False), ("chat", True), ("completions", False))
         for value in BAD_VALUES]


def _request(endpoint: str, stream: bool, value: str) -> tuple[str, dict[str, Any]]:
    text = f"{value} {endpoint} {'streamed' if stream else 'whole'}"
    if endpoint == "chat":
        return "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": text}],
                                        "stream": stream, "max_tokens": 6}
    return "/v1/completions", {"model": "tiny", "prompt": text, "max_tokens": 6}


@pytest.fixture(scope="module")
def recorded_nonfinite(tmp_path_factory) -> tuple[dict[tuple, Any], dict[str, Any]]:
    """Every case once through the proxy and once straight to the server; the recorded rollouts
    by their prompt text (the rollout file read as plain JSON: v1's reader is not what is tested)."""
    out = tmp_path_factory.mktemp("record-nonfinite") / "rollouts.jsonl"
    answers = {}
    with _serve(_FakeVLLM) as upstream, recording(upstream, out, "--idle-seconds", "3600") as proxy:
        for case in CASES:
            path, body = _request(*case)
            answers[case] = (_post(proxy.url.removesuffix("/v1") + path, body), _post(upstream + path, body))
        stdout = proxy.stop(signal.SIGTERM)
        assert proxy.process.returncode == 0, proxy.stderr.read_text()
    rollouts = [json.loads(line) for line in out.read_text().splitlines()]
    by_prompt = {}
    for rollout in rollouts:
        request = rollout["meta"]["record"]["requests"][0]
        by_prompt[request["messages"][-1]["content"] if request["messages"] else rollout["id"]] = rollout
    return answers, {"rollouts": rollouts, "by_prompt": by_prompt, "stdout": stdout}


def test_every_request_with_a_nonfinite_logprob_is_recorded(recorded_nonfinite) -> None:
    stdout = recorded_nonfinite[1]["stdout"]
    assert stdout.startswith(f"wrote {len(CASES)} rollouts ({len(CASES)} recorded requests, 0 not recorded)"), stdout


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_record_keeps_a_token_whose_logprob_is_not_a_number_and_flags_it(recorded_nonfinite, case) -> None:
    answers, recorded = recorded_nonfinite
    through_proxy, straight = answers[case]
    assert through_proxy == straight and straight[0] == 200  # the harness had what the server alone would have sent
    endpoint, stream, value = case
    if endpoint == "chat":
        rollout = recorded["by_prompt"][_request(*case)[1]["messages"][-1]["content"]]
    else:  # completions keep no messages: the prompt ids tell them apart
        prompt = _prompt_ids(_request(*case)[1])
        [rollout] = [r for r in recorded["rollouts"] if r["branches"][0]["segments"][0]["tokens"] == prompt]
    [branch] = rollout["branches"]
    prompt_segment, sampled = branch["segments"]
    assert prompt_segment["tokens"] == _prompt_ids(_request(*case)[1])
    assert sampled["tokens"] == SAMPLED  # all six: none dropped
    assert sampled["logprobs"] == FINITE  # the value v1 cannot hold is null in its place...
    assert rollout["meta"]["record"]["nonfinite_logprobs"] == [  # ...and said for what it was
        {"branch": "main", "segment": 1, "index": 1, "request": 0, "value": None if value == "null" else value}]


def test_a_recording_of_finite_logprobs_flags_nothing(tmp_path) -> None:
    from mismatch.record.assembly import Exchange, build_rollout

    exchange = Exchange(prompt=np.array([1, 2]), sampled=np.array([3, 4]), logprobs=[-0.5, -0.25], endpoint="chat",
                        messages=None, tools=None, params={}, session=None, started=0.0, seconds=0.0,
                        finish_reason="stop")
    rollout = build_rollout("r", [exchange], sampler={}, upstream={})
    assert rollout["branches"][0]["segments"][1]["logprobs"] == [-0.5, -0.25]
    assert rollout["meta"]["record"]["nonfinite_logprobs"] == []


def test_a_harness_request_with_a_bare_nan_is_forwarded_and_the_recording_goes_on(tmp_path) -> None:
    """Python's json takes `NaN` in a request body; kept in meta.sampler, it made the writer's
    strict JSON fail and the recorder stop. Such a request is forwarded as sent, not recorded."""
    out = tmp_path / "rollouts.jsonl"
    with _serve(_FakeVLLM) as upstream, recording(upstream, out, "--idle-seconds", "3600") as proxy:
        path, body = _request("chat", False, "nan")
        answers = []
        for base in (proxy.url.removesuffix("/v1"), upstream):
            request = urllib.request.Request(base + path, data=json.dumps({**body, "temperature": float("nan")}).encode(),
                                             headers={"Content-Type": "application/json"})
            with urllib.request.urlopen(request, timeout=30) as answer:
                answers.append((answer.status, answer.read()))
        assert answers[0] == answers[1] and answers[0][0] == 200
        path, body = _request("chat", True, "null")
        assert _post(proxy.url.removesuffix("/v1") + path, body)[0] == 200
        stdout = proxy.stop(signal.SIGTERM)
        assert proxy.process.returncode == 0, proxy.stderr.read_text()
    assert stdout.startswith("wrote 1 rollouts (1 recorded requests, 1 not recorded)"), stdout
    assert len(out.read_text().splitlines()) == 1


def test_a_message_with_a_lone_surrogate_is_written_as_the_escape_it_came_as() -> None:
    """A harness's `"\\ud800"` is a str json reads but UTF-8 cannot encode: the writer raised and
    the recorder stopped (every later conversation lost)."""
    from mismatch.record.writer import encode_line

    rollout = {"id": "r", "messages": [{"role": "user", "content": json.loads('"a\\ud800b"')}]}
    line = encode_line(rollout)
    assert line.endswith(b"\n") and json.loads(line) == rollout
    assert encode_line({"id": "é"}) == '{"id":"é"}\n'.encode()  # UTF-8 as before otherwise


@pytest.mark.parametrize("event", [
    b'{"choices":[{"index":0,"delta":{"content":"a"},"token_ids":5,"logprobs":null,"finish_reason":null}]}',
    b'{"choices":[{"index":0,"delta":{"content":"a"},"token_ids":["x"],"logprobs":null,"finish_reason":null}]}',
    b'{"choices":{"index":0},"prompt_token_ids":[1]}',
    b'{"choices":[{"index":"0","token_ids":[20]}]}',
    b'[1, 2]',
    b'not json at all',
], ids=["ids-an-int", "ids-strings", "choices-an-object", "index-a-string", "a-list", "not-json"])
def test_an_answer_of_another_shape_reaches_the_harness_as_sent_and_is_not_recorded(event) -> None:
    """Token ids the proxy cannot read are no recording: the request counts as not recorded
    (never a rollout missing those tokens), and the harness has the event unchanged."""
    from mismatch.record.dialects import Capture, prepare

    _, asked = prepare("vllm", "chat", {"model": "m", "messages": [], "stream": True})
    capture = Capture("vllm", "chat", asked)
    first = b'{"choices":[{"index":0,"delta":{"content":"b"},"logprobs":null,"finish_reason":null,"token_ids":[7]}],"prompt_token_ids":[1,2]}'
    capture.event(first)
    assert capture.event(event) == event
    assert capture.exchanges() == []


# ---------------------------------------------------------------------------------------------
# An http:// engine's junk answers: one line naming the server, exit 2


def _raw_server(routes: dict[str, tuple[int, bytes]]) -> Any:
    """A loopback server answering "METHOD /path" with (status, raw bytes) as given."""
    class Handler(BaseHTTPRequestHandler):
        def _answer(self, method: str) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            status, data = routes.get(f"{method} {self.path}", (404, b'{"detail":"Not Found"}'))
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            self._answer("GET")

        def do_POST(self) -> None:
            self._answer("POST")

        def log_message(self, *args: Any) -> None:
            pass

    return _serve(Handler)


MODELS = (200, b'{"object":"list","data":[{"id":"tiny","owned_by":"vllm"}]}')
ONE_ROLLOUT = {"id": "r", "branches": [{"id": "main", "kind": "main", "parent": None, "fork_at": None, "segments": [
    {"role": "user", "tokens": [1, 2, 3]},
    {"role": "assistant", "tokens": [4, 5], "logprobs": [-0.5, -0.25], "extra_logprobs": {"trainer": [-0.5, -0.25]}}]}]}


def _one_rollout(tmp_path: Path) -> Path:
    path = tmp_path / "rollouts.jsonl"
    path.write_text(json.dumps(ONE_ROLLOUT) + "\n")
    return path


def _assert_one_error_line(code: int, err: str, message: str) -> None:
    """Exit 2 and the error as the one line after the progress lines (no traceback)."""
    assert code == 2, err
    assert err.endswith(f"\nmismatch: error: {message}\n") or err == f"mismatch: error: {message}\n", err
    assert err.count("mismatch: error:") == 1 and "Traceback" not in err, err


def test_an_http_engine_answering_bytes_that_are_not_utf8_is_one_line_exit_2(tmp_path, capsys) -> None:
    with _raw_server({"GET /v1/models": MODELS, "POST /v1/completions": (200, b'{"choices": "\xff\xfe"}')}) as url:
        code = main(["audit", str(stored_checkpoint(tmp_path / "ckpt")), "--rollouts", str(_one_rollout(tmp_path)),
                     "--train", "stored:trainer", "--infer", f"{url}/v1", "--out", str(tmp_path / "o")])
    _assert_one_error_line(code, capsys.readouterr().err, f"server at {url}/v1/completions answered bytes that are "
                           "not UTF-8 (byte 0xff at offset 13)")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("status, body, says", [
    (200, b"\xff\xfe\x00junk", "answered bytes that are not UTF-8 (byte 0xff at offset 0)"),
    (200, b"<html>Bad Gateway</html>", "answered with something that is not JSON"),
    (200, b"", "answered with something that is not JSON"),
    (200, b"[" * 100_000 + b"]" * 100_000, "answered JSON nested too deeply"),
    (200, b'{"choices": [{"prompt_logprobs": [null, ' + b"1" * 5000 + b"]}]}", "answered a number of more than"),
    (400, b'{"error": {"message": "bad \xff"}}', "answered HTTP 400: "),
    (400, b"\xff", "answered HTTP 400: Bad Request"),
])
def test_an_http_engine_answering_junk_is_one_engine_error_naming_the_server(tiny_checkpoint, tmp_path, status, body,
                                                                               says) -> None:
    request = ReplayRequest(tokens=np.array([1, 7, 9, 4]), generated=np.array([0, 0, 1, 1], bool), score_from=2)
    with _raw_server({"GET /v1/models": MODELS, "POST /v1/completions": (status, body)}) as url:
        engine = load_engine(f"{url}/v1", str(tiny_checkpoint))
        with pytest.raises(EngineError) as err:
            engine.replay([request])
    message = str(err.value)
    assert message.startswith(f"server at {url}/v1/completions ") and says in message and "\n" not in message, message


def test_an_http_engine_whose_model_listing_is_not_utf8_is_one_engine_error(tiny_checkpoint) -> None:
    with _raw_server({"GET /v1/models": (200, b'{"data": "\xff"}')}) as url:
        with pytest.raises(EngineError, match=rf"^server at {url}/v1/models answered bytes that are not UTF-8"):
            load_engine(f"{url}/v1", str(tiny_checkpoint))


# ---------------------------------------------------------------------------------------------
# A `python:` engine's junk, exceptions and sys.exit: one line, exit 2 (Ctrl-C stays Ctrl-C)

USER_ENGINE = '''
import sys
import numpy as np

class Engine:
    def replay(self, requests, progress=None):
        {replay}

def make(checkpoint, **options):
    {make}
    return Engine()
'''


def _user_engine(tmp_path: Path, *, replay: str = "return [np.full(r.num_scored, -1.0) for r in requests]",
                 make: str = "pass") -> str:
    path = tmp_path / "user_engine.py"
    path.write_text(USER_ENGINE.replace("{replay}", replay).replace("{make}", make))
    return f"python:{path}:make"


@pytest.mark.parametrize("replay, says", [
    ("return 'ab'", "replay returned str, not a list of arrays (one per request)"),
    ("return None", "replay returned NoneType, not a list of arrays (one per request)"),
    ("return 3", "replay returned int, not a list of arrays (one per request)"),
    ("return [np.zeros(2), np.zeros(2)]", "replay returned 2 arrays for 1 requests"),
    ("return [np.zeros(r.num_scored + 1) for r in requests]", "request 0: got (6,) log-probs, expected (5,)"),
    ("return [np.full(r.num_scored, 'a') for r in requests]", "request 0: returned an array of <U1, not of numbers"),
    ("return [np.full(r.num_scored, '-1.0') for r in requests]", "request 0: returned an array of <U4, not of numbers"),
    ("return [[{}] * r.num_scored for r in requests]", "request 0: returned an array of object, not of numbers"),
    ("return [np.ones(r.num_scored, bool) for r in requests]", "request 0: returned an array of bool, not of numbers"),
    ("raise ValueError('boom\\nsecond line')", "replay raised ValueError: boom second line (MISMATCH_DEBUG=1 shows where)"),
    ("sys.exit(0)", "replay called sys.exit(0)"),
    ("sys.exit('bye')", "replay called sys.exit('bye')"),
])
def test_a_python_engine_that_replays_junk_raises_or_exits_is_one_line_exit_2(tmp_path, capsys, replay, says) -> None:
    spec = _user_engine(tmp_path, replay=replay)
    code = main(["audit", str(stored_checkpoint(tmp_path / "ckpt")), "--rollouts", str(_one_rollout(tmp_path)),
                 "--train", "stored:trainer", "--infer", spec, "--out", str(tmp_path / "o")])
    _assert_one_error_line(code, capsys.readouterr().err, f"python engine {spec!r}: {says}")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("make, says", [
    ("raise RuntimeError('no GPU')", "make raised RuntimeError: no GPU (MISMATCH_DEBUG=1 shows where)"),
    ("sys.exit(0)", "make called sys.exit(0)"),
    ("return 'engine'", "the factory returned str, which has no replay(requests) method"),
])
def test_a_python_engine_whose_factory_raises_or_exits_is_one_line_exit_2(tmp_path, capsys, make, says) -> None:
    spec = _user_engine(tmp_path, make=make)
    code = main(["audit", str(stored_checkpoint(tmp_path / "ckpt")), "--rollouts", str(_one_rollout(tmp_path)),
                 "--train", "stored:trainer", "--infer", spec, "--out", str(tmp_path / "o")])
    _assert_one_error_line(code, capsys.readouterr().err, f"python engine {spec!r}: {says}")


def test_a_python_engine_module_that_raises_or_exits_on_import_is_one_line(tmp_path) -> None:
    path = tmp_path / "broken.py"
    for body, says in (("import sys\nsys.exit(0)\n", "importing it called sys.exit(0)"),
                       ("x = 1 / 0\n", "importing it raised ZeroDivisionError: division by zero "
                                       "(MISMATCH_DEBUG=1 shows where)")):
        path.write_text(body)
        with pytest.raises(EngineError) as err:
            load_engine(f"python:{path}:make", str(tmp_path))
        assert str(err.value) == f"python engine '{path}:make': {says}"


def test_ctrl_c_inside_a_python_engine_is_still_an_interrupt(tmp_path, capsys) -> None:
    spec = _user_engine(tmp_path, replay="raise KeyboardInterrupt")
    engine = load_engine(spec, str(tmp_path))
    request = ReplayRequest(tokens=np.array([1, 7, 9]), generated=np.array([0, 1, 1], bool), score_from=1)
    with pytest.raises(KeyboardInterrupt):
        engine.replay([request])
    code = main(["audit", str(stored_checkpoint(tmp_path / "ckpt")), "--rollouts", str(_one_rollout(tmp_path)),
                 "--train", "stored:trainer", "--infer", spec, "--out", str(tmp_path / "o")])
    assert code == 130  # the CLI's interrupt, not an error line


def test_an_http_engine_answering_an_integer_past_float64_is_one_engine_error(tiny_checkpoint) -> None:
    """json reads a 400-digit integer; float() of it raised OverflowError (a traceback). (A negative
    one is below vLLM's -9999 floor: -inf, as before.)"""
    huge = b"9" * 400
    rows = b'[null, {"7": {"logprob": ' + huge + b'}}, {"9": {"logprob": -0.5}}, {"4": {"logprob": -0.5}}]'
    request = ReplayRequest(tokens=np.array([1, 7, 9, 4]), generated=np.array([0, 0, 1, 1], bool), score_from=2)
    with _raw_server({"GET /v1/models": MODELS,
                      "POST /v1/completions": (200, b'{"choices": [{"prompt_logprobs": ' + rows + b"}]}")}) as url:
        engine = load_engine(f"{url}/v1", str(tiny_checkpoint))
        with pytest.raises(EngineError, match=rf"^server at {url}: log-prob at position 1 is not a number \(999"):
            engine.replay([request])
