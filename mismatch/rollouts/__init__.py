"""Rollout format v1: the data model, a streaming loader, and a validator that names every problem.

First step of the flow (ARCHITECTURE.md, "Load and check"): a JSONL/Parquet file -> `Rollout`s ->
replay. Beside it in this package: `trees` (a rollout tree's weights and tree metrics), `drift`
(re-rendering `messages` to find where a harness rewrote history) and `importers` (other
frameworks' dumps into format v1).
"""

from __future__ import annotations

import itertools
import json
import os
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from mismatch.errors import RolloutError

ROLES = ("system", "user", "assistant", "tool", "summary")
_ROLE_SET = frozenset(ROLES)
MODEL_ROLES = frozenset({"assistant", "summary"})
BRANCH_KINDS = ("main", "subagent", "summary", "subagent_summary")

PARQUET_BATCH_SIZE = 256
# Limits that turn hostile input into an error instead of a hang, a huge message or a RecursionError.
MAX_TREE_DEPTH = 1000  # parent links from the root; each level replays its whole context again
MAX_NESTING = 64  # levels of arrays/objects in free-form `meta` and `messages` (written to summary.json)
# Levels of arrays/objects a JSON text may have before it is parsed at all. json's C decoder
# recurses once per level: near the interpreter's recursion limit any finalizer the garbage
# collector runs there fails too (an "unraisable" RecursionError), so deep texts are refused first.
MAX_JSON_DEPTH = 256
MAX_NAME_CHARS = 60  # ids and names quoted in an error message are cut to this

_JSON_TYPE_NAMES = {dict: "object", list: "array", str: "string", bool: "boolean",
                    int: "number", float: "number", type(None): "null"}
_INT_TYPES = frozenset({int})
_NUMBER_TYPES = frozenset({int, float})  # bool is excluded on purpose: type(True) is bool
_UNPARSED = object()  # a line that is not JSON at all (distinct from a line that says `null`)


# eq=False everywhere: the generated __eq__ would compare numpy arrays, whose truth value is ambiguous.
@dataclass(kw_only=True, slots=True, frozen=True, eq=False)
class Segment:
    role: str
    tokens: np.ndarray  # int64, shape (num_tokens,)
    logprobs: np.ndarray | None  # float64, the sampler's log-prob of each token as stored at rollout time
    trainable: bool
    extra_logprobs: dict[str, np.ndarray] = field(default_factory=dict)
    # The experts the sampler routed each token to (MoE), int16 [num_tokens, moe_layers, top_k];
    # a row of -1 where it routed none (see _check_routed_experts).
    routed_experts: np.ndarray | None = None

    @property
    def generated(self) -> bool:
        """Sampled by the model (whether or not the trainer trains on it)."""
        return self.role in MODEL_ROLES

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


@dataclass(kw_only=True, slots=True, frozen=True, eq=False)
class Branch:
    id: str
    kind: str
    parent: str | None
    fork_at: int | None  # token offset in the parent's own stream
    segments: tuple[Segment, ...]

    @property
    def num_tokens(self) -> int:
        return sum(len(s.tokens) for s in self.segments)

    def stream(self) -> np.ndarray:
        """This branch's own tokens (without the context it forks from)."""
        return np.concatenate([s.tokens for s in self.segments])


@dataclass(kw_only=True, slots=True, frozen=True, eq=False)
class Rollout:
    id: str
    meta: dict
    branches: tuple[Branch, ...]
    messages: list | None
    file: str
    line: int  # 1-based line (JSONL) or row (Parquet)
    # id -> branch, so walking a deep or wide tree costs one dict lookup per step, not a scan.
    _by_id: dict[str, Branch] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_id", {b.id: b for b in self.branches})

    def branch(self, branch_id: str) -> Branch:
        try:
            return self._by_id[branch_id]
        except KeyError:
            raise KeyError(f"rollout {self.id!r} has no branch {branch_id!r}") from None


def context_tokens(rollout: Rollout, branch_id: str) -> np.ndarray:
    """The tokens a branch is replayed after: its parent's context plus the parent's stream up to fork_at."""
    pieces: list[np.ndarray] = []
    branch = rollout.branch(branch_id)
    # Iterative, not recursive: validation guarantees the parent links end at the root.
    while branch.parent is not None:
        parent = rollout.branch(branch.parent)
        pieces.append(_prefix(parent, branch.fork_at))
        branch = parent
    if not pieces:
        return np.zeros(0, dtype=np.int64)
    return np.concatenate(pieces[::-1])


def _prefix(branch: Branch, num_tokens: int) -> np.ndarray:
    """The first num_tokens of a branch's stream, touching only the segments it needs."""
    parts, left = [], num_tokens
    for segment in branch.segments:
        if left <= 0:
            break
        parts.append(segment.tokens[:left])
        left -= len(segment.tokens)
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def full_routed_experts(rollout: Rollout, branch_id: str, shape: tuple[int, int]) -> np.ndarray:
    """The stored experts of every token of `full_tokens`, int16 [tokens, layers, k] for a
    (layers, k) `shape`; -1 rows for the tokens whose segment stored none."""
    def rows(segments: tuple[Segment, ...], num_tokens: int | None) -> list[np.ndarray]:
        parts, left = [], num_tokens
        for segment in segments:
            if left is not None and left <= 0:
                break
            stored = segment.routed_experts
            if stored is None:
                stored = np.full((len(segment.tokens), *shape), -1, dtype=np.int16)
            parts.append(stored if left is None else stored[:left])
            left = None if left is None else left - len(segment.tokens)
        return parts

    branch = rollout.branch(branch_id)
    pieces = [rows(branch.segments, None)]
    while branch.parent is not None:  # the context, as context_tokens walks it
        parent = rollout.branch(branch.parent)
        pieces.append(rows(parent.segments, branch.fork_at))
        branch = parent
    parts = [part for piece in pieces[::-1] for part in piece]
    return np.concatenate(parts) if parts else np.zeros((0, *shape), dtype=np.int16)


def routing_shape(rollout: Rollout) -> tuple[int, int] | None:
    """(MoE layers, top-k) of the rollout's stored routed_experts, or None when it stores none
    (the validator holds every segment of a file to one shape)."""
    first = _first_routed(rollout)
    return first[1] if first is not None else None


