"""The rules of rollout format v1, each written once: what a rollout must be, field by field.

Every decoder (`decode`: typed, a branch at a time, a segment at a time) calls these. A rule adds
what breaks it to `Problems` (file:line, rollout, field, reason). The fast decoders call the same
rules with a scratch `Problems` and, at any report, hand the rollout on to the untyped decoder,
which calls them in its fixed order and so words every problem the same way whatever the path.
"""

from __future__ import annotations

import re

import numpy as np

from mismatch.rollouts.model import (BRANCH_KINDS, MODEL_ROLES, ROLES, Branch, deepest_branch, is_index_column,
                                     replayed_tokens)
from mismatch.rollouts.problems import (INT_TYPES, NUMBER_TYPES, Problems, check_same_rows, did_you_mean,
                                        first_bad_type, first_of, json_type, name, nesting, short_id, show,
                                        token_rows)
from mismatch.rollouts.index_rules import check_index_shapes, check_indexer_topk  # noqa: F401
from mismatch.rollouts.sampling_rules import check_sampler_processing, check_sampling_mask  # noqa: F401

# Limits that turn hostile input into an error instead of a hang, a huge message or a RecursionError.
MAX_TREE_DEPTH = 1000  # parent links from the root; each level replays its whole context again
# Tokens one rollout's replay feeds (model.replayed_tokens); depth alone leaves width unbounded.
MAX_REPLAY_TOKENS = 2**25  # 32 Mi: still 256 subagents forked from a full 128k-token context
MAX_NESTING = 64  # levels of arrays/objects in free-form `meta` and `messages` (written to summary.json)
MAX_EXPERT_ID = np.iinfo(np.int16).max  # routed_experts are held as int16; no model has more experts
# meta.step: an integer every reader holds exactly (a float column rounds past 2^53; 2^70 overflowed int64).
MAX_STEP = 2**53


# ---------------------------------------------------------------------------------------------
# Shapes and free-form fields


def unknown_fields(raw: dict, known: tuple[str, ...]) -> list[str]:
    """The keys of `raw` format v1 does not name at its level. A null one is absent, as every
    optional field's null is (Parquet gives each row every field another row has, null where none)."""
    return [key for key, value in raw.items() if key not in known and value is not None and not is_index_column(key)]


def check_fields(raw: dict, known: tuple[str, ...], where: str | None, problems: Problems) -> None:
    """A field the format does not name is a typo until shown otherwise: "logprob" would leave the
    sampler's log-probs out without a word."""
    for key in unknown_fields(raw, known):
        problems.add(where, f"unknown field {name(str(key))} ({did_you_mean(str(key), known)})")


def check_rollout_object(raw: object, problems: Problems) -> bool:
    if not isinstance(raw, dict):
        problems.add(None, f"rollout must be a JSON object, got {json_type(raw)}")
        return False
    return True


def check_object(raw: object, where: str, problems: Problems) -> bool:
    """A branch or a segment is a JSON object."""
    if not isinstance(raw, dict):
        problems.add(where, f"must be an object, got {json_type(raw)}")
        return False
    return True


def required(obj: dict, key: str, where: str, problems: Problems) -> object | None:
    if key not in obj:
        problems.add(where, "missing required field")
    elif obj[key] is None:
        problems.add(where, "required field is null")
    return obj.get(key)


def check_items(value: object, where: str, item: str, problems: Problems) -> bool:
    """`branches` and `segments`: a non-empty array (of `item`s)."""
    if not isinstance(value, list):
        problems.add(where, f"must be an array, got {json_type(value)}")
        return False
    if not value:
        problems.add(where, f"empty {item} list")
        return False
    return True


def check_id(value: object, where: str, problems: Problems) -> str | None:
    if not isinstance(value, str) or not value:
        problems.add(where, f"must be a non-empty string, got {show(value)}")
        return None
    try:
        value.encode("utf-8")  # JSON's \ud800 escapes decode to lone surrogates: no text file holds them
    except UnicodeEncodeError:
        problems.add(where, f"must be valid Unicode text, got {show(value)} (a lone surrogate)")
        return None
    return value


def check_meta(meta: object, problems: Problems) -> dict:
    if meta is None:
        return {}
    if not isinstance(meta, dict):
        problems.add("meta", f"must be an object, got {json_type(meta)}")
        return {}
    if nesting(meta) > MAX_NESTING:  # it is copied into summary.json, whose writers recurse
        problems.add("meta", f"nested deeper than {MAX_NESTING} levels")
        return {}
    check_step(meta.get("step"), problems)
    check_declared_checkpoint(meta.get("checkpoint"), problems)
    check_sampler_processing(meta.get("sampler"), problems)  # sampling_rules.py
    return meta


