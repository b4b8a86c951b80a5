"""Files that are not a framework's run config, told apart from one before they are read as one: an
SFT or accelerate config given as `trl:`, a script launching verl's SFT trainer, a SkyPilot YAML or a
Hydra defaults file given as `verl:`. Each is refused in one line naming what the file is instead; read
as a run config it would derive a run that never existed."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mismatch.errors import SpecError

# Keys that mark a file as something else than a GRPO trainer config: accelerate's launch config
# (accelerate/commands/config/config_args.py), and the keys of TRL 1.16.0's other trainers' configs that
# GRPOConfig lacks (trl/trainer/sft_config.py, dpo_config.py). A file that sets one of them and none of
# GRPOConfig's own keys is refused: read as GRPO it would derive a run that never existed.
ACCELERATE_KEYS = ("compute_environment", "distributed_type")
OTHER_TRAINER_KEYS = ("packing", "max_length", "max_seq_length", "dataset_text_field", "completion_only_loss",
                      "assistant_only_loss", "padding_free", "eos_token", "rpo_alpha", "ref_model_init_kwargs")
GRPO_KEYS = ("num_generations", "max_completion_length", "max_prompt_length", "use_vllm", "vllm_mode",
             "reward_funcs", "reward_weights", "beta", "loss_type", "num_iterations", "epsilon", "scale_rewards",
             "steps_per_generation", "generation_batch_size", "temperature", "vllm_importance_sampling_correction",
             "vllm_importance_sampling_mode", "mask_truncated_completions")


def trl_grpo_or_refused(path: Path, raw: dict[str, Any]) -> None:
    if found := [key for key in ACCELERATE_KEYS if key in raw]:
        raise SpecError(f"{path}: not a trl GRPO config: an accelerate launch config (it sets {found[0]}); "
                        "give the file `trl grpo --config` reads")
    other = [key for key in OTHER_TRAINER_KEYS if key in raw]
    if other and not any(key in raw for key in GRPO_KEYS):
        raise SpecError(f"{path}: not a trl GRPO config: it sets {other[0]} (another trainer's key, e.g. SFTConfig's) "
                        "and none of GRPOConfig's own keys")


# The entry points that run verl's PPO loop (and so read these keys): the run scripts launch one of them.
VERL_PPO_ENTRIES = ("verl.trainer.main_ppo", "verl.trainer.main_ppo_sync",
               "verl.experimental.fully_async_policy.fully_async_main")


def verl_yaml_or_refused(path: Path, loaded: dict[str, Any]) -> dict[str, Any]:
    """A YAML mapping that is a verl config: one of verl's sections at its top, no Hydra defaults list."""
    if "defaults" in loaded and isinstance(loaded["defaults"], list):
        raise SpecError(f"{path}: not a verl run config: a Hydra defaults file (it has a `defaults:` list); give the "
                        "composed config (outputs/.../.hydra/config.yaml) or the run's key=value overrides")
    if not {"actor_rollout_ref", "algorithm", "trainer"} & loaded.keys():
        keys = ", ".join(map(str, list(loaded)[:5]))
        raise SpecError(f"{path}: not a verl config: no actor_rollout_ref, algorithm or trainer section "
                        f"(top-level keys: {keys})")
    return loaded


def verl_entry_or_refused(path: Path, launched: str) -> None:
    """Refuse a command line that launches a module other than verl's PPO entry points."""
    if launched not in VERL_PPO_ENTRIES and "main_ppo" not in launched:
        raise SpecError(f"{path}: not a verl PPO config: the command line launches {launched} "
                        f"(the reader reads {', '.join(VERL_PPO_ENTRIES)})")
