"""AReaL's dump hook: a RolloutWorkflow wrapper that writes every trajectory its workflow returns as format v1.

`MismatchDumpWorkflow(workflow, "rollouts.jsonl")` is itself a RolloutWorkflow: AReaL runs its
`arun_episode(engine, data)`, which awaits the wrapped workflow's, appends what it returned to the
file (`dump.StepDump`) and returns it unchanged. Read in the areal 1.0.4 wheel.

It must be a real RolloutWorkflow subclass: AReaL sends anything else to its OpenAI-proxy agent path
(infra/remote_inf_engine.py:603-718 `_resolve_workflow`, trainer/rl_trainer.py:1335-1377). The
subclass is made on first access of the name (a module `__getattr__`), so importing this module
imports neither areal nor torch; `"mismatch.hooks.areal.MismatchDumpWorkflow"` as an import path
resolves to the same class. The single-controller RolloutController sends a workflow to its workers
as that path plus `workflow_kwargs` (infra/controller/rollout_controller.py:723-752), so the inner
workflow may be given the same way: `workflow="areal.workflow.rlvr.RLVRWorkflow"`,
`workflow_kwargs={...}`, resolved like AReaL's own steps 1-3 (remote_inf_engine.py:628-669).

What goes where (a trajectory is a dict of [batch, seq] tensors, right-padded, rlvr.py:164-178,
multi_turn.py:95-135; `attention_mask` cuts a row's padding):
- `input_ids` before the first `loss_mask` 1 -> the user segment; the rest is the response, its
  `loss_mask` 1 runs assistant segments, its 0 runs (MultiTurnWorkflow's retry prompt, an agent's
  tool results) `off_role` ("user" by default, which AReaL's multi-turn feedback is);
- `logprobs` (0.0 on prompt and feedback, the engine's `output_logprobs` after) -> the assistant
  segments' `logprobs`; AReaL trains against these as the behaviour policy (`old_logp`);
- `versions` (-1 on prompt and feedback, the engine's weight version per sampled token) -> meta.step
  = the oldest version among the trained tokens, with meta.areal.versions = [oldest, newest]. The
  remote engine tags each chunk it receives with its version when the chunk arrives; a generation
  interrupted by a weight update resumes under the new version (remote_inf_engine.py:845-902), so one
  trajectory can span several. The trainer sets version global_step + 1 after each update
  (trainer/rl_trainer.py:768-777): tokens of version v were sampled by the weights trained v steps;
- `rewards` -> meta.areal.reward; the executor's task id (workflow_context, workflow_executor.py:
  1041-1047) -> meta.areal.task_id, the name of AReaL's own `dump_to_file` file for that trajectory
  (workflow_executor.py:835-924; it keeps text and versions, not token ids or log-probs).
A dict of InteractionWithTokenLogpReward (the experimental OpenAI proxy's workflows) is written one
rollout per interaction, through the release's own `to_tensor_dict()` (experimental/openai/types.py:
143-206), as AReaL trains them (workflow_executor.py:1076-1088); an interaction without tensor data
(an external API's, `has_tensor_data` false) has no token ids and is counted and skipped.
Not written: rejected episodes (None), evaluation episodes (workflow_context's `is_eval`), rows with
no trained token. The file holds every trajectory the workflow returned, including those AReaL later
drops (`dynamic_filter_fn`, staleness).

meta.sampler: the engine from the `engine` AReaL passes (a RemoteInfEngine with an SGLangBackend or a
VLLMBackend: remote_inf_engine.py:475-477), the sampling from the wrapped workflow's `gconfig`
(rlvr.py:70, multi_turn.py:36), as the backends send it; the `sampler` in `meta=` overrides any key.
The trainer's recompute (`prox_logp`) is made after the workflow returns, in the training
processes: the dump holds the sampler's stream; `mismatch audit CKPT --rollouts F --train
hf:temperature=T --infer sampler` replays the trainer's side as AReaL runs it, T being the actor's
`temperature` (api/cli_args.py:1098, used by engine/fsdp_engine.py:2000 on the logits).

A dump failure never fails the episode: it is counted (`num_failed`, `first_failure`) and logged.
Processes: every process that runs the wrapper appends whole lines to the one path (O_APPEND).
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import itertools
import logging
import os
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from mismatch.hooks.dump import DumpInputError, StepDump, sample_rollout

logger = logging.getLogger(__name__)

CLASS_NAME = "MismatchDumpWorkflow"
# What the wrapped workflow's gconfig is found under: its own attribute, or that of a workflow it
# wraps in turn (GroupedRolloutWorkflow keeps it as `.workflow`, remote_inf_engine.py:71-82).
_GCONFIG_DEPTH = 4


def __getattr__(name: str) -> Any:
    # PEP 562: the RolloutWorkflow subclass is made when first asked for, importing areal then.
    if name == CLASS_NAME:
        return workflow_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def workflow_class() -> type:
    """`MismatchDumpWorkflow`: the dumping workflow as a subclass of the release's RolloutWorkflow."""
    from areal.api.workflow_api import RolloutWorkflow

    cls = type(CLASS_NAME, (DumpingWorkflow, RolloutWorkflow), {"__module__": __name__,
                                                               "__doc__": DumpingWorkflow.__doc__})
    cls.__qualname__ = CLASS_NAME  # so pickle and AReaL's class paths find it under this module
    return cls


