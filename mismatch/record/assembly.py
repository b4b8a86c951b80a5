"""Recorded exchanges → conversations → format v1 rollout trees, with rewritten history as drift.

Second half of `mismatch record` (the proxy hands every sampled completion here): `Recorder`
groups exchanges into open conversations by their tokens (or a session key) and `build_rollout`
turns a finished conversation into one rollout whose tree holds, for every request, exactly the
token context the sampler saw. Pure Python and numpy: no I/O, no clock of its own.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from mismatch.rollouts.drift import drift_edits

# A request whose prompt leaves an open conversation's tokens at some point, and re-sends at
# least this share of the tokens that followed there, is that conversation with its history
# rewritten (drift); one that re-sends less of them is a new branch of it (a subagent).
DRIFT_MIN_RESENT = 0.5
# Roles a prompt segment may take; the harness's last message decides (see `prompt_role`).
PROMPT_ROLES = {"system": "system", "developer": "system", "user": "user", "tool": "tool",
                "function": "tool"}


@dataclass(kw_only=True, slots=True, frozen=True, eq=False)
class Exchange:
    """One sampled completion as the engine ran it: one choice of one request."""

    prompt: np.ndarray             # int64: the prompt token ids as the server rendered them
    sampled: np.ndarray            # int64: the sampled token ids (stop token included)
    logprobs: list[float | None] | None  # the sampler's log-prob of each sampled token (None: null)
    endpoint: str                  # "chat" | "completions"
    messages: list | None          # as the harness sent them (chat)
    tools: list | None             # as the harness sent them (chat)
    params: dict[str, Any]         # the sampling parameters the request set
    session: str | None            # X-Mismatch-Session or the OpenAI `user` field
    started: float                 # wall-clock seconds (time.time) when the request arrived
    seconds: float                 # how long the upstream took
    finish_reason: str | None
    # Per sampled token the ids the sampler's truncation kept (vLLM generate's `sampling_mask`);
    # None when the server returned none.
    sampling_mask: list[list[int]] | None = None

    @property
    def tokens(self) -> np.ndarray:
        """The whole sequence this exchange ends with: prompt, then what was sampled."""
        return np.concatenate([self.prompt, self.sampled])

    @property
    def prompt_role(self) -> str:
        """The role of the tokens this request added: its last message's (a prefilled assistant
        message, `continue_final_message`, counts as user text: it was a prompt, not sampled)."""
        if not self.messages or not isinstance(self.messages[-1], dict):
            return "user"
        return PROMPT_ROLES.get(str(self.messages[-1].get("role")), "user")


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    """Length of the longest common prefix of two token arrays."""
    n = min(len(a), len(b))
    differ = np.flatnonzero(a[:n] != b[:n])
    return int(differ[0]) if differ.size else n


# ---------------------------------------------------------------------------------------------
# Grouping: which open conversation a finished exchange belongs to


@dataclass(kw_only=True, slots=True, eq=False)
class Conversation:
    id: str
    session: str | None
    exchanges: list[Exchange] = field(default_factory=list)
    sequences: list[np.ndarray] = field(default_factory=list)  # each exchange's tokens
    last: float = 0.0  # the recorder's clock at the last exchange

    def match(self, prompt: np.ndarray) -> tuple[int, bool, np.ndarray]:
        """(longest common prefix with any of its sequences, whether one of them is extended
        whole, the latest sequence sharing that prefix)."""
        best, whole, which = 0, False, self.sequences[0]
        for tokens in self.sequences:
            shared = common_prefix(prompt, tokens)
            if shared >= best:
                best, which = shared, tokens
            whole = whole or shared == len(tokens)
        return best, whole, which

    @property
    def first_prompt(self) -> int:
        return len(self.exchanges[0].prompt)


class Recorder:
    """Open conversations; exchanges in, finished rollouts (dicts) out.

    Grouping rule (docs/recording.md): with a session key, a request joins that
    session's conversation. Without one it joins the open conversation it shares the longest
    token prefix with, provided that prefix reaches past the conversation's first prompt (into
    what the model sampled), or covers that whole first prompt and the request re-sends most of
    what was sampled after it (history rewritten from the first sampled token on); and provided
    it is not a resample (a prompt that ends inside tokens already sampled: `n` > 1, a retry).
    Otherwise it starts a new conversation: sharing only a system prompt or a task statement
    makes a new rollout.
    """

    def __init__(self, *, run_id: str, sampler: dict[str, Any], upstream: dict[str, Any]) -> None:
        self.run_id = run_id
        self.sampler = sampler
        self.upstream = upstream
        self.open: dict[str, Conversation] = {}
        self.sessions: dict[str, str] = {}  # session key -> conversation id
        self.num_conversations = 0
        self.num_exchanges = 0

    def add(self, exchange: Exchange, now: float) -> Conversation:
        conversation = self._conversation_for(exchange)
        conversation.exchanges.append(exchange)
        conversation.sequences.append(exchange.tokens)
        conversation.last = now
        self.num_exchanges += 1
        return conversation

    def _conversation_for(self, exchange: Exchange) -> Conversation:
        if exchange.session is not None:
            known = self.sessions.get(exchange.session)
            if known is not None and known in self.open:
                return self.open[known]
            conversation = self._new(exchange.session)
            self.sessions[exchange.session] = conversation.id
            return conversation
        best: tuple[int, bool, float] | None = None
        chosen: Conversation | None = None
        for conversation in self.open.values():
            if conversation.session is not None:
                continue
            shared, whole, tokens = conversation.match(exchange.prompt)
            if shared == len(exchange.prompt) and not whole:
                continue  # a resample
            if shared < conversation.first_prompt or (
                    shared == conversation.first_prompt and not _resent(tokens[shared:], exchange.prompt[shared:])):
                continue
            # Ties (identical histories) go to an exact extension, then to the latest active.
            key = (shared, whole, conversation.last)
            if best is None or key > best:
                best, chosen = key, conversation
        return chosen if chosen is not None else self._new(None)

    def _new(self, session: str | None) -> Conversation:
        self.num_conversations += 1
        conversation = Conversation(id=f"rec-{self.run_id}-{self.num_conversations:06d}", session=session)
        self.open[conversation.id] = conversation
        return conversation

    def take_idle(self, now: float, idle_seconds: float) -> list[Conversation]:
        """Remove and return the conversations with no exchange for `idle_seconds`."""
        done = [c for c in self.open.values() if now - c.last >= idle_seconds]
        for conversation in done:
            self._close(conversation)
        return done

    def take_all(self) -> list[Conversation]:
        done = list(self.open.values())
        for conversation in done:
            self._close(conversation)
        return done

    def _close(self, conversation: Conversation) -> None:
        del self.open[conversation.id]
        if conversation.session is not None and self.sessions.get(conversation.session) == conversation.id:
            del self.sessions[conversation.session]

    def rollout(self, conversation: Conversation) -> dict[str, Any]:
        return build_rollout(conversation.id, conversation.exchanges, sampler=self.sampler,
                             upstream=self.upstream, session=conversation.session)


# ---------------------------------------------------------------------------------------------
# The tree: a trie of the exchanges' token sequences, the last exchange's path as the root


@dataclass(kw_only=True, slots=True, eq=False)
class _Branch:
    id: str
    parent: int | None
    fork_at: int | None  # offset in the parent's own tokens
    context: int         # tokens before this branch's own (its parent's path up to fork_at)
    tokens: np.ndarray   # own tokens

    @property
    def end(self) -> int:
        return self.context + len(self.tokens)


class _Tree:
    def __init__(self, root: np.ndarray) -> None:
        self.branches = [_Branch(id="main", parent=None, fork_at=None, context=0, tokens=root)]
        self._full = [root]  # context + own tokens per branch

    def full(self, index: int) -> np.ndarray:
        return self._full[index]

    def place(self, sequence: np.ndarray) -> int:
        """Make `sequence` a path from the root; returns a branch whose full tokens start with it."""
        shared = [common_prefix(sequence, self._full[i]) for i in range(len(self.branches))]
        best = int(np.argmax(shared))
        length = shared[best]
        if length == len(sequence):
            return best
        branch = self.branches[best]
        if length == branch.end:  # it runs past this branch's end: the branch grows
            branch.tokens = np.concatenate([branch.tokens, sequence[length:]])
            self._full[best] = np.concatenate([self._full[best], sequence[length:]])
            return best
        owner = best  # the branch whose own tokens hold the first differing position
        while owner != 0 and self.branches[owner].context >= length:
            owner = self.branches[owner].parent
        parent = self.branches[owner]
        self.branches.append(_Branch(id=f"b{len(self.branches)}", parent=owner,
                                     fork_at=length - parent.context, context=length,
                                     tokens=sequence[length:]))
        self._full.append(sequence)
        return len(self.branches) - 1

    def runs(self, leaf: int, end: int) -> list[tuple[int, int, int]]:
        """(branch, start, stop) absolute positions of the path [0, end) that ends in `leaf`."""
        runs, index, stop = [], leaf, end
        while True:
            branch = self.branches[index]
            if stop > branch.context:
                runs.append((index, branch.context, stop))
            if branch.parent is None:
                return runs[::-1]
            stop = min(stop, branch.context)
            index = branch.parent

    def owner(self, leaf: int, position: int) -> int:
        """The branch whose own tokens hold absolute `position` on the path ending in `leaf`."""
        index = leaf
        while self.branches[index].context > position:
            index = self.branches[index].parent
        return index


@dataclass(kw_only=True, slots=True, frozen=True)
class _Link:
    """How an exchange's prompt relates to the exchanges before it in its conversation."""

    after: int | None  # the earlier exchange whose tokens its prompt shares the most with
    shared: int        # that many leading tokens
    kind: str          # new | extends | drift | fork
    turn: int          # requests before it along `after` links: the conversation's turn


