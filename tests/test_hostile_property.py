"""No traceback anywhere: hostile files and strings thrown at every command and reader (hypothesis).

Each example runs one `mismatch` command in-process (`cli.main`; `record`, a server, in a subprocess
with a timeout) and asserts: the exit code is 0, 1, 2 or 3; a failure says one line on stderr;
no Python traceback (an exception escaping `main` is one); nothing half-written (no results dir
without its summary.json, no staging or work dir, no temp file, no output file on a failure).

Covered (one test each, its inputs drawn from HOSTILE_BYTES, hostile text and numbers):
- audit: the rollouts file (stored log-probs: no model loads); --clip-eps, --block-size, --shard;
- audit --for and recommend --for (SETTING=VALUE strings, versions, unknown names and modes);
- audit --train FRAMEWORK:FILE, each config reader (verl, trl, openrlhf, slime, prime-rl), the file's
  bytes hostile (on a missing checkpoint: nothing replays whatever the reader derives);
- diff: the rollouts file, with stored sources;
- merge: shard dirs whose summary.json / tokens.parquet are hostile;
- gate: summary.json hostile, --max / --min strings; gate --trend with hostile dirs and limits;
- trend: step dirs with hostile names, summary.json and rollouts.parquet, --pair/--metric/--order;
- report, recommend: a results dir with hostile summary.json, tokens.parquet or rollouts.parquet;
- import: each format's dump hostile, --out a dir, /proc or an existing file;
- validate: the file hostile (JSONL and Parquet);
- record: hostile --port/--idle-seconds/--upstream with an --out that cannot be written.
Bounded for CI: cheap inputs that fail (or pass) before any model loads, few examples each,
deadline off (the first call of a command pays its imports), about 60 s in all.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from mismatch.cli import main
from mismatch.hooks.dump import StepDump, sample_rollout

EXITS = {0, 1, 2, 3}
FRAMEWORKS = ("verl", "trl", "openrlhf", "slime", "prime-rl")
IMPORT_FORMATS = ("verl", "prime-rl", "skyrl", "verifiers", "slime")

# Bytes that have broken readers before: empty, binary, BOM, NUL, truncated and deep JSON, NaN,
# huge numbers, YAML anchors and tags, TOML tables, shell in a script, Parquet's magic alone.
HOSTILE_BYTES = [
    b"", b"\x00" * 64, b"\xff\xfe\x00garbage", b"\xef\xbb\xbf{}", b"PAR1", b"PAR1\x00\x00\x00\x00PAR1",
    b"{", b"[" * 5000 + b"]" * 5000, b'{"a":' * 3000 + b"1" + b"}" * 3000, b"NaN", b"1e999", b"-0", b"null",
    b'{"id": "x", "branches": []}', b'{"id": "x", "meta": {"step": 1e400}, "branches": [{"id": "m"}]}',
    b'{"id":"r","branches":[{"id":"main","segments":[{"role":"user","tokens":[1,2]},'
    b'{"role":"assistant","tokens":[3],"logprobs":[-0.5],"extra_logprobs":{"t":[-0.4]}}]}]}\n',
    b"a: &a [1]\nb: &b [*a, *a, *a, *a]\nc: &c [*b, *b, *b, *b]\nd: [*c, *c, *c, *c]\n",
    b"dtype: !!python/object/apply:os.system ['echo pwned']\n", b"x: ${oc.env:HOME}\ny: ${y}\n",
    b"[model]\nname = 1\n[[a]]\n" * 3, b"python -m verl.trainer.main_ppo actor_rollout_ref.rollout.name=`id`\n",
    b"--rollout-num-gpus-per-engine 0 --rollout-temperature hot\n", b"temperature: hot\ntop_p: -1\n",
    "caf\u00e9 \u202e\u0663\ud7ff".encode(), b"\r\n\r\n", b"{}\n" * 3, b"[]",
]

TEXT = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=40)
NUMBERS = st.sampled_from(["0", "-2", "1e999", "inf", "-inf", "nan", "1_2", "0x10", "", " ", "1.5", "2", "9" * 30,
                           "\u0663", "1,2", "true", "💥"])
HOSTILE = st.one_of(st.sampled_from(HOSTILE_BYTES), st.binary(max_size=300))
# No shrinking: a failure is reported as found (its inputs are small already), so a failing run is
# as bounded in time as a passing one.
SETTINGS = settings(max_examples=8, deadline=None, derandomize=True, database=None,
                    phases=(Phase.explicit, Phase.generate),
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
# The bytes a config reader meets: the YAML, TOML and shell cases, binary, empty, deep.
CONFIG_BYTES = [data for data in HOSTILE_BYTES if data[:1] in (b"", b"\x00", b"\xff", b"[", b"{", b"a", b"d", b"x",
                                                                 b"p", b"-", b"t", b"c")]


def _rollout_line(i: int) -> str:
    rollout = sample_rollout(f"r{i}", [1, 2, 3], [20 + i, 21, 22, 23], [1] * 4, [-0.5, -0.6, -0.7, -0.8],
                             extra_logprobs={"trainer": [-0.55, -0.6, -0.72, -0.8]})
    return json.dumps(rollout)


@pytest.fixture(scope="module")
def good_run(tiny_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One real audit of stored log-probs: the results dir whose files the hostile ones replace."""
    base = tmp_path_factory.mktemp("good")
    rollouts = base / "r.jsonl"
    with StepDump(rollouts, framework="test") as dump:
        for i in range(6):
            dump.write([json.loads(_rollout_line(i))], step=i // 3)
    out = base / "step_0"
    assert main(["audit", str(tiny_checkpoint), "--rollouts", str(rollouts), "--train", "stored:trainer",
                 "--infer", "sampler", "--out", str(out)]) == 0
    return out


def _run(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """`mismatch ARGS` in this process: its exit code and stderr; an exception escaping is a traceback."""
    capsys.readouterr()
    try:
        code = main(args)
    except SystemExit as exit_:  # click's own exits
        code = exit_.code if isinstance(exit_.code, int) else 2
    except BaseException as error:  # noqa: BLE001 - what the test is for
        pytest.fail(f"mismatch {' '.join(map(repr, args))[:300]}: traceback: {type(error).__name__}: {error}"[:1000])
    err = capsys.readouterr().err
    return code, err


def _check(code: int, err: str, args: list[str]) -> None:
    shown = " ".join(map(repr, args))[:300]
    assert code in EXITS, f"{shown}: exit {code}: {err[:500]}"
    assert "Traceback" not in err, f"{shown}: {err[-1500:]}"
    if code not in (0, 1):
        lines = [line for line in err.split("\n") if line.strip()]
        if args[0] == "validate" and not lines[0].startswith("mismatch: error:"):  # one located line per problem
            assert all(line.startswith(args[1]) for line in lines), f"{shown}: {err[-1500:]}"
            return
        assert len(lines) == 1, f"{shown}: exit {code}, {len(lines)} lines on stderr:\n{err[-1500:]}"


def _leftovers(root: Path, allowed: set[Path]) -> list[Path]:
    """What a failed command left under `root` besides the inputs: staging, work and temp files, a
    results dir without summary.json."""
    found = []
    for path in root.rglob("*"):
        if any(path == a or a in path.parents for a in allowed):
            continue
        found.append(path)
    return found


@pytest.fixture()
def scratch():
    """A fresh directory per hypothesis example (function fixtures are shared across examples)."""
    made = []

    def new() -> Path:
        made.append(Path(tempfile.mkdtemp(prefix="hostile-")))
        return made[-1]
    yield new
    for path in made:
        shutil.rmtree(path, ignore_errors=True)


def _nothing_half_written(code: int, root: Path, inputs: set[Path]) -> None:
    left = _leftovers(root, inputs)
    if code != 0:
        assert left == [], f"exit {code} left {[str(p) for p in left][:5]}"
    else:
        for path in left:
            assert not path.name.startswith((".", "tmp")) or path.name == ".mismatch", path


# --- the rollouts readers -------------------------------------------------------------------------


AUDIT_EXTRAS = [[], ["--clip-eps", "0.2"], ["--clip-eps", "nan"], ["--block-size", "0"], ["--shard", "3/2"],
                ["--skip-invalid"], ["--for", "verl:rollout_is_threshold=1_2"]]


def _rollouts_case(tiny_checkpoint: Path, capsys, root: Path, data: bytes, suffix: str, extra: list[str]) -> None:
    rollouts = root / f"r{suffix}"
    rollouts.write_bytes(data)
    out = root / "out"
    for args in (["validate", str(rollouts)],
                 ["audit", str(tiny_checkpoint), "--rollouts", str(rollouts), "--train", "stored:t", "--infer",
                  "sampler", "--out", str(out), *extra]):
        code, err = _run(args, capsys)
        _check(code, err, args)
        _nothing_half_written(code, root, {rollouts, out} if code == 0 else {rollouts})


@pytest.mark.parametrize("index", range(len(HOSTILE_BYTES)))
def test_audit_and_validate_on_each_hostile_rollouts_file(tiny_checkpoint, capsys, scratch, index):
    suffix = ".parquet" if index % 3 == 2 else ".jsonl"
    _rollouts_case(tiny_checkpoint, capsys, scratch(), HOSTILE_BYTES[index], suffix,
                   AUDIT_EXTRAS[index % len(AUDIT_EXTRAS)])


@SETTINGS
@given(data=st.binary(max_size=300), suffix=st.sampled_from([".jsonl", ".parquet"]),
       extra=st.sampled_from(AUDIT_EXTRAS))
def test_audit_and_validate_on_random_bytes(tiny_checkpoint, capsys, scratch, data, suffix, extra):
    _rollouts_case(tiny_checkpoint, capsys, scratch(), data, suffix, extra)


@SETTINGS
@given(data=HOSTILE)
def test_diff_on_a_hostile_rollouts_file(tiny_checkpoint, capsys, scratch, data):
    root = scratch()
    rollouts = root / "r.jsonl"
    rollouts.write_bytes(data)
    args = ["diff", str(tiny_checkpoint), "--rollouts", str(rollouts), "--a", "stored:x", "--b", "stored:y",
            "--reference", "stored:z", "--out", str(root / "out")]
    code, err = _run(args, capsys)
    _check(code, err, args)
    _nothing_half_written(code, root, {rollouts, root / "out"} if code == 0 else {rollouts})


# --- config readers and --for ---------------------------------------------------------------------


CONFIG_SUFFIX = {"verl": ".yaml", "trl": ".yaml", "openrlhf": ".sh", "slime": ".sh", "prime-rl": ".toml"}


def _config_case(capsys, root: Path, framework: str, data: bytes, suffix: str) -> None:
    config = root / f"config{suffix}"
    config.write_bytes(data)
    rollouts = root / "r.jsonl"
    rollouts.write_text(_rollout_line(0) + "\n")
    # A missing checkpoint and --infer sampler: whatever the reader derives, nothing replays or loads.
    args = ["audit", str(root / "no-checkpoint"), "--rollouts", str(rollouts), "--train", f"{framework}:{config}",
            "--infer", "sampler", "--out", str(root / "out")]
    code, err = _run(args, capsys)
    _check(code, err, args)
    assert code != 0
    _nothing_half_written(code, root, {config, rollouts})


@pytest.mark.parametrize("index", range(len(CONFIG_BYTES) * 2))
def test_each_config_reader_on_each_hostile_file(capsys, scratch, index):
    """Each hostile config file through two readers (all five in turn over the list)."""
    framework = FRAMEWORKS[(index // 2 + (index % 2) * 2) % len(FRAMEWORKS)]
    data = CONFIG_BYTES[index // 2]
    _config_case(capsys, scratch(), framework, data, CONFIG_SUFFIX[framework])


@SETTINGS
@given(framework=st.sampled_from(FRAMEWORKS), data=st.binary(max_size=300),
       suffix=st.sampled_from([".yaml", ".sh", ".toml", ".json", ""]))
def test_each_config_reader_on_random_bytes(capsys, scratch, framework, data, suffix):
    _config_case(capsys, scratch(), framework, data, suffix)


@SETTINGS
@given(framework=st.sampled_from(FRAMEWORKS), version=st.sampled_from(["", "==0.9.10", "==9.9", "==💥", "=="]),
       setting=TEXT, value=st.one_of(NUMBERS, TEXT), command=st.sampled_from(["recommend", "audit"]))
def test_for_on_hostile_settings(good_run, tiny_checkpoint, capsys, scratch, framework, version, setting, value,
                                 command):
    root = scratch()
    target = f"{framework}{version}:{setting}={value}"
    if command == "recommend":
        args = ["recommend", str(good_run), "--for", target]
    else:  # refused before any replay, or it runs on stored log-probs only
        args = ["audit", str(root / "no-checkpoint"), "--rollouts", str(good_run / "summary.json"), "--train",
                "stored:t", "--infer", "sampler", "--out", str(root / "out"), "--for", target]
    code, err = _run(args, capsys)
    _check(code, err, args)
    _nothing_half_written(code, root, set())


# --- results dirs: report, recommend, gate, merge, trend ------------------------------------------

RESULTS_FILES = ("summary.json", "tokens.parquet", "rollouts.parquet")
SUMMARY_EDITS = st.one_of(HOSTILE, st.sampled_from([
    json.dumps({"schema": "mismatch.summary/v1", "command": "audit", "pairs": {"train/sampler": None}}).encode(),
    json.dumps({"schema": "mismatch.summary/v1", "command": "audit", "pairs": {"train/sampler": {"kl_k3": -1}},
                "verdicts": 7, "diagnosis": "x", "recommendations": {"a": 1}}).encode(),
    json.dumps({"schema": "mismatch.summary/v1", "command": "audit", "pairs": {"train/sampler": {"ess": 1.5}},
                "shard": {"files": {"tokens.parquet": 5}}}).encode(),
    json.dumps({"schema": "mismatch.summary/v1", "command": "audit", "pairs": {},
                "verdicts": {"train/sampler": []}, "diagnosis": {"causes": [1, None]},
                "recommendations": [None, "x"], "counts": "many"}).encode(),
]))


def _damaged(good_run: Path, root: Path, name: str, data: bytes, dir_name: str = "run") -> Path:
    copy = root / dir_name
    shutil.copytree(good_run, copy)
    (copy / name).write_bytes(data)
    return copy


def _results_inputs(copy: Path) -> set[Path]:
    return {copy}


@SETTINGS
@given(name=st.sampled_from(RESULTS_FILES), data=SUMMARY_EDITS,
       command=st.sampled_from(["report", "recommend", "gate", "gate-min", "recommend-for"]))
def test_report_recommend_gate_on_a_hostile_results_dir(good_run, capsys, scratch, name, data, command):
    root = scratch()
    copy = _damaged(good_run, root, name, data)
    args = {"report": ["report", str(copy)], "recommend": ["recommend", str(copy)],
            "recommend-for": ["recommend", str(copy), "--for", "trl:vllm_importance_sampling_mode=token_mask"],
            "gate": ["gate", str(copy), "--max", "kl_k3=0.5"], "gate-min": ["gate", str(copy), "--min", "ess=0.5"]}[command]
    code, err = _run(args, capsys)
    _check(code, err, args)
    _nothing_half_written(code, root, _results_inputs(copy))


SUMMARY_JUNK = [
    {"pairs": {"train/sampler": None}}, {"pairs": {"train/sampler": {"kl_k3": -1}}},
    {"pairs": {"train/sampler": {"ess": 1.5}}}, {"pairs": {"train/sampler": {"n_tokens": -1}}},
    {"verdicts": 7}, {"verdicts": {"train/sampler": []}}, {"diagnosis": "x"}, {"diagnosis": {"causes": [1, None]}},
    {"recommendations": {"a": 1}}, {"recommendations": [None, "x"]}, {"counts": "many"}, {"engines": []},
    {"engines": {"sampler": {"meta": 5}}}, {"shard": {"files": {"tokens.parquet": 5}}}, {"shard": 3},
    {"command": None}, {"checkpoint": 5}, {"strata": [1]}, {"framework_metrics": {"train/sampler": 3}},
]


JUNK_COMMANDS = ("report", "recommend", "recommend-for", "gate", "trend")


@pytest.mark.parametrize("index", range(len(SUMMARY_JUNK) * 2))
def test_each_command_on_each_summary_junk(good_run, capsys, scratch, index):
    """Each junk summary through two readers (all five in turn over the list)."""
    junk, command = index // 2, JUNK_COMMANDS[(index // 2 + (index % 2) * 3) % len(JUNK_COMMANDS)]
    root = scratch()
    copy = root / "step_1"
    shutil.copytree(good_run, copy)
    summary = json.loads((copy / "summary.json").read_text())
    summary.update(SUMMARY_JUNK[junk])
    (copy / "summary.json").write_text(json.dumps(summary))
    args = {"report": ["report", str(copy)], "recommend": ["recommend", str(copy)],
            "recommend-for": ["recommend", str(copy), "--for", "trl:vllm_importance_sampling_mode=token_mask"],
            "gate": ["gate", str(copy), "--max", "kl_k3=0.5"], "trend": ["trend", str(good_run), str(copy)]}[command]
    code, err = _run(args, capsys)
    _check(code, err, args)
    _nothing_half_written(code, root, {copy})


@SETTINGS
@given(limit=st.one_of(TEXT, NUMBERS.map(lambda v: f"kl_k3={v}"), TEXT.map(lambda t: f"{t}=1")),
       flag=st.sampled_from(["--max", "--min"]))
def test_gate_on_hostile_limits(good_run, capsys, flag, limit):
    args = ["gate", str(good_run), flag, limit]
    code, err = _run(args, capsys)
    _check(code, err, args)


@SETTINGS
@given(names=st.lists(st.sampled_from(["step_1", "step_2", "latest", "step_-3", "step_1e3", "step_\u0663", "12",
                                       "step_3"]), min_size=1, max_size=3, unique=True),
       damaged=st.sampled_from([None, *RESULTS_FILES]), data=SUMMARY_EDITS,
       extra=st.sampled_from([[], ["--order", "given"], ["--order", "x"], ["--metric", "verl:x"], ["--pair", "a/b"],
                              ["--report", "."], ["--report", "/proc/t.html"], ["--json"]]),
       gate=st.booleans())
def test_trend_and_gate_trend_on_hostile_step_dirs(good_run, capsys, scratch, names, damaged, data, extra, gate):
    root = scratch()
    dirs = []
    for i, name in enumerate(names):
        copy = root / name
        shutil.copytree(good_run, copy)
        if damaged is not None and i == len(names) - 1:
            (copy / damaged).write_bytes(data)
        dirs.append(copy)
    if gate:
        args = ["gate", "--trend", *map(str, dirs), "--max-slope", "kl_k3=1",
                *(extra if extra and extra[0] == "--order" else [])]
    else:
        args = ["trend", *map(str, dirs), *[str(root / e) if e == "." else e for e in extra]]
    code, err = _run(args, capsys)
    _check(code, err, args)
    if code != 0:
        _nothing_half_written(code, root, set(dirs))


@SETTINGS
@given(damaged=st.sampled_from(RESULTS_FILES), data=SUMMARY_EDITS)
def test_merge_of_hostile_shards(good_run, capsys, scratch, damaged, data):
    root = scratch()
    first = _damaged(good_run, root, damaged, data, "shard0")
    second = root / "shard1"
    shutil.copytree(good_run, second)
    args = ["merge", str(first), str(second), "--out", str(root / "merged")]
    code, err = _run(args, capsys)
    _check(code, err, args)
    _nothing_half_written(code, root, {first, second} | ({root / "merged"} if code == 0 else set()))


# --- import and record ----------------------------------------------------------------------------


@SETTINGS
@given(fmt=st.sampled_from([*IMPORT_FORMATS, "💥", ""]), data=HOSTILE,
       suffix=st.sampled_from([".jsonl", ".json", ".parquet", ".pt", ""]),
       out=st.sampled_from(["ok", "dir", "proc", "exists"]))
def test_import_of_a_hostile_dump(capsys, scratch, fmt, data, suffix, out):
    root = scratch()
    dump = root / f"dump{suffix}"
    dump.write_bytes(data)
    target = {"ok": root / "out.jsonl", "dir": root, "proc": Path("/proc/mismatch-out.jsonl"),
              "exists": dump}[out]
    args = ["import", fmt, str(dump), "--out", str(target)]
    code, err = _run(args, capsys)
    _check(code, err, args)
    _nothing_half_written(code, root, {dump, root / "out.jsonl"} if code == 0 else {dump})
    assert dump.read_bytes() == data  # the input is never overwritten without --force


@settings(max_examples=4, deadline=None, derandomize=True, database=None, phases=(Phase.explicit, Phase.generate),
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(port=NUMBERS, idle=NUMBERS, upstream=st.sampled_from(["", "ftp://x", "http://", "💥", "http://127.0.0.1:1"]),
       out=st.sampled_from(["dir", "proc", "exists"]))
def test_record_with_hostile_options_and_an_unwritable_out(scratch, port, idle, upstream, out):
    """`record` serves until stopped once its inputs pass: here --out never can, so it must refuse
    (in a subprocess: a server that started anyway would hang the test, the timeout says so)."""
    root = scratch()
    existing = root / "taken.jsonl"
    existing.write_text("keep\n")
    target = {"dir": root, "proc": Path("/proc/mismatch-rec.jsonl"), "exists": existing}[out]
    args = ["record", "--upstream", upstream, "--out", str(target), "--port", port, "--idle-seconds", idle]
    done = subprocess.run([sys.executable, "-m", "mismatch", *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "MISMATCH_DEBUG": ""})
    _check(done.returncode, done.stderr, args)
    assert done.returncode == 2
    assert existing.read_text() == "keep\n"
    assert _leftovers(root, {existing}) == []


def test_import_on_a_full_disk_is_exit_3_and_leaves_nothing(tmp_path):
    """A real write limit (RLIMIT_FSIZE, the kernel's EFBIG as a full disk gives ENOSPC) under `import`:
    one line, exit 3 (the machine's fault, as audit says it), no temp file left."""
    dump = tmp_path / "dump.jsonl"
    rows = [{"tokens": list(range(1, 200)), "response_length": 190, "loss_mask": [1] * 190,
             "rollout_log_probs": [-0.5] * 190} for _ in range(20)]
    dump.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
    out = tmp_path / "out" / "v1.jsonl"
    out.parent.mkdir()
    code = ("import resource, signal, sys\n"
            "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
            "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))\n"
            "from mismatch.cli import main\n"
            f"sys.exit(main(['import', 'slime', {str(dump)!r}, '--out', {str(out)!r}]))\n")
    # No bytecode written under the limit: importlib ignores the short write and leaves a truncated
    # .pyc of mismatch's modules (4096 bytes) that every later import of them fails on.
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    lines = [line for line in done.stderr.split("\n") if line.strip()]
    assert done.returncode == 3, done.stderr[-2000:]
    assert len(lines) == 1 and "Traceback" not in done.stderr and str(out) in lines[0]
    assert list(out.parent.iterdir()) == []
