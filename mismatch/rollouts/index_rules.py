"""The rule of format v1 for a sparse-attention engine's selections: a segment's `indexer_topk`
(the key positions DSA's indexer kept per token and layer). Part of rules.py's set, which re-exports it.
"""

from __future__ import annotations

import numpy as np

from mismatch.rollouts.problems import INT_TYPES, Problems, check_same_rows, first_bad_type, first_of, show, token_rows

# Key positions are held as int32: no context reaches 2^31 tokens.
MAX_KEY_POSITION = np.iinfo(np.int32).max


def check_indexer_topk(value: object, where: str, num_tokens: int | None, problems: Problems) -> np.ndarray | None:
    """A segment's indexer_topk: for each token, the key positions (0-based in the whole stream the
    token's branch replays: its context, then its own tokens) that the engine's DSA indexer selected
    for the query at that token's position, one [sparse layers][top-k] array per token, -1 in a
    slot with no key (a query with fewer keys than top-k), null for a token the engine recorded none
    (a stream's last token is never fed). Like routed_experts, the token's own position.
    Returns int32 [tokens, layers, k] with each top-k sorted, -1 rows for null; None when all null."""
    frame = token_rows(value, where, num_tokens, "key positions", "recorded", problems)
    if frame is None:
        return None
    present, (layers, k) = frame
    flat = [key for i in present for layer in value[i] for key in layer]
    wrong = first_bad_type(flat, INT_TYPES)
    if wrong is None:
        out_of_range = [j for j, key in enumerate(flat) if not -1 <= key <= MAX_KEY_POSITION]
        if out_of_range:
            wrong = out_of_range[0]
            n, layer = divmod(wrong // k, layers)
            problems.add(where, f"token {present[n]} layer {layer}: key position {show(flat[wrong])} is not in "
                                f"[-1, {MAX_KEY_POSITION}] (-1: no key in that slot)"
                                f"{first_of(len(out_of_range), 'out of range')}")
            return None
    else:
        n, layer = divmod(wrong // k, layers)
        problems.add(where, f"token {present[n]} layer {layer}: key position at index {wrong % k} is not an "
                            f"integer: {show(flat[wrong])}")
        return None
    ordered = np.sort(np.array(flat, dtype=np.int32).reshape(len(present), layers, k), axis=-1)
    twice = np.argwhere((ordered[..., 1:] == ordered[..., :-1]) & (ordered[..., 1:] >= 0))
    empty = np.argwhere((ordered < 0).all(axis=-1))
    for found, words in ((twice, "key {key} appears twice in one top-k"),
                         (empty, "no key selected (a query selects at least itself)")):
        if len(found):
            n, layer = int(found[0][0]), int(found[0][1])
            key = int(ordered[n, layer, found[0][2]]) if found.shape[1] == 3 else None
            problems.add(where, f"token {present[n]} layer {layer}: {words.format(key=key)}")
            return None
    out = np.full((len(value), layers, k), -1, dtype=np.int32)
    out[present] = ordered
    return out


def check_index_shapes(branches: list, problems: Problems) -> None:
    """Every segment's indexer_topk of one rollout has the same [layers][top-k]: one model selected them."""
    check_same_rows(branches, "indexer_topk", "one model selects a rollout's keys", problems)
