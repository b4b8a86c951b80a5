"""A vLLM worker extension for tests/release_drivers/openrlhf_hook.py: OpenRLHF's `update_weight`
(the signature of its vllm_worker_wrap.WorkerWrap.update_weight), receiving each tensor from the
safetensors file the driver names in $MISMATCH_TEST_WEIGHTS instead of an NCCL broadcast from the
trainer, which needs GPUs. The load into the model is vLLM's own (`model.load_weights`)."""

from __future__ import annotations

import os
from typing import Any

from _vllm_reloadable import keep_weights

keep_weights()  # imported by vLLM's worker, wherever it runs, before it loads the model


class FromFile:
    def update_weight(self, name: str, dtype: Any, shape: Any, empty_cache: bool = False) -> None:
        from safetensors.torch import load_file

        weight = load_file(os.environ["MISMATCH_TEST_WEIGHTS"])[name].to(dtype)
        assert tuple(weight.shape) == tuple(shape), (name, weight.shape, shape)
        self.model_runner.model.load_weights(weights=[(name, weight)])