def _first_routed(rollout: Rollout) -> tuple[str, tuple[int, int]] | None:
    """(field path, (layers, k)) of the rollout's first segment with routed_experts."""
    for i, branch in enumerate(rollout.branches):
        for j, segment in enumerate(branch.segments):
            if segment.routed_experts is not None:
                return f"branches[{i}].segments[{j}].routed_experts", segment.routed_experts.shape[1:]
    return None


def full_tokens(rollout: Rollout, branch_id: str) -> np.ndarray:
    """Context plus the branch's own stream: the whole sequence the trainer sees for this branch."""
    return np.concatenate([context_tokens(rollout, branch_id), rollout.branch(branch_id).stream()])


@dataclass(kw_only=True, slots=True, frozen=True)
class ValidationReport:
    num_rollouts: int  # valid rollouts
    num_invalid: int  # rollouts (lines/rows) with at least one error
    num_branches: int  # counts below are over valid rollouts only
    num_tokens: int  # sum of each branch's own stream (shared context is not counted twice)
    num_trainable_tokens: int
    errors: list[RolloutError]
    truncated: bool  # more than max_errors errors; the rest were counted in num_invalid only

    @property
    def ok(self) -> bool:
        return not self.errors


# ---------------------------------------------------------------------------------------------
# Checking one rollout


@dataclass(slots=True)
class _Problems:
    file: str
    line: int
    rollout: str | None = None
    errors: list[RolloutError] = field(default_factory=list)

    def add(self, where: str | None, reason: str) -> None:
        self.errors.append(RolloutError(reason, file=self.file, line=self.line,
                                        rollout=self.rollout, field=where))


def _json_type(value: object) -> str:
    return _JSON_TYPE_NAMES.get(type(value), type(value).__name__)


def _show(value: object) -> str:
    """A value as the user wrote it (JSON), cut short so a reason stays one line."""
    try:
        text = json.dumps(value, default=repr)
    except (RecursionError, ValueError):  # nested too deeply to print, or an int too long for str()
        return f"<{_json_type(value)} too large to show>"
    return text if len(text) <= 40 else text[:37] + "..."


def _name(text: str) -> str:
    """repr() of an id or name for a message, cut to MAX_NAME_CHARS (a 10 MB id stays one short line)."""
    return repr(text) if len(text) <= MAX_NAME_CHARS else repr(text[:MAX_NAME_CHARS]) + "..."


def _nesting(value: object) -> int:
    """Levels of arrays/objects in a JSON value, counted without recursion."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        node, level = stack.pop()
        if isinstance(node, (dict, list)):
            deepest = max(deepest, level)
            stack.extend((child, level + 1) for child in (node.values() if isinstance(node, dict) else node))
    return deepest


def _key_path(name: object) -> str:
    if isinstance(name, str) and name.isidentifier() and len(name) <= MAX_NAME_CHARS:
        return f".{name}"
    return f"[{_show(name)}]"


def _first_of(count: int, what: str) -> str:
    return "" if count == 1 else f" (first of {count} {what})"


def _first_bad_type(values: list, allowed: frozenset[type]) -> int | None:
    # set(map(type, ...)) runs in C, so the common all-good case costs no Python loop per token.
    if set(map(type, values)) <= allowed:
        return None
    return next(i for i, v in enumerate(values) if type(v) not in allowed)


def _required(obj: dict, key: str, where: str, problems: _Problems) -> object | None:
    if key not in obj:
        problems.add(where, "missing required field")
    elif obj[key] is None:
        problems.add(where, "required field is null")
    return obj.get(key)


def _check_id(value: object, where: str, problems: _Problems) -> str | None:
    if not isinstance(value, str) or not value:
        problems.add(where, f"must be a non-empty string, got {_show(value)}")
        return None
    try:
        value.encode("utf-8")  # JSON's \ud800 escapes decode to lone surrogates: no text file holds them
    except UnicodeEncodeError:
        problems.add(where, f"must be valid Unicode text, got {_show(value)} (a lone surrogate)")
        return None
    return value


def _check_tokens(value: object, where: str, vocab_size: int | None, problems: _Problems) -> np.ndarray | None:
    if not isinstance(value, list):
        problems.add(where, f"must be an array of integers, got {_json_type(value)}")
        return None
    if not value:
        problems.add(where, "empty token list")
        return None
    bad = _first_bad_type(value, _INT_TYPES)
    if bad is not None:
        problems.add(where, f"token at index {bad} is not an integer: {_show(value[bad])}")
        return None
    try:
        tokens = np.array(value, dtype=np.int64)
    except OverflowError:
        i = next(i for i, t in enumerate(value) if not -(2**63) <= t < 2**63)
        problems.add(where, f"token id {_show(value[i])} at index {i} does not fit in int64")
        return None
    if tokens.min() >= 0 and (vocab_size is None or tokens.max() < vocab_size):
        return tokens  # the common case in two reductions; the scans below name what is wrong
    negative = np.flatnonzero(tokens < 0)
    if negative.size:
        i = int(negative[0])
        problems.add(where, f"token id {tokens[i]} at index {i} is negative{_first_of(negative.size, 'negative')}")
    if vocab_size is not None:
        too_big = np.flatnonzero(tokens >= vocab_size)
        if too_big.size:
            i = int(too_big[0])
            problems.add(where, f"token id {tokens[i]} at index {i} is >= vocab size {vocab_size}"
                                f"{_first_of(too_big.size, 'out of vocab')}")
    return tokens


def _check_logprobs(value: object, where: str, num_tokens: int | None, problems: _Problems) -> np.ndarray | None:
    if not isinstance(value, list):
        problems.add(where, f"must be an array of numbers, got {_json_type(value)}")
        return None
    bad = _first_bad_type(value, _NUMBER_TYPES)
    if bad is not None:
        problems.add(where, f"logprob at index {bad} is not a number: {_show(value[bad])}")
        return None
    try:
        logp = np.array(value, dtype=np.float64)
    except OverflowError:
        problems.add(where, "an integer logprob is too large for float64")
        return None
    if num_tokens is not None and len(logp) != num_tokens:
        problems.add(where, f"{len(logp)} logprobs for {num_tokens} tokens")
    if ((logp <= 0.0) & (logp > -np.inf)).all():  # finite and <= 0 (NaN fails both): nothing to name
        return logp
    nonfinite = np.flatnonzero(~np.isfinite(logp))
    if nonfinite.size:
        i = int(nonfinite[0])
        problems.add(where, f"logprob at index {i} is {float(logp[i])!r}{_first_of(nonfinite.size, 'non-finite')}")
    # Any positive value is a bug upstream (a probability above 1), even 1e-6 from rounding;
    # +inf is already reported as non-finite.
    positive = np.flatnonzero(np.isfinite(logp) & (logp > 0))
    if positive.size:
        i = int(positive[0])
        problems.add(where, f"logprob at index {i} is {float(logp[i])!r} > 0{_first_of(positive.size, 'positive')}")
    return logp


MAX_EXPERT_ID = np.iinfo(np.int16).max  # routed_experts are held as int16; no model has more experts


def _routing_row_shape(row: object) -> tuple[int, int] | None:
    """(layers, k) of one token's [layers][top-k] row, None when it is not such a rectangle."""
    if not isinstance(row, list) or not row or not all(isinstance(layer, list) for layer in row):
        return None
    k = len(row[0])
    return (len(row), k) if k and all(len(layer) == k for layer in row) else None


