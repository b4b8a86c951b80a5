"""SkyRL generator output → format v1: one rollout per entry of a `GeneratorOutput` batch.

Field names from NovaSky-AI/SkyRL `skyrl-train/skyrl_train/generators/base.py` (`GeneratorOutput`,
columnar: prompt_token_ids, response_ids, rewards, loss_masks, stop_reasons, rollout_metrics,
rollout_logprobs, trajectory_ids, is_last_step; `TrajectoryID`: instance_id, repetition_id).
`loss_masks` is 1 for generated tokens and 0 for observation tokens, whose rollout log-probs
are 0.0 placeholders (`skyrl_gym_generator.py`, `TurnOutput.get_turn_loss_mask`).
"""

from __future__ import annotations

from typing import Any

from mismatch.rollouts.importers._common import (Where, branch, get, masked_segments,
                                                 response_sample, rows_of, source_meta)

COLUMNS = ("prompt_token_ids", "response_ids", "rewards", "loss_masks", "stop_reasons", "rollout_logprobs",
           "trajectory_ids", "is_last_step")


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
    segments = [{"role": "user", "tokens": prompt}, *masked_segments(response, mask, logprobs, off_role="tool")]
    meta = source_meta("skyrl", where, reward=row.get("rewards"), stop_reason=row.get("stop_reasons"),
                       is_last_step=row.get("is_last_step"))
    return {"id": rollout_id, "meta": meta, "branches": [branch("main", segments)]}
