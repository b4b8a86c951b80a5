"""The plan and replay steps: rollouts into replay requests and the token table they fill
(`plan`), the file read block by block (`blocks`), the checks before replay and at the
engine-output boundary (`checks`), every engine source's pass (`passes`), the results read back
(`replayed`), and the trainer side under the sampler's processing (`processed`).
"""

from __future__ import annotations

from mismatch.replay.blocks import Block, FileBlocks, FileScan, file_blocks, scan_file
from mismatch.replay.checks import bad_logprob_rows, check_column, replay_column
from mismatch.replay.passes import (ENGINE_FACTS, ProgressFactory, ReplayOptions, SourcePass, engine_facts, followed_routing,
                                    replay_sources)
from mismatch.replay.plan import DEFAULT_BLOCK, TABLE_KEYS, ReplayPlan, Shard, plan_replay
from mismatch.replay.processed import declared_processing, recompute_processed, replay_processed
from mismatch.replay.replayed import FilledBlocks, Replayed, SavedColumns

__all__ = [
    "DEFAULT_BLOCK", "ENGINE_FACTS", "TABLE_KEYS", "Block", "FileBlocks", "FileScan", "FilledBlocks",
    "ProgressFactory", "ReplayOptions", "ReplayPlan", "Replayed", "SavedColumns", "Shard", "SourcePass", "bad_logprob_rows",
    "check_column", "declared_processing", "engine_facts", "file_blocks", "followed_routing", "plan_replay",
    "recompute_processed", "replay_column", "replay_processed", "replay_sources", "scan_file",
]