def _unflat(index: int, layers: int, k: int) -> tuple[int, int, int]:
    """(row, layer, slot) of an index into the flattened [rows][layers][k] ids."""
    row, rest = divmod(index, layers * k)
    return (row, *divmod(rest, k))


def _check_routed_experts(value: object, where: str, num_tokens: int | None, num_experts: int | None,
                          problems: _Problems) -> np.ndarray | None:
    """A segment's routed_experts: one [moe layers][top-k] array of expert ids per token, as vLLM
    returns them (CompletionOutput.routed_experts, [seq_len, layer_num, topk]); null for a token
    the engine routed none (a stream's last token is never fed; vLLM's routed_experts_prompt_start
    skips prompt tokens an earlier turn returned). Returns int16 [tokens, layers, k], -1 rows for
    null; None when every row is null. Each row's ids are kept sorted."""
    if not isinstance(value, list):
        problems.add(where, f"must be an array (one [layers][top-k] array of expert ids per token), "
                            f"got {_json_type(value)}")
        return None
    if num_tokens is not None and len(value) != num_tokens:
        problems.add(where, f"{len(value)} rows for {num_tokens} tokens (one [layers][top-k] row per "
                            "token, null for a token the engine routed none)")
        return None
    present = [i for i, row in enumerate(value) if row is not None]
    if not present:
        return None
    shape = _routing_row_shape(value[present[0]])
    bad = next((i for i in present if _routing_row_shape(value[i]) != shape), None) if shape else present[0]
    if bad is not None:
        expected = f"like token {present[0]}'s {_layers_by_k(shape)}" if shape else \
            "a non-empty array of equally long non-empty arrays"
        problems.add(where, f"token {bad}: must be [layers][top-k] expert ids ({expected}), "
                            f"got {_show(value[bad])}")
        return None
    layers, k = shape
    flat = [expert for i in present for layer in value[i] for expert in layer]
    bad = _first_bad_type(flat, _INT_TYPES)  # bool is not an expert id: type(True) is bool
    if bad is not None:
        n, layer, j = _unflat(bad, layers, k)
        problems.add(where, f"token {present[n]} layer {layer}: expert id at index {j} is not an integer: "
                            f"{_show(flat[bad])}")
        return None
    limit, why = ((num_experts, f"the checkpoint's {num_experts} experts") if num_experts is not None
                  else (MAX_EXPERT_ID + 1, f"{MAX_EXPERT_ID + 1} (no model has that many experts)"))
    try:
        ids = np.array(flat, dtype=np.int64)
        wrong = np.flatnonzero((ids < 0) | (ids >= limit))
    except OverflowError:  # past int64: out of range whatever the model
        wrong = np.array([i for i, expert in enumerate(flat) if not 0 <= expert < limit])
    if len(wrong):
        n, layer, j = _unflat(int(wrong[0]), layers, k)
        expert = flat[int(wrong[0])]
        problems.add(where, f"token {present[n]} layer {layer}: expert id {_show(expert)} is "
                            f"{'negative' if expert < 0 else f'>= {why}'}{_first_of(len(wrong), 'out of range')}")
        return None
    experts = ids.reshape(len(present), layers, k)
    ordered = np.sort(experts, axis=-1)
    twice = np.argwhere(ordered[..., 1:] == ordered[..., :-1])
    if len(twice):
        n, layer, j = (int(x) for x in twice[0])
        problems.add(where, f"token {present[n]} layer {layer}: expert {int(ordered[n, layer, j])} appears "
                            "twice in one top-k")
        return None
    out = np.full((len(value), *shape), -1, dtype=np.int16)
    out[present] = ordered  # sorted: a top-k is a set, and passes compare as sets (engines/routing.py)
    return out


def _check_segment(raw: object, where: str, vocab_size: int | None, problems: _Problems,
                   num_experts: int | None = None) -> Segment | None:
    if not isinstance(raw, dict):
        problems.add(where, f"must be an object, got {_json_type(raw)}")
        return None
    num_errors = len(problems.errors)

    role = _required(raw, "role", f"{where}.role", problems)
    if role is not None and not isinstance(role, str):
        problems.add(f"{where}.role", f"must be a string, got {_json_type(role)}")
    elif role is not None and role not in ROLES:
        problems.add(f"{where}.role", f"unknown role {_name(role)} (expected one of: {', '.join(ROLES)})")

    raw_tokens = _required(raw, "tokens", f"{where}.tokens", problems)
    tokens = None if raw_tokens is None else _check_tokens(raw_tokens, f"{where}.tokens", vocab_size, problems)
    num_tokens = None if tokens is None else len(tokens)

    # null means absent for every optional field (Parquet fills missing struct fields with null).
    raw_logprobs = raw.get("logprobs")
    logprobs = None if raw_logprobs is None else _check_logprobs(raw_logprobs, f"{where}.logprobs",
                                                                 num_tokens, problems)

    trainable = raw.get("trainable")
    if trainable is not None and not isinstance(trainable, bool):
        problems.add(f"{where}.trainable", f"must be true or false, got {_show(trainable)}")

    extra: dict[str, np.ndarray] = {}
    raw_extra = raw.get("extra_logprobs")
    if raw_extra is not None and not isinstance(raw_extra, dict):
        problems.add(f"{where}.extra_logprobs", f"must be an object, got {_json_type(raw_extra)}")
    elif raw_extra is not None:
        for name, values in raw_extra.items():
            if values is not None:
                extra[name] = _check_logprobs(values, f"{where}.extra_logprobs{_key_path(name)}",
                                              num_tokens, problems)

    raw_routed = raw.get("routed_experts")
    routed = None if raw_routed is None else _check_routed_experts(raw_routed, f"{where}.routed_experts",
                                                                  num_tokens, num_experts, problems)

    if len(problems.errors) > num_errors:
        return None
    return Segment(role=role, tokens=tokens, logprobs=logprobs,
                   trainable=role in MODEL_ROLES if trainable is None else trainable,
                   extra_logprobs=extra, routed_experts=routed)


