"""SkyRL generator output → format v1: one rollout per entry of a `GeneratorOutput` batch.

Read at NovaSky-AI/SkyRL@a9564572eb8e (the package moved from `skyrl-train/skyrl_train/` to
`skyrl/train/`; the field names did not change, so dumps of either layout read the same).
`skyrl/train/generators/base.py:37-63` (`GeneratorOutput`, columnar: prompt_token_ids,
response_ids, rewards, loss_masks, stop_reasons, rollout_metrics, rollout_logprobs,
trajectory_ids, trajectory_generation_times, trajectory_time_splits, rollout_expert_indices,
is_last_step, env_metrics; `TrajectoryID`, base.py:13-19: instance_id, repetition_id).
`loss_masks` is 1 for generated tokens and 0 for observation tokens, whose rollout log-probs
are 0.0 placeholders (`skyrl/train/generators/skyrl_gym_generator.py:104-130`,
`TurnOutput.get_turn_loss_mask` / `get_turn_rollout_logprobs`).

Routing replay (`generator.inference_engine.enable_return_routed_experts`):
`rollout_expert_indices` holds one `RoutedExpertIndices` per trajectory, an integer NumPy array
`[tokens, layers, top-k]` (`skyrl/backends/skyrl_train/utils/routed_experts.py:5`), row i for the
token at position i of prompt + response: the engine returns routes for the whole sequence each
turn and the last turn's array is kept, cut at the response end (skyrl_gym_generator.py:556-559,
1122-1126); the trainer puts it at the prompt's first position (`skyrl/train/dataset/preprocess.py:
265-272`). It may stop short of the last token (never fed); those tokens get no row.
"""

from __future__ import annotations

from typing import Any

from mismatch.rollouts.importers._common import (Where, branch, get, masked_segments, response_sample,
                                                 routed_rows, rows_of, source_meta, with_routing)

COLUMNS = ("prompt_token_ids", "response_ids", "rewards", "loss_masks", "stop_reasons", "rollout_logprobs",
           "trajectory_ids", "is_last_step", "rollout_expert_indices")


def convert(record: Any, where: Where) -> list[dict[str, Any]]:
    """Every entry of one GeneratorOutput (a dict of equal-length columns)."""
    get(record, "prompt_token_ids", where)
    rows = rows_of(record, COLUMNS, where)
    ids = [_trajectory_id(row.get("trajectory_ids"), where, i) for i, row in enumerate(rows)]
    # Step-wise training repeats a trajectory id once per step: number the steps to keep ids unique.
    repeated = {i for i in ids if i is not None and ids.count(i) > 1}
    steps: dict[str, int] = {}
    rollouts = []
    for i, (row, trajectory) in enumerate(zip(rows, ids)):
        if trajectory is None:
            rollout_id = f"skyrl-{where.index}-{i}"
        elif trajectory in repeated:
            steps[trajectory] = steps.get(trajectory, -1) + 1
            rollout_id = f"{trajectory}-step{steps[trajectory]}"
        else:
            rollout_id = trajectory
        rollouts.append(_rollout(row, where, rollout_id, f"[{i}]."))
    return rollouts


def _trajectory_id(value: Any, where: Where, i: int) -> str | None:
    """TrajectoryID.to_string(): f"{instance_id}_{repetition_id}"."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and "instance_id" in value and "repetition_id" in value:
        return f"{value['instance_id']}_{value['repetition_id']}"
    raise where.error(f"trajectory_ids[{i}]", "must be a TrajectoryID (instance_id, repetition_id) or a string")


def _rollout(row: dict[str, Any], where: Where, rollout_id: str, prefix: str) -> dict[str, Any]:
    prompt, response, mask, logprobs = response_sample(row, where, prefix, prompt="prompt_token_ids",
                                                       response="response_ids", mask="loss_masks",
                                                       logprobs="rollout_logprobs")
    routed = row.get("rollout_expert_indices")
    if routed is not None:
        routed = routed_rows(routed, prefix + "rollout_expert_indices", len(prompt) + len(response), where)
    segments = [with_routing({"role": "user", "tokens": prompt}, routed[: len(prompt)] if routed else None),
                *masked_segments(response, mask, logprobs, off_role="tool",
                                 routed=routed[len(prompt):] if routed else None)]
    meta = source_meta("skyrl", where, reward=row.get("rewards"), stop_reason=row.get("stop_reasons"),
                       is_last_step=row.get("is_last_step"))
    return {"id": rollout_id, "meta": meta, "branches": [branch("main", segments)]}
