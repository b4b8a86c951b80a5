"""prime-rl (no PyPI release): validate a TOML snippet with prime-rl's own pydantic config classes,
vendored at the commit in MISMATCH_RELEASE (tests/data/frameworks/prime_rl/, from
packages/prime-rl-configs/src/prime_rl/).

Payload: {"toml": "<TOML text>"}. A snippet of an rl config ([trainer], [trainer.loss],
[inference.vllm]) is validated section by section with the classes RLConfig gives those sections
(configs/rl.py:230 trainer: TrainerConfig, :234 inference: InferenceConfig | None); RLConfig itself
needs OrchestratorConfig, which imports verifiers and renderers (not vendorable here), and the
orchestrator section is required. A snippet with no [trainer]/[inference] table is a standalone
trainer config ([loss] at the top), validated as TrainerConfig. Extra keys are refused by
pydantic_config.BaseConfig (extra="forbid"); [inference.vllm] is extra="allow" in prime-rl itself.
Needs prime-pydantic-config==0.4.3 (pure Python) on the path.
"""

from __future__ import annotations

import sys
import tomllib
from pathlib import Path
from typing import Any

from _driver import main, release

VENDORED = Path(__file__).resolve().parents[1] / "data" / "frameworks" / "prime_rl"
sys.path.insert(0, str(VENDORED))

import pydantic  # noqa: E402

from prime_rl.configs.inference import InferenceConfig  # noqa: E402
from prime_rl.configs.trainer import TrainerConfig  # noqa: E402

RL_SECTIONS = {"trainer", "inference", "orchestrator"}


def _trainer(config: TrainerConfig) -> dict[str, Any]:
    return {"loss": config.loss.model_dump(mode="json"), "enable_router_replay": config.enable_router_replay,
            "model.impl": config.model.impl, "model.optimization_dtype": config.model.optimization_dtype,
            "model.reduce_dtype": config.model.reduce_dtype}


def handle(payload: dict[str, Any]) -> dict[str, Any]:
    framework, _ = release()
    assert framework == "prime-rl", framework
    data = tomllib.loads(payload["toml"])
    if not (set(data) & RL_SECTIONS):
        return {"kind": "trainer", "trainer": _trainer(TrainerConfig.model_validate(data))}
    unknown = sorted(set(data) - RL_SECTIONS)
    if unknown:  # RLConfig has more top-level fields; our snippets set none of them
        raise ValueError(f"top-level table(s) not checked by this driver: {', '.join(unknown)}")
    if "orchestrator" in data:
        raise ValueError("[orchestrator] needs OrchestratorConfig (verifiers, renderers): not vendored")
    result: dict[str, Any] = {"kind": "rl", "trainer": _trainer(TrainerConfig.model_validate(data.get("trainer", {})))}
    if "inference" in data:
        inference = InferenceConfig.model_validate(data["inference"])
        if result["trainer"]["enable_router_replay"]:  # RLConfig.auto_setup_router_replay, rl.py:588-597
            inference.vllm.enable_return_routed_experts = True
        result["inference"] = {"vllm.dtype": inference.vllm.dtype,
                               "vllm.enable_return_routed_experts": inference.vllm.enable_return_routed_experts,
                               "vllm.extra": sorted((inference.vllm.model_extra or {}))}
    return result


REFUSALS = (pydantic.ValidationError, ValueError, tomllib.TOMLDecodeError)

if __name__ == "__main__":
    main(handle, refusals=REFUSALS)