def _fast_segments(raw_segments: list, vocab_size: int | None) -> list[Segment] | None:
    """A branch's segments when every one of them is plainly valid, or None: then _check_segment
    checks each segment and words what is wrong. Routed experts always take that path."""
    parts = []
    for raw in raw_segments:
        if not isinstance(raw, dict) or raw.get("routed_experts") is not None:
            return None
        role, values, stored = raw.get("role"), raw.get("tokens"), raw.get("logprobs")
        trainable, extra = raw.get("trainable"), raw.get("extra_logprobs")
        if (not isinstance(role, str) or not isinstance(values, list)
                or not (stored is None or isinstance(stored, list))
                or not (trainable is None or type(trainable) is bool)
                or not (extra is None or isinstance(extra, dict))
                or any(found is not None and not isinstance(found, list) for found in (extra or {}).values())):
            return None
        parts.append(_SegmentFields(role, values, stored, trainable, extra))
    return _plain_segments(parts, vocab_size, typed=False)


@dataclass(frozen=True, slots=True)
class _SegmentFields:
    """A segment's fields as decoded: lists of JSON values, not yet arrays."""

    role: str
    tokens: list
    logprobs: list | None
    trainable: bool | None
    extra_logprobs: dict[str, list | None] | None


def _plain_segments(parts: list[_SegmentFields], vocab_size: int | None, *, typed: bool) -> list[Segment] | None:
    """A branch's segments from fields of the right JSON kinds, checked a branch at a time (one
    array and one range check over all its tokens, the same per log-prob name), or None when one
    would need a word. `typed`: the decoder checked every list's values' types (_TypedRollout),
    so no scan looks at them again."""
    tokens, logprobs, extras, shapes = [], [], {}, []
    for part in parts:
        if part.role not in _ROLE_SET or not part.tokens:
            return None
        tokens.append(part.tokens)
        logprobs.append(part.logprobs)
        for name, found in (part.extra_logprobs or {}).items():
            extras.setdefault(name, {})[len(shapes)] = found
        trainable = part.role in MODEL_ROLES if part.trainable is None else part.trainable
        shapes.append((part.role, len(part.tokens), trainable))
    lengths = [length for _, length, _ in shapes]
    token_ids = _plain_array(tokens, None if typed else _INT_TYPES, np.int64)
    if token_ids is None or token_ids.min() < 0 or (vocab_size is not None and token_ids.max() >= vocab_size):
        return None
    cuts = list(itertools.accumulate(lengths))[:-1]
    numbers = None if typed else _NUMBER_TYPES
    stored_of = _fast_logprobs(logprobs, lengths, cuts, numbers)
    extra_of = {name: _fast_logprobs([by_segment.get(i) for i in range(len(shapes))], lengths, cuts, numbers)
                for name, by_segment in extras.items()}
    if stored_of is None or any(values is None for values in extra_of.values()):
        return None
    return [Segment(role=role, tokens=ids, logprobs=stored_of[i], trainable=trainable,
                    extra_logprobs={name: values[i] for name, values in extra_of.items() if values[i] is not None})
            for i, ((role, _, trainable), ids) in enumerate(zip(shapes, _split(token_ids, cuts)))]


def _plain_array(lists: list[list], allowed: frozenset[type] | None, dtype: type) -> np.ndarray | None:
    """The lists' values as one array, or None when one is not of an allowed type (None: their
    types are known) or does not fit."""
    flat = list(itertools.chain.from_iterable(lists))
    if allowed is not None and not set(map(type, flat)) <= allowed:  # in C: no Python loop per value
        return None
    try:
        return np.array(flat, dtype=dtype)
    except OverflowError:
        return None


def _split(values: np.ndarray, cuts: list[int]) -> list[np.ndarray]:
    """np.split's views, without its per-piece overhead (a rollout has dozens of segments)."""
    bounds = [0, *cuts, len(values)]
    return [values[start:end] for start, end in itertools.pairwise(bounds)]


def _fast_logprobs(per_segment: list, lengths: list[int], cuts: list[int],
                   allowed: frozenset[type] | None) -> list[np.ndarray | None] | None:
    """One log-prob name's arrays per segment (None where a segment has none), or None when any
    segment's would need a word: a count that is not its tokens', a non-number, a value not <= 0."""
    present = [values is not None for values in per_segment]
    if not any(present):
        return [None] * len(per_segment)
    if any(values is not None and len(values) != length for values, length in zip(per_segment, lengths)):
        return None
    logp = _plain_array([values for values in per_segment if values is not None], allowed, np.float64)
    if logp is None or not ((logp <= 0.0) & (logp > -np.inf)).all():
        return None
    if all(present):
        return _split(logp, cuts)
    out, start = [], 0
    for has, length in zip(present, lengths):
        out.append(logp[start:start + length] if has else None)
        start += length if has else 0
    return out


