"""The GPU run, prepared: one script that measures the CUDA paths with the real CLI, in minutes.

Usage: python benchmarks/gpu/run.py --out DIR [--device cuda|cpu] [--tiny] [--budget-s S]
           [--install auto|never] [--work DIR] [--tiny-checkpoint CKPT] [--stages a,b,…] [--in-process]

On a GPU machine with torch and transformers but no network (the workplace's H200): installs what
`mismatch` needs and the machine lacks from wheels in benchmarks/gpu/carry/wheels (prepare.sh
fills it), and the project itself from this tree; builds the checkpoints offline (the demo's tiny
one, a dense model of Llama-3.2-1B's shapes and a small Qwen3-MoE, the latter two trained a few
hundred steps on the GPU on the demo's corpus so their distributions are peaky); samples agentic
rollouts from each with the toy agent on the GPU; then runs `mismatch audit` / `mismatch probe`
as subprocesses on CUDA (fp32 vs bf16, prefill vs decode with --localize, batch budgets, shuffled
rows, MoE routing with and without R3) and times the `hf` replay against a bare forward on the
same batches. Each stage is timed and fails alone; DIR gets, after every stage:
  results.json     per stage: the command, wall seconds, the key figures, or the error;
  summaries.json   each audit's whole summary.json, by stage name;
  probes.json      each `mismatch probe --out` file, by model.
Three files (the device tool brings back at most eight); tokens.parquet and the reports stay in
the work dir. `--device cpu --tiny --in-process` is the dry run the test suite runs
(tests/test_gpu_script.py; its own test runs `cli` as a subprocess, as the GPU run does).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import math
import os
import platform
import random
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
CARRY = HERE / "carry"  # git-ignored: what prepare.sh puts beside the tree for the GPU machine
SCHEMA = "mismatch.gpu-run/v1"
# What `import mismatch` and the commands below need that the H200 image lacks (KINDS.md's package
# list has torch, transformers, pandas, pyarrow, scipy, typer, rich, pyyaml, packaging, jinja2).
WHEEL_MODULES = ("msgspec", "duckdb")


# --- sizes ------------------------------------------------------------------------------------

@dataclass(frozen=True, kw_only=True)
class Preset:
    """How big each part of the run is: the GPU run's, or the dry run's (`--tiny`)."""

    dense: dict[str, Any]          # LlamaConfig keywords (vocab and special ids come from the tokenizer)
    moe: dict[str, Any]            # Qwen3MoeConfig keywords
    train_steps: int
    train_seconds: float           # per model: the steps are cut to fit (the schedule is fitted, not truncated)
    dense_lr: float
    moe_lr: float
    batch_size: int
    seq_len: int
    dense_rollouts: int
    moe_rollouts: int
    max_turns: int
    max_turn_tokens: int
    block_size: int                # rollouts per block in the batch-variance audits (so a shuffle changes neighbours)
    throughput_copies: int
    repeats: int


# Llama-3.2-1B's shapes (hidden 2048, 16 layers, 32 heads of 64, 8 KV heads, MLP 8192, tied
# embeddings) with the demo tokenizer's 1024-token vocab for its 128k: 0.97B parameters, the
# matmul and attention shapes of a model users train with RL.
GPU = Preset(
    dense={"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8,
           "head_dim": 64, "intermediate_size": 8192, "tie_word_embeddings": True, "rope_theta": 500000.0},
    # A small Qwen3-MoE: 8 layers of 32 experts, top-4 (Qwen3-30B-A3B routes 8 of 128): 0.43B in all.
    moe={"hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 4,
         "head_dim": 64, "intermediate_size": 3072, "moe_intermediate_size": 512, "num_experts": 32,
         "num_experts_per_tok": 4, "norm_topk_prob": True, "router_aux_loss_coef": 0.001,
         "tie_word_embeddings": False},
    # 300 steps of 16 x 256 tokens is ~30 passes over the 39k-token corpus: a near-memorising,
    # peaky policy, as the tiny demo model is after 300 CPU steps.
    train_steps=300, train_seconds=60.0, dense_lr=3e-4, moe_lr=6e-4, batch_size=16, seq_len=256,
    dense_rollouts=16, moe_rollouts=12, max_turns=4, max_turn_tokens=48, block_size=4,
    throughput_copies=8, repeats=5)

# The dry run: the demo's 2-layer shapes (tinymodel._config, architectures' qwen3_moe), a few steps.
TINY = Preset(
    dense={"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "head_dim": 32, "intermediate_size": 384, "tie_word_embeddings": False},
    moe={"hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "head_dim": 32, "intermediate_size": 256, "moe_intermediate_size": 64, "num_experts": 8,
         "num_experts_per_tok": 2, "norm_topk_prob": True, "router_aux_loss_coef": 0.001,
         "tie_word_embeddings": False},
    train_steps=8, train_seconds=20.0, dense_lr=3e-3, moe_lr=3e-3, batch_size=4, seq_len=128,
    dense_rollouts=4, moe_rollouts=3, max_turns=2, max_turn_tokens=12, block_size=2,
    throughput_copies=2, repeats=2)


# --- the run's state and its results files ----------------------------------------------------

class StageError(Exception):
    """A stage that could not finish: its one-line reason goes to results.json."""


@dataclass
class Run:
    args: argparse.Namespace
    preset: Preset
    out: Path
    work: Path
    started: float = field(default_factory=time.perf_counter)
    env: dict[str, str] = field(default_factory=lambda: dict(os.environ))
    results: dict[str, Any] = field(default_factory=dict)
    summaries: dict[str, Any] = field(default_factory=dict)
    probes: dict[str, Any] = field(default_factory=dict)
    paths: dict[str, Path] = field(default_factory=dict)  # what stages made for later ones

    @property
    def device(self) -> str:
        return self.args.device

    def elapsed(self) -> float:
        return time.perf_counter() - self.started

    def left(self) -> float:
        return self.args.budget_s - self.elapsed()

    def need(self, name: str) -> Path:
        if name not in self.paths:
            raise StageError(f"needs {name}, which no earlier stage made (it failed or did not run)")
        return self.paths[name]

    def spec(self, text: str) -> str:
        """An engine spec pinned to the run's device (the default `auto` would pick CUDA when the
        dry run happens to be on a GPU machine)."""
        return f"{text}{',' if ':' in text else ':'}device={self.device}"

    def write(self) -> None:
        self.results["wall_s"] = round(self.elapsed(), 2)
        for name, payload in (("results.json", self.results), ("summaries.json", self.summaries),
                              ("probes.json", self.probes)):
            _atomic_json(self.out / name, payload)


def _atomic_json(path: Path, payload: Any) -> None:
    # A run killed at its time limit still leaves whole files behind (the device tool brings back
    # whatever is there).
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(_finite(payload), indent=1) + "\n")
    tmp.replace(path)


def _finite(value: Any) -> Any:
    """NaN and ±inf as null, as summary.json writes them (strict JSON readers refuse NaN)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def run_stage(run: Run, name: str, body: Callable[[Run], dict[str, Any]], *, min_seconds: float = 5.0) -> None:
    """One stage: timed, its failure recorded (not raised), results written at once."""
    stages = run.results["stages"]
    if run.left() < min_seconds:
        stages[name] = {"ok": False, "wall_s": 0.0,
                        "error": f"skipped: {run.elapsed():.0f} s of the {run.args.budget_s:.0f} s budget spent"}
        print(f"[{run.elapsed():6.1f} s] {name}: skipped (time budget)", flush=True)
        run.write()
        return
    started = time.perf_counter()
    print(f"[{run.elapsed():6.1f} s] {name} …", flush=True)
    try:
        figures = body(run)
        entry = {"ok": True, "wall_s": round(time.perf_counter() - started, 2), "error": None, **figures}
    except Exception as exc:  # a stage fails alone: the ones after it still run and report
        entry = {"ok": False, "wall_s": round(time.perf_counter() - started, 2),
                 "error": f"{type(exc).__name__}: {exc}",
                 **({} if isinstance(exc, StageError) else {"traceback": traceback.format_exc(limit=6)[-3000:]})}
    stages[name] = entry
    status = "ok" if entry["ok"] else f"FAILED: {entry['error'][:300]}"
    print(f"[{run.elapsed():6.1f} s] {name}: {status} ({entry['wall_s']} s)", flush=True)
    run.write()


