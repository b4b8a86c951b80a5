"""The built-in example: a tiny checkpoint, rollouts sampled from it, and their audit.

`mismatch demo DIR` lays out DIR/checkpoint/, DIR/rollouts.jsonl and DIR/audit/, building only
what is missing, so a second run re-audits in seconds. The sampler is vLLM when it is importable
(a real inference engine), else the torch `hf-decode` path; the audit replays that same engine.
"""

from __future__ import annotations

import importlib.util
import json
import os
from collections.abc import Callable
from pathlib import Path

from mismatch.pipeline.audit import AuditResult, audit
from mismatch.replay import ProgressFactory
from mismatch.results import is_results_dir

DEMO_TRAIN = "hf"  # fp32 full forward: the trainer
# The engine that replays each sampler's rollouts: its own path, so infer/sampler measures fidelity.
DEMO_INFER = {"vllm": "vllm:dtype=bfloat16", "hf-decode": "hf-decode:dtype=bfloat16"}
DEFAULT_DIR = Path("reports/demo")
BUILD_STEPS = 300  # the tiny checkpoint's training steps (tinymodel.build_tiny_checkpoint's default)


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def _small_vllm_on_cpu() -> None:
    """The demo's model is tiny: on a CPU, 1 GiB of KV cache and an in-process engine core are
    plenty (vLLM's defaults reserve more and start a second process). Set only when unset."""
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


def run_demo(out: str | Path = DEFAULT_DIR, *, progress: ProgressFactory | None = None,
             say: Callable[[str], None] = lambda _: None) -> AuditResult:
    from mismatch.demo.tinymodel import ensure_tiny_checkpoint
    from mismatch.demo.toy_agent import HarnessConfig, write_rollouts

    _small_vllm_on_cpu()
    root = Path(out)
    checkpoint = root / "checkpoint"
    rollouts = root / "rollouts.jsonl"
    tick = None
    if not (checkpoint / "config.json").is_file():
        say(f"building the tiny checkpoint in {checkpoint} (a minute on 2 cores, once) …")
        tick = progress(f"build the tiny checkpoint: {BUILD_STEPS} training steps", BUILD_STEPS) if progress else None
    built = ensure_tiny_checkpoint(checkpoint, steps=BUILD_STEPS, progress=tick)
    say(f"checkpoint {checkpoint} ({built.num_params:,} params, final train loss {built.final_loss:.3f})")
    if not rollouts.is_file():
        engine = "vllm" if vllm_available() else "hf-decode"
        if engine == "hf-decode":
            say("vllm is not importable: sampling with the torch hf-decode path instead "
                "(pip install 'mismatch[vllm]' for a real engine)")
        say(f"sampling agentic rollouts with the bf16 {engine} sampler …")
        # One harness bug on purpose: a re-rendered tool call that `drift` must find.
        harness = HarnessConfig(engine=engine, faults=("rewrite_tool_args",))
        tick = (progress(f"sample {harness.num_rollouts} rollouts: the bf16 {engine} sampler", harness.num_rollouts)
                if progress else None)
        count = write_rollouts(checkpoint, rollouts, harness, progress=tick)
        say(f"sampled {count} rollouts with the bf16 {engine} sampler -> {rollouts}")
    sampler = _sampler_engine(rollouts)
    if sampler == "vllm" and not vllm_available():
        say(f"{rollouts} was sampled with vLLM, which is not importable here: replaying with "
            "hf-decode instead (infer/sampler will not be exact)")
        sampler = "hf-decode"
    audit_dir = root / "audit"
    # The demo owns DIR/audit: it replaces its own previous results, never anything else.
    return audit(checkpoint, rollouts, train=DEMO_TRAIN, infer=DEMO_INFER[sampler], out=audit_dir,
                 force=is_results_dir(audit_dir), progress=progress)


def _sampler_engine(rollouts: Path) -> str:
    """Which sampler made the demo's rollouts (first line's meta; the demo writes them all alike)."""
    with rollouts.open() as handle:
        meta = json.loads(handle.readline()).get("meta") or {}
    engine = (meta.get("sampler") or {}).get("engine", "hf-decode")
    return engine if engine in DEMO_INFER else "hf-decode"