def _check_branch(raw: object, where: str, vocab_size: int | None, problems: _Problems,
                  num_experts: int | None = None) -> Branch | None:
    if not isinstance(raw, dict):
        problems.add(where, f"must be an object, got {_json_type(raw)}")
        return None
    num_errors = len(problems.errors)

    raw_id = _required(raw, "id", f"{where}.id", problems)
    branch_id = None if raw_id is None else _check_id(raw_id, f"{where}.id", problems)

    parent = raw.get("parent")
    if parent is not None:
        _check_id(parent, f"{where}.parent", problems)

    fork_at = raw.get("fork_at")
    if fork_at is not None and type(fork_at) is not int:
        problems.add(f"{where}.fork_at", f"must be an integer or null, got {_show(fork_at)}")
    elif parent is None and fork_at is not None:
        problems.add(f"{where}.fork_at", f"must be null for a root branch (parent null), got {fork_at}")
    elif parent is not None and fork_at is None:
        problems.add(f"{where}.fork_at", "missing required field (for a branch with a parent)")

    kind = raw.get("kind")
    if kind is None and parent is None:
        kind = "main"  # a plain single-stream rollout need not say so
    elif kind is None:
        problems.add(f"{where}.kind", "missing required field (for a branch with a parent)")
    elif not isinstance(kind, str):
        problems.add(f"{where}.kind", f"must be a string, got {_json_type(kind)}")
    elif kind not in BRANCH_KINDS:
        problems.add(f"{where}.kind", f"unknown branch kind {_name(kind)} "
                                      f"(expected one of: {', '.join(BRANCH_KINDS)})")

    raw_segments = _required(raw, "segments", f"{where}.segments", problems)
    segments: list[Segment | None] = []
    if raw_segments is not None and not isinstance(raw_segments, list):
        problems.add(f"{where}.segments", f"must be an array, got {_json_type(raw_segments)}")
    elif raw_segments is not None and not raw_segments:
        problems.add(f"{where}.segments", "empty segment list")
    elif raw_segments is not None:
        segments = _fast_segments(raw_segments, vocab_size)
        if segments is None:  # something to word: each segment checked on its own
            segments = [_check_segment(s, f"{where}.segments[{i}]", vocab_size, problems, num_experts)
                        for i, s in enumerate(raw_segments)]

    if len(problems.errors) > num_errors:
        return None
    return Branch(id=branch_id, kind=kind, parent=parent, fork_at=fork_at, segments=tuple(segments))


def _find_cycles(parent_of: dict[str, str]) -> list[list[str]]:
    """Each cycle of parent links once, in walk order from the first branch reached."""
    walk_of: dict[str, str] = {}  # branch -> the start of the walk that first reached it
    cycles = []
    for start in parent_of:
        path: list[str] = []
        node: str | None = start
        while node is not None and node not in walk_of:
            walk_of[node] = start
            path.append(node)
            node = parent_of.get(node)
        if node is not None and walk_of[node] == start:  # came back to this very walk: a new cycle
            cycles.append(path[path.index(node):])
    return cycles


def _check_tree(raw_branches: list, branches: list[Branch | None], problems: _Problems) -> None:
    """Cross-branch rules: unique ids, one root, parents that exist, no cycles, fork_at in range."""
    # Only fields whose own type checks passed take part; their type errors are already reported.
    index_of: dict[str, int] = {}
    fields: dict[str, tuple[str | None, object]] = {}  # id -> (parent, fork_at) of its first occurrence
    for i, raw in enumerate(raw_branches):
        if not isinstance(raw, dict) or not isinstance(raw.get("id"), str) or not raw["id"]:
            continue
        branch_id = raw["id"]
        if branch_id in index_of:
            problems.add(f"branches[{i}].id",
                         f"duplicate branch id {_name(branch_id)} (also branches[{index_of[branch_id]}])")
            continue
        index_of[branch_id] = i
        fields[branch_id] = (raw.get("parent"), raw.get("fork_at"))

    roots = [index_of[branch_id] for branch_id, (parent, _) in fields.items() if parent is None]
    if index_of and not roots:
        problems.add("branches", "no root branch; exactly one branch must have parent null")
    for i in roots[1:]:
        problems.add(f"branches[{i}].parent",
                     f"a second root branch (parent null) besides branches[{roots[0]}]; exactly one is allowed")

    parent_of: dict[str, str] = {}
    for branch_id, (parent, _) in fields.items():
        if not isinstance(parent, str) or not parent:
            continue
        if parent not in index_of:
            problems.add(f"branches[{index_of[branch_id]}].parent",
                         f"parent {_name(parent)} is not a branch of this rollout")
            continue
        parent_of[branch_id] = parent

    in_cycle: set[str] = set()
    for cycle in _find_cycles(parent_of):
        first = min(cycle, key=index_of.__getitem__)
        k = cycle.index(first)
        loop = [_short_id(b) for b in cycle[k:] + cycle[:k] + [first]]
        if len(loop) > 8:  # a 10k-branch cycle is named by its ends, not by 10k ids on one line
            loop = [*loop[:4], "...", *loop[-3:]]
        size = f" ({len(cycle)} branches)" if len(cycle) > 7 else ""
        problems.add(f"branches[{index_of[first]}].parent",
                     f"parent links form a cycle: {' -> '.join(loop)}{size}")
        in_cycle.update(cycle)

    for branch_id, parent in parent_of.items():
        fork_at = fields[branch_id][1]
        if type(fork_at) is not int or branch_id in in_cycle:
            continue
        where = f"branches[{index_of[branch_id]}].fork_at"
        parent_branch = branches[index_of[parent]]
        if parent_branch is None:  # parent's own length unknown (its errors are reported)
            if fork_at < 0:
                problems.add(where, f"fork_at {fork_at} is negative")
        elif not 0 <= fork_at <= parent_branch.num_tokens:
            problems.add(where, f"fork_at {fork_at} is outside 0..{parent_branch.num_tokens} "
                                f"(the length of parent {_name(parent)})")

    deepest = _deepest_branch(parent_of, in_cycle)
    if deepest is not None and deepest[1] > MAX_TREE_DEPTH:
        branch_id, depth = deepest
        problems.add(f"branches[{index_of[branch_id]}].parent",
                     f"branch {_name(branch_id)} is {depth} levels below the root; at most "
                     f"{MAX_TREE_DEPTH} are allowed (each level replays its whole context again)")