def check_step(step: object, problems: Problems) -> None:
    """meta.step (a hook's or importer's training step; `trend` splits by it): null or an integer in
    [0, 2^53). "7", true and 2.5 are not steps: read loosely, they lost the rollout its step unsaid."""
    if step is None:
        return
    if type(step) is not int:
        problems.add("meta.step", f"must be a non-negative integer (a training step), got {show(step)}")
    elif not 0 <= step < MAX_STEP:
        problems.add("meta.step", f"must be a non-negative integer below 2^53, got {show(step)}")


_SHA256 = re.compile(r"[0-9a-f]{64}")


def check_declared_checkpoint(value: object, problems: Problems) -> None:
    """meta.checkpoint (the checkpoint the rollout was sampled by; rollouts/declared_checkpoint.py):
    null, a path or name, or {"path" or "name": text, "sha256": {weight file name: lowercase hex
    SHA-256}}, at least one of them."""
    where = "meta.checkpoint"
    if value is None:
        return
    if isinstance(value, str):
        if not value.strip():
            problems.add(where, "must be a non-empty path or name, got an empty string")
        return
    if not isinstance(value, dict):
        problems.add(where, f"must be a path or name, or an object with path and sha256, got {json_type(value)}")
        return
    unknown = sorted(set(value) - {"path", "name", "sha256"})
    if unknown:
        problems.add(where, f"unknown field {unknown[0]!r} (valid: path, name, sha256)")
        return
    for key in ("path", "name"):
        if key in value and not (isinstance(value[key], str) and value[key].strip()):
            problems.add(f"{where}.{key}", f"must be a non-empty string, got {show(value[key])}")
            return
    digests = value.get("sha256")
    if digests is not None and not (isinstance(digests, dict) and digests and all(
            isinstance(name, str) and isinstance(digest, str) and _SHA256.fullmatch(digest)
            for name, digest in digests.items())):
        problems.add(f"{where}.sha256", "must map each weight file's name to its SHA-256 (64 lowercase hex "
                                        f"digits), got {show(digests)}")
        return
    if not value:
        problems.add(where, "must name the checkpoint (path or name) or give its weights' sha256")


def check_messages(messages: object, problems: Problems) -> list | None:
    if messages is not None and not isinstance(messages, list):
        problems.add("messages", f"must be an array, got {json_type(messages)}")
        return None
    if messages is not None and nesting(messages) > MAX_NESTING:
        problems.add("messages", f"nested deeper than {MAX_NESTING} levels")
        return None
    return messages


# ---------------------------------------------------------------------------------------------
# A branch's place in the tree (`where` is the branch's path, e.g. "branches[1]")


def check_links(parent: object, fork_at: object, where: str, problems: Problems) -> None:
    """A root has neither a parent nor a fork_at; any other branch has both."""
    if parent is not None:
        check_id(parent, f"{where}.parent", problems)
    if fork_at is not None and type(fork_at) is not int:
        problems.add(f"{where}.fork_at", f"must be an integer or null, got {show(fork_at)}")
    elif parent is None and fork_at is not None:
        problems.add(f"{where}.fork_at", f"must be null for a root branch (parent null), got {fork_at}")
    elif parent is not None and fork_at is None:
        problems.add(f"{where}.fork_at", "missing required field (for a branch with a parent)")


def check_kind(kind: object, parent: object, where: str, problems: Problems) -> object:
    """The branch's kind, "main" for a root that names none (a plain single-stream rollout need
    not say so)."""
    if kind is None and parent is None:
        return "main"
    if kind is None:
        problems.add(f"{where}.kind", "missing required field (for a branch with a parent)")
    elif not isinstance(kind, str):
        problems.add(f"{where}.kind", f"must be a string, got {json_type(kind)}")
    elif kind not in BRANCH_KINDS:
        problems.add(f"{where}.kind", f"unknown branch kind {name(kind)} "
                                      f"(expected one of: {', '.join(BRANCH_KINDS)})")
    return kind


# ---------------------------------------------------------------------------------------------
# A segment's fields. The value rules take any number of tokens: the fast decoders check a whole
# branch's tokens (or one log-prob name's values) in one call, the untyped decoder one segment's.