class DumpingWorkflow:
    """`MismatchDumpWorkflow(workflow, path, *, workflow_kwargs=None, meta=None, off_role="user")`:
    runs `workflow` (a RolloutWorkflow, its class, or an import path; a class is called with
    `workflow_kwargs`) and appends each trajectory it returns to `path`. Use the subclass
    `MismatchDumpWorkflow` (this module's attribute), which AReaL takes for a RolloutWorkflow."""

    def __init__(self, workflow: Any, path: str | os.PathLike[str], *, workflow_kwargs: Mapping[str, Any] | None = None,
                 meta: Mapping[str, Any] | None = None, off_role: str = "user") -> None:
        self.workflow = resolve_workflow(workflow, workflow_kwargs)
        meta = dict(meta or {})
        self._sampler_override = dict(meta.pop("sampler", None) or {})
        self.mismatch_dump = StepDump(path, framework="areal", meta=meta)
        self.off_role = off_role
        self.num_failed = 0
        self.first_failure: str | None = None
        self.num_skipped = 0  # rows and interactions that carry no rollout (see skip_reasons)
        self.skip_reasons: dict[str, int] = {}
        self._run = uuid.uuid4().hex[:8]
        self._episodes = itertools.count()

    async def arun_episode(self, engine: Any, data: Any) -> Any:
        trajectory = await self.workflow.arun_episode(engine, data)
        if trajectory is not None:
            await self._dump_episode(trajectory, engine)
        return trajectory

    async def _dump_episode(self, trajectory: Any, engine: Any) -> None:
        """Write `trajectory`; whatever goes wrong is counted and logged, never raised into AReaL."""
        try:
            context = episode_context()
            if context.pop("is_eval", False):
                return
            episode = next(self._episodes)
            rows, skipped = trajectory_rows(trajectory)
            self._count_skips(skipped)
            sampler = {**sampler_meta(engine, self.workflow), **self._sampler_override}
            fallback = engine_version(engine)
            meta = {"sampler": sampler, "areal": {**context, "engine_version": fallback}}
            by_step: dict[int, list[dict[str, Any]]] = {}
            for index, row in enumerate(rows):
                rollout_id = f"areal-{self._run}-e{episode}-{index}"
                try:
                    step, rollout, reason = row_rollout(row, rollout_id, off_role=self.off_role,
                                                        fallback_step=fallback, meta=meta)
                except DumpInputError as error:  # this row's log-probs do not align: the others still go
                    self.mismatch_dump.refuse(str(error))
                    continue
                if rollout is None:
                    self._count_skips([reason or "no rollout"])
                    continue
                by_step.setdefault(step, []).append(rollout)
            if by_step:
                # fsync off the event loop: AReaL runs many episodes on it at once
                await asyncio.to_thread(self._write, by_step)
        except Exception as error:  # a hook must not fail the rollout it watches
            self.num_failed += 1
            self.first_failure = self.first_failure or f"{type(error).__name__}: {error}"
            logger.warning("mismatch: a trajectory was not written to %s (%s: %s)", self.mismatch_dump.path,
                           type(error).__name__, error)

    def _write(self, by_step: Mapping[int, list[dict[str, Any]]]) -> None:
        refused = self.mismatch_dump.num_refused
        for step, rollouts in sorted(by_step.items()):
            self.mismatch_dump.write(rollouts, step=step)
        if self.mismatch_dump.num_refused > refused:
            logger.warning("mismatch: %d rollout(s) left out of %s (%s)", self.mismatch_dump.num_refused - refused,
                           self.mismatch_dump.path, self.mismatch_dump.first_refusal)

    def _count_skips(self, reasons: Sequence[str]) -> None:
        for reason in reasons:
            self.num_skipped += 1
            self.skip_reasons[reason] = self.skip_reasons.get(reason, 0) + 1