def _deepest_branch(parent_of: dict[str, str], in_cycle: set[str]) -> tuple[str, int] | None:
    """(id, depth) of the branch with the most parent links above it (first such in `parent_of` order).

    Iterative with memo: O(branches) even for a 10k-level chain. Branches that hang off a cycle
    have no depth (the cycle is reported).
    """
    depth: dict[str, int] = {}  # -1: no way up to a root
    deepest: tuple[str, int] | None = None
    for start in parent_of:
        path: list[str] = []
        node = start
        while node in parent_of and node not in depth and node not in in_cycle:
            path.append(node)
            node = parent_of[node]
        base = -1 if node in in_cycle else depth.get(node, 0)
        for k, branch_id in enumerate(reversed(path), start=1):
            depth[branch_id] = -1 if base < 0 else base + k
        if depth.get(start, -1) > (deepest[1] if deepest else 0):
            deepest = (start, depth[start])
    return deepest


def _check_meta(raw: dict, problems: _Problems) -> dict:
    meta = raw.get("meta")
    if meta is None:
        return {}
    if not isinstance(meta, dict):
        problems.add("meta", f"must be an object, got {_json_type(meta)}")
        return {}
    if _nesting(meta) > MAX_NESTING:  # it is copied into summary.json, whose writers recurse
        problems.add("meta", f"nested deeper than {MAX_NESTING} levels")
        return {}
    return meta


def _check_messages(raw: dict, problems: _Problems) -> list | None:
    messages = raw.get("messages")
    if messages is not None and not isinstance(messages, list):
        problems.add("messages", f"must be an array, got {_json_type(messages)}")
        return None
    if messages is not None and _nesting(messages) > MAX_NESTING:
        problems.add("messages", f"nested deeper than {MAX_NESTING} levels")
        return None
    return messages


def check_rollout(raw: object, *, file: str, line: int, vocab_size: int | None,
                  num_experts: int | None = None) -> tuple[Rollout | None, list[RolloutError]]:
    """Every problem of one parsed rollout; the `Rollout` only when there are none. `num_experts`
    (the checkpoint's, when known) bounds the expert ids of routed_experts."""
    if isinstance(raw, _Typed):
        rollout = _typed_rollout(raw.value, file=file, line=line, vocab_size=vocab_size, num_experts=num_experts)
        if rollout is not None:
            return rollout, []
        raw = msgspec.json.decode(raw.text)  # something to word: the checks below, on the plain value
    problems = _Problems(file=file, line=line)
    if not isinstance(raw, dict):
        problems.add(None, f"rollout must be a JSON object, got {_json_type(raw)}")
        return None, problems.errors

    raw_id = _required(raw, "id", "id", problems)
    rollout_id = None if raw_id is None else _check_id(raw_id, "id", problems)
    problems.rollout = _short_id(rollout_id)

    meta = _check_meta(raw, problems)
    messages = _check_messages(raw, problems)

    raw_branches = _required(raw, "branches", "branches", problems)
    branches: list[Branch | None] = []
    if raw_branches is not None and not isinstance(raw_branches, list):
        problems.add("branches", f"must be an array, got {_json_type(raw_branches)}")
    elif raw_branches is not None and not raw_branches:
        problems.add("branches", "empty branch list")
    elif raw_branches is not None:
        branches = [_check_branch(b, f"branches[{i}]", vocab_size, problems, num_experts)
                    for i, b in enumerate(raw_branches)]
        _check_tree(raw_branches, branches, problems)
        _check_routing_shapes(branches, problems)

    if problems.errors:
        return None, problems.errors
    return Rollout(id=rollout_id, meta=meta, branches=tuple(branches), messages=messages,
                   file=file, line=line), []


def _check_routing_shapes(branches: list[Branch | None], problems: _Problems) -> None:
    """Every segment's routed_experts of one rollout has the same [layers][top-k]: one model routed them."""
    first: tuple[str, tuple[int, ...]] | None = None
    for i, branch in enumerate(branches):
        for j, segment in enumerate(branch.segments if branch is not None else ()):
            if segment.routed_experts is None:
                continue
            where, shape = f"branches[{i}].segments[{j}].routed_experts", segment.routed_experts.shape[1:]
            if first is None:
                first = (where, shape)
            elif shape != first[1]:
                problems.add(where, f"{_layers_by_k(shape)} per token, but {first[0]} has "
                                    f"{_layers_by_k(first[1])} (one model routes a rollout)")


def _layers_by_k(shape: tuple[int, ...]) -> str:
    return f"{shape[0]} layers x top-{shape[1]}"


def _short_id(text: str | None) -> str | None:
    """A rollout or branch id as messages show it: cut to MAX_NAME_CHARS so the message stays short."""
    if text is None or len(text) <= MAX_NAME_CHARS:
        return text
    return text[:MAX_NAME_CHARS] + "..."


# ---------------------------------------------------------------------------------------------
# A JSONL line decoded into the format's types: msgspec checks every value's type as it parses,
# so a valid rollout needs no scan over its values' types (the checker's costliest step, with the
# decoding itself). A line that does not fit the types, or breaks a rule they do not carry, is
# decoded again untyped for check_rollout, which words what is wrong: the same errors either way.
# A field the format does not name sends the line that way too: msgspec skips an unknown field's
# value without checking all of it (a string's UTF-8), where the untyped decoders refuse the line.


class _TypedSegment(msgspec.Struct, forbid_unknown_fields=True):
    role: str
    tokens: list[int]
    logprobs: list[float] | None = None  # a JSON integer decodes as a float, as np.array makes it one
    trainable: bool | None = None
    extra_logprobs: dict[str, list[float] | None] | None = None
    routed_experts: Any = None  # shapes and ids: _check_routed_experts, on the plain lists


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
class _Typed:
    """A line as _TypedRollout, and its text (decoded again untyped when there is something to word)."""

    value: _TypedRollout
    text: bytes


