"""`mismatch record`: the assembly on hand-made token streams, then the proxy as a real subprocess
in front of a real vLLM server on CPU, driven by harnesses written as users write them (the
`openai` client, a messages list, tool results appended, the whole history re-sent each turn).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import free_port

from mismatch.cli import main
from mismatch.record.assembly import Exchange, Recorder, build_rollout
from mismatch.rollouts import check_rollout, full_tokens, load_rollouts, validate_file

REPO = Path(__file__).resolve().parents[1]
SYSTEM = "You are a helpful assistant with a calculator tool."
TOOLS = [{"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}]


# ---------------------------------------------------------------------------------------------
# Assembly on hand-made streams: tokens 1.. stand for a chat template's, 2 ends a turn.


def _exchange(prompt: list[int], sampled: list[int], *, session: str | None = None,
              role: str = "user") -> Exchange:
    return Exchange(prompt=np.array(prompt, np.int64), sampled=np.array(sampled, np.int64),
                    logprobs=[-0.25 - 0.01 * i for i in range(len(sampled))], endpoint="chat",
                    messages=[{"role": role, "content": "..."}], tools=None, params={"seed": 1},
                    session=session, started=0.0, seconds=0.1, finish_reason="stop")


def _rollout(exchanges: list[Exchange]) -> Any:
    raw = json.loads(json.dumps(build_rollout("r", exchanges, sampler={"engine": "vllm", "logprobs": "raw"},
                                              upstream={})))
    rollout, errors = check_rollout(raw, file="t", line=1, vocab_size=None)
    assert not errors, errors
    return rollout


def _assert_every_request_replays(rollout: Any, exchanges: list[Exchange]) -> None:
    """Each request's context is a path of the tree, its sampled tokens trainable with its log-probs."""
    for request, exchange in zip(rollout.meta["record"]["requests"], exchanges, strict=True):
        path = full_tokens(rollout, request["branch"])
        assert path[:len(exchange.tokens)].tolist() == exchange.tokens.tolist()


SYS = [1, 10, 11, 12]  # a first prompt


def test_a_faithful_conversation_is_one_branch_holding_every_request() -> None:
    first = _exchange(SYS, [20, 21, 2])
    second = _exchange([*first.tokens, 30, 31], [22, 2], role="tool")
    third = _exchange([*second.tokens, 32], [23, 24, 2])
    rollout = _rollout([first, second, third])
    [main_branch] = rollout.branches
    assert [(s.role, s.tokens.tolist(), s.trainable) for s in main_branch.segments] == [
        ("user", SYS, False), ("assistant", [20, 21, 2], True), ("tool", [30, 31], False),
        ("assistant", [22, 2], True), ("user", [32], False), ("assistant", [23, 24, 2], True)]
    assert main_branch.segments[1].logprobs.tolist() == [-0.25, -0.26, -0.27]
    assert [r["link"] for r in rollout.meta["record"]["requests"]] == ["new", "extends", "extends"]
    assert rollout.meta["record"]["drift"] == []
    _assert_every_request_replays(rollout, [first, second, third])


def test_rewritten_history_forks_where_it_changed_and_is_recorded_as_drift() -> None:
    first = _exchange(SYS, [20, 21, 2])
    second = _exchange([*first.tokens, 30], [22, 2])
    third = _exchange([*SYS, 20, 99, 2, 30, 22, 2, 31], [23, 2])  # sampled 21 was sent back as 99
    rollout = _rollout([first, second, third])
    main_branch, before = rollout.branches
    # The root is the conversation as last sent; what was sampled before the rewrite keeps its
    # own context on a branch of the same kind, so both turns replay as they were sampled.
    assert (before.kind, before.parent, before.fork_at) == ("main", "main", 5)
    assert [s.tokens.tolist() for s in before.segments] == [[21, 2], [30], [22, 2]]
    assert [s.trainable for s in before.segments] == [True, False, True]
    assert [(s.role, s.trainable) for s in main_branch.segments][-2:] == [("user", False), ("assistant", True)]
    [span] = rollout.meta["record"]["drift"]
    assert span == {"request": 2, "turn": 0, "at_turn": 2, "branch": before.id, "start": 5, "stored": [21],
                    "rendered_branch": "main", "rendered_start": 5, "rendered": [99]}
    _assert_every_request_replays(rollout, [first, second, third])