def check_role(role: object, where: str, problems: Problems) -> None:
    if not isinstance(role, str):
        problems.add(where, f"must be a string, got {json_type(role)}")
    elif role not in ROLES:
        problems.add(where, f"unknown role {name(role)} (expected one of: {', '.join(ROLES)})")


def check_trainable(trainable: object, where: str, problems: Problems) -> None:
    if trainable is not None and not isinstance(trainable, bool):
        problems.add(where, f"must be true or false, got {show(trainable)}")


def trained_on(role: str, trainable: bool | None) -> bool:
    """A valid segment's `trainable`: as stored, else as its role is (a model's segments are)."""
    return role in MODEL_ROLES if trainable is None else trainable


def check_token_list(value: object, where: str, problems: Problems) -> bool:
    if not isinstance(value, list):
        problems.add(where, f"must be an array of integers, got {json_type(value)}")
        return False
    if not value:
        problems.add(where, "empty token list")
        return False
    return True


def check_token_ids(values: list, where: str, vocab_size: int | None, problems: Problems, *,
                    types_known: bool = False) -> np.ndarray | None:
    """int64 ids, >= 0 and below the vocab; the array even when an id is out of range (its
    length still counts the log-probs). `types_known`: the decoder checked they are ints."""
    bad = None if types_known else first_bad_type(values, INT_TYPES)
    if bad is not None:
        problems.add(where, f"token at index {bad} is not an integer: {show(values[bad])}")
        return None
    try:
        tokens = np.array(values, dtype=np.int64)
    except OverflowError:
        i = next(i for i, t in enumerate(values) if not -(2**63) <= t < 2**63)
        problems.add(where, f"token id {show(values[i])} at index {i} does not fit in int64")
        return None
    if tokens.min() >= 0 and (vocab_size is None or tokens.max() < vocab_size):
        return tokens  # the common case in two reductions; the scans below name what is wrong
    negative = np.flatnonzero(tokens < 0)
    if negative.size:
        i = int(negative[0])
        problems.add(where, f"token id {tokens[i]} at index {i} is negative{first_of(negative.size, 'negative')}")
    if vocab_size is not None:
        too_big = np.flatnonzero(tokens >= vocab_size)
        if too_big.size:
            i = int(too_big[0])
            problems.add(where, f"token id {tokens[i]} at index {i} is >= vocab size {vocab_size}"
                                f"{first_of(too_big.size, 'out of vocab')}")
    return tokens


def check_tokens(value: object, where: str, vocab_size: int | None, problems: Problems) -> np.ndarray | None:
    if not check_token_list(value, where, problems):
        return None
    return check_token_ids(value, where, vocab_size, problems)


def check_logprob_list(value: object, where: str, problems: Problems) -> bool:
    if not isinstance(value, list):
        problems.add(where, f"must be an array of numbers, got {json_type(value)}")
        return False
    return True


def check_logprob_values(values: list, where: str, problems: Problems, *,
                         types_known: bool = False) -> np.ndarray | None:
    """float64 log-probs (their range is check_logprob_range's). `types_known`: the decoder
    checked they are numbers."""
    bad = None if types_known else first_bad_type(values, NUMBER_TYPES)
    if bad is not None:
        problems.add(where, f"logprob at index {bad} is not a number: {show(values[bad])}")
        return None
    try:
        return np.array(values, dtype=np.float64)
    except OverflowError:
        problems.add(where, "an integer logprob is too large for float64")
        return None


def check_logprob_count(count: int, num_tokens: int | None, where: str, problems: Problems) -> None:
    """One log-prob per token (unknown when the tokens are wrong: then nothing to compare)."""
    if num_tokens is not None and count != num_tokens:
        problems.add(where, f"{count} logprobs for {num_tokens} tokens")


def logprobs_in_range(logp: np.ndarray) -> bool:
    """Every value finite and <= 0 (NaN fails both)."""
    return bool(((logp <= 0.0) & (logp > -np.inf)).all())


def check_logprob_range(logp: np.ndarray, where: str, problems: Problems) -> None:
    if logprobs_in_range(logp):
        return
    nonfinite = np.flatnonzero(~np.isfinite(logp))
    if nonfinite.size:
        i = int(nonfinite[0])
        problems.add(where, f"logprob at index {i} is {float(logp[i])!r}{first_of(nonfinite.size, 'non-finite')}")
    # Any positive value is a bug upstream (a probability above 1), even 1e-6 from rounding;
    # +inf is already reported as non-finite.
    positive = np.flatnonzero(np.isfinite(logp) & (logp > 0))
    if positive.size:
        i = int(positive[0])
        problems.add(where, f"logprob at index {i} is {float(logp[i])!r} > 0{first_of(positive.size, 'positive')}")