def _links(exchanges: Sequence[Exchange]) -> list[_Link]:
    links: list[_Link] = []
    sequences = [e.tokens for e in exchanges]
    for k, exchange in enumerate(exchanges):
        best: tuple[int, bool, int] | None = None
        for j in range(k):
            shared = common_prefix(exchange.prompt, sequences[j])
            key = (shared, shared == len(sequences[j]), j)
            if best is None or key > best:
                best = key
        if best is None or best[0] == 0:
            links.append(_Link(after=None, shared=0, kind="new", turn=0))
            continue
        shared, whole, j = best
        if whole:
            kind = "extends"
        elif shared < len(exchange.prompt) and _resent(sequences[j][shared:], exchange.prompt[shared:]):
            kind = "drift"
        else:
            kind = "fork"
        links.append(_Link(after=j, shared=shared, kind=kind, turn=links[j].turn + 1))
    return links


def _resent(before: np.ndarray, after: np.ndarray) -> bool:
    """Whether `after` re-sends at least DRIFT_MIN_RESENT of the tokens `before` holds."""
    matcher = difflib.SequenceMatcher(None, before.tolist(), after.tolist(), autojunk=False)
    matched = sum(block.size for block in matcher.get_matching_blocks())
    return matched >= DRIFT_MIN_RESENT * len(before)


