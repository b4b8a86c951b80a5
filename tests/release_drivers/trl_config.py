"""TRL: load a flat GRPOConfig YAML snippet the way `trl grpo --config FILE` would, and report the
effective fields the GRPO trainer reads for vLLM importance-sampling correction, dtype and old-log-prob
recomputation.

Payload: {"snippet": "<YAML text of flat GRPOConfig keys>"}.

The snippet is written to a file verbatim and parsed by the release's own TrlParser
(trl/scripts/utils.py, TrlParser.parse_args_and_config): yaml.safe_load, the values become the
parser's defaults, an unknown key raises TRL's own ValueError ("Unknown arguments from config file"),
and GRPOConfig.__post_init__ (plus transformers' TrainingArguments) runs its checks. Only GRPOConfig
is in the parser, so keys of `trl grpo`'s ScriptArguments / ModelConfig are refused here.

Two command-line flags are added, each only when the snippet does not set that key itself:
  --use_cpu true     GRPOConfig defaults bf16=True when fp16 is unset, and TrainingArguments refuses
                     bf16 on a machine without a GPU unless use_cpu is set; the tests run on CPU.
  --output_dir TMP   so nothing is written beside the driver.
No stand-ins: every module the parser and config import is really installed.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import yaml
from _driver import main

# The GRPOConfig fields the trainer reads for the sampler/trainer gap (trl/trainer/grpo_trainer.py,
# _generate_and_score_completions and _compute_loss), its dtype and when it recomputes old log-probs.
FIELDS = (
    # vLLM and its importance-sampling correction
    "use_vllm", "vllm_mode", "vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
    "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min", "vllm_importance_sampling_cap",
    # dtype: mixed precision (TrainingArguments), the fp32 LM head, and model_init_kwargs' "dtype"
    "bf16", "fp16", "use_cpu", "cast_lm_head_to_fp32", "model_init_kwargs",
    # old_per_token_logps are recomputed by the trainer when
    # gradient_accumulation_steps % (steps_per_generation * num_iterations) != 0, or use_vllm and the correction
    "gradient_accumulation_steps", "steps_per_generation", "num_iterations", "generation_batch_size",
    "per_device_train_batch_size",
    # the loss that the IS ratio multiplies, and the other sampler-logprob consumers
    "loss_type", "importance_sampling_level", "epsilon", "epsilon_high", "delta", "beta",
    "off_policy_mask_threshold", "use_bias_correction_kl", "mask_truncated_completions", "temperature",
)


def handle(payload: dict[str, Any]) -> dict[str, Any]:
    from trl import GRPOConfig, TrlParser

    text = payload["snippet"]
    given = yaml.safe_load(text) or {}  # only to see which keys the user set; TRL parses the file itself
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "config.yaml")
        with open(path, "w") as f:
            f.write(text)
        args = ["--config", path]
        if isinstance(given, dict) and "use_cpu" not in given:
            args += ["--use_cpu", "true"]
        if isinstance(given, dict) and "output_dir" not in given:
            args += ["--output_dir", os.path.join(tmp, "out")]
        (config,) = TrlParser((GRPOConfig,)).parse_args_and_config(args)
    return {name: getattr(config, name) for name in FIELDS if hasattr(config, name)}


if __name__ == "__main__":
    main(handle)
