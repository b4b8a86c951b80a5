"""prime-rl token export → format v1: each TrainingExample of a TrainingBatch becomes one rollout.

Field names and order from PrimeIntellect-ai/prime-rl `src/prime_rl/transport/types.py`
(`TrainingExample`: prompt_ids, prompt_mask, completion_ids, completion_mask, completion_logprobs,
advantage; `TrainingBatch`: examples, temperature, seq_len, step — msgspec structs with
array_like=True, so the msgpack `rollouts/step_N/rollouts.bin` that
`src/prime_rl/transport/filesystem.py` writes holds arrays in that order). A JSON dump with the
same names as keys is read too. In an interleaved multi-turn example the completion holds the
environment's tokens with mask 0 and placeholder log-probs; those become tool segments.
"""

from __future__ import annotations

from typing import Any

from mismatch.rollouts.importers._common import (Where, branch, floats, get, ints, masked_segments,
                                                 runs, same_length, source_meta)

EXAMPLE_FIELDS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "completion_logprobs",
                  "advantage")
BATCH_FIELDS = ("examples", "temperature", "seq_len", "step")


def _as_struct(value: Any, fields: tuple[str, ...], required: int) -> dict[str, Any] | None:
    """A struct as a dict: already one (JSON), or an array_like array (msgpack); else None.

    omit_defaults drops trailing defaulted fields, so an array may be shorter than `fields`.
    """
    if isinstance(value, dict):
        return value
    if isinstance(value, list) and required <= len(value) <= len(fields):
        return dict(zip(fields, value))
    return None


def _is_batch(record: Any) -> bool:
    if isinstance(record, dict):
        return "examples" in record
    return (isinstance(record, list) and len(record) == len(BATCH_FIELDS) and isinstance(record[0], list)
            and all(isinstance(x, (list, dict)) for x in record[0]))


def convert(record: Any, where: Where) -> list[dict[str, Any]]:
    """A TrainingBatch (its examples, with its temperature and step) or a single TrainingExample."""
    if _is_batch(record):
        batch = _as_struct(record, BATCH_FIELDS, len(BATCH_FIELDS))
        examples = get(batch, "examples", where)
        if not isinstance(examples, list):
            raise where.error("examples", "must be an array of TrainingExample")
        return [_rollout(example, where, f"prime-rl-{where.index}-{i}", batch, f"examples[{i}].")
                for i, example in enumerate(examples)]
    return [_rollout(record, where, f"prime-rl-{where.index}", {}, "")]


def _rollout(value: Any, where: Where, rollout_id: str, batch: dict[str, Any], prefix: str) -> dict[str, Any]:
    example = _as_struct(value, EXAMPLE_FIELDS, len(EXAMPLE_FIELDS) - 1)
    if example is None:
        raise where.error(prefix.rstrip(".") or None, "not a TrainingExample (an object with "
                          f"{', '.join(EXAMPLE_FIELDS[:-1])}, or an array of them in that order)")
    field = lambda name: get(example, name, where, prefix=prefix)  # noqa: E731
    prompt = ints(field("prompt_ids"), prefix + "prompt_ids", where)
    prompt_mask = ints(field("prompt_mask"), prefix + "prompt_mask", where)
    completion = ints(field("completion_ids"), prefix + "completion_ids", where)
    completion_mask = ints(field("completion_mask"), prefix + "completion_mask", where)
    logprobs = floats(field("completion_logprobs"), prefix + "completion_logprobs", where)
    same_length(prefix + "prompt_mask", prompt_mask, "prompt_ids", prompt, where)
    same_length(prefix + "completion_mask", completion_mask, "completion_ids", completion, where)
    same_length(prefix + "completion_logprobs", logprobs, "completion_ids", completion, where)
    # A prompt token with mask 1 would be trained on without a sampler log-prob: keep the flag.
    prompt_segments = [{"role": "user", "tokens": prompt[a:b], **({"trainable": True} if on else {})}
                       for a, b, on in runs(prompt_mask)]
    segments = [*prompt_segments, *masked_segments(completion, completion_mask, logprobs, off_role="tool")]
    # TrainingBatch.temperature is the sampling temperature (the trainer scales its logits by it).
    sampler = {"engine": "prime-rl", "temperature": batch["temperature"]} if batch.get("temperature") else None
    meta = source_meta("prime-rl", where, sampler=sampler, step=batch.get("step"),
                       advantage=example.get("advantage"))
    return {"id": rollout_id, "meta": meta, "branches": [branch("main", segments)]}

