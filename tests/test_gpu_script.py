"""The GPU run's dry run: benchmarks/gpu/run.py --device cpu --tiny runs every stage on the CPU and
records measured figures, so the script cannot rot between the times a GPU is at hand.

The dry run proves the script runs; it does not re-measure: its `mismatch` commands run in the
script's own process (--in-process), since ten interpreters each importing torch and transformers
were most of its time here; the subprocess path the GPU run takes has its own test below.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow

SCRIPT = REPO / "benchmarks" / "gpu" / "run.py"
_spec = importlib.util.spec_from_file_location("gpu_run", SCRIPT)
gpu_run = importlib.util.module_from_spec(_spec)
sys.modules["gpu_run"] = gpu_run  # its dataclasses look their module up while it loads
_spec.loader.exec_module(gpu_run)

AUDITS = ("tiny_fp32_vs_bf16", "tiny_prefill_vs_decode", "audit_fp32_vs_bf16", "audit_prefill_vs_decode",
          "batch_budgets", "batch_shuffled", "moe_routing_own", "moe_routing_replay")


def run_script(out: Path, work: Path, *args: str) -> subprocess.CompletedProcess:
    # One OpenMP thread in the script and every CLI it starts: two threads on two shared cores
    # spin-wait whenever another process is busy (conftest.one_torch_thread).
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--tiny", "--install", "never",
                           "--out", str(out), "--work", str(work), *args],
                          capture_output=True, text=True, env=env, timeout=600)


@pytest.fixture(scope="module")
def dry_run(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("gpu-dry-run")
    done = run_script(root / "out", root / "work", "--tiny-checkpoint", str(tiny_checkpoint), "--in-process")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((root / "out" / "results.json").read_text())
    return root, results, results["stages"]


def test_every_stage_ran_on_the_cpu_and_says_what_it_ran(dry_run) -> None:
    root, results, stages = dry_run
    assert results["schema"] == "mismatch.gpu-run/v1" and results["complete"] is True
    assert list(stages) == ["setup", *gpu_run.STAGE_NAMES]
    failed = {name: entry["error"] for name, entry in stages.items() if not entry["ok"]}
    assert failed == {}
    assert results["environment"]["device"] == "cpu" and results["environment"]["torch"]
    for name in AUDITS:
        command = stages[name]["command"]
        assert command.startswith("mismatch audit ") and "device=cpu" in command, command
        assert stages[name]["cli_s"] > 0
    # Only the three small files come back from the device machine; the token tables stay behind.
    assert sorted(p.name for p in (root / "out").iterdir()) == ["probes.json", "results.json", "summaries.json"]
    assert sum(p.stat().st_size for p in (root / "out").iterdir()) < 8 * 2**20


def test_checkpoints_were_trained_and_rollouts_sampled(dry_run) -> None:
    _, _, stages = dry_run
    for kind in ("dense", "moe"):
        built = stages[f"checkpoint_{kind}"]
        assert built["steps"] == gpu_run.TINY.train_steps and built["num_params"] > 0
        assert built["final_loss"] < built["first_loss"]  # it learned something in its few steps
        sampled = stages[f"rollouts_{kind}"]
        assert sampled["rollouts"] >= 3 and sampled["sampled_tokens"] > 0
    assert stages["checkpoint_moe"]["config"]["num_experts"] == 8


def test_fp32_vs_bf16_has_a_gap_and_is_localized(dry_run) -> None:
    _, _, stages = dry_run
    for name in ("tiny_fp32_vs_bf16", "audit_fp32_vs_bf16"):
        pair = stages[name]["pairs"]["train/infer"]
        assert pair["n_tokens"] > 0 and pair["log_ratio_abs_max"] > 0 and pair["bitwise_equal_frac"] < 1
        assert stages[name]["engines"]["train"]["dtype"] == "float32"
        assert stages[name]["engines"]["infer"]["dtype"] == "bfloat16"
    localized = stages["audit_fp32_vs_bf16"]
    assert localized["layers"]["num_tokens"] > 0 and localized["layers"]["output_logp_abs_diff_mean"] > 0
    assert localized["kernels"]["worst_modules"][0]["rel_error"] > 0


def test_prefill_vs_decode_and_the_sampler_replayed_bit_for_bit(dry_run) -> None:
    _, _, stages = dry_run
    audit = stages["audit_prefill_vs_decode"]
    assert audit["engines"]["infer"]["kind"] == "hf-decode" and audit["engines"]["infer"]["device"] == "cpu"
    assert audit["pairs"]["train/infer"]["log_ratio_abs_max"] > 0
    assert "layers" in audit and "skipped" not in audit["layers"]
    # The rollouts were sampled by the device sampler: the same bf16 decode ops the engine replays.
    assert audit["pairs"]["infer/sampler"]["bitwise_equal_frac"] == 1.0
    assert audit["pairs"]["infer/sampler"]["n_tokens"] == audit["pairs"]["train/infer"]["n_tokens"]


def test_batch_variance_and_prefix_consistency(dry_run) -> None:
    _, _, stages = dry_run
    budgets = stages["batch_budgets"]
    assert budgets["engines"]["infer"]["num_forward_calls"] == budgets["counts"]["branches"]  # each stream alone
    assert budgets["engines"]["train"]["num_forward_calls"] < budgets["engines"]["infer"]["num_forward_calls"]
    assert 0.0 <= budgets["pairs"]["train/infer"]["bitwise_equal_frac"] <= 1.0
    for source in ("train", "infer"):
        found = budgets["prefix_consistency"][source]
        assert found["n_prefixes"] > 0 and 0.0 <= found["frac_prefixes_bitwise_equal"] <= 1.0
    shuffled = stages["batch_shuffled"]["shuffled_vs_file"]
    assert shuffled["n_rows"] == budgets["counts"]["tokens"]  # every token found again in the shuffled run
    assert 0 < shuffled["train"]["n_tokens"] == shuffled["infer"]["n_tokens"] <= shuffled["n_rows"]
    # The control: a stream replayed alone cannot see its neighbours, whatever the file's order.
    assert shuffled["infer"]["bitwise_equal_frac"] == 1.0 and shuffled["infer"]["max_abs_diff"] == 0.0


def test_moe_routing_with_and_without_r3(dry_run) -> None:
    _, _, stages = dry_run
    own, replay = stages["moe_routing_own"], stages["moe_routing_replay"]
    assert own["routing_mode"]["mode"] == "own"
    assert replay["routing_mode"] == {"moe_layers": 2, "mode": "replay", "from": "infer"}
    for audit in (own, replay):
        routing = audit["routing"]["train/infer"]
        assert len(routing["flip_rate_by_layer"]) == 2 and 0.0 <= routing["frac_tokens_with_flip"] <= 1.0
        assert routing["with_flip"]["n_tokens"] + routing["without_flip"]["n_tokens"] == routing["n_tokens"]


def test_throughput_against_a_bare_forward(dry_run) -> None:
    _, _, stages = dry_run
    found = stages["throughput"]
    for batching in ("padded", "packed_first_fit"):
        measured = found[batching]
        assert measured["micro_batches"] >= 1 and measured["bare_s"] > 0 and measured["replay_s"] > 0
        assert math.isfinite(measured["replay_over_bare"]) and measured["replay_over_bare"] > 0
        assert measured["replay_tokens_per_s"] > 0
    assert found["packed_first_fit"]["padding_frac"] == 0.0
    assert found["met"] == all(found[b]["replay_over_bare"] <= 1.10 for b in ("padded", "packed_first_fit"))


def test_probes_and_summaries_are_kept_whole(dry_run) -> None:
    root, _, stages = dry_run
    probes = json.loads((root / "out" / "probes.json").read_text())
    assert set(probes) == {"dense", "moe"}
    for kind in ("dense", "moe"):
        assert probes[kind]["environment"]["device"] == "cpu"
        assert stages[f"probe_{kind}"]["num_probes"] == len([r for r in probes[kind]["results"]
                                                             if r.get("applicable", True)])
        assert stages[f"probe_{kind}"]["by_family"]["matmul"]["probes"] > 0
    assert stages["probe_moe"]["router_flips"] and not stages["probe_dense"]["router_flips"]
    summaries = json.loads((root / "out" / "summaries.json").read_text())
    assert set(summaries) == set(AUDITS)
    for name in AUDITS:
        assert summaries[name] == json.loads((root / "work" / "audits" / name / "summary.json").read_text())


def main_here(out: Path, work: Path, *args: str) -> int:
    """The script's main in this process (torch is imported already): for runs whose stages load no
    model, where a subprocess would only pay the imports again (the dry run is the subprocess)."""
    return gpu_run.main(["--device", "cpu", "--tiny", "--install", "never", "--out", str(out), "--work", str(work),
                         *args])


def test_a_failed_or_late_stage_is_recorded_and_the_rest_still_run(tmp_path: Path) -> None:
    assert main_here(tmp_path / "out", tmp_path / "work", "--stages", "rollouts_dense,throughput,probe_moe") == 1
    stages = json.loads((tmp_path / "out" / "results.json").read_text())["stages"]
    assert list(stages) == ["setup", "rollouts_dense", "throughput", "probe_moe"] and stages["setup"]["ok"]
    assert stages["rollouts_dense"]["error"].startswith("StageError: needs dense, which no earlier stage made")
    assert stages["throughput"]["error"].startswith("StageError: needs dense")
    assert stages["probe_moe"]["error"].startswith("StageError: needs moe")

    assert main_here(tmp_path / "late", tmp_path / "work2", "--budget-s", "0", "--stages", "probe_dense") == 1
    entry = json.loads((tmp_path / "late" / "results.json").read_text())["stages"]["probe_dense"]
    assert entry["ok"] is False and entry["error"].startswith("skipped: ") and "budget spent" in entry["error"]


def test_a_command_runs_as_a_subprocess_from_the_work_dir_and_a_failure_is_its_last_lines(tmp_path: Path) -> None:
    """The GPU run's way (no --in-process): `python -m mismatch` in the work dir, its exit and stderr."""
    args = argparse.Namespace(in_process=False, budget_s=600.0)
    run = gpu_run.Run(args=args, preset=gpu_run.TINY, out=tmp_path / "out", work=tmp_path)
    (tmp_path / "rollouts.jsonl").write_text((REPO / "examples" / "rollouts.jsonl").read_text())
    stdout, seconds = gpu_run.cli(run, "validate", "rollouts.jsonl")  # relative: found from the work dir
    assert seconds > 0 and "rollouts.jsonl" in stdout
    with pytest.raises(gpu_run.StageError, match=r"^exit 2: mismatch validate missing\.jsonl: .*missing\.jsonl"):
        gpu_run.cli(run, "validate", "missing.jsonl")


def test_the_project_installs_from_a_copy_of_the_tree(tmp_path: Path) -> None:
    """What the GPU machine runs first: no index, no dependencies, the package-dir mapping kept."""
    gpu_run.install(tmp_path / "site", tmp_path / "no-wheels", tmp_path, modules=[], project=True)
    done = subprocess.run([sys.executable, "-c", "import mismatch, mismatch.probes, mismatch.reports.build; "
                           "print(mismatch.__file__); print(mismatch.probes.__file__)"],
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path / "site")},
                          capture_output=True, text=True, check=True)
    assert done.stdout.splitlines() == [str(tmp_path / "site" / "mismatch" / "__init__.py"),
                                        str(tmp_path / "site" / "mismatch" / "probes" / "__init__.py")]
    with pytest.raises(gpu_run.StageError, match="msgspec not importable and no wheels in"):
        gpu_run.install(tmp_path / "site2", tmp_path / "no-wheels", tmp_path, modules=["msgspec"], project=False)
