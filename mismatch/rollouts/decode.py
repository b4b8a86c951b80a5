"""Decoders of format v1: a JSON text or value -> a `Rollout`, or every problem it has, worded.

Three paths, one rule set (`rules`). A JSONL line is decoded into the format's types (msgspec
checks each value's type as it parses) and its branches checked a branch at a time; a plain
value (a Parquet row, or a line that does not fit the types) is checked a branch at a time too
when every segment is plainly valid. Anything to word goes to the untyped decoder, which calls
the rules a segment at a time in a fixed order: the same errors whichever path a rollout came by.
"""

from __future__ import annotations

import itertools
import json
import sys
from dataclasses import dataclass, replace
from typing import Annotated, Any, Literal

import msgspec
import numpy as np

from mismatch.errors import RolloutError
from mismatch.rollouts.model import BRANCH_FIELDS, ROLES, ROLLOUT_FIELDS, SEGMENT_FIELDS, Branch, Rollout, Segment
from mismatch.rollouts.problems import Problems, key_path, short_id
from mismatch.rollouts.rules import (
    check_extra_logprobs,
    check_fields,
    check_id,
    check_items,
    check_kind,
    check_links,
    check_logprob_count,
    check_logprob_range,
    check_logprob_values,
    check_logprobs,
    check_messages,
    check_meta,
    check_object,
    check_role,
    check_rollout_object,
    check_index_shapes,
    check_indexer_topk,
    check_routed_experts,
    check_routing_shapes,
    check_sampling_mask,
    check_token_ids,
    check_tokens,
    check_trainable,
    check_tree,
    required,
    trained_on,
)

# Levels of arrays/objects a JSON text may have before it is parsed at all. json's C decoder
# recurses once per level: near the interpreter's recursion limit any finalizer the garbage
# collector runs there fails too (an "unraisable" RecursionError), so deep texts are refused first.
MAX_JSON_DEPTH = 256
UNPARSED = object()  # a line that is not JSON at all (distinct from a line that says `null`)


# ---------------------------------------------------------------------------------------------
# JSON text


def loads(text: str | bytes) -> tuple[object, str | None]:
    """(value, None) for valid JSON, else (UNPARSED, why) -- whatever the bytes hold."""
    if deeper_than(text, MAX_JSON_DEPTH):
        return UNPARSED, "arrays/objects nested too deeply"
    try:  # msgspec parses a dump's number arrays faster than json, into the same Python values
        return msgspec.json.decode(text), None
    except msgspec.DecodeError:
        pass  # not plain JSON to msgspec: json decides (it takes NaN/Infinity) and words the error
    try:
        return json.loads(text), None
    except json.JSONDecodeError as e:
        # removesuffix: "Unterminated string starting at" would read "... at at column N".
        return UNPARSED, f"{e.msg.removesuffix(' at')} at column {e.colno}"
    except UnicodeDecodeError as e:
        return UNPARSED, f"not UTF-8 (byte 0x{e.object[e.start]:02x} at offset {e.start})"
    except RecursionError:  # the C decoder recurses once per level of [ or {
        return UNPARSED, "arrays/objects nested too deeply"
    except ValueError:  # int() refuses a literal longer than sys.get_int_max_str_digits()
        return UNPARSED, f"a number has more than {sys.get_int_max_str_digits()} digits"


def deeper_than(text: str | bytes, limit: int) -> bool:
    """Whether a JSON text opens more than `limit` arrays/objects at once, without parsing it.

    Vectorized over the bytes: brackets inside strings (between unescaped quotes) do not count.
    A text with at most `limit` opening brackets in all cannot be deeper, so most lines cost two
    `count` calls.
    """
    raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    data = np.frombuffer(raw, dtype=np.uint8)
    index = np.arange(len(data))
    backslash = data == ord("\\")
    # A quote is escaped when an odd run of backslashes comes right before it.
    last_plain = np.maximum.accumulate(np.where(backslash, -1, index))
    quotes = np.flatnonzero(data == ord('"'))
    run = quotes - 1 - last_plain[np.maximum(quotes - 1, 0)]
    run[quotes == 0] = 0
    toggles = np.zeros(len(data) + 1, dtype=np.int64)
    toggles[quotes[run % 2 == 0] + 1] = 1
    in_string = (np.cumsum(toggles)[:-1] % 2).astype(bool)
    step = np.zeros(len(data), dtype=np.int64)
    step[(data == ord("[")) | (data == ord("{"))] = 1
    step[(data == ord("]")) | (data == ord("}"))] = -1
    step[in_string] = 0
    return int(np.cumsum(step).max()) > limit


