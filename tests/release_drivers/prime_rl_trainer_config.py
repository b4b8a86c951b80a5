"""prime-rl (no PyPI release): load a whole trainer TOML or rl TOML with prime-rl's own config code,
vendored at the commit in MISMATCH_RELEASE (tests/data/frameworks/prime_rl/), and report the
effective values of the keys mismatch's config reader maps (mismatch/frameworks/configs/prime_rl.py).

Payload: {"path": "<config file>", "ours": bool}.

A trainer TOML (`uv run trainer @ train.toml`) is loaded by the trainer entrypoint's own call,
`pydantic_config.cli(TrainerConfig, args=["@", path])`; its inference values are InferenceConfig's
defaults (what `uv run inference` runs with no config). An rl TOML (`uv run rl @ rl.toml`) needs
RLConfig, whose OrchestratorConfig imports verifiers and renderers (not vendorable): the file is
read with tomllib, RLConfig's own before-validator runs on it (configs/rl.py:379-386:
utils/validation.py `propagate_shared_fields`, which fills `seq_len`, `[model]` ... into the
sections), and the [trainer] and [inference] sections are validated with the classes RLConfig gives
them (rl.py:230, :234). RLConfig's after-validators that rewrite inference values (rl.py:537-603,
657-679: LoRA, router replay, data-parallel size from [deployment]) are not run: those keys are left
out of the answer. Of [orchestrator] only `seq_len` is answered, where the propagation set it.

pydantic_config reads TOML with `tomli` (cli.py:411-419), which the venv lacks; the stdlib's
tomllib is tomli itself (merged into Python 3.11), registered under that name. With "ours": true
the answer also holds what mismatch's reader makes of the file in this process, where prime-rl's
config classes import: its loader line and values.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path
from typing import Any

from _driver import main, release, stand_in

VENDORED = Path(__file__).resolve().parents[1] / "data" / "frameworks" / "prime_rl"
sys.path.insert(0, str(VENDORED))
sys.modules.setdefault("tomli", tomllib)

import pydantic  # noqa: E402
from pydantic_config import cli  # noqa: E402
from pydantic_config.cli import ConfigFileError  # noqa: E402

from prime_rl.configs.inference import InferenceConfig  # noqa: E402
from prime_rl.configs.trainer import TrainerConfig  # noqa: E402

stand_in("prime_rl.configs.orchestrator")  # validation.py imports OrchestratorConfig for type hints only
from prime_rl.utils.validation import propagate_shared_fields  # noqa: E402

RL_SECTIONS = {"trainer", "orchestrator", "inference"}
VLLM_FIELDS = ("dtype", "max_model_len", "enforce_eager", "rope_scaling", "tensor_parallel_size", "data_parallel_size",
               "seed",
               "gpu_memory_utilization", "enable_prefix_caching", "quantization", "enable_expert_parallel",
               "enable_lora", "enable_return_routed_experts")
# Rewritten by RLConfig's after-validators (not run here) in an rl config.
RL_REWRITTEN = ("inference.vllm.data_parallel_size", "inference.vllm.enable_lora",
                "inference.vllm.enable_return_routed_experts")


def trainer_values(config: TrainerConfig, prefix: str) -> dict[str, Any]:
    model = config.model
    values = {f"model.{name}": getattr(model, name) for name in (
        "optimization_dtype", "reduce_dtype", "attn", "impl", "seq_len", "cp", "cp_style", "ep",
        "fused_lm_head_token_chunk_size", "moe_router_dtype")}
    values.update({"model.compile": model.compile is not None,
                   "model.quantization": model.quantization.type if model.quantization else None,
                   "model.lora": {"rank": model.lora.rank, "alpha": model.lora.alpha} if model.lora else None,
                   "matmul_precision": config.matmul_precision, "enable_router_replay": config.enable_router_replay})
    return {prefix + key: value for key, value in values.items()}


def inference_values(config: InferenceConfig) -> dict[str, Any]:
    """What the server hands vLLM: InferenceConfig.to_namespace() (inference.py:590-629)."""
    namespace = vars(config.to_namespace())
    extra = {key: value for key, value in (config.vllm.model_extra or {}).items() if value is not None}
    values = {f"inference.vllm.{name}": getattr(config.vllm, name) for name in VLLM_FIELDS}
    values.update({"inference.vllm.logprobs_mode": namespace["logprobs_mode"],
                   "inference.vllm.extra": {k: v for k, v in extra.items() if k != "logprobs_mode"},
                   "inference.enable_fp32_lm_head": config.enable_fp32_lm_head,
                   "inference.enable_fp32_router_logits": config.enable_fp32_router_logits,
                   "inference.kv_cache_offload": config.kv_cache_offload.type if config.kv_cache_offload else None})
    return values


def _rl(path: str) -> dict[str, Any]:
    with open(path, "rb") as f:
        data = propagate_shared_fields(tomllib.load(f))
    values = trainer_values(TrainerConfig.model_validate(data.get("trainer", {})), "trainer.")
    values.update(inference_values(InferenceConfig.model_validate(data.get("inference") or {})))
    for key in RL_REWRITTEN:
        values.pop(key)
    seq_len = (data.get("orchestrator") or {}).get("seq_len")
    if seq_len is not None:
        values["orchestrator.seq_len"] = seq_len
    return values


def handle(payload: dict[str, Any]) -> dict[str, Any]:
    framework, _ = release()
    assert framework == "prime-rl", framework
    path = payload["path"]
    with open(path, "rb") as f:
        is_rl = bool(set(tomllib.load(f)) & RL_SECTIONS)
    if is_rl:
        values = _rl(path)
    else:
        values = trainer_values(cli(TrainerConfig, args=["@", path]), "")
        values.update(inference_values(InferenceConfig()))
    answer: dict[str, Any] = {"kind": "rl" if is_rl else "trainer", "values": values}
    if payload.get("ours"):
        from mismatch.frameworks.configs import prime_rl as reader

        read = reader.read_config(Path(path))
        answer["ours"] = {"loader": read.loader, "values": read.values}
    return answer


REFUSALS = (pydantic.ValidationError, ValueError, tomllib.TOMLDecodeError, ConfigFileError)

if __name__ == "__main__":
    main(handle, refusals=REFUSALS)
