"""slime rollout dumps → format v1: each `Sample` of a `--save-debug-rollout-data` file is one rollout.

Read at THUDM/slime@624b824a898a. `slime/observability/rollout_data_utils.py:140-153`
(`save_debug_rollout_data`) writes `torch.save({"rollout_id": id, "samples": [sample.to_dict()
...]})` to `--save-debug-rollout-data` (`{dump_details}/rollout_data/{rollout_id}.pt` with
`--dump-details`; evaluation rollouts as `eval_{rollout_id}.pt`, rollout_data_utils.py:144); a .pt is
a pickle, so `--allow-pickle`. The file's `rollout_id` is its samples' meta.step, so a whole
`rollout_data/` directory imports as one run. A JSON Lines file of `to_dict()`s is
read too. `Sample` (`slime/utils/types.py:93-130`): `tokens` is prompt + response,
`response_length` the response's tail of it, `loss_mask` (None: all 1) and `rollout_log_probs`
align with the response, 0 / 0.0 on tool and environment tokens (`append_response_tokens`,
types.py:253-314); `remove_sample` zeroes the whole mask at training (`slime/ray/rollout.py:674-681`).

Routing replay (`--use-rollout-routing-replay`): `rollout_routed_experts` is SGLang's capture,
int32 `[len(tokens) - 1, num_layers, moe_router_topk]`, row i for the token at position i
(types.py:352-396). Its layer axis is every hidden layer: the capturer's zero buffer is written
only by MoE layers (`docker/patch/v0.5.6/sglang.patch`, `_RoutedExpertsDeviceCache`; the R3
check skips non-MoE layers, rollout_data_utils.py:55-88), so a dense layer's ids are all 0. A
top-k of k > 1 names k different experts, so those layers are dropped here: format v1 rows
hold MoE layers only.
"""

from __future__ import annotations

from typing import Any

import msgspec

from mismatch.rollouts.importers._common import (Where, branch, masked_segments, routed_rows, same_length,
                                                 source_meta, typed, with_routing)


class _Sample(msgspec.Struct, frozen=True):
    """`Sample.to_dict()` (types.py:93-130), the fields read here."""

    tokens: list[int]                      # prompt + response
    response_length: int                   # the response's tail of `tokens`
    loss_mask: list[int] | None = None     # per response token; None: all 1
    rollout_log_probs: list[float] | None = None  # per response token
    rollout_routed_experts: Any = None     # [tokens - 1][layers][top-k]: routed_rows names its shape
    remove_sample: bool | None = False    # null read as false, as before
    index: int | None = None
    group_index: int | None = None
    reward: Any = None                     # a number, or the reward model's dict: meta as written
    status: str | None = None


class _Dump(msgspec.Struct, frozen=True):
    """`save_debug_rollout_data`'s {"rollout_id", "samples"}."""

    samples: list[Any]                     # each read as a _Sample, its errors named samples[i]
    rollout_id: int | None = None


def convert(record: Any, where: Where) -> list[dict[str, Any]]:
    """A debug dump ({"rollout_id", "samples"}) or one Sample dict."""
    if isinstance(record, dict) and "samples" in record:
        dump = typed(record, _Dump, where)
        return [_rollout(sample, where, f"slime-{where.index}-{i}", f"samples[{i}].", dump.rollout_id)
                for i, sample in enumerate(dump.samples)]
    return [_rollout(record, where, f"slime-{where.index}", "", None)]


def _rollout(record: Any, where: Where, rollout_id: str, prefix: str, step: int | None) -> dict[str, Any]:
    sample = typed(record, _Sample, where, prefix=prefix)
    tokens, num_response = sample.tokens, sample.response_length
    if not 0 <= num_response <= len(tokens):
        raise where.error(prefix + "response_length", f"must be an integer from 0 to the {len(tokens)} tokens, "
                                                      f"got {num_response!r}")
    prompt, response = tokens[: len(tokens) - num_response], tokens[len(tokens) - num_response:]
    mask = [1] * num_response if sample.loss_mask is None else sample.loss_mask
    same_length(prefix + "loss_mask", mask, "response tokens", response, where)
    logprobs = sample.rollout_log_probs
    if logprobs is not None:
        same_length(prefix + "rollout_log_probs", logprobs, "response tokens", response, where)
    routed = sample.rollout_routed_experts
    if routed is not None:
        routed = _moe_layers(routed_rows(routed, prefix + "rollout_routed_experts", len(tokens), where))
    # Mask 0 in a response: tool / environment tokens.
    segments = [with_routing({"role": "user", "tokens": prompt}, routed[: len(prompt)] if routed else None),
                *masked_segments(response, mask, logprobs, off_role="tool",
                                 routed=routed[len(prompt):] if routed else None)]
    if sample.remove_sample:  # slime zeroes its mask: sampled, measured, not trained
        segments = [{**s, "trainable": False} if s["role"] == "assistant" else s for s in segments]
    meta = source_meta("slime", where, step=step, index=sample.index, group_index=sample.group_index,
                       reward=sample.reward, status=sample.status)
    return {"id": rollout_id, "meta": meta, "branches": [branch("main", segments)]}


def _moe_layers(rows: list[Any]) -> list[Any]:
    """The rows without the layers that route no token (the dense layers of SGLang's capture)."""
    present = [row for row in rows if row is not None]
    if not present or not all(isinstance(row, list) and row and all(isinstance(layer, list) and len(layer) > 1
                                                                     for layer in row) for row in present):
        return rows  # k = 1 or a malformed row: nothing can be told apart; the v1 validator names the rest
    num_layers = len(present[0])
    routed = [j for j in range(num_layers) if any(j < len(row) and any(row[j]) for row in present)]
    if len(routed) == num_layers:
        return rows
    return [None if row is None else [row[j] for j in routed if j < len(row)] for row in rows]
