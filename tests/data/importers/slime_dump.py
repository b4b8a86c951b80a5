"""slime's own Sample building and `--save-debug-rollout-data` writer; run by tests/test_importers.py
in a subprocess with tests/data/importers/slime (vendored THUDM/slime@624b824a898a) on the path.

Payload (stdin, JSON): {"template": "<dir>/rollout_data/{rollout_id}.pt", "num_layers": L,
"topk": K, "rollouts": {ROLLOUT_ID: [sample, ...]}}, a sample {"prompt_tokens", "turns": [{"tokens",
"log_probs" (null on a tool turn), "trainable"}], "routed_experts" ([len(tokens) - 1][L][K] or null),
"remove_sample"}.

Each sample, slime's own code (slime/utils/types.py): Sample(tokens=prompt) then
`append_response_tokens` per turn (:253-314: model turns with log-probs, tool turns
trainable=False get loss-mask 0 and 0.0 log-probs); the last model turn passes SGLang's
meta_info with `routed_experts` as int32 bytes and `finish_reason`, decoded by `_apply_meta_info`
(:352-396) into `rollout_routed_experts` [len(tokens) - 1, L, K]. Then
slime/observability/rollout_data_utils.py `save_debug_rollout_data` (:140-153) writes each rollout.
Not run: SGLang (the tokens, log-probs and routing come from the payload).
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace
from typing import Any

import numpy as np
from slime.observability.rollout_data_utils import save_debug_rollout_data
from slime.utils.types import Sample


def _sample(index: int, spec: dict[str, Any], args: SimpleNamespace) -> Sample:
    sample = Sample(index=index, group_index=0, prompt="2+3?", tokens=list(spec["prompt_tokens"]), reward=1.0)
    last_model = max(i for i, turn in enumerate(spec["turns"]) if turn["trainable"])
    for i, turn in enumerate(spec["turns"]):
        meta = None
        if i == last_model:
            meta = {"finish_reason": {"type": "stop"}}
            if spec["routed_experts"] is not None:
                meta["routed_experts"] = np.array(spec["routed_experts"], dtype=np.int32).tobytes()
        sample.append_response_tokens(args, tokens=turn["tokens"], log_probs=turn["log_probs"],
                                      trainable=turn["trainable"], meta_info=meta)
    sample.remove_sample = spec["remove_sample"]
    return sample


def main() -> None:
    payload = json.loads(sys.stdin.read())
    args = SimpleNamespace(num_layers=payload["num_layers"], moe_router_topk=payload["topk"])
    for rollout_id, specs in payload["rollouts"].items():
        samples = [_sample(i, spec, args) for i, spec in enumerate(specs)]
        save_debug_rollout_data(payload["template"], samples, rollout_id=int(rollout_id), evaluation=False)
    print(json.dumps({"written": sorted(payload["rollouts"])}))


if __name__ == "__main__":
    main()