def resolve_workflow(workflow: Any, workflow_kwargs: Mapping[str, Any] | None) -> Any:
    """The workflow to wrap, as AReaL resolves one (remote_inf_engine.py:628-669): an instance as it is,
    a class called with `workflow_kwargs`, an import path to either."""
    if isinstance(workflow, str):
        module, _, name = workflow.rpartition(".")
        if not module:
            raise ValueError(f"workflow {workflow!r}: expected an import path like 'package.module.Class'")
        workflow = getattr(importlib.import_module(module), name)
    if isinstance(workflow, type):
        workflow = workflow(**dict(workflow_kwargs or {}))
    elif workflow_kwargs is not None:
        raise ValueError("workflow_kwargs is for a workflow class or import path, not an instance")
    if not callable(getattr(workflow, "arun_episode", None)):
        raise TypeError(f"{type(workflow).__name__} has no arun_episode: wrap a RolloutWorkflow")
    return workflow


def episode_context() -> dict[str, Any]:
    """The executor's task id and eval flag for this episode (workflow_executor.py:1041-1047)."""
    try:
        from areal import workflow_context
    except ImportError:
        return {}
    context = workflow_context.get()
    return {"task_id": context.task_id, "is_eval": bool(context.is_eval)}


def engine_version(engine: Any) -> int | None:
    """The engine's weight version now (the step for a trajectory whose tokens carry none)."""
    try:
        return int(engine.get_version())
    except Exception:  # an engine without versions: the tokens' own must do
        return None


def trajectory_rows(trajectory: Any) -> tuple[list[dict[str, Any]], list[str]]:
    """Each row of the trajectory as plain lists cut to its attention, and why any part was skipped."""
    if not isinstance(trajectory, Mapping) or not trajectory:
        return [], [f"not a trajectory dict ({type(trajectory).__name__})"]
    values = list(trajectory.values())
    if all(callable(getattr(v, "to_tensor_dict", None)) for v in values):
        rows: list[dict[str, Any]] = []
        skipped = []
        for key, interaction in trajectory.items():
            if not getattr(interaction, "has_tensor_data", True):
                skipped.append("an interaction without token ids (external API)")
                continue
            rows += [{**row, "interaction": str(key)} for row in tensor_rows(interaction.to_tensor_dict())]
        return rows, skipped
    if "input_ids" not in trajectory or "loss_mask" not in trajectory:
        return [], ["a trajectory without input_ids and loss_mask"]
    return tensor_rows(trajectory), []