# ---------------------------------------------------------------------------------------------
# A JSONL line decoded into the format's types: msgspec checks every value's type as it parses,
# so a valid rollout needs no scan over its values' types (the checker's costliest step, with the
# decoding itself). A line that does not fit the types, or breaks a rule they do not carry, is
# decoded again untyped for check_rollout, which words what is wrong: the same errors either way.
# A field the format does not name sends the line that way too: msgspec skips an unknown field's
# value without checking all of it (a string's UTF-8), where the untyped decoders refuse the line.


# The segment rules that are facts of a value's type are carried by the type, so a valid segment
# costs no Python call for them: a role of ROLES (check_role), a non-empty list of integers
# (check_token_list), true/false/null (check_trainable), lists of numbers (check_logprob_list) in an
# object (check_extra_logprobs). A segment that breaks one fails the decode: the untyped decoder words it.
_Role = Literal[ROLES]  # type: ignore[valid-type]  # Literal of the tuple's strings: ROLES is the one list
_Tokens = Annotated[list[int], msgspec.Meta(min_length=1)]


class _TypedSegment(msgspec.Struct, forbid_unknown_fields=True):
    role: _Role
    tokens: _Tokens
    logprobs: list[float] | None = None  # a JSON integer decodes as a float, as np.array makes it one
    trainable: bool | None = None
    extra_logprobs: dict[str, list[float] | None] | None = None
    routed_experts: Any = None  # shapes and ids: rules.check_routed_experts, on the plain lists
    sampling_mask: Any = None   # CSR offsets and ids: rules.check_sampling_mask
    indexer_topk: Any = None    # shapes and key positions: rules.check_indexer_topk


class _TypedBranch(msgspec.Struct, forbid_unknown_fields=True):
    id: str
    segments: list[_TypedSegment]
    kind: str | None = None
    parent: str | None = None
    fork_at: int | None = None


class _TypedRollout(msgspec.Struct, forbid_unknown_fields=True):
    id: str
    branches: list[_TypedBranch]
    meta: dict[str, Any] | None = None
    messages: list[Any] | None = None


_TYPED_DECODER = msgspec.json.Decoder(_TypedRollout)


@dataclass(frozen=True, slots=True)
class TypedLine:
    """A line as _TypedRollout, and its text (decoded again untyped when there is something to word)."""

    value: _TypedRollout
    text: bytes


def decode_line(text: bytes) -> tuple[object, str | None]:
    """A JSONL line (its newline included): as TypedLine when it fits the format's types, else as
    `loads` decodes it (which refuses a text nested too deeply before it parses it)."""
    try:
        return TypedLine(_TYPED_DECODER.decode(text), text), None
    except (msgspec.MsgspecError, RecursionError):  # not JSON to msgspec, another type, too deep
        pass
    # rstrip: a trailing newline would move an "unexpected end" error to a column on line 2.
    return loads(text.rstrip(b"\r\n"))


def raw_id(raw: object) -> object:
    """The `id` a decoded line or row says it has, whatever its type (None when it says none)."""
    if isinstance(raw, TypedLine):
        return raw.value.id
    return raw.get("id") if isinstance(raw, dict) else None


