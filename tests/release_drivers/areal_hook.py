"""AReaL: the release's own rollout workflows run through mismatch's dump hook (mismatch/hooks/areal.py),
on the tests' tiny checkpoint, on CPU.

Payload: {"checkpoint": DIR, "dump": PATH, "workflow": "rlvr" | "multi_turn" | "resolved" | "interactions",
          "episodes": [{"version": V, "interrupt": {"after": N, "version": W} (optional),
                        "data": {...} (optional), "is_eval": bool (optional)}, ...],
          "gconfig": {GenerationHyperparameters fields}, "meta": {...}, "seed": S,
          "close_dump_first": bool (optional: the dump's file closed before the episodes, so every write fails)}
    or {"engines": true}: the hook's meta.sampler for the release's RemoteSGLangEngine and RemotevLLMEngine.
Answer: {"episodes": [{"returned": {name: nested list} (per interaction for "interactions"), "same": the
          wrapper returned the object the release's workflow returned, "inner": each grouped episode's}],
          "written", "refused", "first_refusal", "failed", "first_failure", "skipped", "skip_reasons",
          "is_rollout_workflow", "wrapper", "needs_proxy"}.

Each episode is the release's `arun_episode(engine, data)` under the release's workflow_context (task id =
the episode's index, as WorkflowExecutor sets it before the call: infra/workflow_executor.py:1041-1047):
- "rlvr": areal.workflow.rlvr.RLVRWorkflow (the chat template, ModelRequest, reward through AReaL's
  AsyncRewardWrapper process pool, the trajectory dict), wrapped as an instance;
- "multi_turn": areal.workflow.multi_turn.MultiTurnWorkflow, max_turns 2, a reward of 0 so it retries once
  (the retry prompt between the two answers is loss_mask 0);
- "resolved": the wrapper named by its import path with `workflow_kwargs` naming RLVRWorkflow by path,
  resolved by the release's RemoteInfEngine._resolve_workflow with group_size 2 (so AReaL wraps it in its
  GroupedRolloutWorkflow and concatenates two episodes), as the single-controller workers get it;
- "interactions": a workflow returning the release's InteractionWithTokenLogpReward for one sampled answer,
  and one without tensor data (what an external API's interaction is).

The engine is the one stand-in: the remote SGLang/vLLM server AReaL's RemoteInfEngine talks to cannot run
here, so `TinyEngine.agenerate(ModelRequest) -> ModelResponse` samples with transformers' generate at the
request's gconfig and returns the sampled tokens' log-probs from `output_scores` (after temperature), each
chunk tagged with the engine's version when it arrives. An "interrupt" plays a weight update mid-generation as
RemoteInfEngine.agenerate handles it (remote_inf_engine.py:845-902): the first N tokens, a new version, then
the rest resumed from prompt + those tokens.

Stand-ins: as areal_config.py (ray and its submodules; the experiment trackers). None is called.
"""

from __future__ import annotations

import asyncio
import logging
import types
from typing import Any

from areal_config import _stand_ins  # noqa: F401  (registers the same import-time stand-ins)
from _driver import main

MESSAGES = [{"role": "user", "content": "hello there"}]


def reward(prompt: str, completion: str, prompt_ids: list[int], completion_ids: list[int], **data: Any) -> float:
    """Module level, so AReaL's AsyncRewardWrapper can send it to its process pool; 0 when the data
    says retry (MultiTurnWorkflow then asks again)."""
    return 0.0 if data.get("retry") else len(completion_ids) / 10


