"""prime-rl token exports → format v1: each sample of a micro-batch file (or TrainingExample) is one rollout.

Current prime-rl (PrimeIntellect-ai/prime-rl@559b44772e47): with `rollout_transport = {type =
"filesystem"}` the orchestrator writes `rollouts/step_N/rank_R.bin`, one msgspec msgpack list of
`MicroBatch` (`src/prime_rl/transports/rollouts/filesystem.py:29-35`; the struct, array_like with
omit_defaults, in `src/prime_rl/transports/rollouts/types.py:74-98`): samples packed end to end,
their lengths in `seq_lens`, `loss_mask` true on sampled tokens, `inference_logprobs` per token,
padding appended to the last sample with position ids restarting at 0
(`src/prime_rl/trainer/batch.py:345-458` prepare_sample, `:538-617` _materialize_bin, `:692-738`
pad_micro_batch). Routing replay (`trainer.enable_router_replay`): `routed_experts` is a
`RoutedExperts(data: bytes, shape: [tokens, layers, top-k], dtype)` (types.py:15-19), row i for
token i, zero rows where vLLM returned none (`src/prime_rl/orchestrator/trajectories.py:52-67`
zero-pads the tail; vLLM's `CompletionOutput.routed_experts` never has the last token).

The trainer's token export (`trainer.enable_token_export`) writes `token_exports/step_N/rank_R.jsonl`
(`src/prime_rl/trainer/rl/token_export.py:87-100`): one line per packed sequence that has a
loss-mask token, padding trimmed (:55-74, :239-244), with step, env_name and per-token token_ids,
loss_mask, advantages, `inference_logprobs` (the sampler's) and `trainer_logprobs`, the training
forward's log-probs of the same tokens (:136-157; null where non-finite, :247-253). Those land in
`extra_logprobs["trainer"]`: `--train stored:trainer --infer sampler` measures prime-rl's own gap.
The filesystem transport's dummy micro batches (loss_mask all false, `trainer/batch.py:774-792`,
added to even out the ranks) are skipped.

Older prime-rl (until b8697b0f0, 2025-12-15) wrote a `TrainingBatch` (examples, temperature,
seq_len, step) of `TrainingExample` (prompt_ids, prompt_mask, completion_ids, completion_mask,
completion_logprobs, advantage) from `src/prime_rl/transport/types.py`; a JSON dump with the same
names as keys is read too. That format never carried routed experts: router replay came later
(bc77fa069, 2026-02-26). In an interleaved multi-turn sample the tokens between sampled spans are
the environment's (mask 0); those become tool segments.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from mismatch.rollouts.importers._common import (Where, branch, floats, get, ints, masked_segments,
                                                 routed_rows, runs, same_length, source_meta, with_routing)

EXAMPLE_FIELDS = ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "completion_logprobs",
                  "advantage")
BATCH_FIELDS = ("examples", "temperature", "seq_len", "step")
MICRO_BATCH_FIELDS = ("input_ids", "loss_mask", "advantages", "inference_logprobs", "position_ids",
                      "sequence_lengths", "temperatures", "env_names", "seq_lens", "ref_logprobs", "routed_experts",
                      "mm_kwargs", "mm_token_type_ids", "rl_weights", "ce_weights", "ref_kl_weights")
MICRO_BATCH_REQUIRED = 9  # through seq_lens; the rest default to None and omit_defaults drops them
ROUTED_EXPERTS_FIELDS = ("data", "shape", "dtype")
# The token export's training-forward log-probs (the ratio's numerator), as extra_logprobs["trainer"].
TRAINER_LOGPROBS = "trainer"


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


def _is_micro_batch(value: Any) -> bool:
    if isinstance(value, dict):
        return "input_ids" in value
    return (isinstance(value, list) and MICRO_BATCH_REQUIRED <= len(value) <= len(MICRO_BATCH_FIELDS)
            and all(isinstance(x, list) for x in value[:MICRO_BATCH_REQUIRED]))


def convert(record: Any, where: Where) -> list[dict[str, Any]]:
    """A token-export line, a rank file's MicroBatch list (or one MicroBatch), a TrainingBatch (its
    examples, with its temperature and step) or a single TrainingExample."""
    if _is_token_export(record):
        return [_token_export(record, where)]
    # A list of MicroBatch is tested first: four of them would also pass for a TrainingBatch's shape.
    if isinstance(record, list) and record and all(_is_micro_batch(x) for x in record):
        return [rollout for m, micro in enumerate(record) for rollout in _micro_batch(micro, where, m)]
    if isinstance(record, dict) and _is_micro_batch(record):
        return _micro_batch(record, where, None)
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



def _flags(value: Any, field: str, where: Where) -> list[int]:
    """A list[bool] mask (msgpack booleans; 0/1 in hand-written JSON) as 0/1."""
    if not isinstance(value, list) or not all(v in (0, 1) for v in value):
        raise where.error(field, "must be an array of booleans")
    return [int(v) for v in value]


def _micro_batch(value: Any, where: Where, index: int | None) -> list[dict[str, Any]]:
    """Each packed sample of one MicroBatch as a rollout, its padding dropped."""
    prefix = "" if index is None else f"[{index}]."
    micro = _as_struct(value, MICRO_BATCH_FIELDS, MICRO_BATCH_REQUIRED)
    field = lambda name: get(micro, name, where, prefix=prefix)
    ids = ints(field("input_ids"), prefix + "input_ids", where)
    loss_mask = _flags(field("loss_mask"), prefix + "loss_mask", where)
    logprobs = floats(field("inference_logprobs"), prefix + "inference_logprobs", where)
    positions = ints(field("position_ids"), prefix + "position_ids", where)
    temperatures = floats(field("temperatures"), prefix + "temperatures", where)
    advantages = floats(field("advantages"), prefix + "advantages", where)
    env_names = field("env_names")
    seq_lens = ints(field("seq_lens"), prefix + "seq_lens", where)
    for name, values in (("loss_mask", loss_mask), ("inference_logprobs", logprobs), ("position_ids", positions),
                         ("temperatures", temperatures), ("advantages", advantages), ("env_names", env_names)):
        same_length(prefix + name, values, "input_ids", ids, where)
    if sum(seq_lens) != len(ids) or any(n <= 0 for n in seq_lens):
        raise where.error(prefix + "seq_lens", f"must be positive sample lengths summing to the "
                                               f"{len(ids)} input_ids, got {seq_lens}")
    routed = micro.get("routed_experts")
    if routed is not None:
        routed = _routed_experts(routed, prefix + "routed_experts", len(ids), where)
    rollouts = []
    start = 0
    for s, length in enumerate(seq_lens):
        # pad_micro_batch extends the last sample with position ids counting again from 0.
        stop = next((i for i in range(start + 1, start + length) if positions[i] == 0), start + length)
        if not any(loss_mask[start:stop]):
            # No sampled token: one of prepare_batch's dummy micro batches, a copy of a real one
            # with loss_mask all false to even out the ranks (trainer/batch.py:774-792).
            start += length
            continue
        rollout_id = f"prime-rl-{where.index}" + ("" if index is None else f"-{index}") + f"-{s}"
        rollouts.append(_sample(ids[start:stop], loss_mask[start:stop], logprobs[start:stop],
                                temperatures[start:stop], advantages[start:stop], env_names[start],
                                routed[start:stop] if routed is not None else None, where, rollout_id))
        start += length
    return rollouts


def _routed_experts(value: Any, field: str, num_tokens: int, where: Where) -> list[Any]:
    """RoutedExperts(data, shape, dtype): raw bytes of a [tokens, layers, top-k] integer array, as
    trajectories.py `_encode_routed_experts` writes it (`arr.tobytes()`, `str(arr.dtype)`)."""
    struct = _as_struct(value, ROUTED_EXPERTS_FIELDS, len(ROUTED_EXPERTS_FIELDS))
    if struct is None or not isinstance(struct.get("data"), bytes):
        raise where.error(field, "must be a RoutedExperts (data: bytes, shape: [tokens, layers, top-k], dtype)")
    shape = ints(get(struct, "shape", where, prefix=field + "."), field + ".shape", where)
    try:
        dtype = np.dtype(get(struct, "dtype", where, prefix=field + "."))
    except TypeError:
        dtype = None
    if dtype is None or dtype.kind not in "iu":
        raise where.error(field + ".dtype", f"must name an integer dtype, got {struct['dtype']!r}")
    if len(shape) != 3 or shape[0] != num_tokens or len(struct["data"]) != int(np.prod(shape)) * dtype.itemsize:
        raise where.error(field, f"shape {shape} and {len(struct['data'])} bytes of {dtype} do not make "
                                 f"[{num_tokens} tokens, layers, top-k]")
    rows = np.frombuffer(struct["data"], dtype=dtype).reshape(shape).tolist()
    return routed_rows(rows, field, num_tokens, where)


def _sample(ids: list[int], mask: list[int], logprobs: list[float], temperatures: list[float] | None,
            advantages: list[float], env_name: Any, routed: list[Any] | None, where: Where,
            rollout_id: str, extra: dict[str, list[float]] | None = None, step: Any = None) -> dict[str, Any]:
    # The tokens before the first sampled one are the prompt; later mask-0 runs are the environment's.
    first = next((i for i, on in enumerate(mask) if on), len(mask))
    extra_tail = {name: values[first:] for name, values in extra.items()} if extra else None
    segments = [with_routing({"role": "user", "tokens": ids[:first]}, routed[:first] if routed else None),
                *masked_segments(ids[first:], mask[first:], logprobs[first:], off_role="tool",
                                 routed=routed[first:] if routed else None, extra_logprobs=extra_tail)]
    # Per-token temperatures and advantages: one value over the sampled tokens is the rollout's.
    sampled_temperatures = {t for t, on in zip(temperatures or [], mask) if on}
    sampled_advantages = {a for a, on in zip(advantages, mask) if on}
    sampler = ({"engine": "prime-rl", "temperature": sampled_temperatures.pop()}
               if len(sampled_temperatures) == 1 else None)
    meta = source_meta("prime-rl", where, sampler=sampler, env=env_name or None, step=step,
                       advantage=sampled_advantages.pop() if len(sampled_advantages) == 1 else None)
    return {"id": rollout_id, "meta": meta, "branches": [branch("main", segments)]}


def _is_token_export(record: Any) -> bool:
    return isinstance(record, dict) and "schema_version" in record and "trainer_logprobs" in record


def _token_export(record: dict[str, Any], where: Where) -> dict[str, Any]:
    """One sequence of the trainer's token export (`trainer.enable_token_export`): the sampler's
    and the trainer's log-probs of the same tokens, side by side."""
    ids = ints(get(record, "token_ids", where), "token_ids", where)
    mask = _flags(get(record, "loss_mask", where), "loss_mask", where)
    logprobs = _sampled_floats(record, "inference_logprobs", mask, where)
    trainer = _sampled_floats(record, "trainer_logprobs", mask, where)
    advantages = floats(get(record, "advantages", where), "advantages", where)
    for name, values in (("loss_mask", mask), ("advantages", advantages)):
        same_length(name, values, "token_ids", ids, where)
    return _sample(ids, mask, logprobs, None, advantages, record.get("env_name"), None, where,
                   f"prime-rl-{where.index}", extra={TRAINER_LOGPROBS: trainer}, step=record.get("step"))


def _sampled_floats(record: dict[str, Any], field: str, mask: list[int], where: Where) -> list[float]:
    """A per-token log-prob column; the exporter writes null for a non-finite value
    (token_export.py:247-253), which only a token outside the loss may carry here."""
    values = get(record, field, where)
    if not isinstance(values, list) or len(values) != len(mask):
        raise where.error(field, f"must be an array of {len(mask)} numbers (one per token)")
    bad = next((i for i, (v, on) in enumerate(zip(values, mask)) if on and v is None), None)
    if bad is not None:
        raise where.error(field, f"is null (non-finite) at sampled token {bad}")
    return floats([0.0 if v is None else v for v in values], field, where)