# --- setup: the wheels, the project, the environment ------------------------------------------

def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package missing
        return False


def install_missing(site: Path, wheels: Path, work: Path) -> dict[str, Any]:
    """What is not importable, installed into `site`: the WHEEL_MODULES and this project."""
    missing = [name for name in WHEEL_MODULES if not _importable(name)]
    project = not _importable("mismatch.probes")
    if missing or project:
        install(site, wheels, work, modules=missing, project=project)
    return {"installed": [*missing, *(["mismatch"] if project else [])]}


def install(site: Path, wheels: Path, work: Path, *, modules: list[str], project: bool) -> None:
    """pip-installs into a fresh `site` (no index, no dependencies) `modules` from the wheels in
    `wheels`, and with `project` this project, built from a copy of its sources (probes/ and
    reports/ become mismatch.probes and mismatch.reports only through pyproject's package-dir, so
    the tree itself cannot go on PYTHONPATH; the copy keeps build/ and egg-info out of the checkout)."""
    shutil.rmtree(site, ignore_errors=True)
    targets = list(modules)
    if modules and not any(wheels.glob("*.whl")):
        raise StageError(f"{', '.join(modules)} not importable and no wheels in {wheels}: run "
                         "benchmarks/gpu/prepare.sh on a machine with the package index, and carry "
                         "benchmarks/gpu/carry")
    if project:
        source = work / "src"
        shutil.rmtree(source, ignore_errors=True)
        ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
        for part in ("mismatch", "probes", "reports"):
            shutil.copytree(REPO / part, source / part, ignore=ignore)
        for part in ("pyproject.toml", "README.md"):
            shutil.copy(REPO / part, source / part)
        targets.append(str(source))
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--no-compile",
               "--no-cache-dir", "--no-build-isolation", "--disable-pip-version-check", "--target", str(site),
               "--find-links", str(wheels), *targets]
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise StageError(f"pip install failed (exit {done.returncode}): {_tail(done.stderr or done.stdout)}")