def _engine_class() -> type:
    from areal.api import InferenceEngine

    class TinyEngine(InferenceEngine):
        """transformers' generate in place of AReaL's remote server (see the module docstring)."""

        def __init__(self, checkpoint: str) -> None:
            import torch
            from transformers import AutoModelForCausalLM

            self.model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
            self._version = 0
            self.interrupt: dict[str, int] | None = None

        @property
        def initialized(self) -> bool:
            return True

        def set_version(self, version: int) -> None:
            self._version = version

        def get_version(self) -> int:
            return self._version

        async def agenerate(self, req: Any) -> Any:
            from areal.api import ModelResponse

            gconfig = req.gconfig
            # the token budget as remote_inf_engine.py:811-813 computes it
            budget = min(gconfig.max_tokens - len(req.input_ids), gconfig.max_new_tokens)
            tokens: list[int] = []
            logps: list[float] = []
            versions: list[int] = []
            interrupt, self.interrupt = self.interrupt, None
            chunks = [interrupt["after"], budget - interrupt["after"]] if interrupt else [budget]
            stopped = False
            for k, size in enumerate(chunks):
                if k and interrupt:
                    self.set_version(interrupt["version"])  # the weight update that interrupted it
                new, new_logps, stopped = self._sample(list(req.input_ids) + tokens, size, gconfig)
                tokens, logps = tokens + new, logps + new_logps
                versions += [self.get_version()] * len(new)  # as remote_inf_engine.py:900-902
                if stopped:
                    break
            return ModelResponse(input_tokens=list(req.input_ids), output_tokens=tokens, output_logprobs=logps,
                                 output_versions=versions, stop_reason="stop" if stopped else "length",
                                 tokenizer=req.tokenizer)

        def _sample(self, ids: list[int], size: int, gconfig: Any) -> tuple[list[int], list[float], bool]:
            import torch

            vocab = self.model.config.vocab_size
            with torch.no_grad():
                out = self.model.generate(
                    input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                    do_sample=not gconfig.greedy, temperature=gconfig.temperature, top_p=gconfig.top_p,
                    top_k=gconfig.top_k if gconfig.top_k < vocab else 0, max_new_tokens=size,
                    eos_token_id=list(gconfig.stop_token_ids), pad_token_id=self.model.config.pad_token_id,
                    return_dict_in_generate=True, output_scores=True)
            new = out.sequences[0, len(ids):].tolist()
            # scores: the logits after generate's processors (temperature here), one row per new token
            logps = [torch.log_softmax(score[0].float(), dim=-1)[token].item() for score, token in zip(out.scores, new)]
            return new, logps, bool(new) and new[-1] in gconfig.stop_token_ids

    return TinyEngine


def _gconfig(payload: dict[str, Any]) -> Any:
    from areal.api.cli_args import GenerationHyperparameters

    return GenerationHyperparameters(**{"max_new_tokens": 8, **payload.get("gconfig", {})})


def _wrapper(payload: dict[str, Any], tokenizer: Any) -> Any:
    """The hook around the release's workflow, built the way the payload's case names."""
    from areal.workflow.multi_turn import MultiTurnWorkflow
    from areal.workflow.rlvr import RLVRWorkflow

    from mismatch.hooks.areal import MismatchDumpWorkflow

    kind, meta, gconfig = payload["workflow"], payload.get("meta"), _gconfig(payload)
    if kind == "rlvr":
        inner = RLVRWorkflow(reward_fn=reward, gconfig=gconfig, tokenizer=tokenizer)
    elif kind == "multi_turn":
        inner = MultiTurnWorkflow(reward_fn=reward, gconfig=gconfig, tokenizer=tokenizer, max_turns=2,
                                  turn_discount=0.5)
    elif kind == "interactions":
        inner = _InteractionsWorkflow(gconfig, tokenizer)
    else:
        return _resolved(payload, gconfig)
    return MismatchDumpWorkflow(inner, payload["dump"], meta=meta)


def _resolved(payload: dict[str, Any], gconfig: Any) -> Any:
    """The wrapper from its import path and kwargs, resolved by the release (remote_inf_engine.py:603-718)."""
    from areal.infra.remote_inf_engine import RemoteInfEngine

    kwargs = {"workflow": "areal.workflow.rlvr.RLVRWorkflow", "path": payload["dump"], "meta": payload.get("meta"),
              "workflow_kwargs": {"reward_fn": "areal_hook.reward", "gconfig": gconfig,
                                  "tokenizer": payload["checkpoint"]}}
    resolver = types.SimpleNamespace(logger=logging.getLogger("areal_hook"), config=None)
    return RemoteInfEngine._resolve_workflow(resolver, "mismatch.hooks.areal.MismatchDumpWorkflow", kwargs,
                                             group_size=2)


class _InteractionsWorkflow:
    """What the OpenAI-proxy workflows return: interactions keyed by id, one with the engine's response,
    one without tensor data (an external API's)."""

    def __init__(self, gconfig: Any, tokenizer: Any) -> None:
        self.gconfig = gconfig.new_with_stop_and_pad_token_ids(tokenizer)
        self.tokenizer = tokenizer

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> dict[str, Any]:
        from areal.api import ModelRequest
        from areal.experimental.openai.types import InteractionWithTokenLogpReward
        from areal.utils.hf_utils import apply_chat_template

        ids = apply_chat_template(self.tokenizer, MESSAGES, tokenize=True, add_generation_prompt=True)
        resp = await engine.agenerate(ModelRequest(input_ids=ids, gconfig=self.gconfig.new(n_samples=1),
                                                   tokenizer=self.tokenizer))
        return {"chat-1": InteractionWithTokenLogpReward(model_response=resp, reward=0.5),
                "external-1": InteractionWithTokenLogpReward(reward=1.0, messages=MESSAGES)}


