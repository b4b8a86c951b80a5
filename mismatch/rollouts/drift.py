"""Render drift: the stored token ids against the chat the harness says it had, re-rendered.

Rollouts that carry `messages` → chat template → token ids → token diff with the main branch's
stream → drifted spans per turn (what a trainer that re-renders would train on instead).
Rollouts written by `mismatch record` carry the drift as it happened instead
(`meta.record.drift`: what the server rendered in place of the tokens a conversation had); those
spans are read, decoded and reported in the same shape.
"""

from __future__ import annotations

import difflib
import os
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import msgspec
import numpy as np

from mismatch.errors import MismatchError, RolloutError
from mismatch.rollouts.model import Rollout, segment_turns

# Equal runs this short between two edits are folded into one span: BPE splits one logical edit
# ("2 + 3" -> "2+3") into several opcodes around the tokens that happen to survive it.
MERGE_GAP = 2
MAX_WIDEN = 8  # tokens a span may grow on each side to show whole words
CONTEXT_TOKENS = 6  # unchanged tokens shown on each side of a span, so a reader can place it


@dataclass(kw_only=True, slots=True, frozen=True)
class _MainStream:
    """The main branch's stream with, per token, what the drift report needs to name a span."""

    tokens: list[int]
    turn: np.ndarray       # int, per token
    segment: np.ndarray    # int, per token
    role: list[str]        # per segment
    trainable: np.ndarray  # bool, per token


def _main_stream(rollout: Rollout) -> _MainStream:
    main = next(b for b in rollout.branches if b.parent is None)  # validation: exactly one root
    lengths = [len(s.tokens) for s in main.segments]
    turns = segment_turns([s.role for s in main.segments])
    return _MainStream(tokens=main.stream().tolist(),
                       turn=np.repeat(np.asarray(turns, np.int64), lengths),
                       segment=np.repeat(np.arange(len(lengths)), lengths),
                       role=[s.role for s in main.segments],
                       trainable=np.repeat([s.trainable for s in main.segments], lengths).astype(bool))


def _render(tokenizer: Any, messages: list, rollout: Rollout) -> str:
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception as e:  # noqa: BLE001 - Jinja raises many types; each is the user's data
        raise RolloutError(f"chat template cannot render them: {type(e).__name__}: {e}",
                           file=rollout.file, line=rollout.line, rollout=rollout.id,
                           field="messages") from None
    if not isinstance(text, str):
        raise RolloutError("chat template did not return text", file=rollout.file, line=rollout.line,
                           rollout=rollout.id, field="messages")
    return text


def render_ids(tokenizer: Any, rollout: Rollout) -> tuple[list[int], list[int]]:
    """Token ids of the rollout's `messages` rendered by the chat template, and each id's message
    index (-1 when the render could not be split by message).

    Each message's text (the growth of the rendered prefix) is tokenized on its own and the
    pieces concatenated: that is how a harness builds the stream turn by turn, so BPE merges
    never cross a message boundary. A template whose render of a prefix is not a prefix of the
    next render (one that rewrites history, e.g. drops old think blocks) is tokenized whole.
    """
    messages = list(rollout.messages or [])
    if getattr(tokenizer, "chat_template", None) is None:
        raise MismatchError("drift: the checkpoint's tokenizer has no chat_template to render messages with")
    texts = [_render(tokenizer, messages[: k + 1], rollout) for k in range(len(messages))]
    if not all(b.startswith(a) for a, b in zip(texts, texts[1:])):
        ids = tokenizer.encode(texts[-1], add_special_tokens=False)
        return ids, [-1] * len(ids)
    ids: list[int] = []
    owner: list[int] = []
    for index, (before, after) in enumerate(zip([""] + texts[:-1], texts)):
        piece_ids = tokenizer.encode(after[len(before):], add_special_tokens=False)
        ids += piece_ids
        owner += [index] * len(piece_ids)
    return ids, owner


def drift_edits(stored: list[int], rendered: list[int]) -> list[tuple[int, int, int, int]]:
    """(i1, i2, j1, j2) of each drifted span: stored[i1:i2] became rendered[j1:j2]."""
    # autojunk off: in long streams the frequent tokens (newlines, headers) are the anchors.
    opcodes = difflib.SequenceMatcher(None, stored, rendered, autojunk=False).get_opcodes()
    # Tokens the template adds after the last stored token (the separator after the final
    # `<|end|>`) were never sampled nor trained on: not drift. Dropped before merging so they
    # never ride along with a real edit just before them.
    if opcodes and opcodes[-1][0] == "insert" and opcodes[-1][1] == len(stored):
        opcodes = opcodes[:-1]
    spans: list[list[int]] = []
    for tag, i1, i2, j1, j2 in opcodes:
        if tag == "equal":
            continue
        if spans and i1 - spans[-1][1] <= MERGE_GAP and j1 - spans[-1][3] <= MERGE_GAP:
            spans[-1][1], spans[-1][3] = i2, j2
        else:
            spans.append([i1, i2, j1, j2])
    return [tuple(span) for span in spans]