_PROMPT, _SAMPLED = 1, 2
# What the sampler said of a sampled token's log-prob: nothing (it sent no column), a number
# (NaN and ±inf included: format v1 holds finite ones only), or null.
_UNSAID, _NUMBER, _NULL = 0, 1, 2


def _sampled_logprobs(exchange: Exchange) -> tuple[np.ndarray, np.ndarray]:
    """(float64 value, what was said: _UNSAID/_NUMBER/_NULL) per sampled token."""
    n = len(exchange.sampled)
    if exchange.logprobs is None:
        return np.full(n, np.nan), np.full(n, _UNSAID, np.int8)
    said = np.array([_NULL if v is None else _NUMBER for v in exchange.logprobs], np.int8)
    return np.array([np.nan if v is None else v for v in exchange.logprobs], np.float64), said


class _Labels:
    """Per branch and own position: which exchange put the token there, and whether it sampled it
    (with its log-prob) or sent it in a prompt. The first exchange to claim a position keeps it."""

    def __init__(self, tree: _Tree) -> None:
        self.tree = tree
        self.how = [np.zeros(len(b.tokens), np.int8) for b in tree.branches]
        self.who = [np.full(len(b.tokens), -1, np.int64) for b in tree.branches]
        self.logp = [np.full(len(b.tokens), np.nan) for b in tree.branches]
        self.said = [np.full(len(b.tokens), _UNSAID, np.int8) for b in tree.branches]
        self.kept = [np.full(len(b.tokens), None, dtype=object) for b in tree.branches]  # a row or None

    def claim(self, leaf: int, lo: int, hi: int, how: int, exchange: int,
              logp: tuple[np.ndarray, np.ndarray] | None = None, kept: list[list[int]] | None = None) -> None:
        """Positions [lo, hi) of the path ending in `leaf`; `logp` holds one (value, said) per position."""
        for index, start, stop in self.tree.runs(leaf, hi):
            start = max(start, lo)
            if start >= stop:
                continue
            context = self.tree.branches[index].context
            own = slice(start - context, stop - context)
            free = self.how[index][own] == 0
            self.how[index][own][free] = how
            self.who[index][own][free] = exchange
            if logp is not None:
                self.logp[index][own][free] = logp[0][start - lo:stop - lo][free]
                self.said[index][own][free] = logp[1][start - lo:stop - lo][free]
            if kept is not None:
                for at in np.flatnonzero(free):
                    self.kept[index][own.start + at] = kept[start - lo + at]

    def exchange_at(self, leaf: int, position: int) -> int:
        index = self.tree.owner(leaf, position)
        return int(self.who[index][position - self.tree.branches[index].context])


