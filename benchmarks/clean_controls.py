"""Clean controls for the diagnosis (issue 43): rollouts sampled by the toy agent from the demo
checkpoint under one sampling seed each (hf-decode: two rollouts per seed; vLLM: one rollout per
per-call seed of one run), audited with an fp32 trainer and a replay of the
sampler's own config. Nothing is planted, so any cause but the numerics' own (precision, kernel
paths) is a false alarm; the rate is what benchmarks/RESULTS.md states.

    python benchmarks/clean_controls.py --seeds 20 --configs hf-decode:bfloat16,hf-decode:float32 --out DIR
    flock /tmp/vllm.lock python benchmarks/clean_controls.py --seeds 20 --configs vllm:bfloat16,vllm:float32 --out DIR

Each summary is kept (DIR/summaries/CONFIG-SEED.json) so the rule can be re-read offline
(`mismatch.advise.diagnose.diagnose(summary)` is a function of the summary alone).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

NUMERICS = {"precision", "kernel_path"}  # what a clean control may be blamed on
CONTROLS_PER_VLLM_RUN = 20


def control(checkpoint: Path, root: Path, engine: str, dtype: str, seed: int) -> dict[str, Any]:
    from mismatch.demo.toy_agent import HarnessConfig, write_rollouts
    from mismatch.pipeline.audit import audit

    rollouts = root / "rollouts" / f"{engine}-{dtype}-{seed}.jsonl"
    rollouts.parent.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    if not rollouts.exists() and engine == "vllm":
        # One vLLM run (an engine per sampling seed would be a load per control): its rollouts, each
        # drawn under its own per-call seed (toy_agent's VLLMSampler), one control each.
        run = root / "rollouts" / f"{engine}-{dtype}-run.jsonl"
        write_rollouts(checkpoint, run, HarnessConfig(num_rollouts=CONTROLS_PER_VLLM_RUN, seed=0, engine=engine,
                                                      dtype=dtype, max_turns=3, max_turn_tokens=32))
        for index, line in enumerate(run.read_text().splitlines()):
            (root / "rollouts" / f"{engine}-{dtype}-{index}.jsonl").write_text(line + "\n")
    if not rollouts.exists():
        write_rollouts(checkpoint, rollouts, HarnessConfig(num_rollouts=2, seed=seed, engine=engine, dtype=dtype,
                                                            max_turns=3, max_turn_tokens=32))
    summary = audit(checkpoint, rollouts, train="hf:dtype=float32", infer=f"{engine}:dtype={dtype}").summary
    (root / "summaries").mkdir(exist_ok=True)
    (root / "summaries" / f"{engine}-{dtype}-{seed}.json").write_text(json.dumps(summary, default=str))
    return row(summary, engine=engine, dtype=dtype, seed=seed, seconds=time.perf_counter() - started)


def row(summary: dict[str, Any], **extra: Any) -> dict[str, Any]:
    causes = summary["diagnosis"]["causes"]
    leading = [c["kind"] for c in causes if not c["minor"]]
    return {**extra, "kl_k3": {pair: m["kl_k3"] for pair, m in summary["pairs"].items()},
            "causes": [(c["kind"], c["minor"]) for c in causes],
            "false_alarm": [kind for kind in leading if kind not in NUMERICS],
            "first_recommendation": summary["recommendations"][0]["kind"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--configs", default="hf-decode:bfloat16,hf-decode:float32")
    parser.add_argument("--checkpoint", type=Path, default=None, help="default: the demo checkpoint, built once")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--reread", action="store_true",
                        help="re-diagnose the summaries kept in OUT with this code, sampling and replaying nothing")
    args = parser.parse_args()
    if args.reread:
        reread(args.out)
        return
    import torch

    torch.set_num_threads(1)
    checkpoint = args.checkpoint
    if checkpoint is None:
        from mismatch.demo.tinymodel import ensure_tiny_checkpoint

        checkpoint = ensure_tiny_checkpoint(args.out / "checkpoint").path
    rows = []
    for config in args.configs.split(","):
        engine, dtype = config.split(":")
        for seed in range(args.seeds):
            found = control(checkpoint, args.out, engine, dtype, seed)
            rows.append(found)
            print(json.dumps(found), flush=True)
    (args.out / "controls.json").write_text(json.dumps(rows, indent=1))
    for config in args.configs.split(","):
        mine = [r for r in rows if f"{r['engine']}:{r['dtype']}" == config]
        alarms = [r for r in mine if r["false_alarm"]]
        named = ", ".join("seed {}: {}".format(r["seed"], r["false_alarm"]) for r in alarms) or "none"
        print(f"{config}: {len(alarms)} false alarms in {len(mine)} seeds ({named})")

def reread(out: Path) -> None:
    """The kept summaries through today's diagnosis (a function of the summary alone): each config's
    false alarms, and the render drift found apart (a sampled token sequence that re-renders to
    other tokens is real drift in the data, not a threshold's false alarm)."""
    from mismatch.advise.advice import advise
    from mismatch.pipeline.summary import with_parts
    from mismatch.results.summary_model import partial_summary

    by_config: dict[str, list[dict[str, Any]]] = {}
    for file in sorted((out / "summaries").glob("*.json")):
        record = partial_summary(json.loads(file.read_text()))
        summary = with_parts(record, advise(record).parts()).to_dict()
        engine, dtype, seed = file.stem.rsplit("-", 2)
        found = row(summary, engine=engine, dtype=dtype, seed=int(seed))
        by_config.setdefault(f"{engine}:{dtype}", []).append(found)
    for config, rows in by_config.items():
        drift = [r["seed"] for r in rows if "render_drift" in r["false_alarm"]]
        alarms = [(r["seed"], [k for k in r["false_alarm"] if k != "render_drift"]) for r in rows]
        alarms = [(seed, kinds) for seed, kinds in alarms if kinds]
        leads = sorted({kind for r in rows for kind, minor in r["causes"] if not minor})
        print(f"{config}: {len(rows)} seeds, {len(alarms)} false alarms {alarms}, causes named {leads}, "
              f"render drift (real, re-tokenized) in seeds {drift}, first recommendations "
              f"{sorted({r['first_recommendation'] for r in rows})}")


if __name__ == "__main__":
    main()
