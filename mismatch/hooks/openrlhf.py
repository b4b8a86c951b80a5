"""OpenRLHF's dump hook: an agent-executor mixin that writes every sample the rollout engines make.

In the agent file given to `--train.agent_func_path`, put the mixin first among the bases of the
`AgentExecutor` OpenRLHF loads (trainer/ray/vllm_engine.py:19-30, `_load_agent_executor`, which calls
the class with no arguments) and name the file in `mismatch_dump`:

    class AgentExecutor(MismatchDumpMixin, MultiTurnAgentExecutor):
        mismatch_dump = "/data/run/rollouts.jsonl"
        def __init__(self):
            super().__init__(MyAgentInstance)

The mixin awaits the executor's own `execute` and appends the sample it returns (read in the
openrlhf 0.11.2 wheel, utils/agent.py, both executors' final dict):
- `observation_tokens`: the prompt, then each action followed by the environment's feedback;
- `action_ranges`: the sampled spans, [start, end) in that list -> assistant segments; the prompt
  before the first one is the user segment, the feedback between and after them role "tool";
- `rollout_log_probs`: vLLM's log-prob of every sampled token, 0.0 placeholders on prompt and
  feedback tokens (agent.py:147-153, :256-261), kept on the assistant tokens only. OpenRLHF asks for
  them only when IS correction is on (ppo_utils/samples_generator.py:206, `logprobs=1 if
  is_correction_level != "off"`), and its engines then return `processed_logprobs`
  (cli/train_ppo_ray.py:78): after temperature, as the trainer's own log-probs are. With the
  correction off there are none, and the audit replays both sides (`--infer vllm`).
The trainer truncates a sample to `max_len` before training it (samples_generator.py:256-268,
`sequences[:truncate_length]`); the dump keeps what the trainer keeps.

OpenRLHF's trainer-side log-probs (the actor's recompute in make_experience) live in the training
processes, which an executor in the rollout engine never sees: the dump holds the sampler's stream,
and `mismatch audit CKPT --rollouts F --train hf:temperature=T --infer sampler` replays the trainer's
side as OpenRLHF runs it: its actor divides the logits by `--rollout.temperature`
(trainer/ray/ppo_actor.py:525, models/actor.py:268-271).

meta.step: the engine's weight version, the number of weight syncs it has received since the hook
started. The trainer syncs after each training step (ppo_trainer.py:241-247, `broadcast_to_vllm`),
one `update_weight` (or `update_weight_cuda_ipc`) call per parameter, the last one with
`empty_cache=True` (trainer/ray/ppo_actor.py:427, :456-462); the rollout actor forwards each to its
engine's `collective_rpc` (vllm_engine.py:114-125), which the hook counts. On a fresh run it is the
trainer's global_step when the sample was drawn (OpenRLHF logs that step's update as step + 1); a
resumed run syncs once before the first sample (ppo_trainer.py:514-515), so give the step it resumes
from as `mismatch_first_step`. A sample that spans a sync (`--train.partial_rollout_enable`) keeps
the version it began with, and both in meta.openrlhf.weight_versions.

Processes: each rollout engine is its own process with its own executor; all append to the one
path, one whole line per `write` (O_APPEND), so engines on one machine share a file safely. Engines
on several machines need a path on each machine's disk (or a file system that appends atomically).
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from mismatch.hooks.dump import DumpInputError, StepDump, sample_rollout

logger = logging.getLogger(__name__)

# The engine calls one weight sync is made of (trainer/ray/ppo_actor.py:427, :456-462).
SYNC_METHODS = frozenset({"update_weight", "update_weight_cuda_ipc"})
# SamplingParams fields OpenRLHF sets from --rollout.* (samples_generator.py:198-207).
SAMPLING_FIELDS = ("temperature", "top_p", "top_k")


class MismatchDumpMixin:
    """Put first among the bases of your `AgentExecutor`; set `mismatch_dump` to the file's path."""

    mismatch_dump: ClassVar[str | os.PathLike[str] | None] = None
    mismatch_first_step: ClassVar[int] = 0

    async def execute(self, prompt: Any, label: Any, sampling_params: Any, max_length: int, hf_tokenizer: Any,
                      llm_engine: Any, images: Any = None) -> Any:
        versions = weight_versions(llm_engine)
        began = versions.synced
        output = await super().execute(prompt, label, sampling_params, max_length, hf_tokenizer,  # type: ignore[misc]
                                       llm_engine, images=images)
        try:
            await asyncio.to_thread(self._mismatch_write, output, sampling_params, llm_engine, max_length,
                                    (began, versions.synced))
        except Exception as error:  # a dump must never stop the rollout it records
            logger.warning("mismatch: a sample was not written to %s (%s: %s)", self.mismatch_dump,
                           type(error).__name__, error)
        return output

    def _mismatch_write(self, output: Mapping[str, Any], sampling_params: Any, llm_engine: Any, max_length: int,
                        versions: tuple[int, int]) -> None:
        dump = self._mismatch_file(sampling_params, llm_engine)
        step = self.mismatch_first_step + versions[0]
        refused = dump.num_refused
        try:
            rollout = sample_of(output, f"{self._mismatch_run}-{next_index(self)}", max_length=max_length,
                                versions=versions)
        except DumpInputError as error:  # log-probs that do not align with the sample's tokens
            dump.refuse(str(error))
            rollout = None
        dump.write([rollout] if rollout is not None else [], step=step)
        if dump.num_refused > refused:
            logger.warning("mismatch: a sample of step %d was left out of %s (%s)", step, dump.path,
                           dump.first_refusal)

    def _mismatch_file(self, sampling_params: Any, llm_engine: Any) -> StepDump:
        """The StepDump, opened at the first sample: its sampler meta needs the engine and the params."""
        dump = getattr(self, "_mismatch_dump_file", None)
        if dump is None:
            if self.mismatch_dump is None:
                raise ValueError("set mismatch_dump on the AgentExecutor class to the dump's path")
            dump = StepDump(self.mismatch_dump, framework="openrlhf",
                            meta={"sampler": sampler_meta(sampling_params, llm_engine)})
            self._mismatch_dump_file = dump
            self._mismatch_run = f"openrlhf-{uuid.uuid4().hex[:8]}-{os.getpid()}"
            self._mismatch_count = 0
        return dump