def build_rollout(rollout_id: str, exchanges: Sequence[Exchange], *, sampler: dict[str, Any],
                  upstream: dict[str, Any], session: str | None = None) -> dict[str, Any]:
    """One format v1 rollout (a dict) from a conversation's exchanges, in the order they finished.

    The root branch is the path of the last exchange (the conversation as the harness last sent
    it); every other exchange's tokens are a path too, forking where they first differ. Each
    position is labeled by the first exchange that sampled it (an assistant segment with its
    log-prob) or else by the first whose prompt held it (a prompt segment). A non-root branch
    is kind "main" where the harness rewrote history (the other side of a drift) and
    "subagent" where another conversation forked off.
    """
    sequences = [e.tokens for e in exchanges]
    tree = _Tree(sequences[-1])
    leaves = [tree.place(tokens) for tokens in sequences[:-1]] + [0]
    labels = _Labels(tree)
    for k, exchange in enumerate(exchanges):  # sampled first: a sampled token is never a prompt
        labels.claim(leaves[k], len(exchange.prompt), len(sequences[k]), _SAMPLED, k, _sampled_logprobs(exchange),
                     exchange.sampling_mask)
    for k, exchange in enumerate(exchanges):
        labels.claim(leaves[k], 0, len(exchange.prompt), _PROMPT, k)
    links = _links(exchanges)
    kinds = _branch_kinds(tree, leaves, links)
    branches, nonfinite = [], []
    for i, branch in enumerate(tree.branches):
        segments = _segments(branch.tokens, labels.how[i], labels.who[i], exchanges)
        nonfinite += _fill_logprobs(segments, branch.id, labels.logp[i], labels.said[i], labels.who[i])
        _fill_masks(segments, labels.kept[i])
        branches.append({"id": branch.id, "kind": kinds[i],
                         "parent": None if branch.parent is None else tree.branches[branch.parent].id,
                         "fork_at": branch.fork_at, "segments": [segment for segment, _ in segments]})
    record = {
        "proxy": "mismatch record", "upstream": upstream, "session": session,
        "requests": _requests(exchanges, links, leaves, tree),
        "tools": _distinct_tools(exchanges),
        "drift": _drift(exchanges, links, leaves, tree, labels.exchange_at),
        "nonfinite_logprobs": nonfinite,
    }
    return {"id": rollout_id,
            "meta": {"sampler": {**sampler, **_sampling(exchanges[0].params)}, "record": record},
            "branches": branches,
            "messages": exchanges[-1].messages}