def _typed_rollout(typed: _TypedRollout, *, file: str, line: int, vocab_size: int | None,
                   num_experts: int | None) -> Rollout | None:
    """The Rollout of a typed line that breaks no rule, else None. (Its strings hold no lone
    surrogates: msgspec refuses those escapes, and json words them.)"""
    scratch = Problems(file=file, line=line)  # never read: any report hands the line on
    check_id(typed.id, "id", scratch)
    meta = check_meta(typed.meta, scratch)
    messages = check_messages(typed.messages, scratch)
    check_items(typed.branches, "branches", "branch", scratch)
    if scratch.errors:
        return None
    branches = []
    for raw in typed.branches:
        branch = _typed_branch(raw, vocab_size, num_experts, scratch)
        if branch is None:
            return None
        branches.append(branch)
    check_tree([{"id": b.id, "parent": b.parent, "fork_at": b.fork_at} for b in typed.branches], branches, scratch)
    check_routing_shapes(branches, scratch)
    check_index_shapes(branches, scratch)
    if scratch.errors:
        return None
    return Rollout(id=typed.id, meta=meta, branches=tuple(branches), messages=messages, file=file, line=line)


def _typed_branch(raw: _TypedBranch, vocab_size: int | None, num_experts: int | None,
                  scratch: Problems) -> Branch | None:
    check_id(raw.id, "id", scratch)
    check_links(raw.parent, raw.fork_at, "", scratch)
    kind = check_kind(raw.kind, raw.parent, "", scratch)
    check_items(raw.segments, "segments", "segment", scratch)
    if scratch.errors:
        return None
    segments = _typed_segments(raw.segments, vocab_size, scratch)
    if segments is None:
        return None
    for i, fields in enumerate(raw.segments):
        if fields.routed_experts is not None:
            routed = check_routed_experts(fields.routed_experts, "routed_experts", segments[i].num_tokens,
                                          num_experts, scratch)
            segments[i] = replace(segments[i], routed_experts=routed)
        if fields.sampling_mask is not None:
            kept = check_sampling_mask(fields.sampling_mask, "sampling_mask", segments[i].tokens, vocab_size, scratch)
            segments[i] = replace(segments[i], sampling_mask=kept)
        if fields.indexer_topk is not None:
            selected = check_indexer_topk(fields.indexer_topk, "indexer_topk", segments[i].num_tokens, scratch)
            segments[i] = replace(segments[i], indexer_topk=selected)
    if scratch.errors:
        return None
    return Branch(id=raw.id, kind=kind, parent=raw.parent, fork_at=raw.fork_at, segments=tuple(segments))


# ---------------------------------------------------------------------------------------------
# A branch's segments checked at once: one array and one range check over all its tokens (the
# same per log-prob name), the rules called on the whole branch. A rollout has dozens of segments
# and thousands of tokens; nothing here loops over tokens in Python.


def fast_segments(raw_segments: list, vocab_size: int | None) -> list[Segment] | None:
    """A branch's segments when every one of them is plainly valid, or None: then the untyped
    decoder checks each segment and words what is wrong. The plain values (a Parquet row's) are
    converted to the format's types as a JSONL line is decoded into them; routed experts and
    sampling masks always take the untyped path, and so does a field the format does not name."""
    try:
        typed = msgspec.convert(raw_segments, list[_TypedSegment])
    except msgspec.ValidationError:
        return None
    if any(s.routed_experts is not None or s.sampling_mask is not None or s.indexer_topk is not None for s in typed):
        return None
    return _typed_segments(typed, vocab_size, Problems(file="", line=0))