def _word_edges(stored: list[int], rendered: list[int], span: tuple[int, int, int, int],
                text: Any, floor: tuple[int, int], ceiling: tuple[int, int]) -> tuple[int, int, int, int]:
    """Widen a span over the unchanged tokens that continue its first and last word.

    The token diff is minimal (`false` -> `False` is ` f` -> ` F`); a reader wants the word. The
    tokens added on each side are equal on both sides, so the edit itself does not change; the
    edges stay within `floor` (the previous span's end) and `ceiling` (the next one's start), so
    spans never overlap.
    """
    i1, i2, j1, j2 = span
    for _ in range(MAX_WIDEN):
        edge = text(stored[i1:i2]) or text(rendered[j1:j2])
        if not (i1 > floor[0] and j1 > floor[1] and edge[:1].isalnum()
                and text(stored[i1 - 1:i1])[-1:].isalnum()):
            break
        i1, j1 = i1 - 1, j1 - 1
    for _ in range(MAX_WIDEN):
        edge = text(stored[i1:i2]) or text(rendered[j1:j2])
        if not (i2 < ceiling[0] and j2 < ceiling[1] and edge[-1:].isalnum()
                and text(stored[i2:i2 + 1])[:1].isalnum()):
            break
        i2, j2 = i2 + 1, j2 + 1
    return i1, i2, j1, j2


def _message_at(owner: list[int], j: int) -> int | None:
    """Index of the message the rendered side starts in (None when the render was not split)."""
    index = owner[min(j, len(owner) - 1)] if owner else -1
    return index if index >= 0 else None


def _kind(stored: str, rendered: str, in_tool_call: bool) -> str:
    if stored == rendered:
        return "retokenized"  # same text, other ids: the trainer re-tokenized what was sampled
    if re.sub(r"\s+", "", stored) == re.sub(r"\s+", "", rendered):
        return "whitespace"
    if stored.lower() == rendered.lower():
        return "case"  # e.g. false -> False from a Python-side re-serialization
    if "<think>" in stored and "<think>" not in rendered:
        return "think_dropped"
    return "tool_call" if in_tool_call else "content"


def _in_tool_call(text_before: str) -> bool:
    return text_before.rfind("<tool_call>") > text_before.rfind("</tool_call>")


def recorded(rollout: Rollout) -> bool:
    """Whether `mismatch record` wrote this rollout (its drift was recorded, not re-rendered)."""
    record = rollout.meta.get("record")
    return isinstance(record, dict) and record.get("proxy") == "mismatch record"


@dataclass(kw_only=True, slots=True, frozen=True)
class _Path:
    """A branch's whole sequence (context, then its own tokens) with, per position, the branch
    and segment that hold it."""

    tokens: list[int]
    branch: list[str]      # per position
    segment: np.ndarray    # int, per position: index in its branch's segments
    role: list[str]        # per position
    trainable: np.ndarray  # bool, per position


def _path(rollout: Rollout, branch_id: str) -> _Path:
    chain = []  # (branch, how many of its own tokens the path takes), leaf first
    branch, take = rollout.branch(branch_id), None
    while True:  # validation: the parent links end at the root
        chain.append((branch, branch.num_tokens if take is None else take))
        if branch.parent is None:
            break
        branch, take = rollout.branch(branch.parent), branch.fork_at
    tokens: list[int] = []
    owners: list[str] = []
    segments: list[int] = []
    roles: list[str] = []
    trainable: list[bool] = []
    for branch, take in reversed(chain):
        for k, segment in enumerate(branch.segments):
            n = min(len(segment.tokens), take)
            if n <= 0:
                break
            tokens += segment.tokens[:n].tolist()
            owners += [branch.id] * n
            segments += [k] * n
            roles += [segment.role] * n
            trainable += [segment.trainable] * n
            take -= n
    return _Path(tokens=tokens, branch=owners, segment=np.asarray(segments, np.int64), role=roles,
                 trainable=np.asarray(trainable, bool))