def _branch_kinds(tree: _Tree, leaves: list[int], links: list[_Link]) -> list[str]:
    """Root: main. A branch that starts where a drift split two paths: its parent's kind (the
    same conversation, before or after the rewrite). Any other fork: subagent."""
    starts: dict[int, str] = {}
    for k, link in enumerate(links):
        if link.kind not in ("drift", "fork"):
            continue
        for leaf in (leaves[link.after], leaves[k]):
            index = tree.owner(leaf, link.shared)
            if tree.branches[index].context == link.shared and index != 0:
                starts.setdefault(index, link.kind)
    kinds = ["main"]
    for index, branch in enumerate(tree.branches[1:], start=1):  # parents come before children
        kinds.append(kinds[branch.parent] if starts.get(index) == "drift" else "subagent")
    return kinds


def _segments(tokens: np.ndarray, label: np.ndarray, owner: np.ndarray,
              exchanges: Sequence[Exchange]) -> list[tuple[dict[str, Any], slice]]:
    """Format v1 segments, each with its own positions: one per sampled completion, one per run of
    prompt tokens of one role."""
    roles = np.array([e.prompt_role for e in exchanges], dtype=object)[owner]
    sampled = label == _SAMPLED
    cuts = np.flatnonzero((sampled[1:] != sampled[:-1]) | (sampled[1:] & (owner[1:] != owner[:-1]))
                          | (~sampled[1:] & (roles[1:] != roles[:-1]))) + 1
    segments = []
    for lo, hi in zip([0, *cuts.tolist()], [*cuts.tolist(), len(tokens)]):
        role = "assistant" if label[lo] == _SAMPLED else exchanges[int(owner[lo])].prompt_role
        segments.append(({"role": role, "tokens": tokens[lo:hi].tolist()}, slice(lo, hi)))
    return segments


def _said_as(value: float, said: int) -> str | None:
    """How meta.record.nonfinite_logprobs names a value v1 cannot hold: "nan", "inf", "-inf", null."""
    return None if said == _NULL else "nan" if np.isnan(value) else "inf" if value > 0 else "-inf"


def _fill_logprobs(segments: list[tuple[dict[str, Any], slice]], branch: str, logp: np.ndarray,
                   said: np.ndarray, owner: np.ndarray) -> list[dict[str, Any]]:
    """Give each sampled segment the sampler's log-probs. One that is no finite number keeps its
    token, null in its place, and is returned as a meta.record.nonfinite_logprobs entry:
    {branch, segment, index (into the segment's tokens), request, value}."""
    flagged = []
    for number, (segment, own) in enumerate(segments):
        if segment["role"] != "assistant" or not (said[own] != _UNSAID).all():
            continue  # a prompt, or a completion the sampler sent no log-prob column for
        values, what = logp[own], said[own]
        finite = (what == _NUMBER) & np.isfinite(values)
        segment["logprobs"] = [float(v) if ok else None for v, ok in zip(values.tolist(), finite.tolist())]
        flagged += [{"branch": branch, "segment": number, "index": int(i), "request": int(owner[own][i]),
                     "value": _said_as(float(values[i]), int(what[i]))} for i in np.flatnonzero(~finite)]
    return flagged