def next_index(executor: Any) -> int:
    """The executor's samples numbered in the order they finish (ids unique within the run)."""
    index = executor._mismatch_count
    executor._mismatch_count = index + 1
    return index


class WeightVersions:
    """Counts the weight syncs an engine has finished, by wrapping its `collective_rpc`."""

    def __init__(self, engine: Any) -> None:
        self.synced = 0
        self._call = getattr(engine, "collective_rpc", None)
        if self._call is None:  # not vLLM's engine: its syncs cannot be seen, every sample is version 0
            logger.warning("mismatch: the rollout engine has no collective_rpc; meta.step stays at the first step")
            return

        async def counted(method: str, *args: Any, **kwargs: Any) -> Any:
            result = await self._call(method, *args, **kwargs)
            call_args = kwargs.get("args", args[1] if len(args) > 1 else ())
            # The last parameter of a sync is sent with empty_cache=True (ppo_actor.py:427, :461).
            if method in SYNC_METHODS and call_args and call_args[-1] is True:
                self.synced += 1
            return result

        engine.collective_rpc = counted


def weight_versions(llm_engine: Any) -> WeightVersions:
    """The rollout actor's counter, installed on its vLLM engine (`llm_engine.llm`) at the first call."""
    versions = getattr(llm_engine, "_mismatch_weight_versions", None)
    if versions is None:
        versions = WeightVersions(getattr(llm_engine, "llm", None))
        llm_engine._mismatch_weight_versions = versions
    return versions


def sampler_meta(sampling_params: Any, llm_engine: Any) -> dict[str, Any]:
    """meta.sampler: vLLM, its dtype, the sampling OpenRLHF set, and what its log-probs are."""
    meta: dict[str, Any] = {"engine": "vllm"}
    # create_vllm_engines passes dtype "bfloat16" (vllm_engine.py:271); the engine's config says what it runs.
    dtype = getattr(getattr(getattr(llm_engine, "llm", None), "model_config", None), "dtype", None)
    if dtype is not None:
        meta["dtype"] = str(dtype).removeprefix("torch.")
    meta.update({name: getattr(sampling_params, name) for name in SAMPLING_FIELDS})
    if getattr(sampling_params, "logprobs", None) is not None:
        meta["logprobs"] = "processed"  # logprobs_mode="processed_logprobs" (train_ppo_ray.py:78)
    return meta


def sample_of(output: Mapping[str, Any], rollout_id: str, *, max_length: int,
              versions: tuple[int, int]) -> dict[str, Any] | None:
    """The format v1 rollout of one executor result, cut at `max_length` as the trainer cuts it;
    None for a sample with no sampled token (OpenRLHF trains nothing of it)."""
    tokens = [int(t) for t in output["observation_tokens"]][:max_length]
    ranges = [(int(start), min(int(end), len(tokens))) for start, end in output["action_ranges"]
              if int(start) < len(tokens)]
    if not ranges or all(start == end for start, end in ranges):
        return None
    first = ranges[0][0]
    mask = action_mask(len(tokens), ranges)
    logprobs = output.get("rollout_log_probs")
    meta: dict[str, Any] = {"openrlhf": _facts(output, versions)}
    return sample_rollout(rollout_id, tokens[:first], tokens[first:], mask[first:],
                          None if logprobs is None else list(logprobs)[first:len(tokens)],
                          off_role="tool", meta=meta)


def action_mask(length: int, ranges: Sequence[tuple[int, int]]) -> list[int]:
    """1 on the sampled spans, as samples_generator.py:251-254 builds `action_mask`."""
    mask = [0] * length
    for start, end in ranges:
        mask[start:end] = [1] * (end - start)
    return mask


def _facts(output: Mapping[str, Any], versions: tuple[int, int]) -> dict[str, Any]:
    facts: dict[str, Any] = {"truncated": bool(output.get("truncated", False))}
    for name in ("reward", "scores"):
        value = output.get(name)
        if isinstance(value, (int, float)) or hasattr(value, "item"):
            facts[name] = float(value)
    if versions[1] != versions[0]:
        facts["weight_versions"] = list(versions)
    return facts