def test_a_subagent_forked_from_the_open_end_is_the_branch_once_the_main_conversation_goes_on() -> None:
    main_turn = _exchange(SYS, [20, 2])
    sub_1 = _exchange([*main_turn.tokens, 5, 40, 41], [42, 2])  # extends the main conversation's end
    sub_2 = _exchange([*sub_1.tokens, 5, 43], [44, 2])
    main_next = _exchange([*main_turn.tokens, 5, 50], [51, 2], role="tool")
    rollout = _rollout([main_turn, sub_1, sub_2, main_next])
    _, sub = rollout.branches
    assert (sub.kind, sub.parent, sub.fork_at) == ("subagent", "main", len(main_turn.tokens) + 1)
    assert [s.tokens.tolist() for s in sub.segments] == [[40, 41], [42, 2], [5, 43], [44, 2]]
    assert [r["link"] for r in rollout.meta["record"]["requests"]] == ["new", "extends", "extends", "fork"]
    assert rollout.meta["record"]["drift"] == []
    _assert_every_request_replays(rollout, [main_turn, sub_1, sub_2, main_next])


def test_grouping_by_tokens_and_by_session() -> None:
    recorder = Recorder(run_id="t", sampler={}, upstream={})
    first = _exchange(SYS, [20, 2])
    ids = [recorder.add(e, 0.0).id for e in [
        first,
        _exchange([*first.tokens, 30], [21, 2]),   # continues it
        _exchange([*SYS, 13], [20, 2]),            # shares only the first prompt: new
        _exchange(SYS, [20, 7]),                   # a resample of the first prompt: new
        _exchange([1, 10], [6, 2], session="s"),   # a session groups what tokens would not
        _exchange([9, 9, 9], [6, 2], session="s"),
    ]]
    assert ids == ["rec-t-000001", "rec-t-000001", "rec-t-000002", "rec-t-000003", "rec-t-000004",
                   "rec-t-000004"]
    assert [c.id for c in recorder.take_idle(10.0, 5.0)] == ids[:1] + ids[2:4] + ids[4:5]
    # Requests a session groups share no token: the earlier one forks off the root at 0.
    session = _rollout([_exchange([1, 10], [6, 2], session="s"), _exchange([9, 9, 9], [6, 2], session="s")])
    assert [(b.parent, b.fork_at) for b in session.branches] == [(None, None), ("main", 0)]


def test_the_sglang_dialect_reads_sglext_ids_and_hands_back_the_plain_answer() -> None:
    """No SGLang build runs on this CPU: these bodies are shaped as SGLang's serving_chat.py writes
    them (`sglext` at the response level; in a stream, one chunk with `choices: []`)."""
    from mismatch.record.dialects import Capture, prepare

    upstream_body, asked = prepare("sglang", "chat", {"model": "m", "messages": [], "stream": True})
    assert upstream_body["return_input_ids_in_sglext"] and upstream_body["return_output_ids_in_sglext"]
    assert upstream_body["logprobs"] is True and not asked.logprobs and not asked.token_ids
    capture = Capture("sglang", "chat", asked)
    lp = '{"content":[{"token":"a","bytes":[97],"logprob":-0.5,"top_logprobs":[]}]}'
    events = [b'{"id":"x","choices":[{"index":0,"delta":{"content":"a"},"logprobs":%s,"finish_reason":null}]}' % lp.encode(),
              b'{"id":"x","choices":[{"index":0,"delta":{"content":null},"logprobs":%s,"finish_reason":null}]}'
              % lp.replace('"a"', '"b"').replace("-0.5", "-1.25").encode(),
              b'{"id":"x","choices":[],"sglext":{"input_ids":[1,2,3],"output_ids":[[7,8]]}}']
    out = [capture.event(event) for event in events]
    assert out == [b'{"id":"x","choices":[{"index":0,"delta":{"content":"a"},"logprobs":null,"finish_reason":null}]}',
                   None, None]  # the logprob-only and the ids chunks exist only because the proxy asked
    [(prompt, choice)] = capture.exchanges()
    assert (prompt, choice.sampled, choice.logprobs) == ([1, 2, 3], [7, 8], [-0.5, -1.25])


