"""Rollout format v1: the data model, a streaming loader, and a validator that names every problem.

First step of the flow (ARCHITECTURE.md, "Load and check"): a JSONL/Parquet file -> `Rollout`s ->
replay. The package, by concern: `model` (Rollout, Branch, Segment and the walks over a tree),
`rules` (the format's rules, each once; `problems` words what breaks them), `decode` (JSON ->
Rollout: typed, a branch at a time, a segment at a time), `io` (files, one rollout at a time),
`forked` (a file read by several processes), `trees` (a rollout tree's token weights), `drift`
(re-rendering `messages` to find where a harness rewrote history) and `importers` (other
frameworks' dumps into format v1). The public names are re-exported here.
"""

from mismatch.rollouts.decode import MAX_JSON_DEPTH, check_rollout
from mismatch.rollouts.io import (
    PARQUET_BATCH_SIZE,
    FileChecks,
    LineFacts,
    ValidationReport,
    iter_rollouts,
    load_rollouts,
    validate_file,
)
from mismatch.rollouts.model import (
    BRANCH_KINDS,
    MODEL_ROLES,
    ROLES,
    Branch,
    Rollout,
    Segment,
    context_tokens,
    full_indexer_topk,
    full_routed_experts,
    full_tokens,
    routing_shape,
    segment_turns,
)
from mismatch.rollouts.problems import MAX_NAME_CHARS
from mismatch.rollouts.rules import MAX_EXPERT_ID, MAX_NESTING, MAX_TREE_DEPTH

__all__ = [
    "BRANCH_KINDS", "MAX_EXPERT_ID", "MAX_JSON_DEPTH", "MAX_NAME_CHARS", "MAX_NESTING", "MAX_TREE_DEPTH",
    "MODEL_ROLES", "PARQUET_BATCH_SIZE", "ROLES", "Branch", "FileChecks", "LineFacts", "Rollout", "Segment",
    "ValidationReport", "check_rollout", "context_tokens", "full_indexer_topk", "full_routed_experts", "full_tokens", "iter_rollouts",
    "load_rollouts", "routing_shape", "segment_turns", "validate_file",
]