def _typed_segments(typed: list[_TypedSegment], vocab_size: int | None, scratch: Problems) -> list[Segment] | None:
    """A branch's segments, or None when the rules report anything to `scratch` (whose words are
    never read). Their types hold every per-segment rule but one (_TypedSegment); left to check
    are one log-prob per token, each segment, and then over the whole branch at once each token
    id within the vocabulary and each log-prob's range."""
    lengths = [len(segment.tokens) for segment in typed]
    extras: dict[str, list[list[float] | None]] = {}  # log-prob name -> each segment's values (None: none)
    for i, (segment, num_tokens) in enumerate(zip(typed, lengths)):
        if segment.logprobs is not None:
            check_logprob_count(len(segment.logprobs), num_tokens, "logprobs", scratch)
        for key, found in (segment.extra_logprobs or {}).items():
            if found is not None:
                check_logprob_count(len(found), num_tokens, "logprobs", scratch)
                extras.setdefault(key, [None] * len(typed))[i] = found
    if scratch.errors:
        return None
    token_ids = check_token_ids(list(itertools.chain.from_iterable(segment.tokens for segment in typed)), "tokens",
                                vocab_size, scratch, types_known=True)
    if scratch.errors:
        return None
    cuts = list(itertools.accumulate(lengths))[:-1]
    stored_of = _fast_logprobs([segment.logprobs for segment in typed], lengths, cuts, scratch)
    extra_of = {key: _fast_logprobs(by_segment, lengths, cuts, scratch) for key, by_segment in extras.items()}
    if scratch.errors:
        return None
    return [Segment(role=segment.role, tokens=ids, logprobs=stored_of[i],
                    trainable=trained_on(segment.role, segment.trainable),
                    extra_logprobs={key: values[i] for key, values in extra_of.items() if values[i] is not None})
            for i, (segment, ids) in enumerate(zip(typed, _split(token_ids, cuts)))]


def _split(values: np.ndarray, cuts: list[int]) -> list[np.ndarray]:
    """np.split's views, without its per-piece overhead (a rollout has dozens of segments)."""
    bounds = [0, *cuts, len(values)]
    return [values[start:end] for start, end in itertools.pairwise(bounds)]


def _fast_logprobs(per_segment: list, lengths: list[int], cuts: list[int],
                   scratch: Problems) -> list[np.ndarray | None]:
    """One log-prob name's arrays per segment (None where a segment has none), their values
    checked in one call (their types are _TypedSegment's, their counts _typed_segments')."""
    present = [values is not None for values in per_segment]
    if not any(present):
        return [None] * len(per_segment)
    flat = list(itertools.chain.from_iterable(values for values in per_segment if values is not None))
    logp = check_logprob_values(flat, "logprobs", scratch, types_known=True)
    if logp is None:
        return [None] * len(per_segment)  # reported: the caller hands the branch on
    check_logprob_range(logp, "logprobs", scratch)
    if all(present):
        return _split(logp, cuts)
    out, start = [], 0
    for has, length in zip(present, lengths):
        out.append(logp[start:start + length] if has else None)
        start += length if has else 0
    return out


# ---------------------------------------------------------------------------------------------
# The untyped decoder: every rule, a segment at a time, each problem worded with its field


def check_rollout(raw: object, *, file: str, line: int, vocab_size: int | None,
                  num_experts: int | None = None) -> tuple[Rollout | None, list[RolloutError]]:
    """Every problem of one parsed rollout; the `Rollout` only when there are none. `num_experts`
    (the checkpoint's, when known) bounds the expert ids of routed_experts."""
    if isinstance(raw, TypedLine):
        rollout = _typed_rollout(raw.value, file=file, line=line, vocab_size=vocab_size, num_experts=num_experts)
        if rollout is not None:
            return rollout, []
        raw = msgspec.json.decode(raw.text)  # something to word: the checks below, on the plain value
    problems = Problems(file=file, line=line)
    if not check_rollout_object(raw, problems):
        return None, problems.errors

    found_id = required(raw, "id", "id", problems)
    rollout_id = None if found_id is None else check_id(found_id, "id", problems)
    problems.rollout = short_id(rollout_id)

    meta = check_meta(raw.get("meta"), problems)
    messages = check_messages(raw.get("messages"), problems)
    check_fields(raw, ROLLOUT_FIELDS, None, problems)

    raw_branches = required(raw, "branches", "branches", problems)
    branches: list[Branch | None] = []
    if raw_branches is not None and check_items(raw_branches, "branches", "branch", problems):
        branches = [_check_branch(b, f"branches[{i}]", vocab_size, problems, num_experts)
                    for i, b in enumerate(raw_branches)]
        check_tree(raw_branches, branches, problems)
        check_routing_shapes(branches, problems)
        check_index_shapes(branches, problems)

    if problems.errors:
        return None, problems.errors
    return Rollout(id=rollout_id, meta=meta, branches=tuple(branches), messages=messages,
                   file=file, line=line), []