def _fill_masks(segments: list[tuple[dict[str, Any], slice]], kept: np.ndarray) -> None:
    """Give each sampled segment whose every token has a kept-id row its `sampling_mask`, CSR as
    format v1 holds it: {"offsets": [0, ..., len(token_ids)], "token_ids": rows concatenated}."""
    for segment, own in segments:
        rows = kept[own].tolist()
        if segment["role"] != "assistant" or any(row is None for row in rows):
            continue
        segment["sampling_mask"] = {"offsets": np.cumsum([0, *map(len, rows)]).tolist(),
                                    "token_ids": [i for row in rows for i in row]}


def _sampling(params: dict[str, Any]) -> dict[str, Any]:
    """meta.sampler's processing keys, OpenAI's defaults where the request left them out."""
    def pick(key: str, default: Any) -> Any:
        value = params.get(key)
        return default if value is None else value
    return {"temperature": pick("temperature", 1.0), "top_p": pick("top_p", 1.0), "top_k": pick("top_k", -1),
            "min_p": pick("min_p", 0.0)}


def _distinct_tools(exchanges: Sequence[Exchange]) -> list[Any]:
    tools: list[Any] = []
    for exchange in exchanges:
        if exchange.tools is not None and exchange.tools not in tools:
            tools.append(exchange.tools)
    return tools


def _requests(exchanges: Sequence[Exchange], links: list[_Link], leaves: list[int],
              tree: _Tree) -> list[dict[str, Any]]:
    """Per request: where its tokens are in the tree, how it relates to the one before, and its
    messages as sent (only what changed since the request it follows: the rest is that one's)."""
    tools = _distinct_tools(exchanges)
    out = []
    for k, (exchange, link) in enumerate(zip(exchanges, links)):
        start = 0
        before = exchanges[link.after].messages if link.after is not None else None
        if exchange.messages is not None and before is not None:
            while start < min(len(before), len(exchange.messages)) and before[start] == exchange.messages[start]:
                start += 1
        out.append({
            "branch": tree.branches[leaves[k]].id, "prompt_tokens": len(exchange.prompt),
            "sampled_tokens": len(exchange.sampled), "turn": link.turn, "link": link.kind, "after": link.after,
            "shared_tokens": link.shared, "endpoint": exchange.endpoint,
            "finish_reason": exchange.finish_reason, "params": exchange.params,
            "started": exchange.started, "seconds": exchange.seconds,
            "tools": None if exchange.tools is None else tools.index(exchange.tools),
            "messages_from": start if exchange.messages is not None else None,
            "messages": None if exchange.messages is None else exchange.messages[start:],
        })
    return out


def _drift(exchanges: Sequence[Exchange], links: list[_Link], leaves: list[int], tree: _Tree,
           who: Callable[[int, int], int]) -> list[dict[str, Any]]:
    """meta.record.drift: per span, the tokens the conversation had (`stored`, at absolute
    position `start` on the path of branch `branch`) and what the harness sent in their place
    (`rendered`, at `rendered_start` on the path of `rendered_branch`); `request` sent them in
    conversation turn `at_turn`, and `turn` is the turn whose tokens they were. `who(leaf, pos)`
    is the exchange that sampled (or first prompted) a path position."""
    spans = []
    for k, link in enumerate(links):
        if link.kind != "drift":
            continue
        before, sent = exchanges[link.after].tokens, exchanges[k].prompt
        for i1, i2, j1, j2 in drift_edits(before[link.shared:].tolist(), sent[link.shared:].tolist()):
            at = min(link.shared + i1, len(before) - 1)  # an insertion is placed at the token it precedes
            spans.append({"request": k, "turn": links[who(leaves[link.after], at)].turn,
                          "at_turn": link.turn, "branch": tree.branches[leaves[link.after]].id,
                          "start": link.shared + i1,
                          "stored": before[link.shared + i1:link.shared + i2].tolist(),
                          "rendered_branch": tree.branches[leaves[k]].id,
                          "rendered_start": link.shared + j1,
                          "rendered": sent[link.shared + j1:link.shared + j2].tolist()})
    return spans