def _typed_rollout(typed: _TypedRollout, *, file: str, line: int, vocab_size: int | None,
                   num_experts: int | None) -> Rollout | None:
    """The Rollout of a typed line that breaks no rule of check_rollout's, else None. (Its strings
    hold no lone surrogates: msgspec refuses those escapes, and json words them.)"""
    if not typed.id or not typed.branches or _nesting(typed.meta) > MAX_NESTING \
            or _nesting(typed.messages) > MAX_NESTING:
        return None
    problems = _Problems(file=file, line=line)
    branches = []
    for raw in typed.branches:
        kind = raw.kind if raw.kind is not None or raw.parent is not None else "main"
        if (not raw.id or raw.parent == "" or (raw.parent is None) != (raw.fork_at is None)
                or kind not in BRANCH_KINDS or not raw.segments):
            return None
        segments = _plain_segments([_SegmentFields(s.role, s.tokens, s.logprobs, s.trainable, s.extra_logprobs)
                                    for s in raw.segments], vocab_size, typed=True)
        if segments is None:
            return None
        for i, fields in enumerate(raw.segments):
            if fields.routed_experts is not None:
                routed = _check_routed_experts(fields.routed_experts, "routed_experts", segments[i].num_tokens,
                                               num_experts, problems)
                segments[i] = replace(segments[i], routed_experts=routed)
        branches.append(Branch(id=raw.id, kind=kind, parent=raw.parent, fork_at=raw.fork_at,
                               segments=tuple(segments)))
    _check_tree([{"id": b.id, "parent": b.parent, "fork_at": b.fork_at} for b in typed.branches], branches, problems)
    _check_routing_shapes(branches, problems)
    if problems.errors:
        return None
    return Rollout(id=typed.id, meta=typed.meta if typed.meta is not None else {}, branches=tuple(branches),
                   messages=typed.messages, file=file, line=line)


def _decode_line(text: bytes) -> tuple[object, str | None]:
    """A JSONL line (its newline included): as _Typed when it fits the format's types, else as
    _loads decodes it (which refuses a text nested too deeply before it parses it)."""
    try:
        return _Typed(_TYPED_DECODER.decode(text), text), None
    except (msgspec.MsgspecError, RecursionError):  # not JSON to msgspec, another type, too deep
        pass
    # rstrip: a trailing newline would move an "unexpected end" error to a column on line 2.
    return _loads(text.rstrip(b"\r\n"))


# ---------------------------------------------------------------------------------------------
# Reading files, one rollout at a time


def _loads(text: str | bytes) -> tuple[object, str | None]:
    """(value, None) for valid JSON, else (_UNPARSED, why) -- whatever the bytes hold."""
    if _deeper_than(text, MAX_JSON_DEPTH):
        return _UNPARSED, "arrays/objects nested too deeply"
    try:  # msgspec parses a dump's number arrays ~4x faster than json, into the same Python values
        return msgspec.json.decode(text), None
    except msgspec.DecodeError:
        pass  # not plain JSON to msgspec: json decides (it takes NaN/Infinity) and words the error
    try:
        return json.loads(text), None
    except json.JSONDecodeError as e:
        # removesuffix: "Unterminated string starting at" would read "... at at column N".
        return _UNPARSED, f"{e.msg.removesuffix(' at')} at column {e.colno}"
    except UnicodeDecodeError as e:
        return _UNPARSED, f"not UTF-8 (byte 0x{e.object[e.start]:02x} at offset {e.start})"
    except RecursionError:  # the C decoder recurses once per level of [ or {
        return _UNPARSED, "arrays/objects nested too deeply"
    except ValueError:  # int() refuses a literal longer than sys.get_int_max_str_digits()
        return _UNPARSED, f"a number has more than {sys.get_int_max_str_digits()} digits"


def _deeper_than(text: str | bytes, limit: int) -> bool:
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


_SKIPPED = object()  # a line read past, not decoded (another reader's: rollouts/forked.py)


def _read_jsonl(path: Path, file: str,
                wanted: Callable[[int], bool] | None = None) -> Iterator[tuple[int, object, list[RolloutError]]]:
    """(line, value, errors) of each rollout line; `wanted(n)` says whether the file's n-th
    rollout (from 0) is decoded, the others come as _SKIPPED."""
    number = -1
    with path.open("rb") as f:
        for line_no, text in enumerate(f, start=1):
            if not text or text.isspace():  # as `not text.strip()`, without copying the line
                continue
            number += 1
            if wanted is not None and not wanted(number):
                yield line_no, _SKIPPED, []
                continue
            raw, why = _decode_line(text)
            errors = [] if why is None else [RolloutError(f"invalid JSON: {why}", file=file, line=line_no)]
            yield line_no, raw, errors


def _decode_json_columns(row: dict, file: str, line: int) -> list[RolloutError]:
    """Parquet may hold the free-form `meta` and `messages` as JSON strings; decode them in place."""
    errors = []
    rollout_id = row.get("id") if isinstance(row.get("id"), str) and row["id"] else None
    for key in ("meta", "messages"):
        if isinstance(row.get(key), str):
            row[key], why = _loads(row[key])
            if why is not None:
                errors.append(RolloutError(f"invalid JSON: {why}", file=file, line=line,
                                           rollout=_short_id(rollout_id), field=key))
                row[key] = None  # reported once here, not again as "must be an object"
    return errors


def _read_parquet(path: Path, file: str) -> Iterator[tuple[int, object, list[RolloutError]]]:
    # Imported here: JSONL users should not pay for pyarrow's import.
    import pyarrow as pa
    import pyarrow.parquet as pq

    def unreadable(e: Exception) -> RolloutError:
        if isinstance(e, UnicodeDecodeError):  # Arrow does not check UTF-8 on read; Python decodes
            reason = f"a string is not UTF-8 (byte 0x{e.object[e.start]:02x})"
        else:  # Arrow's messages may span lines (thrift errors end in "\n"); keep the first.
            reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return RolloutError(f"not a readable Parquet file: {reason}", file=file)

    try:
        parquet = pq.ParquetFile(path)
    # ArrowInvalid; OSError for a corrupt footer; UnicodeDecodeError for damaged schema names
    except (pa.ArrowException, OSError, UnicodeDecodeError) as e:
        raise unreadable(e) from None
    batches = parquet.iter_batches(batch_size=PARQUET_BATCH_SIZE)
    row_no = 0
    while True:
        try:  # a corrupt page surfaces only when its batch is read
            batch = next(batches, None)
            rows = None if batch is None else batch.to_pylist()
        except (pa.ArrowException, OSError, UnicodeDecodeError) as e:
            raise unreadable(e) from None
        if rows is None:
            return
        for row in rows:
            row_no += 1
            yield row_no, row, _decode_json_columns(row, file, row_no)


