"""verl rollout dumps → format v1: one rollout per sample, the response split at its mask.

Read at verl-project/verl@1dda039b9c63 and in the verl 0.9.1 wheel (the same fields in both;
line numbers are the wheel's, `verl/experimental/agent_loop/agent_loop.py`):
- `AgentLoopOutput` (:88-115): prompt_ids, response_ids, response_mask (1 for LLM-generated
  tokens, 0 for tool-response tokens), response_logprobs, routed_experts, reward_score,
  num_turns, metrics, extra_fields — dumped as JSON (`model_dump()`).
- `AgentLoopOutput.as_dict()` (:117-161): the same sample renamed `prompts`, `responses`,
  `response_mask`, `rollout_log_probs`, `rm_scores` (the reward on the last token),
  `routed_experts` zero-padded over prompt + response; unpadded, so no attention_mask.
- the `_postprocess` batch (:1057-1148, a DataProto; `DataProto.save_to_disk` pickles it,
  `verl/protocol.py:423-425`): `prompts` left-padded, `responses` right-padded, `response_mask`,
  `attention_mask` over both, `rollout_log_probs` (0.0 on padding), `routed_experts`, `rm_scores`.
  The trainer adds `old_log_probs`, its own recompute of the same tokens (`verl/trainer/ppo/
  ray_trainer.py:1318`; in bypass mode a copy of rollout_log_probs, :1571-1584): kept as
  `extra_logprobs["trainer_old"]`, so `--train stored:trainer_old` measures verl's own gap.
`trainer.rollout_data_dir` writes `{global_steps}.jsonl` of decoded text only (input, output,
gts, score, step; ray_trainer.py:454-477): no token ids, so it is refused with what to dump instead.

Routing replay (R3): row i of `routed_experts` ([tokens][layers][top-k], vLLM's
`CompletionOutput.routed_experts`) is the token at position i of prompt + response; verl places
it at the left-padded prompt's first position in a zero tensor (agent_loop.py:783-809), zeros
where vLLM returned no row (padding, and the last token, never fed).
"""

from __future__ import annotations

from typing import Any

from mismatch.rollouts.importers._common import (Where, branch, floats, get, ints, masked_segments,
                                                 response_sample, routed_rows, rows_of, same_length, source_meta,
                                                 with_routing)

AGENT_LOOP_KEYS = ("prompt_ids", "response_ids", "response_mask", "response_logprobs", "reward_score",
                   "num_turns", "routed_experts")
BATCH_KEYS = ("prompts", "responses", "response_mask", "attention_mask", "rollout_log_probs", "routed_experts",
              "old_log_probs", "rm_scores", "__num_turns__")
TRAINER_LOGPROBS = {"old_log_probs": "trainer_old"}  # verl's batch key -> extra_logprobs name
TEXT_DUMP_KEYS = ("input", "output", "score", "step")


def convert(record: Any, where: Where) -> list[dict[str, Any]]:
    """One AgentLoopOutput (or its as_dict()), or a columnar batch of them / of `_postprocess` rows."""
    if isinstance(record, dict) and all(key in record for key in TEXT_DUMP_KEYS) and "prompts" not in record:
        raise where.error(None, "this is verl's trainer.rollout_data_dir dump (decoded text, no token ids); "
                                "import the batch instead: DataProto.save_to_disk(...) of the step's batch "
                                "(prompts, responses, response_mask, attention_mask, rollout_log_probs)")
    padded = isinstance(record, dict) and "prompts" in record
    first = get(record, "prompts" if padded else "prompt_ids", where)
    if isinstance(first, list) and first and isinstance(first[0], list):  # a batch: one row per sample
        rows = rows_of(record, BATCH_KEYS if padded else AGENT_LOOP_KEYS, where)
        return [_rollout(row, where, f"verl-{where.index}-{i}", padded, prefix=f"[{i}].")
                for i, row in enumerate(rows)]
    return [_rollout(record, where, f"verl-{where.index}", padded, prefix="")]