def check_logprobs(value: object, where: str, num_tokens: int | None, problems: Problems) -> np.ndarray | None:
    if not check_logprob_list(value, where, problems):
        return None
    logp = check_logprob_values(value, where, problems)
    if logp is None:
        return None
    check_logprob_count(len(logp), num_tokens, where, problems)
    check_logprob_range(logp, where, problems)
    return logp


def check_extra_logprobs(value: object, where: str, problems: Problems) -> bool:
    """`extra_logprobs` is an object {NAME: [...]} (each name's values are check_logprobs')."""
    return check_object(value, where, problems)


def _unflat(index: int, layers: int, k: int) -> tuple[int, int, int]:
    """(row, layer, slot) of an index into the flattened [rows][layers][k] ids."""
    row, rest = divmod(index, layers * k)
    return (row, *divmod(rest, k))


def check_routed_experts(value: object, where: str, num_tokens: int | None, num_experts: int | None,
                         problems: Problems) -> np.ndarray | None:
    """A segment's routed_experts: one [moe layers][top-k] array of expert ids per token, as vLLM
    returns them (CompletionOutput.routed_experts, [seq_len, layer_num, topk]); null for a token
    the engine routed none (a stream's last token is never fed; vLLM's routed_experts_prompt_start
    skips prompt tokens an earlier turn returned). Returns int16 [tokens, layers, k], -1 rows for
    null; None when every row is null. Each row's ids are kept sorted."""
    frame = token_rows(value, where, num_tokens, "expert ids", "routed", problems)
    if frame is None:
        return None
    present, shape = frame
    experts = _expert_ids(value, present, shape, where, num_experts, problems)
    if experts is None:
        return None
    out = np.full((len(value), *shape), -1, dtype=np.int16)
    out[present] = experts  # sorted: a top-k is a set, and passes compare as sets (engines/routing.py)
    return out


def _expert_ids(value: list, present: list[int], shape: tuple[int, int], where: str, num_experts: int | None,
                problems: Problems) -> np.ndarray | None:
    """The routed rows' expert ids, [rows, layers, k] with each top-k sorted: integers, in range,
    none twice in a top-k."""
    layers, k = shape
    flat = [expert for i in present for layer in value[i] for expert in layer]
    bad = first_bad_type(flat, INT_TYPES)  # bool is not an expert id: type(True) is bool
    if bad is not None:
        n, layer, j = _unflat(bad, layers, k)
        problems.add(where, f"token {present[n]} layer {layer}: expert id at index {j} is not an integer: "
                            f"{show(flat[bad])}")
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
        problems.add(where, f"token {present[n]} layer {layer}: expert id {show(expert)} is "
                            f"{'negative' if expert < 0 else f'>= {why}'}{first_of(len(wrong), 'out of range')}")
        return None
    ordered = np.sort(ids.reshape(len(present), layers, k), axis=-1)
    twice = np.argwhere(ordered[..., 1:] == ordered[..., :-1])
    if len(twice):
        n, layer, j = (int(x) for x in twice[0])
        problems.add(where, f"token {present[n]} layer {layer}: expert {int(ordered[n, layer, j])} appears "
                            "twice in one top-k")
        return None
    return ordered


def check_routing_shapes(branches: list[Branch | None], problems: Problems) -> None:
    """Every segment's routed_experts of one rollout has the same [layers][top-k]: one model routed them."""
    check_same_rows(branches, "routed_experts", "one model routes a rollout", problems)


# ---------------------------------------------------------------------------------------------
# The tree: rules across a rollout's branches


def check_tree(raw_branches: list, branches: list[Branch | None], problems: Problems) -> None:
    """Unique ids, one root, parents that exist, no cycles, fork_at in range, at most
    MAX_TREE_DEPTH levels. `raw_branches` are dicts of the branches' `id`, `parent`, `fork_at`
    as written; `branches` the decoded ones (None where a branch has errors). A sound tree feeds
    at most MAX_REPLAY_TOKENS."""
    num_errors = len(problems.errors)
    index_of, links = _first_ids(raw_branches, problems)
    _check_one_root(index_of, links, problems)
    parent_of = _known_parents(index_of, links, problems)
    in_cycle = _check_cycles(parent_of, index_of, problems)
    _check_fork_range(parent_of, links, in_cycle, index_of, branches, problems)
    deepest = deepest_branch(parent_of, in_cycle)
    if deepest is not None and deepest[1] > MAX_TREE_DEPTH:
        branch_id, depth = deepest
        problems.add(f"branches[{index_of[branch_id]}].parent",
                     f"branch {name(branch_id)} is {depth} levels below the root; at most "
                     f"{MAX_TREE_DEPTH} are allowed (each level replays its whole context again)")
    if len(problems.errors) == num_errors and all(branches) and (total := replayed_tokens(branches)) > MAX_REPLAY_TOKENS:
        problems.add("branches", f"{total:,} tokens to replay (each branch's context plus its own tokens, over its "
                                 f"{len(branches)} branches); at most {MAX_REPLAY_TOKENS:,} per rollout")