def _plain(trajectory: Any) -> dict[str, Any]:
    if all(hasattr(v, "to_tensor_dict") for v in trajectory.values()):
        return {key: _plain(v.to_tensor_dict()) for key, v in trajectory.items() if v.has_tensor_data}
    return {name: value.tolist() for name, value in trajectory.items() if hasattr(value, "tolist")}


def _capture(wrapper: Any) -> list[Any]:
    """What the release's workflow returned, episode by episode, before the hook saw it."""
    inner = wrapper.workflow if hasattr(wrapper, "mismatch_dump") else wrapper.workflow.workflow
    seen: list[Any] = []
    run = inner.arun_episode

    async def arun_episode(engine: Any, data: Any) -> Any:
        seen.append(await run(engine, data))
        return seen[-1]

    inner.arun_episode = arun_episode
    return seen


async def _episodes(wrapper: Any, engine: Any, payload: dict[str, Any]) -> list[dict[str, Any]]:
    from areal import workflow_context
    from areal.infra.workflow_context import WorkflowContext

    seen = _capture(wrapper)
    answers = []
    for task_id, episode in enumerate(payload["episodes"]):
        engine.set_version(episode["version"])
        engine.interrupt = episode.get("interrupt")
        workflow_context.set(WorkflowContext(is_eval=episode.get("is_eval", False), task_id=task_id))
        returned = await wrapper.arun_episode(engine, {"messages": MESSAGES, **episode.get("data", {})})
        # under GroupedRolloutWorkflow the release concatenates its episodes: each is answered too
        answers.append({"returned": _plain(returned), "same": returned is seen[-1] if len(seen) == 1 else None,
                        "inner": [_plain(s) for s in seen] if len(seen) > 1 else None})
        seen.clear()
    return answers


def _engines() -> dict[str, Any]:
    from areal.api.cli_args import InferenceEngineConfig
    from areal.engine import RemoteSGLangEngine, RemotevLLMEngine

    from mismatch.hooks.areal import sampler_meta

    config = InferenceEngineConfig(experiment_name="mismatch-release-test", trial_name="trial0")
    workflow = types.SimpleNamespace(gconfig=_gconfig({"gconfig": {"temperature": 0.6, "top_p": 0.9}}))
    answer = {}
    for name, cls in (("sglang", RemoteSGLangEngine), ("vllm", RemotevLLMEngine)):
        engine = cls(config)
        # the executor passes the inner RemoteInfEngine (remote_inf_engine.py:475-477); users may hold the wrapper
        answer[name] = {"inner": sampler_meta(engine._engine, workflow), "wrapper": sampler_meta(engine, workflow)}
    return answer


def handle(payload: dict[str, Any]) -> dict[str, Any]:
    if payload.get("engines"):
        return _engines()
    import torch
    from areal.api.workflow_api import RolloutWorkflow
    from areal.trainer.rl_trainer import PPOTrainer
    from transformers import AutoTokenizer

    torch.manual_seed(payload.get("seed", 0))
    tokenizer = AutoTokenizer.from_pretrained(payload["checkpoint"])
    wrapper = _wrapper(payload, tokenizer)
    hook = wrapper if hasattr(wrapper, "mismatch_dump") else wrapper.workflow  # under GroupedRolloutWorkflow
    if payload.get("close_dump_first"):
        hook.mismatch_dump.close()
    engine = _engine_class()(payload["checkpoint"])
    episodes = asyncio.run(_episodes(wrapper, engine, payload))
    hook.mismatch_dump.close()
    dump = hook.mismatch_dump
    return {"episodes": episodes, "written": dump.num_written, "refused": dump.num_refused,
            "first_refusal": dump.first_refusal, "failed": hook.num_failed, "first_failure": hook.first_failure,
            "lost": dump.num_lost, "first_loss": dump.first_loss,
            "skipped": hook.num_skipped, "skip_reasons": hook.skip_reasons,
            "is_rollout_workflow": isinstance(hook, RolloutWorkflow), "wrapper": type(wrapper).__name__,
            # the trainer's own test for "a RolloutWorkflow, not an agent needing the proxy" (rl_trainer.py:1335-1377)
            "needs_proxy": PPOTrainer._requires_proxy_workflow(None, "mismatch.hooks.areal.MismatchDumpWorkflow")}


if __name__ == "__main__":
    main(handle)