def _check_branch(raw: object, where: str, vocab_size: int | None, problems: Problems,
                  num_experts: int | None) -> Branch | None:
    if not check_object(raw, where, problems):
        return None
    num_errors = len(problems.errors)

    found_id = required(raw, "id", f"{where}.id", problems)
    branch_id = None if found_id is None else check_id(found_id, f"{where}.id", problems)
    parent, fork_at = raw.get("parent"), raw.get("fork_at")
    check_links(parent, fork_at, where, problems)
    kind = check_kind(raw.get("kind"), parent, where, problems)

    raw_segments = required(raw, "segments", f"{where}.segments", problems)
    segments: list[Segment | None] = []
    if raw_segments is not None and check_items(raw_segments, f"{where}.segments", "segment", problems):
        segments = fast_segments(raw_segments, vocab_size)
        if segments is None:  # something to word: each segment checked on its own
            segments = [_check_segment(s, f"{where}.segments[{i}]", vocab_size, problems, num_experts)
                        for i, s in enumerate(raw_segments)]
    check_fields(raw, BRANCH_FIELDS, where, problems)

    if len(problems.errors) > num_errors:
        return None
    return Branch(id=branch_id, kind=kind, parent=parent, fork_at=fork_at, segments=tuple(segments))


def _check_segment(raw: object, where: str, vocab_size: int | None, problems: Problems,
                   num_experts: int | None) -> Segment | None:
    if not check_object(raw, where, problems):
        return None
    num_errors = len(problems.errors)

    role = required(raw, "role", f"{where}.role", problems)
    if role is not None:
        check_role(role, f"{where}.role", problems)

    raw_tokens = required(raw, "tokens", f"{where}.tokens", problems)
    tokens = None if raw_tokens is None else check_tokens(raw_tokens, f"{where}.tokens", vocab_size, problems)
    num_tokens = None if tokens is None else len(tokens)

    # null means absent for every optional field (Parquet fills missing struct fields with null).
    raw_logprobs = raw.get("logprobs")
    logprobs = None if raw_logprobs is None else check_logprobs(raw_logprobs, f"{where}.logprobs",
                                                                num_tokens, problems)
    trainable = raw.get("trainable")
    check_trainable(trainable, f"{where}.trainable", problems)
    extra = _check_extra_logprobs(raw.get("extra_logprobs"), f"{where}.extra_logprobs", num_tokens, problems)
    raw_routed = raw.get("routed_experts")
    routed = None if raw_routed is None else check_routed_experts(raw_routed, f"{where}.routed_experts",
                                                                 num_tokens, num_experts, problems)
    raw_mask = raw.get("sampling_mask")
    kept = None if raw_mask is None else check_sampling_mask(raw_mask, f"{where}.sampling_mask", tokens,
                                                             vocab_size, problems)
    raw_selected = raw.get("indexer_topk")
    selected = None if raw_selected is None else check_indexer_topk(raw_selected, f"{where}.indexer_topk",
                                                                    num_tokens, problems)
    check_fields(raw, SEGMENT_FIELDS, where, problems)

    if len(problems.errors) > num_errors:
        return None
    return Segment(role=role, tokens=tokens, logprobs=logprobs, trainable=trained_on(role, trainable),
                   extra_logprobs=extra, routed_experts=routed, sampling_mask=kept, indexer_topk=selected)


def _check_extra_logprobs(raw_extra: object, where: str, num_tokens: int | None,
                          problems: Problems) -> dict[str, np.ndarray]:
    extra: dict[str, np.ndarray] = {}
    if raw_extra is not None and check_extra_logprobs(raw_extra, where, problems):
        for key, values in raw_extra.items():
            if values is not None:
                extra[key] = check_logprobs(values, f"{where}{key_path(key)}", num_tokens, problems)
    return extra