def use_site(run: Run, site: Path) -> None:
    """The installed packages first, in this process and in every CLI subprocess."""
    sys.path.insert(0, str(site))
    importlib.invalidate_caches()
    run.env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), run.env.get("PYTHONPATH")]))


def environment(device: str) -> dict[str, Any]:
    import torch
    import transformers

    import mismatch

    facts: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
        "mismatch": mismatch.__version__, "device": device, "torch_threads": torch.get_num_threads(),
        "cpu_count": os.cpu_count()}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        facts |= {"gpu": props.name, "capability": list(torch.cuda.get_device_capability(0)),
                  "gpu_memory_gib": round(props.total_memory / 2**30, 1), "cuda": torch.version.cuda,
                  "cudnn": torch.backends.cudnn.version(),
                  # The defaults the audits run under (PyTorch's: TF32 matmuls off, bf16 reduced-
                  # precision reductions on); the probes vary them.
                  "allow_tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
                  "allow_bf16_reduced_precision_reduction":
                      torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction}
    return facts


# --- checkpoints ------------------------------------------------------------------------------

def stage_checkpoint_tiny(run: Run) -> dict[str, Any]:
    """The demo's checkpoint: carried (prepare.sh copies the one built on the dev machine, which
    the CPU figures use), given, or built here with the demo recipe (about 30 s on one CPU thread)."""
    from mismatch.demo.tinymodel import ensure_tiny_checkpoint

    given = run.args.tiny_checkpoint or (CARRY / "tiny-checkpoint")
    if (Path(given) / "config.json").is_file():
        path, how = Path(given), "given" if run.args.tiny_checkpoint else "carried"
    else:
        path, how = ensure_tiny_checkpoint(run.work / "tiny").path, "built"
    run.paths["tiny"] = path
    facts = json.loads((path / "mismatch_build.json").read_text()) if (path / "mismatch_build.json").is_file() else {}
    return {"path": str(path), "how": how, **{k: facts.get(k) for k in ("num_params", "final_loss", "steps", "torch")}}


def corpus_ids(tokenizer_dir: Path):
    """The demo corpus (toy-agent transcripts and the bundled prose, chat-rendered) as one token
    stream, tokenized as tinymodel tokenizes it for the tiny model."""
    import torch

    from mismatch.checkpoint import load_tokenizer
    from mismatch.demo.tinymodel import chat_corpus

    tokenizer = load_tokenizer(tokenizer_dir)
    encoded = tokenizer(chat_corpus(0), add_special_tokens=False)["input_ids"]
    return torch.tensor([t for ids in encoded for t in ids], dtype=torch.long)


def model_config(kind: str, keywords: dict[str, Any], tokenizer_dir: Path):
    from transformers import LlamaConfig, Qwen3MoeConfig

    ids = json.loads((tokenizer_dir / "config.json").read_text())
    config = {"dense": LlamaConfig, "moe": Qwen3MoeConfig}[kind](
        vocab_size=ids["vocab_size"], max_position_embeddings=2048, rms_norm_eps=1e-5,
        bos_token_id=ids.get("bos_token_id"), eos_token_id=ids.get("eos_token_id"),
        pad_token_id=ids.get("pad_token_id"), **keywords)
    return config