def tensor_rows(tensors: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The rows of a [batch, seq] tensor dict, each cut to its attention_mask (AReaL pads right:
    utils/data.py:241-256 concat_padded_tensors)."""
    columns = {name: _lists(tensors.get(name)) for name in ("input_ids", "loss_mask", "logprobs", "versions",
                                                            "attention_mask")}
    rewards = _lists(tensors.get("rewards"))
    rows = []
    for i, ids in enumerate(columns["input_ids"]):
        attention = columns["attention_mask"]
        length = int(sum(bool(a) for a in attention[i])) if attention is not None else len(ids)
        row = {name: values[i][:length] if values is not None else None for name, values in columns.items()}
        row["reward"] = _scalar(rewards[i]) if rewards is not None and i < len(rewards) else None
        rows.append(row)
    return rows


def row_rollout(row: Mapping[str, Any], rollout_id: str, *, off_role: str, fallback_step: int | None,
                meta: dict[str, Any]) -> tuple[int, dict[str, Any] | None, str | None]:
    """(meta.step, the format v1 rollout, None) for one row, or (0, None, why not)."""
    ids, mask = row["input_ids"], [int(bool(m)) for m in row["loss_mask"]]
    if 1 not in mask:
        return 0, None, "a row with no trained token (loss_mask all 0)"
    start = mask.index(1)  # the prompt: everything before the first sampled token
    versions = row["versions"]
    trained = sorted({int(v) for v, m in zip(versions, mask) if m and int(v) >= 0}) if versions is not None else []
    if trained:
        step = trained[0]  # the oldest policy that sampled a trained token: the staleness that matters
    elif fallback_step is not None:
        step = fallback_step
    else:
        return 0, None, "a row with no versions and an engine without get_version"
    areal = {**meta["areal"], "versions": [trained[0], trained[-1]] if trained else None, "reward": row["reward"]}
    if row.get("interaction") is not None:
        areal["interaction"] = row["interaction"]
    logprobs = row["logprobs"][start:] if row["logprobs"] is not None else None
    rollout = sample_rollout(rollout_id, ids[:start], ids[start:], mask[start:], logprobs, off_role=off_role,
                             meta={**meta, "areal": areal})
    return step, rollout, None


def sampler_meta(engine: Any, workflow: Any) -> dict[str, Any]:
    """meta.sampler: what the engine's log-probs are, and the sampling the workflow asks for."""
    gconfig = _gconfig(workflow)
    kind = engine_kind(engine)
    sampling = _sampling(gconfig, kind) if gconfig is not None else {}
    if kind == "vllm":
        # AReaL's vLLMConfig has no logprobs_mode (cli_args.py:1689-1741; build_args passes its
        # fields only), so its server returns vLLM's default raw_logprobs; the request asks for the
        # sampled token's log-prob only ("logprobs": 0, vllm_remote.py:52-64, parsed :107-114).
        return {"engine": "vllm", "logprobs": "raw",
                "logprobs_from": "vLLM's default raw_logprobs (AReaL's vLLMConfig sets no logprobs_mode)", **sampling}
    if kind == "sglang":
        return _sglang_meta(sampling)
    name = type(engine).__name__
    return {"engine": f"areal:{name}", **sampling}


def _sglang_meta(sampling: dict[str, Any]) -> dict[str, Any]:
    """SGLang's `output_token_logprobs` (sglang_remote.py:74, :120-121) are log_softmax(logits / T)
    before top-k/top-p, or the unscaled ones when the server runs with SGLANG_RETURN_ORIGINAL_LOGPROB=1
    (read from this process's environment: AReaL's launcher starts its SGLang servers with a copy of
    its own, infra/launcher/sglang_server.py:48-59, which the training processes inherit too)."""
    if os.environ.get("SGLANG_RETURN_ORIGINAL_LOGPROB", "").strip().lower() in ("1", "true"):
        return {"engine": "sglang", "logprobs": "raw", "logprobs_from": "SGLANG_RETURN_ORIGINAL_LOGPROB=1", **sampling}
    # Processed by temperature only: top-k/top-p shape the sampling, not the returned log-probs,
    # so they are kept apart from the keys a processed replay applies.
    cut = {key: sampling.pop(key) for key in ("top_p", "top_k") if key in sampling}
    return {"engine": "sglang", "logprobs": "processed",
            "logprobs_from": "SGLang's default (temperature-scaled; raw with SGLANG_RETURN_ORIGINAL_LOGPROB=1)",
            **sampling, **({"not_in_logprobs": cut} if cut else {})}


def engine_kind(engine: Any) -> str | None:
    """"sglang" or "vllm" for AReaL's remote engines, from their backend (remote_inf_engine.py:359-362)
    or the public wrapper classes (engine/sglang_remote.py:367-382, engine/vllm_remote.py:318-333)."""
    inner = getattr(engine, "_engine", engine)
    names = {cls.__name__ for cls in type(engine).__mro__} | {type(getattr(inner, "backend", None)).__name__}
    if names & {"SGLangBackend", "RemoteSGLangEngine"}:
        return "sglang"
    if names & {"VLLMBackend", "RemotevLLMEngine"}:
        return "vllm"
    return None


def _sampling(gconfig: Any, kind: str | None) -> dict[str, Any]:
    """GenerationHyperparameters' sampling fields as the backends send them (cli_args.py:164-228):
    temperature 0.0 when greedy (sglang_remote.py:57-66, vllm_remote.py:52-64); only SGLang's
    request carries frequency_penalty."""
    greedy = bool(getattr(gconfig, "greedy", False))
    sampling: dict[str, Any] = {"temperature": 0.0 if greedy else float(gconfig.temperature),
                                "top_p": float(gconfig.top_p), "top_k": int(gconfig.top_k)}
    if greedy:
        sampling["greedy"] = True
    if kind == "sglang":
        sampling["frequency_penalty"] = float(gconfig.frequency_penalty)
    return sampling


def _gconfig(workflow: Any) -> Any:
    for _ in range(_GCONFIG_DEPTH):
        if workflow is None:
            return None
        gconfig = getattr(workflow, "gconfig", None)
        if gconfig is not None and hasattr(gconfig, "temperature"):
            return gconfig
        workflow = getattr(workflow, "workflow", None)
    return None


def _lists(tensor: Any) -> list[Any] | None:
    """A [batch, seq] tensor as nested lists (float32 values stay exact as Python floats)."""
    if tensor is None:
        return None
    return tensor.tolist() if hasattr(tensor, "tolist") else list(tensor)


def _scalar(value: Any) -> float | None:
    while isinstance(value, list):  # a reward of shape [batch] or [batch, 1]
        if not value:
            return None
        value = value[0]
    return float(value)
