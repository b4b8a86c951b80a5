"""A results dir's tables held to its summary.json (mismatch/results/verify.py) by every reader:
report, gate, recommend. Two real audits of stored log-probs (no model loads) give two runs' dirs;
each case swaps, cuts, doubles or edits one file and expects one line and exit 2.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from mismatch.cli import main
from mismatch.hooks.dump import StepDump, sample_rollout


def _dump(path: Path, seed: int, count: int) -> Path:
    with StepDump(path, framework="test") as dump:
        for i in range(count):
            n = 5 + (i + seed) % 7
            logp = [-0.3 - 0.05 * ((k * (seed + 3)) % 11) for k in range(n)]
            dump.write([sample_rollout(f"r{i}", [1, 2, 3], [20 + (k + seed) % 40 for k in range(n)], [1] * n, logp,
                                       extra_logprobs={"trainer_old": [v - 0.01 * (k % 3) for k, v in enumerate(logp)]})],
                       step=i // 2)
    return path


@pytest.fixture(scope="module")
def runs(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    base = tmp_path_factory.mktemp("verify")
    dirs = []
    for name, seed, count in (("a", 0, 8), ("b", 5, 6)):
        rollouts = _dump(base / f"{name}.jsonl", seed, count)
        out = base / name
        assert main(["audit", str(tiny_checkpoint), "--rollouts", str(rollouts), "--train", "stored:trainer_old",
                     "--infer", "sampler", "--out", str(out)]) == 0
        dirs.append(out)
    return dirs[0], dirs[1]


@pytest.fixture()
def run_a(runs: tuple[Path, Path], tmp_path: Path) -> Path:
    copy = tmp_path / "a"
    shutil.copytree(runs[0], copy)
    return copy


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    return err.strip()


def _tokens(path: Path) -> pa.Table:
    return pq.read_table(path / "tokens.parquet")


def test_report_of_the_run_itself_is_built(run_a, capsys):
    assert main(["report", str(run_a)]) == 0
    assert (run_a / "index.html").stat().st_size > 0


def _another_runs(run_a: Path, runs: tuple[Path, Path]) -> None:
    shutil.copy(runs[1] / "tokens.parquet", run_a / "tokens.parquet")


def _half(run_a: Path, runs: tuple[Path, Path]) -> None:
    table = _tokens(run_a)
    pq.write_table(table.slice(0, table.num_rows // 2), run_a / "tokens.parquet")


def _doubled(run_a: Path, runs: tuple[Path, Path]) -> None:
    table = _tokens(run_a)
    pq.write_table(pa.concat_tables([table, table]), run_a / "tokens.parquet")


def _positive(run_a: Path, runs: tuple[Path, Path]) -> None:
    table = _tokens(run_a)
    column = table.column("logp_sampler").to_pylist()
    column[3] = 0.5
    pq.write_table(table.set_column(table.schema.get_field_index("logp_sampler"), "logp_sampler",
                                    pa.array(column, pa.float64())), run_a / "tokens.parquet")


def _dropped(run_a: Path, runs: tuple[Path, Path]) -> None:
    pq.write_table(_tokens(run_a).drop_columns(["token_id"]), run_a / "tokens.parquet")


def _garbage(run_a: Path, runs: tuple[Path, Path]) -> None:
    (run_a / "tokens.parquet").write_bytes(b"PAR1 not really")


def _empty(run_a: Path, runs: tuple[Path, Path]) -> None:
    (run_a / "tokens.parquet").write_bytes(b"")


def _rollouts_swapped(run_a: Path, runs: tuple[Path, Path]) -> None:
    shutil.copy(runs[1] / "rollouts.parquet", run_a / "rollouts.parquet")


DAMAGE = {"another run's tokens.parquet": (_another_runs, "its content is not what"),
          "half the rows": (_half, "its content is not what"), "the rows doubled": (_doubled, "its content is not what"),
          "a positive log-prob": (_positive, "its content is not what"),
          "a column dropped": (_dropped, "its content is not what"),
          "garbage bytes": (_garbage, "its content is not what"), "an empty file": (_empty, "its content is not what"),
          "another run's rollouts.parquet": (_rollouts_swapped, "rollouts.parquet: its content is not what")}


@pytest.mark.parametrize("command", ["report", "gate", "recommend"])
@pytest.mark.parametrize("case", list(DAMAGE))
def test_a_table_that_is_not_the_recorded_one_is_refused(runs, run_a, capsys, command, case):
    damage, said = DAMAGE[case]
    damage(run_a, runs)
    before = sorted(p.name for p in run_a.iterdir())
    args = [command, str(run_a)] + (["--max", "kl_k3=1"] if command == "gate" else [])
    assert main(args) == 2
    line = _one_line(capsys)
    assert said in line and str(run_a) in line
    assert sorted(p.name for p in run_a.iterdir()) == before  # nothing written beside it


UNRECORDED = {"half the rows": (_half, "rows, but"), "a positive log-prob": (_positive, "logp_sampler holds 0.5"),
              "a column dropped": (_dropped, "missing column(s) token_id"),
              "garbage bytes": (_garbage, "not a readable Parquet table"),
              "an empty file": (_empty, "not a readable Parquet table")}


@pytest.mark.parametrize("case", list(UNRECORDED))
def test_without_recorded_digests_the_tables_are_held_to_the_contract(runs, run_a, capsys, case):
    """A summary with no `shard.files` (by hand, an older mismatch): counts, columns, value ranges."""
    summary = json.loads((run_a / "summary.json").read_text())
    del summary["shard"]["files"]
    (run_a / "summary.json").write_text(json.dumps(summary))
    assert main(["report", str(run_a)]) == 0  # as it is, the page is built
    damage, said = UNRECORDED[case]
    damage(run_a, runs)
    assert main(["report", str(run_a)]) == 2
    assert said in _one_line(capsys)


def test_an_unwritable_report_is_one_line(run_a, capsys):
    (run_a / "index.html").unlink()
    (run_a / "index.html").mkdir()  # what an immutable or foreign file is to os.replace: refused
    assert main(["report", str(run_a)]) == 2
    assert "index.html: cannot be written or read" in _one_line(capsys)


@pytest.mark.parametrize(("edit", "said"), [
    (lambda p: p.update(kl_k3=-0.5), "kl_k3 = -0.5 is impossible"),
    (lambda p: p.update(ess=1.5), "ess = 1.5 is impossible"),
    (lambda p: p.update(n_tokens=-3), "n_tokens = -3 is impossible"),
])
def test_recommend_refuses_the_summaries_gate_refuses(run_a, capsys, edit, said):
    summary = json.loads((run_a / "summary.json").read_text())
    edit(summary["pairs"]["train/sampler"])
    (run_a / "summary.json").write_text(json.dumps(summary))
    for command in (["recommend", str(run_a)], ["gate", str(run_a), "--max", "kl_k3=1"]):
        assert main(command) == 2
        assert said in _one_line(capsys)


def test_recommend_refuses_a_null_pair(run_a, capsys):
    summary = json.loads((run_a / "summary.json").read_text())
    summary["pairs"]["train/sampler"] = None
    (run_a / "summary.json").write_text(json.dumps(summary))
    assert main(["recommend", str(run_a)]) == 2
    assert "pairs/train/sampler: None is not of type 'object'" in _one_line(capsys)  # the schema's word