def _lr_at(step: int, steps: int, peak: float) -> float:
    """Linear warmup then cosine to a tenth (tinymodel's schedule, at this model's peak)."""
    warmup = max(1, min(20, steps // 10))
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, steps - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train_checkpoint(run: Run, kind: str, out: Path) -> dict[str, Any]:
    """A random-init model of the preset's shape trained on the demo corpus (AdamW, no weight
    decay: a peaky, near-memorising policy), saved in fp32 with the tiny checkpoint's tokenizer."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM, GenerationConfig

    from mismatch.demo.architectures import TOKENIZER_FILES

    preset, device = run.preset, run.device
    tokenizer_dir = run.need("tiny")
    config = model_config(kind, preset.dense if kind == "dense" else preset.moe, tokenizer_dir)
    token_ids = corpus_ids(tokenizer_dir)
    torch.manual_seed(0)
    with torch.device(device):  # initialized where it trains: 1B parameters drawn on a CPU take seconds
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    num_params = sum(p.numel() for p in model.parameters())
    peak = preset.dense_lr if kind == "dense" else preset.moe_lr
    optimizer = torch.optim.AdamW(model.parameters(), lr=peak, betas=(0.9, 0.95), weight_decay=0.0,
                                  **({"fused": True} if device == "cuda" else {}))
    generator = torch.Generator().manual_seed(0)
    offsets_T = torch.arange(preset.seq_len + 1)
    # The dense model: bf16 autocast over fp32 weights on the GPU, as trainers run it (and many
    # times the fp32 step rate). The MoE trains in fp32: transformers' grouped expert matmuls are
    # not autocast-enabled (its integrations/moe.py, pytorch#174763), and its ~0.1B active
    # parameters are cheap in fp32. The CPU dry run's few tiny steps run in fp32 too.
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device == "cuda" and kind == "dense"
                else nullcontext())
    planned, losses, started, timed_from = preset.train_steps, [], time.perf_counter(), None
    model.train()
    step = 0
    while step < planned:
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, planned, peak)
        starts_B = torch.randint(0, len(token_ids) - preset.seq_len - 1, (preset.batch_size,), generator=generator)
        window_BT = token_ids[starts_B[:, None] + offsets_T].to(device)
        with autocast:
            output = model(input_ids=window_BT[:, :-1], use_cache=False,
                           **({"output_router_logits": True} if kind == "moe" else {}))
        loss = F.cross_entropy(output.logits.float().flatten(0, 1), window_BT[:, 1:].flatten())
        if kind == "moe" and getattr(output, "aux_loss", None) is not None:
            # Load balancing, as MoE pre-training has it: without it a few experts take every token.
            loss = loss + config.router_aux_loss_coef * output.aux_loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
        step += 1
        if step == 3:
            timed_from = time.perf_counter()  # past the first steps' kernel selection and allocator growth
        if step == 10 and timed_from is not None:
            # Fit the step count to the time allowed once the step rate is known: the cosine then
            # still ends at its floor, which a cut-short schedule would not.
            per_step = (time.perf_counter() - timed_from) / 7
            fit = 10 + int((preset.train_seconds - (time.perf_counter() - started)) / per_step)
            planned = max(11, min(planned, fit))
    train_s = time.perf_counter() - started
    model.eval()
    model.generation_config = GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                                               pad_token_id=config.pad_token_id)
    shutil.rmtree(out, ignore_errors=True)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)  # fp32, so `hf:dtype=float32` is a real fp32 trainer
    for file in TOKENIZER_FILES:
        if (tokenizer_dir / file).is_file():
            shutil.copy(tokenizer_dir / file, tmp / file)
    tail = losses[-10:]
    facts = {"kind": kind, "config": {k: v for k, v in (preset.dense if kind == "dense" else preset.moe).items()},
             "num_params": num_params, "steps": step, "steps_asked": preset.train_steps,
             "tokens_per_step": preset.batch_size * preset.seq_len, "peak_lr": peak,
             "first_loss": losses[0], "final_loss": sum(tail) / len(tail), "train_s": round(train_s, 2),
             "corpus_tokens": len(token_ids)}
    (tmp / "gpu_build.json").write_text(json.dumps(facts, indent=1) + "\n")
    tmp.rename(out)
    del model, optimizer, output, loss
    _free_device(device)
    return facts


def _free_device(device: str) -> None:
    """This process's cached device memory back, before a CLI subprocess loads its own models."""
    import gc

    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def stage_checkpoint(kind: str) -> Callable[[Run], dict[str, Any]]:
    def body(run: Run) -> dict[str, Any]:
        started = time.perf_counter()
        facts = train_checkpoint(run, kind, run.work / kind)
        run.paths[kind] = run.work / kind
        return {"path": str(run.work / kind), "build_s": round(time.perf_counter() - started, 2), **facts}
    return body


# --- rollouts ---------------------------------------------------------------------------------

def sample_rollouts(run: Run, checkpoint: Path, out: Path, num: int) -> dict[str, Any]:
    from mismatch.demo.toy_agent import HarnessConfig, write_rollouts

    # The toy agent's bf16 hf-decode sampler on the device: the ops of the hf-decode replay, so an
    # `hf-decode:dtype=bfloat16` replay there should give its log-probs bit for bit (infer/sampler).
    config = HarnessConfig(num_rollouts=num, seed=0, engine="hf-decode", dtype="bfloat16", device=run.device,
                           max_turns=run.preset.max_turns, max_turn_tokens=run.preset.max_turn_tokens)
    started = time.perf_counter()
    count = write_rollouts(checkpoint, out, config)
    seconds = time.perf_counter() - started
    _free_device(run.device)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    segments = [s for r in lines for b in r["branches"] for s in b["segments"]]
    logps = sorted(lp for s in segments for lp in s.get("logprobs") or ())
    return {"path": str(out), "rollouts": count, "branches": sum(len(r["branches"]) for r in lines),
            "tokens": sum(len(s["tokens"]) for s in segments), "sampled_tokens": len(logps),
            "sample_s": round(seconds, 2), "sampled_tokens_per_s": round(len(logps) / seconds, 1),
            # How peaky the policy is where it sampled (a near-uniform one over 1024 tokens: -6.9).
            "sampled_logp_mean": sum(logps) / len(logps), "sampled_logp_median": logps[len(logps) // 2]}


def stage_rollouts(kind: str) -> Callable[[Run], dict[str, Any]]:
    def body(run: Run) -> dict[str, Any]:
        num = run.preset.dense_rollouts if kind == "dense" else run.preset.moe_rollouts
        out = run.work / f"rollouts-{kind}.jsonl"
        figures = sample_rollouts(run, run.need(kind), out, num)
        run.paths[f"{kind}_rollouts"] = out
        if kind == "dense":
            # The same rollouts in another order: with small blocks, each stream gets other
            # neighbours in its micro-batch (batch composition, not batch size, is what moves).
            lines = out.read_text().splitlines()
            random.Random(0).shuffle(lines)
            shuffled = run.work / "rollouts-dense-shuffled.jsonl"
            shuffled.write_text("\n".join(lines) + "\n")
            run.paths["dense_rollouts_shuffled"] = shuffled
        return figures
    return body


# --- the CLI as users run it ------------------------------------------------------------------

def _tail(text: str, lines: int = 6) -> str:
    return " | ".join(line.strip() for line in text.strip().splitlines()[-lines:])[-1500:]


def cli(run: Run, *argv: str) -> tuple[str, float]:
    """`python -m mismatch ARGV` in a subprocess (its own CUDA context and memory, freed when it
    exits), from the work dir (never the checkout, whose mismatch/ lacks probes/ and reports/),
    within what is left of the budget; returns (stdout, wall seconds). With --in-process, the
    same ARGV through `mismatch.cli.main` in this process (cli_in_process)."""
    started = time.perf_counter()
    if run.args.in_process:
        code, stdout, stderr = cli_in_process(run.work, list(argv))
    else:
        try:
            done = subprocess.run([sys.executable, "-m", "mismatch", *argv], cwd=run.work, env=run.env,
                                  capture_output=True, text=True, timeout=max(run.left(), 10.0))
        except subprocess.TimeoutExpired:
            raise StageError(f"timed out past the budget: {shlex.join(argv)}") from None
        code, stdout, stderr = done.returncode, done.stdout, done.stderr
    if code != 0:
        raise StageError(f"exit {code}: mismatch {shlex.join(argv)}: {_tail(stderr)}")
    return stdout, time.perf_counter() - started


def cli_in_process(cwd: Path, argv: list[str]) -> tuple[int, str, str]:
    """`mismatch ARGV` run by `mismatch.cli.main` in this process, from `cwd`: (exit code, stdout,
    stderr). For the CPU dry run: ten commands would each pay an interpreter and the torch and
    transformers imports (most of the dry run's time on a 2-core machine), and there is no CUDA
    context to free between them. No budget timeout: a command cannot be cut short in-process."""
    import io
    from contextlib import redirect_stderr, redirect_stdout

    from mismatch.cli import main

    stdout, stderr, here = io.StringIO(), io.StringIO(), Path.cwd()
    os.chdir(cwd)
    try:
        with redirect_stdout(stdout), redirect_stderr(stderr):
            try:
                code = main(argv)
            except SystemExit as exit_:  # what a console script's sys.exit would have returned
                code = exit_.code if isinstance(exit_.code, int) else 1
    finally:
        os.chdir(here)
    return code, stdout.getvalue(), stderr.getvalue()


PAIR_KEYS = ("n_tokens", "log_ratio_mean", "log_ratio_abs_mean", "log_ratio_abs_max", "kl_k3", "chi2_token",
             "ratio_q001", "ratio_q999", "frac_outside_2", "prob_abs_diff_max", "bitwise_equal_frac")
ENGINE_KEYS = ("kind", "spec", "dtype", "attn", "device", "num_tokens_scored", "num_forward_calls",
               "padding_frac", "seconds", "tokens_per_s")


def audit_figures(summary: dict[str, Any]) -> dict[str, Any]:
    """The figures results.json keeps of an audit (the whole summary goes to summaries.json)."""
    engines = {source: {k: e.get(k) for k in ENGINE_KEYS} for source, e in summary["engines"].items()
               if e.get("kind") not in ("stored", None)}
    figures: dict[str, Any] = {
        "counts": summary["counts"],
        "pairs": {pair: {k: metrics.get(k) for k in PAIR_KEYS} for pair, metrics in summary["pairs"].items()},
        "engines": engines, "prefix_consistency": summary.get("prefix_consistency"),
        "diagnosis": [cause.get("title") for cause in (summary.get("diagnosis") or {}).get("causes", [])][:3]}
    localization = summary.get("localization") or {}
    if "layers" in localization:
        layers = localization["layers"]
        figures["layers"] = ({"skipped": layers["skipped"]} if "skipped" in layers else
                             {k: layers.get(k) for k in ("num_tokens", "embed_rel_error", "output_logp_abs_diff_mean",
                                                         "jump_layer", "jump_block", "jump_module")})
    if "kernels" in localization:
        kernels = localization["kernels"]
        figures["kernels"] = ({"skipped": kernels["skipped"]} if "skipped" in kernels else
                              {"num_tokens": kernels.get("num_tokens"),
                               "by_type": kernels.get("by_type"),
                               "worst_modules": sorted(kernels.get("by_module") or [],
                                                       key=lambda m: -(m.get("rel_error") or 0.0))[:5]})
    if summary.get("routing"):
        figures["routing"] = summary["routing"]  # per pair: flip rates, margins, the gap with and without flips
        figures["routing_mode"] = summary["engines"].get("train", {}).get("routing")
    return figures


def audit(run: Run, name: str, checkpoint: Path, rollouts: Path, train: str, infer: str,
          *extra: str) -> dict[str, Any]:
    out = run.work / "audits" / name
    argv = ["audit", str(checkpoint), "--rollouts", str(rollouts), "--train", run.spec(train),
            "--infer", run.spec(infer), "--out", str(out), "--force", "--json", *extra]
    _, seconds = cli(run, *argv)
    summary = json.loads((out / "summary.json").read_text())
    run.summaries[name] = summary
    return {"command": "mismatch " + shlex.join(argv), "cli_s": round(seconds, 2), **audit_figures(summary)}


def stage_audit(checkpoint: str, rollouts: str, train: str, infer: str, *extra: str) -> Callable[[Run], dict[str, Any]]:
    def body(run: Run) -> dict[str, Any]:
        source = EXAMPLE_ROLLOUTS if rollouts == "examples" else run.need(rollouts)
        return audit(run, body.stage_name, run.need(checkpoint), source, train, infer, *extra)
    return body


EXAMPLE_ROLLOUTS = REPO / "examples" / "rollouts.jsonl"  # sampled from the demo checkpoint (its meta)


BATCH_SPECS = ("hf:dtype=bfloat16", "hf:dtype=bfloat16,batch_tokens=1")


def stage_batch_budgets(run: Run) -> dict[str, Any]:
    """train: the default budget batches a block's streams together; infer: batch_tokens=1 gives
    every stream a forward of its own (padded_by_budget batches a row over the budget alone).
    Same kernels otherwise, so train/infer is the batch-size variance and prefix_consistency the
    same-prefix one."""
    return audit(run, "batch_budgets", run.need("dense"), run.need("dense_rollouts"), *BATCH_SPECS,
                 "--block-size", str(run.preset.block_size))


def stage_batch_shuffled(run: Run) -> dict[str, Any]:
    """The batch-budget audit again over the shuffled file; each token's log-prob then compared
    with the unshuffled run's, per source (train: batched by the budget, so its neighbours changed;
    infer: every stream alone, the control that must not move)."""
    import numpy as np
    import pandas as pd

    if "batch_budgets" not in run.summaries:
        raise StageError("needs batch_budgets, which did not finish")
    figures = audit(run, "batch_shuffled", run.need("dense"), run.need("dense_rollouts_shuffled"), *BATCH_SPECS,
                    "--block-size", str(run.preset.block_size))
    keys = ["rollout", "branch", "pos"]
    columns = [*keys, "logp_train", "logp_infer"]
    a = pd.read_parquet(run.work / "audits" / "batch_budgets" / "tokens.parquet", columns=columns)
    b = pd.read_parquet(run.work / "audits" / "batch_shuffled" / "tokens.parquet", columns=columns)
    for frame in (a, b):
        for key in ("rollout", "branch"):
            frame[key] = frame[key].astype(str)
    joined = a.merge(b, on=keys, suffixes=("_file", "_shuffled"), validate="one_to_one")
    if len(joined) != len(a):
        raise StageError(f"{len(a)} tokens unshuffled, {len(b)} shuffled, {len(joined)} matched")
    compared = {}
    for source in ("train", "infer"):
        x, y = joined[f"logp_{source}_file"].to_numpy(), joined[f"logp_{source}_shuffled"].to_numpy()
        keep = ~np.isnan(x) & ~np.isnan(y)
        compared[source] = {"n_tokens": int(keep.sum()), "bitwise_equal_frac": float(np.mean(x[keep] == y[keep])),
                            "max_abs_diff": float(np.max(np.abs(x[keep] - y[keep]))) if keep.any() else None}
    return {"shuffled_vs_file": {"n_rows": len(joined), **compared}, **figures}


def probe_figures(payload: dict[str, Any]) -> dict[str, Any]:
    """Per family and per source of variation: how many probes, how many not bitwise equal, the
    largest |difference|; and the router's flips (MoE)."""
    results = [r for r in payload["results"] if r.get("applicable", True)]
    tables: dict[str, dict[str, dict[str, Any]]] = {"by_family": {}, "by_source": {}}
    for r in results:
        for table, key in ((tables["by_family"], r["family"]), (tables["by_source"], r["source"])):
            row = table.setdefault(key, {"probes": 0, "not_bitwise_equal": 0, "max_abs_diff": 0.0})
            row["probes"] += 1
            row["not_bitwise_equal"] += int((r.get("bitwise_equal_frac") or 0.0) < 1.0)
            if isinstance(r.get("max_abs_diff"), (int, float)) and math.isfinite(r["max_abs_diff"]):
                row["max_abs_diff"] = max(row["max_abs_diff"], r["max_abs_diff"])
    # The batch-size probes are what makes a trainer's log-probs depend on its micro-batches.
    batch = [{k: r.get(k) for k in ("op", "variation", "dtype", "bitwise_equal_frac", "max_abs_diff")}
             for r in results if r["source"] == "batch_size"]
    flips = [{k: r.get(k) for k in ("op", "variation", "dtype", "num_flipped", "flipped_frac")}
             for r in results if r.get("num_flipped") is not None]
    return {"environment": payload.get("environment"), "num_probes": len(results), **tables,
            "batch_size": batch, "router_flips": flips}


def stage_probe(kind: str) -> Callable[[Run], dict[str, Any]]:
    def body(run: Run) -> dict[str, Any]:
        out = run.work / f"probe-{kind}.json"
        argv = ["probe", str(run.need(kind)), "--device", run.device, "--out", str(out), "--json"]
        _, seconds = cli(run, *argv)
        payload = json.loads(out.read_text())
        run.probes[kind] = payload
        return {"command": "mismatch " + shlex.join(argv), "cli_s": round(seconds, 2), **probe_figures(payload)}
    return body


# --- throughput: the replay against a bare forward on the same batches ------------------------

def _best_of(repeats: int, work: Callable[[], None], sync: Callable[[], None]) -> float:
    times = []
    for _ in range(repeats):
        sync()
        started = time.perf_counter()
        work()
        sync()  # CUDA runs ahead of Python: a time is only read once the device is done
        times.append(time.perf_counter() - started)
    return min(times)


def stage_throughput(run: Run) -> dict[str, Any]:
    """benchmarks/replay.py and packing.py on the device, bf16: the `hf` engine's whole replay
    (forward, chunked fp32 log-softmax, gather, copy back) against `model(...).logits` on the very
    micro-batches it forms, each batch's ids copied to the device inside the timing on both sides.
    Padded (mismatch's default batching) and packed (`packing=varlen,balance=first_fit`,
    prime-rl's rows). Target: replay <= 1.10 x bare."""
    import numpy as np
    import torch

    from mismatch.engines import load_engine
    from mismatch.engines.hf import micro_batches
    from mismatch.replay import plan_replay
    from mismatch.rollouts import load_rollouts

    checkpoint = run.need("dense")
    requests = plan_replay(load_rollouts(run.need("dense_rollouts"))).requests * run.preset.throughput_copies
    lengths = [len(r.tokens) for r in requests]
    sync = torch.cuda.synchronize if run.device == "cuda" else (lambda: None)
    found: dict[str, Any] = {"dtype": "bfloat16", "requests": len(requests), "tokens": int(sum(lengths)),
                             "scored_tokens": int(sum(r.num_scored for r in requests)), "repeats": run.preset.repeats}
    for name, options in (("padded", ""), ("packed_first_fit", ",packing=varlen,balance=first_fit")):
        engine = load_engine(run.spec(f"hf:dtype=bfloat16{options}"), str(checkpoint))
        model, device = engine.model, engine.device
        inputs = []
        for batch in micro_batches(lengths, engine.options):
            if engine.options.packing == "varlen":
                ids = torch.from_numpy(np.concatenate([requests[i].tokens for i in batch]))[None]
                positions = torch.from_numpy(np.concatenate([np.arange(lengths[i]) for i in batch]))[None]
                inputs.append({"input_ids": ids, "position_ids": positions})
            else:
                ids_BL = torch.zeros((len(batch), max(lengths[i] for i in batch)), dtype=torch.long)
                for row, index in enumerate(batch):
                    ids_BL[row, : lengths[index]] = torch.from_numpy(requests[index].tokens)
                inputs.append({"input_ids": ids_BL})

        def bare() -> None:
            with torch.inference_mode():
                for feed in inputs:
                    model(**{k: v.to(device) for k, v in feed.items()}, use_cache=False).logits

        def replay() -> None:
            engine.replay(requests)

        bare(), replay(), sync()  # warm up: kernel selection, the allocator's pools
        bare_s = _best_of(run.preset.repeats, bare, sync)
        replay_s = _best_of(run.preset.repeats, replay, sync)
        found[name] = {"micro_batches": len(inputs), "bare_s": bare_s, "replay_s": replay_s,
                       "replay_over_bare": replay_s / bare_s, "replay_tokens_per_s": found["scored_tokens"] / replay_s,
                       "padding_frac": engine.describe()["padding_frac"]}
        engine.close()
        del engine, model
        _free_device(run.device)
    found["target_replay_over_bare"] = 1.10
    found["met"] = all(found[n]["replay_over_bare"] <= 1.10 for n in ("padded", "packed_first_fit"))
    return found


# --- the run ----------------------------------------------------------------------------------

def stages() -> list[tuple[str, Callable[[Run], dict[str, Any]], float]]:
    """(name, body, seconds it needs at least to start). In order of what matters most if the
    budget runs out: the demo model's audits first (cheap, comparable with the CPU figures), then
    the dense model's, the batch variance, the throughput, the MoE."""
    table = [
        ("checkpoint_tiny", stage_checkpoint_tiny, 40),
        # The demo checkpoint and examples/rollouts.jsonl (sampled from it by the CPU bf16 decode
        # path): the dry run measures these same two audits on the CPU (RESULTS.md, "GPU").
        ("tiny_fp32_vs_bf16", stage_audit("tiny", "examples", "hf:dtype=float32", "hf:dtype=bfloat16"), 10),
        ("tiny_prefill_vs_decode", stage_audit("tiny", "examples", "hf:dtype=bfloat16",
                                               "hf-decode:dtype=bfloat16"), 10),
        ("checkpoint_dense", stage_checkpoint("dense"), 60),
        ("rollouts_dense", stage_rollouts("dense"), 20),
        ("audit_fp32_vs_bf16", stage_audit("dense", "dense_rollouts", "hf:dtype=float32", "hf:dtype=bfloat16",
                                           "--localize"), 20),
        # The sampler was this very bf16 decode path on this device: infer/sampler is replay fidelity.
        ("audit_prefill_vs_decode", stage_audit("dense", "dense_rollouts", "hf:dtype=bfloat16",
                                                "hf-decode:dtype=bfloat16", "--localize"), 20),
        ("batch_budgets", stage_batch_budgets, 15),
        ("batch_shuffled", stage_batch_shuffled, 15),
        ("throughput", stage_throughput, 15),
        ("probe_dense", stage_probe("dense"), 10),
        ("checkpoint_moe", stage_checkpoint("moe"), 45),
        ("rollouts_moe", stage_rollouts("moe"), 15),
        # README's R3 measurement: the bf16 trainer's own routing, then following the fp32 pass's.
        ("moe_routing_own", stage_audit("moe", "moe_rollouts", "hf:dtype=bfloat16", "hf:dtype=float32"), 15),
        ("moe_routing_replay", stage_audit("moe", "moe_rollouts", "hf:dtype=bfloat16,routing=replay",
                                           "hf:dtype=float32"), 15),
        ("probe_moe", stage_probe("moe"), 10),
    ]
    for name, body, _ in table:
        body.stage_name = name  # type: ignore[attr-defined]
    return table


STAGE_NAMES = tuple(name for name, _, _ in stages())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True,
                        help="results dir (results.json, summaries.json, probes.json)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--tiny", action="store_true",
                        help="the dry run's sizes (the demo's 2-layer shapes, a few steps)")
    parser.add_argument("--budget-s", type=float, default=450.0,
                        help="stop starting stages past this many seconds (the GPU run's target is 8 minutes)")
    parser.add_argument("--install", default="auto", choices=("auto", "never"),
                        help="auto: pip-install what is not importable from the carried wheels and this tree")
    parser.add_argument("--work", type=Path, default=None,
                        help="checkpoints, rollouts and audit dirs (default: a fresh temp dir)")
    parser.add_argument("--tiny-checkpoint", type=Path, default=None,
                        help="the demo checkpoint to use (default: benchmarks/gpu/carry/tiny-checkpoint, else built)")
    parser.add_argument("--stages", type=lambda text: [s for s in text.split(",") if s], default=None,
                        help=f"run only these (comma-separated): {', '.join(STAGE_NAMES)}")
    parser.add_argument("--in-process", action="store_true",
                        help="run the mismatch commands in this process, not one subprocess each (the CPU "
                             "dry run: no interpreter start and imports per command; no budget timeout)")
    args = parser.parse_args(argv)
    # The CLI runs from the work dir: every path it is given must be absolute.
    args.out = args.out.resolve()
    args.tiny_checkpoint = args.tiny_checkpoint.resolve() if args.tiny_checkpoint else None
    unknown = sorted(set(args.stages or ()) - set(STAGE_NAMES))
    if unknown:
        parser.error(f"unknown stage(s) {', '.join(unknown)}; known: {', '.join(STAGE_NAMES)}")
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="mismatch-gpu-"))
    work.mkdir(parents=True, exist_ok=True)
    preset = TINY if args.tiny else GPU
    run = Run(args=args, preset=preset, out=args.out, work=work.resolve())
    run.env.setdefault("HF_HUB_OFFLINE", "1")
    run.env.setdefault("TRANSFORMERS_OFFLINE", "1")
    run.env["PYTHONUNBUFFERED"] = "1"
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    run.results = {"schema": SCHEMA, "argv": sys.argv[1:] if argv is None else argv, "device": args.device,
                   "tiny": args.tiny, "budget_s": args.budget_s, "preset": asdict(preset), "work": str(run.work),
                   "environment": None, "complete": False, "stages": {}}

    def setup(run: Run) -> dict[str, Any]:
        if args.install == "never":
            missing = [m for m in (*WHEEL_MODULES, "mismatch.probes") if not _importable(m)]
            if missing:
                raise StageError(f"not importable and --install never: {', '.join(missing)}")
            found = {"installed": []}
        else:
            found = install_missing(run.work / "site", CARRY / "wheels", run.work)
            if found["installed"]:
                use_site(run, run.work / "site")
        import torch

        if args.device == "cuda" and not torch.cuda.is_available():
            raise StageError("--device cuda, but torch sees no CUDA device (use --device cpu for the dry run)")
        run.results["environment"] = environment(args.device)
        return found

    run_stage(run, "setup", setup, min_seconds=-math.inf)  # the budget's stages need it, whatever is left
    if not run.results["stages"]["setup"]["ok"]:
        return 2
    for name, body, min_seconds in stages():
        if not args.stages or name in args.stages:
            run_stage(run, name, body, min_seconds=min_seconds)
    run.results["complete"] = True
    run.write()
    failed = [name for name, entry in run.results["stages"].items() if not entry["ok"]]
    print(f"[{run.elapsed():6.1f} s] done: {len(run.results['stages']) - len(failed)} stage(s) ok"
          + (f", failed: {', '.join(failed)}" if failed else "") + f"; results in {args.out}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
