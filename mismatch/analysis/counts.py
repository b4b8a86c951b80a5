"""summary.json `counts`: rollouts, branches, tokens and trainable tokens, chunk by chunk."""

from __future__ import annotations

from mismatch.analysis.chunked import Chunk


class Counts:
    """summary.json `counts` of rows: rollouts, branches, tokens, trainable tokens."""

    def __init__(self) -> None:
        self.counts = {"rollouts": 0, "branches": 0, "tokens": 0, "trainable_tokens": 0}

    def wants(self, index: int) -> bool:
        return index == 0

    def add(self, chunk: Chunk, index: int) -> None:
        every_row = chunk.view(trainable_only=False)  # its sequences are the (rollout, branch) pairs
        self.counts["rollouts"] += every_row.num_rollouts
        self.counts["branches"] += every_row.num_seqs
        self.counts["tokens"] += len(chunk.table)
        self.counts["trainable_tokens"] += chunk.view().num_tokens

    def merge(self, other: Counts, index: int) -> None:
        for name, count in other.counts.items():
            self.counts[name] += count
