"""The built-in example: a tiny checkpoint, rollouts sampled from it, and their audit.

`mismatch demo DIR` lays out DIR/checkpoint/, DIR/rollouts.jsonl and DIR/audit/, building only
what is missing, so a second run re-audits in seconds.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from mismatch.audit import AuditResult, audit
from mismatch.replay import ProgressFactory
from mismatch.results import is_results_dir

DEMO_TRAIN = "hf"                         # fp32 full forward: the trainer
DEMO_INFER = "hf-decode:dtype=bfloat16"   # bf16 prefill + decode: the sampler's own path
DEFAULT_DIR = Path("reports/demo")


def run_demo(out: str | Path = DEFAULT_DIR, *, progress: ProgressFactory | None = None,
             say: Callable[[str], None] = lambda _: None) -> AuditResult:
    from mismatch.tinymodel import ensure_tiny_checkpoint
    from mismatch.toy_agent import HarnessConfig, write_rollouts

    root = Path(out)
    checkpoint = root / "checkpoint"
    rollouts = root / "rollouts.jsonl"
    built = ensure_tiny_checkpoint(checkpoint)
    say(f"checkpoint {checkpoint} ({built.num_params:,} params, final train loss {built.final_loss:.3f})")
    if not rollouts.is_file():
        count = write_rollouts(checkpoint, rollouts, HarnessConfig())
        say(f"sampled {count} rollouts with the bf16 hf-decode sampler -> {rollouts}")
    audit_dir = root / "audit"
    # The demo owns DIR/audit: it replaces its own previous results, never anything else.
    return audit(checkpoint, rollouts, train=DEMO_TRAIN, infer=DEMO_INFER, out=audit_dir,
                 force=is_results_dir(audit_dir), progress=progress)
