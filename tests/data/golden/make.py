"""Writes rollouts.jsonl of the golden stored-log-prob audit (run once; the file is checked in).

Small but with every shape the analysis treats apart: trees (subagent, summary and
subagent_summary branches with fork_at), trainable overrides, a segment without stored
log-probs, exact ties (bitwise-equal tokens) and a heavy tail. expected_summary.json next to it
is `mismatch audit` of this file as computed before the analysis was rewritten (see
tests/test_golden.py), kept to prove the numbers did not move.
"""

import json
from pathlib import Path

import numpy as np

VOCAB = 1000


def main() -> None:
    rng = np.random.default_rng(1234)
    lines = []
    for index in range(48):
        def seg(role: str, n: int, *, stored: bool = True, trainable: bool | None = None) -> dict:
            out: dict = {"role": role, "tokens": rng.integers(0, VOCAB, n).tolist()}
            if trainable is not None:
                out["trainable"] = trainable
            if role in ("assistant", "summary") and stored:
                logp = np.minimum(-rng.exponential(0.9, n), 0.0)
                tail = rng.standard_t(2, n) * (0.05 if index % 7 == 0 else 0.01)
                trainer = np.where(rng.random(n) < 0.2, logp, np.minimum(logp + tail, 0.0))
                engine = np.where(rng.random(n) < 0.5, logp, np.minimum(logp + rng.normal(0, 0.003, n), 0.0))
                out["logprobs"] = np.round(logp, 6).tolist()
                out["extra_logprobs"] = {"trainer": np.round(trainer, 6).tolist(),
                                         "engine": np.round(engine, 6).tolist()}
            return out

        main = [seg("system", 12), seg("user", 9)]
        for turn in range(int(rng.integers(2, 6))):
            main.append(seg("assistant", int(rng.integers(3, 25)), stored=not (index == 5 and turn == 1)))
            main.append(seg("tool", int(rng.integers(2, 10)), trainable=(index % 11 == 3) or None))
        branches = [{"id": "main", "kind": "main", "parent": None, "fork_at": None, "segments": main}]
        if index % 3 == 0:
            branches.append({"id": "sub", "kind": "subagent", "parent": "main", "fork_at": 15,
                             "segments": [seg("user", 6), seg("assistant", int(rng.integers(4, 20)))]})
            branches.append({"id": "sub-sum", "kind": "subagent_summary", "parent": "sub", "fork_at": 6,
                             "segments": [seg("summary", 5)]})
        if index % 4 == 1:
            branches.append({"id": "compact", "kind": "summary", "parent": "main", "fork_at": 21,
                             "segments": [seg("user", 4), seg("summary", 8),
                                          seg("assistant", 6, trainable=False)]})
        meta = {"sampler": {"engine": "vllm", "dtype": "bfloat16", "temperature": 1.0, "top_p": 1.0,
                            "top_k": -1, "logprobs": "raw"}}
        lines.append(json.dumps({"id": f"g-{index:03d}", "meta": meta, "branches": branches}))
    (Path(__file__).parent / "rollouts.jsonl").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
