"""verl's own rollout path on CPU, writing per-step dumps the way a verl run does; run by
tests/test_importers.py in a subprocess with the verl release (tests/releases.py) on the path.

Payload (stdin, JSON): {"tokenizer": DIR, "out": DIR, "prompt_length": P, "response_length": R,
"steps": {STEP: [sample, ...]}}, a sample {"prompt_ids", "response_ids", "response_mask",
"response_logprobs", "routed_experts", "reward_score", "num_turns", "old_log_probs"}.

Per step, each the release's own code (verl 0.9.1, verl/experimental/agent_loop/agent_loop.py):
  1. AgentLoopOutput(...) as an agent loop returns it (:88-115);
  2. AgentLoopWorker._agent_loop_postprocess (:728-866): verl's padding with the checkpoint's
     tokenizer, routed experts placed in the zero tensor over prompt + response;
  3. AgentLoopWorker._postprocess (:1057-1148): the DataProto batch;
  4. DataProto.union with the trainer's `old_log_probs` (the key ray_trainer.py:1318 names), then
     DataProto.save_to_disk (verl/protocol.py:423-425) to OUT/batches/{step}.pkl;
  5. AgentLoopOutput.as_dict() (:117-161) torch.save'd to OUT/as_dict/step_{step}/{i}.pt;
  6. RayPPOTrainer._write_generations (verl/trainer/ppo/ray_trainer.py:454-477), what
     trainer.rollout_data_dir writes: OUT/rollout_data/{step}.jsonl.
Not run (no GPU, no engine): the vLLM server that samples the tokens (their ids, log-probs and
routed experts come from the payload) and the FSDP actor's compute_log_prob (old_log_probs come
from the payload). The worker is made with __new__ and given the attributes these two methods
read (tokenizer, processor None, prompt/response lengths): its __init__ builds the LLM client.
Then mismatch's `import_file` on OUT/batches (unpickling a DataProto needs verl importable, as
it is here) writes OUT/batches.jsonl. Answer: {"batch": the DataProto's tensors as lists}.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from _driver import stand_in

# Runtime packages verl's modules import at module level and these paths never call.
STAND_INS = ("ray", "ray.actor", "ray.experimental", "ray.experimental.state", "ray.experimental.state.api",
             "ray.util", "ray.util.placement_group", "ray.util.scheduling_strategies", "torchdata",
             "torchdata.stateful_dataloader", "peft", "peft.utils", "peft.utils.save_and_load")


def _stand_ins() -> None:
    stand_in(*STAND_INS)
    for name in STAND_INS:  # `ray.actor.ActorHandle` is read as an attribute of the stand-in parent
        parent, _, child = name.rpartition(".")
        if parent:
            sys.modules[parent].__dict__.setdefault(child, sys.modules[name])


_stand_ins()

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402
from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput, AgentLoopWorker  # noqa: E402
from verl.protocol import DataProto  # noqa: E402
from verl.trainer.ppo.ray_trainer import RayPPOTrainer  # noqa: E402


def _worker(payload: dict[str, Any]) -> AgentLoopWorker:
    worker = AgentLoopWorker.__new__(AgentLoopWorker)
    worker.tokenizer = AutoTokenizer.from_pretrained(payload["tokenizer"])
    worker.processor = None
    worker.mm_processor_kwargs = {}
    worker.reward_loop_worker_handles = None
    worker.distillation_enabled = False
    worker.rollout_config = SimpleNamespace(prompt_length=payload["prompt_length"],
                                            response_length=payload["response_length"])
    return worker


def _output(sample: dict[str, Any]) -> AgentLoopOutput:
    return AgentLoopOutput(prompt_ids=sample["prompt_ids"], response_ids=sample["response_ids"],
                           response_mask=sample["response_mask"], response_logprobs=sample["response_logprobs"],
                           routed_experts=np.array(sample["routed_experts"], dtype=np.int32),
                           reward_score=sample["reward_score"], num_turns=sample["num_turns"],
                           metrics=AgentLoopMetrics())


def _step(worker: AgentLoopWorker, step: int, samples: list[dict[str, Any]], out: Path) -> DataProto:
    outputs = [_output(sample) for sample in samples]
    for i, output in enumerate(outputs):
        folder = out / "as_dict" / f"step_{step}"
        folder.mkdir(parents=True, exist_ok=True)
        torch.save(_output(samples[i]).as_dict(), folder / f"{i}.pt")
    internal = [asyncio.run(worker._agent_loop_postprocess(output, validate=False, raw_prompt=[]))
                for output in outputs]
    batch = worker._postprocess(internal)
    old = torch.zeros_like(batch.batch["rollout_log_probs"])
    for i, sample in enumerate(samples):
        old[i, : len(sample["old_log_probs"])] = torch.tensor(sample["old_log_probs"])
    batch = batch.union(DataProto.from_dict(tensors={"old_log_probs": old}))
    (out / "batches").mkdir(parents=True, exist_ok=True)
    batch.save_to_disk(str(out / "batches" / f"{step}.pkl"))
    decode = worker.tokenizer.batch_decode
    RayPPOTrainer._write_generations(decode(batch.batch["prompts"], skip_special_tokens=True),
                                     decode(batch.batch["responses"], skip_special_tokens=True),
                                     [None] * len(samples), [s["reward_score"] for s in samples], {},
                                     str(out / "rollout_data"), step)
    return batch


def main() -> None:
    payload = json.loads(sys.stdin.read())
    out = Path(payload["out"])
    worker = _worker(payload)
    batches = {step: _step(worker, int(step), samples, out) for step, samples in payload["steps"].items()}
    from mismatch.rollouts.importers import import_file

    import_file("verl", out / "batches", out / "batches.jsonl", allow_pickle=True)
    keys = ("prompts", "responses", "response_mask", "attention_mask", "rollout_log_probs", "old_log_probs",
            "routed_experts", "rm_scores")
    print(json.dumps({"batch": {step: {key: batch.batch[key].tolist() for key in keys}
                                for step, batch in batches.items()}}))


if __name__ == "__main__":
    main()
