"""verl agent-loop outputs → format v1: one rollout per sample, the response split at its mask.

Field names from volcengine/verl `verl/experimental/agent_loop/agent_loop.py` (`AgentLoopOutput`:
prompt_ids, response_ids, response_mask — 1 for LLM-generated tokens, 0 for tool-response
tokens —, response_logprobs, reward_score, num_turns, extra_fields) and its `_postprocess`
batch (`prompts`, `responses`, `response_mask`, `attention_mask`, `rollout_log_probs`, left-
padded prompts and right-padded responses, with 0.0 log-probs on padding and tool tokens).

Routing replay (R3): with `enable_rollout_routing_replay`, both carry `routed_experts`
([tokens][layers][top-k], vLLM's CompletionOutput.routed_experts), row i for the token at
position i of prompt + response. Read at volcengine/verl@b178a3cd56f5:
`verl/workers/rollout/vllm_rollout/vllm_async_server.py:523-525` takes vLLM's
`final_res.outputs[0].routed_experts`; `verl/experimental/agent_loop/agent_loop.py:589-611` places it
at the left-padded prompt's first position in a zero tensor over prompt + response (zeros where vLLM
returned no row: padding, and the last token, never fed). vLLM returns it as
`CompletionOutput.routed_experts: np.ndarray | None  # [seq_len,layer_num,topk]`
(vllm-project/vllm@003d3ee22261 `vllm/outputs.py`).
"""

from __future__ import annotations

from typing import Any

from mismatch.rollouts.importers._common import (Where, branch, floats, get, ints, masked_segments,
                                                 response_sample, routed_rows, rows_of, same_length, source_meta,
                                                 with_routing)

AGENT_LOOP_KEYS = ("prompt_ids", "response_ids", "response_mask", "response_logprobs", "reward_score",
                   "num_turns", "routed_experts")
BATCH_KEYS = ("prompts", "responses", "response_mask", "attention_mask", "rollout_log_probs", "routed_experts")


def convert(record: Any, where: Where) -> list[dict[str, Any]]:
    """One AgentLoopOutput (dict), or a columnar batch of them / of `_postprocess` rows."""
    padded = isinstance(record, dict) and "prompts" in record
    first = get(record, "prompts" if padded else "prompt_ids", where)
    if isinstance(first, list) and first and isinstance(first[0], list):  # a batch: one row per sample
        rows = rows_of(record, BATCH_KEYS if padded else AGENT_LOOP_KEYS, where)
        return [_rollout(row, where, f"verl-{where.index}-{i}", padded, prefix=f"[{i}].")
                for i, row in enumerate(rows)]
    return [_rollout(record, where, f"verl-{where.index}", padded, prefix="")]


def _unpad(row: dict[str, Any], where: Where, prefix: str) -> tuple[list[int], list[int], list[int],
                                                                     list[float] | None, list[Any] | None]:
    """A `_postprocess` row without its padding (attention_mask 0); its routed_experts rows with it."""
    prompt = ints(get(row, "prompts", where, prefix=prefix), prefix + "prompts", where)
    response = ints(get(row, "responses", where, prefix=prefix), prefix + "responses", where)
    attention = ints(get(row, "attention_mask", where, prefix=prefix), prefix + "attention_mask", where)
    mask = ints(get(row, "response_mask", where, prefix=prefix), prefix + "response_mask", where)
    if len(attention) != len(prompt) + len(response):
        raise where.error(prefix + "attention_mask", f"has {len(attention)} entries for "
                          f"{len(prompt)} prompt + {len(response)} response tokens")
    same_length(prefix + "response_mask", mask, "response tokens", response, where)
    logprobs = row.get("rollout_log_probs")
    if logprobs is not None:
        logprobs = floats(logprobs, prefix + "rollout_log_probs", where)
        same_length(prefix + "rollout_log_probs", logprobs, "response tokens", response, where)
    keep_prompt, keep_response = attention[: len(prompt)], attention[len(prompt):]
    kept = [i for i, on in enumerate(keep_response) if on]
    routed = row.get("routed_experts")
    if routed is not None:
        routed = routed_rows(routed, prefix + "routed_experts", len(attention), where)
        routed = [r for r, on in zip(routed, attention) if on]
    return ([t for t, on in zip(prompt, keep_prompt) if on], [response[i] for i in kept],
            [mask[i] for i in kept], None if logprobs is None else [logprobs[i] for i in kept], routed)


def _rollout(row: dict[str, Any], where: Where, rollout_id: str, padded: bool, prefix: str) -> dict[str, Any]:
    if padded:
        prompt, response, mask, logprobs, routed = _unpad(row, where, prefix)
    else:
        prompt, response, mask, logprobs = response_sample(row, where, prefix, prompt="prompt_ids",
                                                           response="response_ids", mask="response_mask",
                                                           logprobs="response_logprobs")
        routed = row.get("routed_experts")
        if routed is not None:
            routed = routed_rows(routed, prefix + "routed_experts", len(prompt) + len(response), where)
    # The prompt is the dataset's chat (system + user) as one run of prompt tokens.
    segments = [with_routing({"role": "user", "tokens": prompt}, routed[: len(prompt)] if routed else None),
                *masked_segments(response, mask, logprobs, off_role="tool",
                                 routed=routed[len(prompt):] if routed else None)]
    meta = source_meta("verl", where, reward=row.get("reward_score"), num_turns=row.get("num_turns"))
    return {"id": rollout_id, "meta": meta, "branches": [branch("main", segments)]}
