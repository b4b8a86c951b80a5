"""The rules of format v1 for what a sampler's truncation leaves: a segment's `sampling_mask` (the
kept ids per token) and meta.sampler's processing keys. Part of rules.py's set, which re-exports them.
"""

from __future__ import annotations

import numpy as np

from mismatch.rollouts.problems import INT_TYPES, NUMBER_TYPES, Problems, first_bad_type, first_of, json_type, show
from mismatch.streams import KeptSets

# meta.sampler's processing keys and what each must be (a replay applies them: a string there
# would fail deep in a pass, after the models load).
_PROCESSING_RULES = {
    "temperature": (lambda v: type(v) in NUMBER_TYPES and v >= 0, "a number >= 0"),
    "top_p": (lambda v: type(v) in NUMBER_TYPES and 0 < v <= 1, "a number in (0, 1]"),
    "min_p": (lambda v: type(v) in NUMBER_TYPES and 0 <= v <= 1, "a number in [0, 1]"),
    "top_k": (lambda v: type(v) in INT_TYPES, "an integer (-1 or 0: off)"),
}


def check_sampler_processing(sampler: object, problems: Problems) -> None:
    if not isinstance(sampler, dict):
        return
    for key, (ok, wanted) in _PROCESSING_RULES.items():
        value = sampler.get(key)
        if value is not None and not ok(value):
            problems.add(f"meta.sampler.{key}", f"must be {wanted}, got {show(value)}")



def check_sampling_mask(value: object, where: str, tokens: np.ndarray | None, vocab_size: int | None,
                        problems: Problems) -> KeptSets | None:
    """A segment's sampling_mask: the token ids the sampler's truncation (top-k / top-p / min-p) kept
    at each token, CSR as vLLM's `return_sampling_mask` gives them (vllm/v1/outputs.py
    SamplingMaskLists): {"offsets": [0, ..., len(token_ids)] (one more than the tokens),
    "token_ids": [...]}; token i kept token_ids[offsets[i]:offsets[i+1]], an empty row where none was
    recorded. A recorded set holds the token sampled there. None when no row is recorded."""
    if not isinstance(value, dict) or set(value) - {"offsets", "token_ids"} or "offsets" not in value \
            or "token_ids" not in value:
        problems.add(where, 'must be an object {"offsets": [...], "token_ids": [...]} (CSR: token i kept '
                            f"token_ids[offsets[i]:offsets[i+1]]), got {show(value)}")
        return None
    offsets_raw, ids_raw = value["offsets"], value["token_ids"]
    for key, raw in (("offsets", offsets_raw), ("token_ids", ids_raw)):
        if not isinstance(raw, list):
            problems.add(f"{where}.{key}", f"must be an array of integers, got {json_type(raw)}")
            return None
        bad = first_bad_type(raw, INT_TYPES)
        if bad is not None:
            problems.add(f"{where}.{key}", f"index {bad} is not an integer: {show(raw[bad])}")
            return None
    if tokens is not None and len(offsets_raw) != len(tokens) + 1:
        problems.add(f"{where}.offsets", f"{len(offsets_raw)} offsets for {len(tokens)} tokens (one more "
                                         "than the tokens: token i kept token_ids[offsets[i]:offsets[i+1]])")
        return None
    try:
        offsets, ids = np.array(offsets_raw, dtype=np.int64), np.array(ids_raw, dtype=np.int64)
    except OverflowError:
        problems.add(where, "an id or offset does not fit in int64")
        return None
    steps = np.diff(offsets)
    if not len(offsets) or offsets[0] != 0 or offsets[-1] != len(ids) or (steps < 0).any():
        problems.add(f"{where}.offsets", f"must start at 0, never decrease and end at len(token_ids) = {len(ids)}, "
                                         f"got {show(offsets_raw)}")
        return None
    limit = vocab_size if vocab_size is not None else np.iinfo(np.int32).max
    wrong = np.flatnonzero((ids < 0) | (ids >= limit))
    if len(wrong):
        problems.add(f"{where}.token_ids", f"token id {int(ids[wrong[0]])} at index {int(wrong[0])} is out of range "
                                           f"(0 <= id < {limit}){first_of(len(wrong), 'out of range')}")
        return None
    if not len(ids):
        return None
    if tokens is not None:
        rows = np.repeat(np.arange(len(tokens)), steps)
        has_own = np.zeros(len(tokens), dtype=bool)
        has_own[rows[ids == tokens[rows]]] = True
        missing = np.flatnonzero((steps > 0) & ~has_own)
        if len(missing):
            i = int(missing[0])
            problems.add(where, f"token {i}: its kept set does not hold the token sampled there ({int(tokens[i])})"
                                f"{first_of(len(missing), 'without their token')}")
            return None
    return KeptSets(offsets=offsets, ids=ids.astype(np.int32))