def _first_ids(raw_branches: list, problems: Problems) -> tuple[dict[str, int], dict[str, tuple[object, object]]]:
    """Each id's index and (parent, fork_at) at its first occurrence; a later one is a duplicate.
    Only ids whose own checks passed take part; their type errors are already reported."""
    index_of: dict[str, int] = {}
    links: dict[str, tuple[object, object]] = {}
    for i, raw in enumerate(raw_branches):
        if not isinstance(raw, dict) or not isinstance(raw.get("id"), str) or not raw["id"]:
            continue
        branch_id = raw["id"]
        if branch_id in index_of:
            problems.add(f"branches[{i}].id",
                         f"duplicate branch id {name(branch_id)} (also branches[{index_of[branch_id]}])")
            continue
        index_of[branch_id] = i
        links[branch_id] = (raw.get("parent"), raw.get("fork_at"))
    return index_of, links


def _check_one_root(index_of: dict[str, int], links: dict[str, tuple[object, object]], problems: Problems) -> None:
    roots = [index_of[branch_id] for branch_id, (parent, _) in links.items() if parent is None]
    if index_of and not roots:
        problems.add("branches", "no root branch; exactly one branch must have parent null")
    for i in roots[1:]:
        problems.add(f"branches[{i}].parent",
                     f"a second root branch (parent null) besides branches[{roots[0]}]; exactly one is allowed")


def _known_parents(index_of: dict[str, int], links: dict[str, tuple[object, object]],
                   problems: Problems) -> dict[str, str]:
    """branch id -> parent id, for the parents that are branches of this rollout."""
    parent_of: dict[str, str] = {}
    for branch_id, (parent, _) in links.items():
        if not isinstance(parent, str) or not parent:
            continue
        if parent not in index_of:
            problems.add(f"branches[{index_of[branch_id]}].parent",
                         f"parent {name(parent)} is not a branch of this rollout")
            continue
        parent_of[branch_id] = parent
    return parent_of


def _check_cycles(parent_of: dict[str, str], index_of: dict[str, int], problems: Problems) -> set[str]:
    """Each cycle of parent links reported once, from its first branch; the branches in them."""
    in_cycle: set[str] = set()
    for cycle in _find_cycles(parent_of):
        first = min(cycle, key=index_of.__getitem__)
        k = cycle.index(first)
        loop = [short_id(b) for b in cycle[k:] + cycle[:k] + [first]]
        if len(loop) > 8:  # a 10k-branch cycle is named by its ends, not by 10k ids on one line
            loop = [*loop[:4], "...", *loop[-3:]]
        size = f" ({len(cycle)} branches)" if len(cycle) > 7 else ""
        problems.add(f"branches[{index_of[first]}].parent",
                     f"parent links form a cycle: {' -> '.join(loop)}{size}")
        in_cycle.update(cycle)
    return in_cycle


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


def _check_fork_range(parent_of: dict[str, str], links: dict[str, tuple[object, object]], in_cycle: set[str],
                      index_of: dict[str, int], branches: list[Branch | None], problems: Problems) -> None:
    """A fork_at lies within its parent's own stream (0..its length)."""
    for branch_id, parent in parent_of.items():
        fork_at = links[branch_id][1]
        if type(fork_at) is not int or branch_id in in_cycle:
            continue
        where = f"branches[{index_of[branch_id]}].fork_at"
        parent_branch = branches[index_of[parent]]
        if parent_branch is None:  # parent's own length unknown (its errors are reported)
            if fork_at < 0:
                problems.add(where, f"fork_at {fork_at} is negative")
        elif not 0 <= fork_at <= parent_branch.num_tokens:
            problems.add(where, f"fork_at {fork_at} is outside 0..{parent_branch.num_tokens} "
                                f"(the length of parent {name(parent)})")
