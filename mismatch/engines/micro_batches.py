"""Which sequences a torch trainer replay puts in one forward: its micro-batches.

Batch composition is part of what a trainer computes (a batch-variant kernel gives a sequence other
bits beside other sequences; verl#6280: `log_prob` != `old_log_prob` when the micro-batch sizes
differ), so the replay can form its micro-batches the way the trainer does:
- `padded_by_budget`: longest first under a padded-token budget (mismatch's own default);
- `in_order`: a fixed number of sequences each, in the batch's order, as verl splits a batch by
  `log_prob_micro_batch_size_per_gpu` (verl 0.9.1: verl/workers/actor/dp_actor.py,
  `compute_log_prob`: `data.split(micro_batch_size)`);
- `balanced_by_tokens`: verl's dynamic batch size (`use_dynamic_bsz` with
  `log_prob_max_token_len_per_gpu`): the fewest micro-batches whose real tokens fit the budget,
  balanced by Karmarkar-Karp on verl's workload estimate (verl 0.9.1:
  verl/utils/seqlen_balancing.py, `rearrange_micro_batches` (line 348), `karmarkar_karp` (49),
  `calculate_workload` (27)). verl then reorders the micro-batches for pipeline bubbles, which
  changes no sequence's neighbours, so the order here is by first index;
- `first_fit_decreasing`: prime-rl's packer: longest first, each sequence into the first row its
  tokens fit (prime-rl 559b447: src/prime_rl/trainer/batch.py, `packed_samples_into_micro_bs`
  (line 637) and `_MicroBatchBin.can_add` (486)), on one data-parallel rank.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence


def padded_by_budget(lengths: Sequence[int], budget: int) -> list[list[int]]:
    """Indices grouped longest-first so each batch's padded size stays under `budget` tokens.

    Sorting first keeps padding small: rows in a batch have similar lengths. A row longer than
    the budget gets a batch of its own rather than an error.
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    batches: list[list[int]] = []
    for index in order:
        if batches and (len(batches[-1]) + 1) * lengths[batches[-1][0]] <= budget:
            batches[-1].append(index)
        else:
            batches.append([index])
    return batches


def in_order(count: int, size: int) -> list[list[int]]:
    """`size` sequences a micro-batch, in order (the last one holds the rest)."""
    return [list(range(start, min(start + size, count))) for start in range(0, count, size)]


def workload(length: int) -> int:
    """verl's estimate of a sequence's forward cost (calculate_workload: a 7B model's
    12·h²·L + 2·h·L² at h = 4096, divided by 2·h)."""
    return 24576 * length + length * length


def balanced_by_tokens(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """verl's dynamic micro-batches: start from ceil(total / max_tokens) micro-batches (at most one
    per sequence), partition the workloads by Karmarkar-Karp, and add one micro-batch until every
    partition's tokens fit. A sequence longer than the budget is verl's error; here it gets a
    micro-batch of its own, as the padded path does."""
    if not lengths:
        return []
    if max(lengths) > max_tokens:
        alone = [i for i, n in enumerate(lengths) if n > max_tokens]
        rest = [i for i, n in enumerate(lengths) if n <= max_tokens]
        parts = [[rest[j] for j in part] for part in balanced_by_tokens([lengths[i] for i in rest], max_tokens)]
        return sorted([[i] for i in alone] + parts)
    count = min(len(lengths), -(-sum(lengths) // max_tokens))
    loads = [workload(n) for n in lengths]
    while True:
        partitions = sorted(sorted(part) for part in karmarkar_karp(loads, count))
        if all(sum(lengths[i] for i in part) <= max_tokens for part in partitions):
            return partitions
        count += 1


class _Set:
    """One partition being built: its items (index, value) and their sum (verl's `Set`)."""

    __slots__ = ("items", "sum")

    def __init__(self) -> None:
        self.items: list[tuple[int, int]] = []
        self.sum = 0

    def add(self, index: int, value: int) -> None:
        self.items.append((index, value))
        self.sum += value

    def key(self) -> tuple[int, int, list[tuple[int, int]]]:
        return self.sum, len(self.items), self.items


class _State:
    """k partitions, largest first; the heap pops the widest spread first (verl's `State`)."""

    __slots__ = ("sets",)

    def __init__(self, index: int, value: int, k: int) -> None:
        self.sets = [_Set() for _ in range(k)]
        self.sets[0].add(index, value)
        self.sets.sort(key=_Set.key, reverse=True)

    def merge(self, other: _State) -> None:
        k = len(self.sets)
        for i in range(k):
            for index, value in other.sets[k - 1 - i].items:
                self.sets[i].add(index, value)
        self.sets.sort(key=_Set.key, reverse=True)

    @property
    def spread(self) -> int:
        return self.sets[0].sum - self.sets[-1].sum

    def __lt__(self, other: _State) -> bool:
        if self.spread != other.spread:
            return self.spread > other.spread
        return self.sets[0].key() > other.sets[0].key()


def karmarkar_karp(values: Sequence[int], k: int) -> list[list[int]]:
    """verl's largest-differencing partition of `values` into `k` sets of similar sums (its
    equal_size=False path), as index lists."""
    heap: list[_State] = []
    for value, index in sorted((value, i) for i, value in enumerate(values)):
        heapq.heappush(heap, _State(index, value, k))  # one by one, as verl: ties pop the same way
    while len(heap) > 1:
        first, second = heapq.heappop(heap), heapq.heappop(heap)
        first.merge(second)
        heapq.heappush(heap, first)
    return [[index for index, _ in partition.items] for partition in heap[0].sets]


def first_fit_decreasing(lengths: Sequence[int], max_tokens: int) -> list[list[int]]:
    """prime-rl's micro-batches: sequences sorted longest first (a stable sort, as its
    `samples.sort(key=-len)`), each put in the first row whose tokens it fits under `max_tokens`
    (its seq_len), else in a new row; a longer sequence gets a row of its own, never truncated.
    prime-rl splits rows further only for several data-parallel ranks, which one replay has not."""
    rows: list[list[int]] = []
    filled: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for row, tokens in enumerate(filled):
            if tokens + lengths[index] <= max_tokens:
                rows[row].append(index)
                filled[row] += lengths[index]
                break
        else:
            rows.append([index])
            filled.append(lengths[index])
    return rows