class RecordedDrift(msgspec.Struct, frozen=True):
    """One meta.record.drift entry as record/assembly._drift writes it: the tokens the conversation
    had (`stored`, at absolute position `start` on the path of branch `branch`) and what the
    harness sent in their place (`rendered`, at `rendered_start` on the path of `rendered_branch`);
    `request` (a meta.record.requests index) sent them in turn `at_turn`; `turn` is the turn whose
    tokens they were."""

    branch: str
    start: int
    stored: list[int]
    rendered_branch: str
    rendered_start: int
    rendered: list[int]
    turn: int | None = None
    request: int | None = None
    at_turn: int | None = None


def _recorded_entries(rollout: Rollout) -> list[RecordedDrift]:
    """meta.record.drift as records, each checked against the rollout's branches (meta is
    free-form to the format's validator: this is its one check); else one RolloutError naming
    the entry and its field."""
    raw = rollout.meta["record"].get("drift") or []  # meta: an open map, its keys the writer's
    try:
        entries = msgspec.convert(raw, list[RecordedDrift])
    except msgspec.ValidationError as error:
        reason, _, path = str(error).partition(" - at `$")
        raise RolloutError(reason, file=rollout.file, line=rollout.line, rollout=rollout.id,
                           field="meta.record.drift" + path.rstrip("`")) from None
    branch_ids = {b.id for b in rollout.branches}
    for index, entry in enumerate(entries):
        def bad(why: str) -> RolloutError:
            return RolloutError(why, file=rollout.file, line=rollout.line, rollout=rollout.id,
                                field=f"meta.record.drift[{index}]")
        for key, branch_id in (("branch", entry.branch), ("rendered_branch", entry.rendered_branch)):
            if branch_id not in branch_ids:
                raise bad(f"{key} {branch_id!r} is not a branch of this rollout")
        for key, offset in (("start", entry.start), ("rendered_start", entry.rendered_start)):
            if offset < 0:
                raise bad(f"{key} must be a token offset, got {offset!r}")
    return entries


def recorded_drift(rollout: Rollout, tokenizer: Any) -> list[dict[str, Any]]:
    """The spans `mismatch record` saw drift, in `rollout_drift`'s shape plus where they were
    found: `branch` (holding the stored side), `request` (meta.record.requests index of the
    request that sent the rewrite) and `at_turn` (its turn); `turn` is the conversation turn
    whose tokens were rewritten, `message` is None (the spans come from tokens, not messages)."""
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)
    spans = []
    for index, entry in enumerate(_recorded_entries(rollout)):
        stored_path = _path(rollout, entry.branch)
        start, stored = entry.start, entry.stored
        if start + len(stored) > len(stored_path.tokens) or stored_path.tokens[start:start + len(stored)] != stored:
            raise RolloutError(f"stored tokens are not at {start} of branch {entry.branch!r}'s path",
                               file=rollout.file, line=rollout.line, rollout=rollout.id,
                               field=f"meta.record.drift[{index}]")
        rendered_path = _path(rollout, entry.rendered_branch).tokens
        r_start, rendered = entry.rendered_start, entry.rendered
        at = min(start, len(stored_path.tokens) - 1)  # an insertion is placed at the token it precedes
        in_call = _in_tool_call(decode(stored_path.tokens[:start]))
        stored_text, rendered_text = decode(stored), decode(rendered)
        spans.append({
            "rollout": rollout.id, "turn": entry.turn,
            "segment": int(stored_path.segment[at]), "role": stored_path.role[at], "message": None,
            "stored": stored_text, "rendered": rendered_text,
            "kind": _kind(stored_text, rendered_text, in_call), "in_tool_call": in_call,
            "trainable_tokens": int(stored_path.trainable[start:start + len(stored)].sum()),
            "stored_start": start, "stored_ids": stored, "rendered_ids": rendered,
            "stored_context": decode(stored_path.tokens[max(0, start - CONTEXT_TOKENS):start + len(stored) + CONTEXT_TOKENS]),
            "rendered_context": decode(rendered_path[max(0, r_start - CONTEXT_TOKENS):r_start + len(rendered) + CONTEXT_TOKENS]),
            "branch": stored_path.branch[at], "request": entry.request, "at_turn": entry.at_turn,
            "source": "recorded",
        })
    return spans