def _response_floats(row: dict[str, Any], key: str, num: int, where: Where, prefix: str) -> list[float] | None:
    values = row.get(key)
    if values is None:
        return None
    values = floats(values, prefix + key, where)
    if len(values) != num:
        raise where.error(prefix + key, f"has {len(values)} entries for {num} response tokens")
    return values


def _unpad(row: dict[str, Any], where: Where, prefix: str) -> dict[str, Any]:
    """A `_postprocess` / as_dict() row without its padding (attention_mask 0; as_dict() has none)."""
    prompt = ints(get(row, "prompts", where, prefix=prefix), prefix + "prompts", where)
    response = ints(get(row, "responses", where, prefix=prefix), prefix + "responses", where)
    mask = ints(get(row, "response_mask", where, prefix=prefix), prefix + "response_mask", where)
    same_length(prefix + "response_mask", mask, "response tokens", response, where)
    attention = row.get("attention_mask")
    attention = [1] * (len(prompt) + len(response)) if attention is None else \
        ints(attention, prefix + "attention_mask", where)
    if len(attention) != len(prompt) + len(response):
        raise where.error(prefix + "attention_mask", f"has {len(attention)} entries for "
                          f"{len(prompt)} prompt + {len(response)} response tokens")
    streams = {key: _response_floats(row, key, len(response), where, prefix)
               for key in ("rollout_log_probs", "rm_scores", *TRAINER_LOGPROBS)}
    keep_response = attention[len(prompt):]
    kept = [i for i, on in enumerate(keep_response) if on]
    routed = row.get("routed_experts")
    if routed is not None:
        routed = routed_rows(routed, prefix + "routed_experts", len(attention), where)
        routed = [r for r, on in zip(routed, attention) if on]
    return {"prompt": [t for t, on in zip(prompt, attention) if on], "response": [response[i] for i in kept],
            "mask": [mask[i] for i in kept], "routed": routed,
            **{key: None if values is None else [values[i] for i in kept] for key, values in streams.items()}}


def _sample(row: dict[str, Any], where: Where, prefix: str, padded: bool) -> dict[str, Any]:
    """prompt, response, mask, rollout_log_probs, routed rows, trainer streams and reward of a row."""
    if padded:
        sample = _unpad(row, where, prefix)
        sample["reward"] = sum(sample["rm_scores"]) if sample["rm_scores"] is not None else None
        return sample
    prompt, response, mask, logprobs = response_sample(row, where, prefix, prompt="prompt_ids",
                                                       response="response_ids", mask="response_mask",
                                                       logprobs="response_logprobs")
    routed = row.get("routed_experts")
    if routed is not None:
        routed = routed_rows(routed, prefix + "routed_experts", len(prompt) + len(response), where)
    return {"prompt": prompt, "response": response, "mask": mask, "rollout_log_probs": logprobs,
            "routed": routed, "reward": row.get("reward_score")}


def _rollout(row: dict[str, Any], where: Where, rollout_id: str, padded: bool, prefix: str) -> dict[str, Any]:
    sample = _sample(row, where, prefix, padded)
    prompt, routed = sample["prompt"], sample["routed"]
    extra = {name: sample[key] for key, name in TRAINER_LOGPROBS.items() if sample.get(key) is not None}
    # The prompt is the dataset's chat (system + user) as one run of prompt tokens.
    segments = [with_routing({"role": "user", "tokens": prompt}, routed[: len(prompt)] if routed else None),
                *masked_segments(sample["response"], sample["mask"], sample["rollout_log_probs"], off_role="tool",
                                 routed=routed[len(prompt):] if routed else None, extra_logprobs=extra or None)]
    num_turns = row.get("num_turns", row.get("__num_turns__"))  # the DataProto's non-tensor name
    meta = source_meta("verl", where, reward=sample["reward"], num_turns=num_turns)
    return {"id": rollout_id, "meta": meta, "branches": [branch("main", segments)]}