def _open(path: str | os.PathLike[str]) -> tuple[str, Iterator[tuple[int, object, list[RolloutError]]]]:
    """Check the path now (not at the first `next`) and pick the reader by suffix."""
    file = os.fspath(path)
    p = Path(file)
    if not p.exists():
        raise RolloutError("no such file", file=file)
    if not p.is_file():
        raise RolloutError("not a file", file=file)
    try:  # fail now, with one line, rather than with a PermissionError at the first `next`
        p.open("rb").close()
    except OSError as e:
        raise RolloutError(f"cannot read: {e.strerror or e}", file=file) from None
    reader = _read_parquet if p.suffix.lower() == ".parquet" else _read_jsonl
    return file, reader(p, file)


@dataclass(frozen=True, slots=True)
class LineFacts:
    """What the checks across a file need of one of its rollouts (picklable: a forked reader
    sends them to the process that checks the file's order, rollouts/forked.py)."""

    line: int
    raw_id: str | None                          # the `id` as written, when a non-empty string
    rollout_id: str | None                      # the valid rollout's id
    routed: tuple[str, tuple[int, int]] | None  # (field, (layers, k)) of its first routed_experts

    @classmethod
    def of(cls, line: int, raw: object, rollout: Rollout | None) -> LineFacts:
        raw_id = raw.value.id if isinstance(raw, _Typed) else raw.get("id") if isinstance(raw, dict) else None
        return cls(line=line, raw_id=raw_id if isinstance(raw_id, str) and raw_id else None,
                   rollout_id=rollout.id if rollout is not None else None,
                   routed=_first_routed(rollout) if rollout is not None else None)


class FileChecks:
    """The checks of a rollout against the ones before it in its file: one routing shape, unique ids."""

    def __init__(self, file: str) -> None:
        self.file = file
        self.first_line: dict[str, int] = {}  # rollout id -> line; one small entry per rollout, not per token
        self.routing: tuple[int, tuple[int, int]] | None = None  # (line, shape) of the first stored routing

    def errors(self, facts: LineFacts) -> list[RolloutError]:
        errors = []
        first = facts.routed
        if first is not None and self.routing is None:
            self.routing = (facts.line, first[1])
        elif first is not None and first[1] != self.routing[1]:
            errors.append(RolloutError(f"{_layers_by_k(first[1])} per token, but line {self.routing[0]} stores "
                                       f"{_layers_by_k(self.routing[1])} (one model routes a file)", file=self.file,
                                       line=facts.line, rollout=_short_id(facts.rollout_id), field=first[0]))
        if facts.raw_id is not None:
            if facts.raw_id in self.first_line:
                errors.append(RolloutError(f"duplicate rollout id (first at line {self.first_line[facts.raw_id]})",
                                           file=self.file, line=facts.line, rollout=_short_id(facts.raw_id),
                                           field="id"))
            else:
                self.first_line[facts.raw_id] = facts.line
        return errors


def _checked(file: str, rows: Iterator[tuple[int, object, list[RolloutError]]], vocab_size: int | None,
             num_experts: int | None = None) -> Iterator[tuple[Rollout | None, list[RolloutError]]]:
    checks = FileChecks(file)
    for line, raw, read_errors in rows:
        if raw is _UNPARSED:
            yield None, read_errors
            continue
        rollout, errors = check_rollout(raw, file=file, line=line, vocab_size=vocab_size, num_experts=num_experts)
        errors = read_errors + errors + checks.errors(LineFacts.of(line, raw, rollout))
        yield (None if errors else rollout), errors


def _empty_file_error(file: str) -> RolloutError:
    return RolloutError("no rollouts (empty file)", file=file)


def iter_rollouts(path: str | os.PathLike[str], *, vocab_size: int | None = None,
                  num_experts: int | None = None) -> Iterator[Rollout]:
    """Rollouts of a JSONL or Parquet file, one at a time; raises `RolloutError` at the first bad one."""
    file, rows = _open(path)
    return _iter_valid(file, rows, vocab_size, num_experts)


def _iter_valid(file: str, rows: Iterator[tuple[int, object, list[RolloutError]]],
                vocab_size: int | None, num_experts: int | None) -> Iterator[Rollout]:
    num_rollouts = 0
    for rollout, errors in _checked(file, rows, vocab_size, num_experts):
        if errors:
            raise errors[0]
        num_rollouts += 1
        yield rollout
    if num_rollouts == 0:
        raise _empty_file_error(file)


def load_rollouts(path: str | os.PathLike[str], *, vocab_size: int | None = None,
                  num_experts: int | None = None) -> list[Rollout]:
    return list(iter_rollouts(path, vocab_size=vocab_size, num_experts=num_experts))


def validate_file(path: str | os.PathLike[str], *, vocab_size: int | None = None, num_experts: int | None = None,
                  max_errors: int = 1000) -> ValidationReport:
    """Every problem in a file (up to max_errors), still streaming; raises only if the file cannot be opened."""
    file, rows = _open(path)
    num_rollouts = num_invalid = num_branches = num_tokens = num_trainable = 0
    errors: list[RolloutError] = []
    truncated = False
    for rollout, rollout_errors in _checked(file, rows, vocab_size, num_experts):
        if rollout_errors:
            num_invalid += 1
            room = max_errors - len(errors)
            truncated = truncated or len(rollout_errors) > room
            errors.extend(rollout_errors[:room])
            continue
        num_rollouts += 1
        num_branches += len(rollout.branches)
        for branch in rollout.branches:
            num_tokens += branch.num_tokens
            num_trainable += sum(len(s.tokens) for s in branch.segments if s.trainable)
    if num_rollouts == 0 and num_invalid == 0:
        errors.append(_empty_file_error(file))
    return ValidationReport(num_rollouts=num_rollouts, num_invalid=num_invalid, num_branches=num_branches,
                            num_tokens=num_tokens, num_trainable_tokens=num_trainable, errors=errors,
                            truncated=truncated)