# ---------------------------------------------------------------------------------------------
# The command's refusals: one line, exit 2, nothing written


def test_an_existing_out_and_an_unreachable_upstream_are_refused_in_one_line(tmp_path, capsys) -> None:
    existing = tmp_path / "rollouts.jsonl"
    existing.write_text("")
    assert main(["record", "--upstream", "http://127.0.0.1:9", "--out", str(existing)]) == 2
    assert capsys.readouterr().err == f"mismatch: error: {existing}: already exists; pass --force to replace it\n"
    fresh = tmp_path / "new.jsonl"
    assert main(["record", "--upstream", f"http://127.0.0.1:{free_port()}", "--out", str(fresh)]) == 2
    err = capsys.readouterr().err
    assert re.fullmatch(r"mismatch: error: --upstream http://127\.0\.0\.1:\d+: unreachable \(ConnectError: .*\); "
                        r"start the vLLM or SGLang server first\n", err), err
    assert not fresh.exists()
    assert main(["record", "--upstream", "127.0.0.1:8000", "--out", str(fresh)]) == 2
    assert "must start with http:// or https://" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------
# Against a real vLLM server


@pytest.fixture(scope="module")
def upstream(vllm_server) -> str:
    """`vllm serve` with the demo checkpoint and its tool calls parsed (hermes: <tool_call> JSON):
    the session's (conftest.vllm_server)."""
    pytest.importorskip("openai", reason="the harnesses use the openai client")
    return vllm_server


@dataclass(slots=True)
class Proxy:
    url: str               # http://127.0.0.1:PORT/v1
    process: subprocess.Popen
    stderr: Path

    def stop(self, sig: int = signal.SIGTERM) -> str:
        """Signal the proxy, wait for it; its stdout."""
        self.process.send_signal(sig)
        out, _ = self.process.communicate(timeout=60)
        return out


@contextmanager
def recording(upstream: str, out: Path, *args: str, env: dict[str, str] | None = None) -> Iterator[Proxy]:
    """`mismatch record` as users run it, on a free port, until the block ends (SIGKILL if left running)."""
    stderr = out.with_suffix(".stderr")
    with stderr.open("w") as sink:
        process = subprocess.Popen([sys.executable, "-m", "mismatch", "record", "--upstream", upstream,
                                    "--out", str(out), "--port", "0", *args], stdout=subprocess.PIPE,
                                   stderr=sink, text=True, env={**os.environ, **(env or {})})
    try:
        deadline = time.monotonic() + 60
        while not (found := re.search(r"recording (http://\S+/v1)", stderr.read_text())):
            if process.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"mismatch record did not start:\n{stderr.read_text()}")
            time.sleep(0.1)
        yield Proxy(url=found.group(1), process=process, stderr=stderr)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def _tool_result(call: dict[str, Any]) -> str:
    from mismatch.demo.toy_agent import calculate

    try:
        value = calculate(str(json.loads(call["function"]["arguments"])["expression"]))
    except (ValueError, KeyError, TypeError, SyntaxError, ZeroDivisionError):
        return "error: could not evaluate the call"
    return str(int(value)) if float(value).is_integer() else f"{value:.4g}"


