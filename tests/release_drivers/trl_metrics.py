"""TRL: the `sampling/*` metrics GRPOTrainer logs about the vLLM-sampler / trainer log-prob gap, computed
by the release's own GRPOTrainer._generate_and_score_completions on our log-probs.

Payload: {"sequences": [{"logp_train": [...], "logp_rollout": [...]}, ...],
          "settings": {GRPOConfig keys, e.g. vllm_importance_sampling_mode / _clip_max / _clip_min}}.
Answer: {metric_key: float} for every metric the method logged under "sampling/".

TRL has no function for the IS ratio or its metrics: both are inline in
_generate_and_score_completions (grpo_trainer.py, "Compute the importance sampling ratio when using
vLLM" and the `sampling/...` block further down). So the release's whole method is run, unchanged, on a
GRPOTrainer made with object.__new__ (no model, no dataset, no vLLM). What it reads is set the way
GRPOTrainer.__init__ sets it, from a real GRPOConfig built from `settings` (so TRL's own __post_init__
checks them), and its three data sources are replaced on the instance:
  _generate                           -> our token counts and logp_rollout (vLLM's sampling logprobs)
  _get_per_token_logps_and_entropies  -> logp_train (the trainer's recomputed old_per_token_logps)
  _calculate_rewards                  -> zeros (rewards only feed advantages, not the sampling metrics)
Padding, the completion mask, the IS mode/clip, the NaN handling, the reductions and the (single
process) accelerator.gather / nanmin / nanmax are all the release's own lines. A real
accelerate.Accelerator(cpu=True) serves as self.accelerator. No stand-ins.
"""

from __future__ import annotations

import os
import tempfile
from collections import defaultdict, deque
from typing import Any

from _driver import main


class _Model:
    """What _generate_and_score_completions reads of self.model: `.training` (train/eval metrics) and
    `.is_gradient_checkpointing` (trl.models.utils.disable_gradient_checkpointing)."""

    training = True
    is_gradient_checkpointing = False


class _Tokenizer:
    pad_token_id = 0
    bos_token_id = None

    def batch_decode(self, ids: Any, skip_special_tokens: bool = True) -> list[str]:  # 1.14.2 decodes for its logs
        return ["" for _ in ids]


def handle(payload: dict[str, Any]) -> dict[str, float]:
    import torch
    from accelerate import Accelerator
    from trl import GRPOConfig
    from trl.trainer.grpo_trainer import GRPOTrainer

    # float64 throughout, so the release's arithmetic is compared with ours to 1e-9, not to float32
    # rounding: TRL makes its tensors at torch's default dtype.
    torch.set_default_dtype(torch.float64)
    sequences = payload["sequences"]
    settings = {"use_vllm": True, "vllm_importance_sampling_correction": True, **payload.get("settings", {})}
    n = len(sequences)
    for s in sequences:
        if len(s["logp_train"]) != len(s["logp_rollout"]):
            raise ValueError("logp_train and logp_rollout differ in length")

    with tempfile.TemporaryDirectory() as tmp:
        args = GRPOConfig(output_dir=os.path.join(tmp, "out"), use_cpu=True, report_to="none", **settings)

    trainer = object.__new__(GRPOTrainer)
    # As GRPOTrainer.__init__ sets them from args (grpo_trainer.py, __init__).
    trainer.args = args
    trainer.use_vllm = args.use_vllm
    trainer.vllm_importance_sampling_correction = args.vllm_importance_sampling_correction
    trainer.vllm_importance_sampling_mode = args.vllm_importance_sampling_mode
    trainer.vllm_importance_sampling_clip_max = args.vllm_importance_sampling_clip_max
    trainer.vllm_importance_sampling_clip_min = args.vllm_importance_sampling_clip_min
    trainer.num_iterations = args.num_iterations
    trainer.pad_to_multiple_of = args.pad_to_multiple_of
    trainer.multi_objective_aggregation = args.multi_objective_aggregation
    trainer.scale_rewards = args.scale_rewards
    trainer.log_multimodal = args.log_multimodal
    # Our batch: one prompt group of n completions, no tools/environments/images, nothing masked as
    # truncated (the fake token ids carry no EOS), no reference model (beta 0: no ref forward).
    trainer.num_generations = n
    trainer.num_generations_eval = n
    trainer.mask_truncated_completions = False
    trainer.beta = 0.0
    trainer.ref_model = None
    trainer.environment_factories = None
    trainer.environments = None
    trainer.tools = []
    trainer.reward_func_names = ["reward"]
    trainer.reward_weights = torch.ones(1)
    trainer.eos_token_ids = [1]
    trainer._tokenizer = trainer.processing_class = _Tokenizer()
    trainer.model = _Model()
    trainer.accelerator = Accelerator(cpu=True)
    trainer._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    size = max(n, 1)
    trainer._logs = {
        "images": deque(maxlen=size), "prompt": deque(maxlen=size), "completion": deque(maxlen=size),
        "rewards": defaultdict(lambda: deque(maxlen=size)), "advantages": deque(maxlen=size),
        "extra": defaultdict(lambda: deque(maxlen=size)),
    }
    trainer._pending_extra_logs = defaultdict(list)
    trainer._pending_metrics = defaultdict(list)

    lengths = [len(s["logp_train"]) for s in sequences]
    width = max(lengths, default=0)

    def generate(prompts: list[Any]) -> tuple[Any, ...]:
        # (prompt_ids, completion_ids, tool_mask, completions, sampling logprobs, extra_fields, images, tool_images)
        return ([[2] for _ in prompts], [[3] * k for k in lengths], None, ["" for _ in prompts],
                [list(s["logp_rollout"]) for s in sequences], {}, None, [None for _ in prompts])

    def trainer_logps(model: Any, input_ids: Any, attention_mask: Any, logits_to_keep: int, **kwargs: Any) -> Any:
        assert logits_to_keep == width, (logits_to_keep, width)
        logps = torch.zeros(n, logits_to_keep, dtype=torch.float64)
        for i, s in enumerate(sequences):
            logps[i, : len(s["logp_train"])] = torch.tensor(s["logp_train"], dtype=torch.float64)
        return logps, None, None

    trainer._generate = generate
    trainer._get_per_token_logps_and_entropies = trainer_logps
    trainer._calculate_rewards = lambda inputs, prompts, completions, ids: torch.zeros(n, 1)

    inputs = [{"prompt": "p"} for _ in range(n)]
    GRPOTrainer._generate_and_score_completions(trainer, inputs)
    return {key: float(values[-1]) for key, values in trainer._metrics["train"].items()
            if key.startswith("sampling/")}


if __name__ == "__main__":
    main(handle)