def rollout_drift(rollout: Rollout, tokenizer: Any) -> list[dict[str, Any]]:
    """Drifted spans of one rollout (empty when it carries no messages or nothing drifted)."""
    if recorded(rollout):
        return recorded_drift(rollout, tokenizer)
    if not rollout.messages:
        return []
    main = _main_stream(rollout)
    rendered, owner = render_ids(tokenizer, rollout)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)
    spans = []
    edits = drift_edits(main.tokens, rendered)
    floor = (0, 0)
    for k, edit in enumerate(edits):
        ceiling = edits[k + 1][0::2] if k + 1 < len(edits) else (len(main.tokens), len(rendered))
        i1, i2, j1, j2 = _word_edges(main.tokens, rendered, edit, decode, floor, ceiling)
        floor = (i2, j2)
        at = min(i1, len(main.tokens) - 1)  # an insertion is placed at the token it precedes
        segment = int(main.segment[at])
        stored_text, rendered_text = decode(main.tokens[i1:i2]), decode(rendered[j1:j2])
        in_call = _in_tool_call(decode(main.tokens[:i1]))
        spans.append({
            "rollout": rollout.id, "turn": int(main.turn[at]), "segment": segment,
            "role": main.role[segment], "message": _message_at(owner, j1),
            "stored": stored_text, "rendered": rendered_text,
            "kind": _kind(stored_text, rendered_text, in_call), "in_tool_call": in_call,
            "trainable_tokens": int(main.trainable[i1:i2].sum()),
            "stored_start": i1, "stored_ids": main.tokens[i1:i2], "rendered_ids": rendered[j1:j2],
            "stored_context": decode(main.tokens[max(0, i1 - CONTEXT_TOKENS):i2 + CONTEXT_TOKENS]),
            "rendered_context": decode(rendered[max(0, j1 - CONTEXT_TOKENS):j2 + CONTEXT_TOKENS]),
        })
    return spans


def find_drift(rollouts: Sequence[Rollout], tokenizer: Any) -> dict[str, Any]:
    """`summary["drift"]`: every drifted span of the rollouts that carry `messages`, and of those
    `mismatch record` wrote (their spans as recorded: `source` "recorded", with `branch`,
    `request` and `at_turn`; see `recorded_drift`).

    `spans` (contract: each has `rollout`, `turn`, `stored`, `rendered`) also say `segment`,
    `role`, `message` (index into `messages` where the rendered side starts, or None for a
    template that rewrites history and so is tokenized whole), `kind`
    (retokenized | whitespace | case | think_dropped | tool_call | content), `in_tool_call`,
    `trainable_tokens` (stored tokens in the span that the trainer would train on), the ids, and
    `stored_context` / `rendered_context` (the span with a few unchanged tokens either side).
    """
    checked = [r for r in rollouts if r.messages or recorded(r)]
    spans = [span for rollout in checked for span in rollout_drift(rollout, tokenizer)]
    return {
        "num_rollouts_checked": len(checked),
        "num_rollouts_without_messages": len(rollouts) - len(checked),
        "num_rollouts_recorded": sum(recorded(r) for r in checked),
        "num_rollouts_drifted": len({span["rollout"] for span in spans}),
        "num_spans": len(spans),
        # "retokenized" (the model sampled a non-canonical split of its own text) is a different
        # hazard from a harness that rewrote the text; a report should tell them apart.
        "spans_by_kind": dict(sorted(Counter(span["kind"] for span in spans).items())),
        "trainable_tokens_touched": sum(span["trainable_tokens"] for span in spans),
        "spans": spans,
    }


def drift_file(checkpoint: str | os.PathLike[str], rollouts: str | os.PathLike[str]) -> dict[str, Any]:
    """`find_drift` for a checkpoint directory (its tokenizer and template) and a rollouts file."""
    from mismatch.checkpoint import checkpoint_info, load_tokenizer
    from mismatch.rollouts.io import load_rollouts

    info = checkpoint_info(checkpoint)
    loaded = load_rollouts(rollouts, vocab_size=info.vocab_size)
    if not any(rollout.messages or recorded(rollout) for rollout in loaded):  # "0 spans" would claim a check
        raise MismatchError(f"{rollouts}: no rollout carries `messages`, so there is nothing to "
                            "re-render; record them with the rollouts (format v1 `messages`)")
    return find_drift(loaded, load_tokenizer(checkpoint))


def describe_span(span: dict[str, Any]) -> str:
    """One line for a terminal: where, what kind, and both spellings."""
    return (f"{span['rollout']} turn {span['turn']} ({span['role']}, {span['kind']}, "
            f"{span['trainable_tokens']} trainable tokens): stored {span['stored_context']!r} "
            f"-> rendered {span['rendered_context']!r}")