def _turn(client: Any, model: str, messages: list[dict[str, Any]], seed: int) -> None:
    """One agent turn as harnesses write it: send the whole history, append the reply, run its
    tool calls and append their results (or nudge the model when it made none)."""
    reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=40,
                                           temperature=1.0, seed=seed).choices[0].message
    message: dict[str, Any] = {"role": "assistant", "content": reply.content}
    if reply.tool_calls:
        message["tool_calls"] = [{"id": call.id, "type": "function", "function": {
            "name": call.function.name, "arguments": call.function.arguments}} for call in reply.tool_calls]
    messages.append(message)
    for call in message.get("tool_calls", []):
        messages.append({"role": "tool", "tool_call_id": call["id"], "content": _tool_result(call)})
    if not reply.tool_calls:
        messages.append({"role": "user", "content": "Please check it with the calculator."})


def _agent(client: Any, model: str, question: str, seed: int, *, rewrite: str | None = None) -> list[dict[str, Any]]:
    """Three turns; before the third, `rewrite` edits the first tool call's arguments in the history:
    "separators" re-serializes the JSON compactly, "minify" strips its spaces as text."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    for turn in range(3):
        if turn == 2 and rewrite is not None:
            call = next(c for m in messages for c in m.get("tool_calls", []))
            arguments = call["function"]["arguments"]
            call["function"]["arguments"] = (json.dumps(json.loads(arguments), separators=(",", ":"))
                                             if rewrite == "separators" else arguments.replace(" ", ""))
            assert call["function"]["arguments"] != arguments, "the rewrite must change the harness's text"
        _turn(client, model, messages, seed * 100 + turn)
    return messages


@dataclass(slots=True)
class Recording:
    out: Path
    conversations: dict[str, list[dict[str, Any]]]  # name -> the harness's final messages
    subagent: list[dict[str, Any]]
    stdout: str
    errors: list[tuple[int, bytes, int, bytes]]  # (proxy status, body, direct status, body)


@pytest.fixture(scope="module")
def recorded(upstream, tmp_path_factory) -> Recording:
    """One recording session: a faithful agent, one whose harness re-serializes a tool call's
    JSON, one that minifies it, and an agent that delegates to a subagent forked from its
    history; then a bad request; then SIGTERM (nothing went idle: every line is the final flush)."""
    from openai import OpenAI

    out = tmp_path_factory.mktemp("record") / "rollouts.jsonl"
    with recording(upstream, out, "--idle-seconds", "3600") as proxy:
        client = OpenAI(base_url=proxy.url, api_key="unused")
        model = client.models.list().data[0].id
        conversations = {"faithful": _agent(client, model, "What is 12 + 30?", 1),
                         "separators": _agent(client, model, "What is 9 * 7?", 2, rewrite="separators"),
                         "minify": _agent(client, model, "What is 7 * 6?", 2, rewrite="minify")}
        # The main agent's first turn calls a tool it delegates: a subagent starts from its history
        # and works two turns before the main agent goes on with the subagent's answer.
        main_agent = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 45 - 3?"}]
        _turn(client, model, main_agent, 301)
        subagent = main_agent[:3] + [{"role": "user", "content": "Task: compute 45 - 3 with the calculator."}]
        _turn(client, model, subagent, 401)
        _turn(client, model, subagent, 402)
        _turn(client, model, main_agent, 302)
        conversations["main"] = main_agent
        errors = []
        for body in ({"model": model, "messages": [{"role": "robot", "content": "beep"}]},
                     {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 10**6}):
            answers = []
            for base in (proxy.url, f"{upstream}/v1"):
                request = urllib.request.Request(f"{base}/chat/completions", data=json.dumps(body).encode(),
                                                 headers={"Content-Type": "application/json"})
                try:
                    with urllib.request.urlopen(request, timeout=30) as answer:
                        answers += [answer.status, answer.read()]
                except urllib.error.HTTPError as e:
                    answers += [e.code, e.read()]
            errors.append(tuple(answers))
        stdout = proxy.stop(signal.SIGTERM)
        assert proxy.process.returncode == 0, proxy.stderr.read_text()
    return Recording(out=out, conversations=conversations, subagent=subagent, stdout=stdout, errors=errors)


def _by_question(path: Path) -> dict[str, Any]:
    return {rollout.messages[1]["content"]: rollout for rollout in load_rollouts(path)}


def test_sigterm_flushes_every_open_conversation_as_valid_rollouts(recorded) -> None:
    report = validate_file(recorded.out)
    assert report.ok and report.num_rollouts == 4, report.errors
    assert recorded.stdout.startswith(f"wrote 4 rollouts (13 recorded requests, 2 not recorded) to {recorded.out}")
    for rollout in load_rollouts(recorded.out):
        sampler = rollout.meta["sampler"]
        assert sampler == {"engine": "vllm", "logprobs": "raw", "dtype": "float32", "temperature": 1.0,
                           "top_p": 1.0, "top_k": -1, "min_p": 0.0}
        assert rollout.meta["record"]["upstream"]["logprobs_from"] == "server /server_info"


def test_upstream_errors_reach_the_harness_unchanged(recorded) -> None:
    for proxy_status, proxy_body, direct_status, direct_body in recorded.errors:
        assert proxy_status == direct_status >= 400
        assert proxy_body == direct_body


def test_each_request_is_recorded_with_the_prompt_the_server_rendered(recorded, upstream) -> None:
    """The tree holds, for every request, the very ids vLLM rendered from the harness's messages
    (asked again here through vLLM's own /tokenize), then what it sampled."""
    for name, rollout in _by_question(recorded.out).items():
        record = rollout.meta["record"]
        sent: list[list[Any]] = []  # each request's messages: the one it follows', then its own
        for request in record["requests"]:
            before = sent[request["after"]] if request["after"] is not None else []
            sent.append(before[:request["messages_from"]] + request["messages"])
            body = {"messages": sent[-1], "tools": record["tools"][request["tools"]], "add_generation_prompt": True}
            rendered = _post(f"{upstream}/tokenize", body)["tokens"]
            path = full_tokens(rollout, request["branch"])
            assert path[:request["prompt_tokens"]].tolist() == rendered, (name, request)
            assert len(path) >= request["prompt_tokens"] + request["sampled_tokens"]


def _post(url: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as answer:
        return json.loads(answer.read())


def test_the_subagent_is_a_branch_forked_where_its_prompt_leaves_the_main_conversation(recorded, upstream) -> None:
    rollout = _by_question(recorded.out)["What is 45 - 3?"]
    main_branch, sub = rollout.branches
    # Where the two prompts part, as vLLM renders them (not as the recorder saw them).
    def rendered(messages: list[Any]) -> list[int]:
        return _post(f"{upstream}/tokenize", {"messages": messages, "tools": TOOLS, "add_generation_prompt": True})["tokens"]
    main_prompt = rendered(recorded.conversations["main"][:4])  # its second request: ..., tool result
    sub_prompt = rendered(recorded.subagent[:4])                  # its first: ..., the task
    fork_at = next(i for i, (a, b) in enumerate(zip(main_prompt, sub_prompt)) if a != b)
    assert (main_branch.kind, sub.kind, sub.parent, sub.fork_at) == ("main", "subagent", "main", fork_at)
    assert [r["branch"] for r in rollout.meta["record"]["requests"]] == ["main", sub.id, sub.id, "main"]
    assert [s.role for s in sub.segments if s.trainable] == ["assistant", "assistant"]


def test_the_audit_replays_the_recording_bitwise_and_finds_the_rewrite_at_its_turn(recorded, upstream,
                                                                                 tiny_checkpoint, tmp_path,
                                                                                 capsys) -> None:
    out = tmp_path / "audit"
    assert main(["audit", str(tiny_checkpoint), "--rollouts", str(recorded.out), "--train", "hf",
                 "--infer", f"{upstream}/v1", "--out", str(out)]) == 0
    summary = json.loads((out / "summary.json").read_text())
    # Same server, same config: every sampled token's log-prob comes back bit for bit.
    assert summary["pairs"]["infer/sampler"]["bitwise_equal_frac"] == 1.0
    assert summary["pairs"]["infer/sampler"]["n_tokens"] == sum(
        len(s.tokens) for r in load_rollouts(recorded.out) for b in r.branches for s in b.segments if s.trainable)
    # vLLM parses tool-call arguments and renders them with the template's tojson, so JSON that
    # only changed its separators renders as sampled: no drift. Text the harness minified parses
    # to another value: drift, in the turn whose call it was, found when the third turn sent it.
    minify = _by_question(recorded.out)["What is 7 * 6?"]
    messages = recorded.conversations["minify"]
    first_call = next(i for i, m in enumerate(messages) if m.get("tool_calls"))
    turn = sum(m["role"] == "assistant" for m in messages[:first_call])
    [span] = summary["drift"]["spans"]
    assert (span["rollout"], span["turn"], span["at_turn"], span["source"]) == (minify.id, turn, 2, "recorded")
    assert span["kind"] == "whitespace" and span["in_tool_call"] and span["trainable_tokens"] >= 1
    assert span["stored"].replace(" ", "") == span["rendered"] and " " in span["stored"]
    assert summary["drift"]["num_rollouts_recorded"] == 4 and summary["drift"]["num_rollouts_drifted"] == 1
    # The rewrite forked the conversation where it changed; the sampled turns keep their contexts.
    assert [b.kind for b in minify.branches] == ["main", "main"]
    html = (out / "index.html").read_text()
    assert "Render drift: 1 drifted span" in html and minify.id in html and "at_turn" in html
    # `mismatch drift` reports the same span.
    capsys.readouterr()
    assert main(["drift", str(tiny_checkpoint), "--rollouts", str(recorded.out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["spans"] == [span]


NUM_CONVERSATIONS = 50


def _events(raw: bytes) -> list[dict[str, Any]]:
    return [json.loads(event[len(b"data: "):]) for event in raw.split(b"\n\n")
            if event.startswith(b"data: {")]


def _stream_text(raw: bytes) -> str:
    return "".join(choice["delta"].get("content") or "" for event in _events(raw) for choice in event["choices"])


def _canonical_stream(raw: bytes) -> tuple[str, list[bytes]]:
    """A stream as its harness reads it: the text, and every event with its text taken out.

    vLLM puts as many tokens in one event as its detokenizer has ready, so where one stream sends
    " use" and " the" another sends " use the": sent straight to the server twice, the same request
    with the same seed is cut differently (measured: 6 of 12 under load). So the text is compared
    whole, and the events byte for byte with their text emptied, text-only ones dropped. The last
    piece of text may ride in the finishing event or come just before it (seen in CI: the same
    request straight to the server and through the proxy, cut either way), so a finishing event's
    emptied text counts as no text."""
    kept = []
    for event in raw.split(b"\n\n"):
        event = re.sub(rb'"created":\d+', b'"created":0', event)
        event = re.sub(rb'"content":"(?:[^"\\]|\\.)*"', b'"content":""', event)
        if b'"delta":{"content":""},"logprobs":null,"finish_reason":null,' in event:
            continue
        event = event.replace(b'"delta":{"content":""},"logprobs":null,"finish_reason":"', b'"delta":{},"logprobs":null,"finish_reason":"')
        kept.append(event)
    return _stream_text(raw), kept


async def _converse(client: Any, model: str, k: int) -> list[tuple[dict[str, Any], bytes]]:
    """Two turns of conversation k (even: streamed); each request's body and its raw answer."""
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": f"What is {k} + {2 * k + 7}?"}]
    sent = []
    for turn in range(2):
        request = {"model": model, "messages": [dict(m) for m in messages], "max_tokens": 12,
                   "temperature": 1.0, "seed": 1000 * k + turn, "stream": k % 2 == 0}
        headers = {"X-Request-Id": f"conversation-{k}-{turn}"}  # vLLM's response id, so it is comparable
        if request["stream"]:
            async with client.chat.completions.with_streaming_response.create(**request, extra_headers=headers) as answer:
                raw = b"".join([chunk async for chunk in answer.iter_bytes()])
            text = _stream_text(raw)
        else:
            answer = await client.chat.completions.with_raw_response.create(**request, extra_headers=headers)
            raw = answer.http_response.content
            text = json.loads(raw)["choices"][0]["message"]["content"]
        sent.append((request, raw))
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": "And times 2?"}]
    return sent


async def _replay_directly(base: str, sent: list[tuple[dict[str, Any], bytes]], k: int) -> list[bytes]:
    import httpx

    answers = []
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        for turn, (request, _) in enumerate(sent):
            answer = await client.post("/chat/completions", json=request,
                                       headers={"X-Request-Id": f"conversation-{k}-{turn}"})
            answers.append(answer.content)
    return answers


def test_fifty_concurrent_conversations_are_recorded_once_each_and_answered_as_the_engine_answers(
        upstream, tmp_path) -> None:
    from openai import AsyncOpenAI

    out = tmp_path / "rollouts.jsonl"
    with recording(upstream, out, "--idle-seconds", "3600") as proxy:
        async def all_conversations() -> list[Any]:
            client = AsyncOpenAI(base_url=proxy.url, api_key="unused", max_retries=0)
            model = (await client.models.list()).data[0].id
            return await asyncio.gather(*[_converse(client, model, k) for k in range(NUM_CONVERSATIONS)])

        started = time.perf_counter()
        proxied = asyncio.run(all_conversations())
        seconds_proxied = time.perf_counter() - started
        assert proxy.stop(signal.SIGTERM).startswith(f"wrote {NUM_CONVERSATIONS} rollouts (100 recorded requests")
    started = time.perf_counter()

    async def directly() -> list[Any]:
        return await asyncio.gather(*[_replay_directly(f"{upstream}/v1", proxied[k], k)
                                      for k in range(NUM_CONVERSATIONS)])
    direct = asyncio.run(directly())
    print(f"\n{NUM_CONVERSATIONS} conversations x 2 turns: {seconds_proxied:.1f} s through the proxy, "
          f"{time.perf_counter() - started:.1f} s straight to vLLM")
    for k in range(NUM_CONVERSATIONS):
        for (request, through_proxy), straight in zip(proxied[k], direct[k], strict=True):
            if request["stream"]:
                assert _canonical_stream(through_proxy) == _canonical_stream(straight), (k, request)
            else:  # byte for byte, but for the second the server stamps
                assert re.sub(rb'"created":\d+', b"", through_proxy) == re.sub(rb'"created":\d+', b"", straight)
    rollouts = _by_question(out)
    assert len(rollouts) == NUM_CONVERSATIONS == len(load_rollouts(out))  # each once
    for k in range(NUM_CONVERSATIONS):
        rollout = rollouts[f"What is {k} + {2 * k + 7}?"]
        requests = rollout.meta["record"]["requests"]
        assert [r["params"]["seed"] for r in requests] == [1000 * k, 1000 * k + 1]
        # A reply that began with <tool_call> (no tools were offered: no parser) reaches the harness
        # without it (special tokens are skipped in text), so its history comes back rewritten from
        # the first sampled token: recorded as drift, the conversation still one rollout.
        assert requests[1]["link"] == ("drift" if rollout.meta["record"]["drift"] else "extends")
        # Complete: every sampled token is in the tree once, trainable, with its log-prob.
        sampled = [s for b in rollout.branches for s in b.segments if s.trainable]
        assert sum(len(s.tokens) for s in sampled) == sum(r["sampled_tokens"] for r in requests)
        assert all(s.logprobs is not None for s in sampled)


def test_kill_9_leaves_only_whole_lines_and_the_proxy_keeps_its_token(upstream, tmp_path) -> None:
    """A conversation idle past --idle-seconds is written while another streams; SIGKILL then
    loses the open one only. The proxy asks harnesses for its own token and never shows the
    upstream's key."""
    from openai import AuthenticationError, OpenAI

    out = tmp_path / "rollouts.jsonl"
    env = {"PROXY_TOKEN": "proxy-token-1", "UPSTREAM_KEY": "sk-upstream-secret-2"}
    with recording(upstream, out, "--idle-seconds", "0.5", "--api-key-env", "PROXY_TOKEN",
                   "--upstream-key-env", "UPSTREAM_KEY", env=env) as proxy:
        with pytest.raises(AuthenticationError):
            OpenAI(base_url=proxy.url, api_key="wrong", max_retries=0).models.list()
        client = OpenAI(base_url=proxy.url, api_key="proxy-token-1", max_retries=0)
        model = client.models.list().data[0].id
        _turn(client, model, [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "What is 2 + 2?"}], 7)
        deadline = time.monotonic() + 30
        while not out.read_bytes().endswith(b"\n"):
            assert time.monotonic() < deadline, "the idle conversation was not written"
            time.sleep(0.1)
        stream = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Count to 9."}],
                                                max_tokens=40, seed=3, stream=True)
        next(iter(stream))  # the second conversation is mid-stream
        proxy.process.kill()
        proxy.process.wait()
        assert "sk-upstream-secret-2" not in proxy.stderr.read_text()
    lines = out.read_bytes().split(b"\n")
    assert lines[-1] == b"" and all(json.loads(line) for line in lines[:-1])
    report = validate_file(out)
    assert report.ok and report.num_rollouts == 1


def test_the_recording_page_commands_are_ones_the_cli_takes(tmp_path, capsys) -> None:
    """docs/recording.md: the two commands, run against nothing, fail on their inputs
    (no server, no checkpoint), never on their usage."""
    import shlex

    block = re.search(r"<!-- record -->\s*```bash\n(.*?)```", (REPO / "docs/recording.md").read_text(), re.DOTALL)
    assert block is not None
    record, audit = [shlex.split(line) for line in block.group(1).splitlines() if line.strip()]
    assert record[:2] == ["mismatch", "record"] and audit[:2] == ["mismatch", "audit"]
    free = f"http://127.0.0.1:{free_port()}"
    swap = {"http://127.0.0.1:8000": free, "http://127.0.0.1:8000/v1": f"{free}/v1",
            "rollouts.jsonl": str(tmp_path / "rollouts.jsonl"), "audit/": str(tmp_path / "audit"),
            "CKPT": str(tmp_path / "no-checkpoint")}
    assert main([swap.get(arg, arg) for arg in record[1:]]) == 2
    assert "unreachable" in capsys.readouterr().err
    assert main([swap.get(arg, arg) for arg in audit[1:]]) == 2
    err = capsys.readouterr().err
    assert "no-checkpoint" in err and "No such option" not in err, err


def test_record_json_prints_what_it_wrote_on_stop(upstream, tmp_path) -> None:
    """`record --json`: on SIGTERM, stdout is one JSON object with the file and its counts."""
    from openai import OpenAI

    out = tmp_path / "rollouts.jsonl"
    with recording(upstream, out, "--json") as proxy:
        client = OpenAI(base_url=proxy.url, api_key="unused")
        model = client.models.list().data[0].id
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "2+2?"}], max_tokens=4)
        stdout = proxy.stop(signal.SIGTERM)
    assert json.loads(stdout) == {"out": str(out), "num_rollouts": 1, "num_requests": 1, "num_unrecorded": 0}
    assert validate_file(out).num_rollouts == 1
