"""Builders for the diagnosis fault matrix (tests/test_diagnosis.py): rollouts whose stored
log-probs are a replay of a chosen engine and checkpoint, and the faults planted on them.

Also a `python:` engine whose log-probs depend on the batch they come in (batch variance):
    python:tests/faults_matrix.py:make_batch_variant
Only numpy, json and pathlib at import: the engine loader imports this file once more.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

EXAMPLE_ROLLOUTS = Path(__file__).resolve().parents[1] / "examples" / "rollouts.jsonl"
THIS_FILE = Path(__file__).resolve()
BATCH_VARIANT = f"python:{THIS_FILE}:make_batch_variant"


def replayed_logprobs(checkpoint: Path, rollouts: Path, spec: str = "hf:dtype=float32",
                      temperature: float | None = None) -> np.ndarray:
    """`spec`'s log-probs of every token-table row of `rollouts` (plan order: rollout, branch,
    segment), block by block as the audit replays them, so the bits are the audit's. With
    `temperature`, the processed log-probs a sampler at that temperature stores."""
    from mismatch.engines import load_engine
    from mismatch.replay import plan_replay, replay_column
    from mismatch.rollouts import load_rollouts

    plan = plan_replay(load_rollouts(rollouts))
    if temperature is not None:
        from mismatch.engines.processing import Sampling
        from mismatch.replay import replay_processed

        return replay_processed(plan, spec, checkpoint, Sampling(temperature=temperature))
    engine = load_engine(spec, str(checkpoint))
    try:
        return np.concatenate([replay_column(requests, engine) for _, requests in plan.blocks()])
    finally:
        engine.close()


def sampler_meta(engine: str = "hf", dtype: str = "float32", **extra: Any) -> dict[str, Any]:
    """meta.sampler as a sampler that ran `engine` at `dtype` declares it (diagnose.sides reads
    engine, dtype and attn)."""
    return {"engine": engine, "dtype": dtype, "attn": "sdpa", "temperature": 1.0, "top_p": 1.0, "top_k": -1,
            "logprobs": "raw", "seed": 0, **extra}


def segment_turns(roles: list[str]) -> list[int]:
    from mismatch.rollouts import segment_turns as turns

    return turns(roles)


Edit = Callable[[dict[str, Any]], None]


def write_stored(src: Path, dst: Path, logprobs: np.ndarray, *, meta: dict[str, Any] | None = None,
                 keep_messages: bool = False, edit: Edit | None = None) -> Path:
    """`src` with each stored segment's log-probs taken from `logprobs` (a column over the token
    table's rows, plan order), meta.sampler replaced by `meta`, `messages` dropped unless
    `keep_messages` (no messages: no render drift to find), then `edit(rollout)` on each."""
    lines, start = [], 0
    for line in src.read_text().splitlines():
        rollout = json.loads(line)
        for branch in rollout["branches"]:
            for segment in branch["segments"]:
                n = len(segment["tokens"])
                if "logprobs" in segment:
                    values = logprobs[start:start + n]
                    assert not np.isnan(values).any(), (rollout["id"], branch["id"])
                    segment["logprobs"] = values.tolist()
                start += n
        if meta is not None:
            rollout["meta"]["sampler"] = dict(meta)
        if not keep_messages:
            rollout.pop("messages", None)
        if edit is not None:
            edit(rollout)
        lines.append(json.dumps(rollout))
    assert start == len(logprobs), (start, len(logprobs))
    dst.write_text("\n".join(lines) + "\n")
    return dst


def rewrite(src: Path, dst: Path, edit: Edit) -> Path:
    lines = []
    for line in src.read_text().splitlines():
        rollout = json.loads(line)
        edit(rollout)
        lines.append(json.dumps(rollout))
    dst.write_text("\n".join(lines) + "\n")
    return dst


def rewrite_lines(src: Path, dst: Path, count: int) -> Path:
    """The first `count` rollouts of `src`."""
    dst.write_text("\n".join(src.read_text().splitlines()[:count]) + "\n")
    return dst


# --- faults on stored rollouts (each an `edit` of one rollout) ---

def step_from_turn(turn: int, delta: float) -> Edit:
    """Every stored log-prob of turn >= `turn` moved by `delta` (the sampler changed at that turn)."""
    def edit(rollout: dict[str, Any]) -> None:
        for branch in rollout["branches"]:
            turns = segment_turns([segment["role"] for segment in branch["segments"]])
            for segment, at in zip(branch["segments"], turns):
                if at >= turn and segment.get("logprobs"):
                    segment["logprobs"] = [value + delta for value in segment["logprobs"]]
    return edit


def shifted_by_one(rollout: dict[str, Any]) -> None:
    """stored[i] holds the log-prob of token i + 1 (an exporter's off-by-one; the end keeps its own)."""
    for branch in rollout["branches"]:
        for segment in branch["segments"]:
            if segment.get("logprobs"):
                segment["logprobs"] = segment["logprobs"][1:] + segment["logprobs"][-1:]


def rewritten_answers(rollouts: set[str], text: str) -> Edit:
    """The harness's `messages` of these rollouts carry another last assistant answer than was
    sampled (a harness that rewrote the history it hands the trainer)."""
    def edit(rollout: dict[str, Any]) -> None:
        if rollout["id"] not in rollouts:
            return
        last = max(i for i, m in enumerate(rollout["messages"]) if m["role"] == "assistant")
        rollout["messages"][last]["content"] = text
    return edit


def last_assistant_turn(rollout: dict[str, Any]) -> int:
    """The turn of the main branch's last assistant segment (drift is found on the main branch)."""
    main = next(b for b in rollout["branches"] if b.get("parent") is None)
    roles = [segment["role"] for segment in main["segments"]]
    turns = segment_turns(roles)
    return max(t for role, t in zip(roles, turns) if role == "assistant")


def noised(logprobs: np.ndarray, sd: float, seed: int = 0) -> np.ndarray:
    """Stored log-probs replaced by noised ones (a pipeline that corrupts what it stores): each
    moved by N(0, sd), kept <= 0."""
    return np.minimum(logprobs + np.random.default_rng(seed).normal(0.0, sd, len(logprobs)), 0.0)


def adam_step(tensors: dict[str, Any]) -> None:
    """One Adam step's worth of change on every tensor (its first step is lr x the gradient's
    sign): a copy one optimizer step stale (tests/test_weights.py makes the same)."""
    import torch

    generator = torch.Generator().manual_seed(1)
    for name, weight in tensors.items():
        tensors[name] = weight - 1e-5 * torch.randn(weight.shape, generator=generator).sign()


def edited_copy(src: Path, dst: Path, edit: Callable[[dict[str, Any]], None]) -> Path:
    """A copy of checkpoint `src` whose tensors went through `edit` before saving (once)."""
    import shutil

    from safetensors.torch import load_file, save_file

    if not dst.exists():
        shutil.copytree(src, dst)
        tensors = load_file(dst / "model.safetensors")
        edit(tensors)
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def renamed(rollout: dict[str, Any], prefix: str) -> dict[str, Any]:
    """The rollout under another id (rollouts of several sampling runs in one file)."""
    return {**rollout, "id": f"{prefix}{rollout['id']}"}


# --- a batch-variant engine ---

class BatchVariant:
    """An fp32 hf engine whose log-probs move with the request's place in the batch: the same
    prefix gets other numbers in another request (what a batch-variant kernel does)."""

    def __init__(self, checkpoint: str, scale: float) -> None:
        from mismatch.engines import load_engine

        self.inner = load_engine("hf:dtype=float32", checkpoint)
        self.scale = scale

    def describe(self) -> dict[str, Any]:
        return {"module": f"BatchVariant(scale={self.scale:g})", "logprob_semantics": "raw"}

    def replay(self, requests, progress=None) -> list[np.ndarray]:
        found = self.inner.replay(requests, progress=progress)
        return [logp - self.scale * index / len(requests) for index, logp in enumerate(found)]

    def close(self) -> None:
        self.inner.close()


def make_batch_variant(checkpoint: str, scale: float = 1e-3) -> BatchVariant:
    return BatchVariant(checkpoint, scale)
