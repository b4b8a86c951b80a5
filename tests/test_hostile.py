"""Hostile input: every bad rollouts file or checkpoint is one line on stderr and exit 2.

Never a traceback, a hang, or a results dir left behind. Small bad files live in
tests/data/hostile/; big ones (10 MB lines, 10k-level trees) are generated in tmp_path.
Also: a hypothesis fuzz of the loader, and the safety rules (no pickle, no remote code).
"""

from __future__ import annotations

import json
import os
import pickle
import re
import shutil
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from mismatch.checkpoint import CheckpointInfo, checkpoint_info, load_model
from mismatch.cli import main
from mismatch.errors import CheckpointError, MismatchError, RolloutError
from mismatch.rollouts import MAX_TREE_DEPTH, context_tokens, iter_rollouts, load_rollouts, validate_file

REPO = Path(__file__).resolve().parents[1]
HOSTILE = REPO / "tests" / "data" / "hostile"
VOCAB = 1024  # the tiny checkpoint's; token_other_vocab.jsonl holds a Llama-3-sized id

GOOD = {"id": "r-0", "branches": [{"id": "main", "segments": [
    {"role": "user", "tokens": [1, 2, 3]},
    {"role": "assistant", "tokens": [5, 6], "logprobs": [-0.5, -1.0]}]}]}

# File -> what `mismatch audit` must say after "mismatch: error: <path>". Line 1 of each JSONL file
# is a good rollout, so the error also shows that streaming got past it.
CORPUS = {
    "truncated.jsonl": ":2: invalid JSON: Unterminated string starting at column 135",
    "wrong_types.jsonl": ":2: rollout 'r-1': branches[0].segments[1].tokens: must be an array of integers, got string",
    "bool_logprob.jsonl": ":2: rollout 'r-1': branches[0].segments[1].logprobs: "
                          "logprob at index 0 is not a number: true",
    "segments_object.jsonl": ":2: rollout 'r-1': branches[0].segments: must be an array, got object",
    "token_int64_overflow.jsonl": ":2: rollout 'r-1': branches[0].segments[1].tokens: "
                                  "token id 18446744073709551616 at index 1 does not fit in int64",
    "token_4301_digits.jsonl": ":2: invalid JSON: a number has more than 4300 digits",
    "token_other_vocab.jsonl": ":2: rollout 'r-1': branches[0].segments[1].tokens: "
                               "token id 128000 at index 1 is >= vocab size 1024",
    "negative_token.jsonl": ":2: rollout 'r-1': branches[0].segments[1].tokens: token id -7 at index 1 is negative",
    "negative_fork_at.jsonl": ":2: rollout 'r-1': branches[1].fork_at: fork_at -3 is outside 0..3 "
                              "(the length of parent 'main')",
    "cyclic.jsonl": ":2: rollout 'r-1': branches[1].parent: parent links form a cycle: a -> b -> a",
    "deep_json.jsonl": ":2: invalid JSON: arrays/objects nested too deeply",
    "deep_meta.jsonl": ":2: rollout 'r-1': meta: nested deeper than 64 levels",
    "nan_logprob.jsonl": ":2: rollout 'r-1': branches[0].segments[1].logprobs: logprob at index 1 is nan",
    "inf_logprob.jsonl": ":2: rollout 'r-1': branches[0].segments[1].logprobs: logprob at index 0 is -inf",
    "non_utf8.jsonl": ":2: invalid JSON: not UTF-8 (byte 0xff at offset 10)",
    "gzip_bytes.jsonl": ":1: invalid JSON: not UTF-8 (byte 0x8b at offset 1)",
    "empty.jsonl": ": no rollouts (empty file)",
    "branches_string.parquet": ":1: rollout 'r-1': branches: must be an array, got string",
    "tokens_float.parquet": ":1: rollout 'r-1': branches[0].segments[0].tokens: "
                            "token at index 0 is not an integer: 1.0",
    "fork_at_float.parquet": ":1: rollout 'r-1': branches[1].fork_at: must be an integer or null, got 1.0",
    "truncated.parquet": ": not a readable Parquet file: Parquet magic bytes not found in footer. "
                         "Either the file is corrupted or this is not a parquet file.",
}


def run_cli(args: list[str], capsys) -> tuple[int, str]:
    code = main(args)
    return code, capsys.readouterr().err


def assert_one_line_exit_2(code: int, err: str, expected: str) -> None:
    assert code == 2
    assert "Traceback" not in err
    assert err.count("\n") == 1 and err.endswith("\n"), err[:2000]
    assert err.rstrip("\n") == f"mismatch: error: {expected}"


def audit_fails(checkpoint: Path, rollouts: Path, tmp_path: Path, capsys, *extra: str) -> str:
    """`mismatch audit` on bad input: exit 2, one line, no results dir (nor its temp) left behind."""
    out = tmp_path / "out"
    before = set(tmp_path.iterdir())
    code, err = run_cli(["audit", str(checkpoint), "--rollouts", str(rollouts), "--out", str(out), *extra],
                        capsys)
    assert code == 2, err
    assert "Traceback" not in err, err[:2000]
    assert err.count("\n") == 1, f"not one line: {err[:2000]!r}"
    assert not out.exists()
    assert set(tmp_path.iterdir()) == before  # no .out.tmp-* stage either
    return err.rstrip("\n").removeprefix("mismatch: error: ")


def write_lines(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def chain(depth: int, *, cycle: bool = False) -> dict:
    """A rollout whose branches nest `depth` levels below main (each forks at its parent's end)."""
    segments = [{"role": "user", "tokens": [1]}, {"role": "assistant", "tokens": [2], "logprobs": [-0.1]}]
    branches = [{"id": "b0", "segments": segments}]
    branches += [{"id": f"b{i}", "kind": "subagent", "parent": f"b{i - 1}", "fork_at": 2, "segments": segments}
                 for i in range(1, depth + 1)]
    if cycle:  # close the chain into one cycle through every branch
        branches[0].update(kind="main", parent=f"b{depth}", fork_at=0)
    return {"id": "r-1", "branches": branches}


# ---------------------------------------------------------------------------------------------
# The corpus, through the real CLI


def test_corpus_is_complete():
    assert sorted(p.name for p in HOSTILE.iterdir()) == sorted(CORPUS)


@pytest.mark.parametrize("name", sorted(CORPUS))
def test_bad_rollouts_file_is_one_line_and_exit_2(name, tiny_checkpoint, tmp_path, capsys):
    path = HOSTILE / name
    assert audit_fails(tiny_checkpoint, path, tmp_path, capsys) == f"{path}{CORPUS[name]}"
    # `validate` names the same problem (among every other one) and exits 2 too.
    code, err = run_cli(["validate", str(path), "--vocab-size", str(VOCAB)], capsys)
    assert code == 2 and "Traceback" not in err
    assert f"{path}{CORPUS[name]}" in err.splitlines() or f"mismatch: error: {path}{CORPUS[name]}" in err


def test_rollouts_path_is_a_directory_or_missing(tiny_checkpoint, tmp_path, capsys):
    folder = tmp_path / "rollouts"
    folder.mkdir()
    assert audit_fails(tiny_checkpoint, folder, tmp_path, capsys) == f"{folder}: not a file"
    missing = tmp_path / "nope.jsonl"
    assert audit_fails(tiny_checkpoint, missing, tmp_path, capsys) == f"{missing}: no such file"


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_unreadable_rollouts_file(tiny_checkpoint, tmp_path, capsys):
    path = write_lines(tmp_path / "r.jsonl", [GOOD])
    path.chmod(0)
    assert audit_fails(tiny_checkpoint, path, tmp_path, capsys) == f"{path}: cannot read: Permission denied"


def test_ten_megabyte_lines(tiny_checkpoint, tmp_path, capsys):
    # 2M valid tokens and one bad one at the very end of a single 10 MB line.
    tokens = list(range(1, VOCAB)) * 2000 + ["x"]
    big = {"id": "r-1", "branches": [{"id": "main", "segments": [{"role": "user", "tokens": tokens}]}]}
    path = write_lines(tmp_path / "big.jsonl", [GOOD, big])
    assert path.stat().st_size > 10_000_000
    assert audit_fails(tiny_checkpoint, path, tmp_path, capsys) == (
        f"{path}:2: rollout 'r-1': branches[0].segments[0].tokens: token at index {len(tokens) - 1} "
        'is not an integer: "x"')
    # A 10 MB rollout id and a 10 MB role: the message quotes only their first 60 characters.
    huge = {"id": "r" * 10_000_000, "branches": [{"id": "main", "segments": [{"role": "x" * 100, "tokens": [1]}]}]}
    path = write_lines(tmp_path / "id.jsonl", [huge])
    message = audit_fails(tiny_checkpoint, path, tmp_path, capsys)
    assert message == (f"{path}:1: rollout '{'r' * 60}...': branches[0].segments[0].role: unknown role "
                       f"'{'x' * 60}'... (expected one of: system, user, assistant, tool, summary)")


def test_deep_tree_is_refused_fast_without_recursion(tiny_checkpoint, tmp_path, capsys):
    path = write_lines(tmp_path / "deep.jsonl", [GOOD, chain(10_000)])
    assert audit_fails(tiny_checkpoint, path, tmp_path, capsys) == (
        f"{path}:2: rollout 'r-1': branches[10000].parent: branch 'b10000' is 10000 levels below the root; "
        f"at most {MAX_TREE_DEPTH} are allowed (each level replays its whole context again)")


def test_cycle_through_ten_thousand_branches_is_named_by_its_ends(tiny_checkpoint, tmp_path, capsys):
    path = write_lines(tmp_path / "cycle.jsonl", [chain(9_999, cycle=True)])
    report = validate_file(path)
    assert [str(e) for e in report.errors] == [
        f"{path}:1: rollout 'r-1': branches: no root branch; exactly one branch must have parent null",
        f"{path}:1: rollout 'r-1': branches[0].parent: parent links form a cycle: "
        "b0 -> b9999 -> b9998 -> b9997 -> ... -> b2 -> b1 -> b0 (10000 branches)"]
    assert audit_fails(tiny_checkpoint, path, tmp_path, capsys) == str(report.errors[0])


def test_tree_at_the_depth_limit_loads_without_recursion(tmp_path):
    path = write_lines(tmp_path / "deep.jsonl", [chain(MAX_TREE_DEPTH)])
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(250)  # far below the depth: any per-level recursion would blow up
    try:
        (rollout,) = load_rollouts(path)
        deepest = context_tokens(rollout, f"b{MAX_TREE_DEPTH}")
    finally:
        sys.setrecursionlimit(limit)
    assert deepest.tolist() == [1, 2] * MAX_TREE_DEPTH
    # Every branch's context, as replay plans them: linear per branch, not a scan per level.
    assert sum(len(context_tokens(rollout, b.id)) for b in rollout.branches) == MAX_TREE_DEPTH * (MAX_TREE_DEPTH + 1)


def test_corrupt_parquet_page_is_one_line(tiny_checkpoint, tmp_path, capsys):
    rows = [{**GOOD, "id": f"r-{i}"} for i in range(300)]
    path = tmp_path / "r.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, compression="snappy")
    data = bytearray(path.read_bytes())
    for offset in range(200, len(data) // 2, 97):  # footer intact: the damage shows only when pages are read
        data[offset] ^= 0xFF
    path.write_bytes(bytes(data))
    message = audit_fails(tiny_checkpoint, path, tmp_path, capsys)
    assert message.startswith(f"{path}: not a readable Parquet file: ")


# ---------------------------------------------------------------------------------------------
# Checkpoints that cannot be loaded safely

ROLLOUTS_OK = [GOOD]


def broken_checkpoint(tiny_checkpoint: Path, tmp_path: Path, edit) -> Path:
    root = tmp_path / "ckpt"
    shutil.copytree(tiny_checkpoint, root)
    edit(root)
    return root


def edit_config(**changes):
    def edit(root: Path) -> None:
        config = json.loads((root / "config.json").read_text())
        config.update(changes)
        (root / "config.json").write_text(json.dumps(config))
    return edit


class _Marker:
    """Unpickling this creates a file: proof that a pickle was (or was not) loaded."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def to_pickle_weights(root: Path) -> None:
    (root / "model.safetensors").unlink()
    (root / "pytorch_model.bin").write_bytes(pickle.dumps(_Marker(str(root.parent / "UNPICKLED"))))


def with_remote_code(root: Path) -> None:
    (root / "modeling_evil.py").write_text(f"open({str(root.parent / 'IMPORTED')!r}, 'w')\n")
    edit_config(model_type="evil", auto_map={"AutoConfig": "modeling_evil.EvilConfig",
                                             "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"})(root)


CHECKPOINTS = {
    "pickle_bin": (to_pickle_weights, "{root}: weights are pickle files (.bin/.pt); mismatch loads safetensors "
                                      "only (convert with save_pretrained(safe_serialization=True))"),
    "no_config": (lambda root: (root / "config.json").unlink(), "{root}: not a checkpoint (no config.json)"),
    "config_not_object": (lambda root: (root / "config.json").write_text("[1024]"),
                          "{root}/config.json: must be a JSON object"),
    "config_deep": (lambda root: (root / "config.json").write_text("[" * 100_000 + "]" * 100_000),
                    "{root}/config.json: invalid JSON: arrays/objects nested too deeply"),
    "vocab_bool": (edit_config(vocab_size=True), "{root}/config.json: vocab_size missing or not a positive integer"),
    # config.json is decoded once into typed records (checkpoint.ModelConfig): a key read of another type is named
    "layers_text": (edit_config(num_hidden_layers="2"),
                    "{root}/config.json: num_hidden_layers: expected `int | null`, got `str`"),
    "dtype_unknown": (edit_config(dtype="float8_e9"),
                      "{root}/config.json: dtype 'float8_e9' is not a floating-point torch dtype "
                      "(pass dtype=float32 or bfloat16 in the engine spec)"),
    # config.json (the tokenizer's vocab) says 5000, the weights hold 1024 rows: ids 1024..4999
    # would pass validation and index past the embedding.
    "vocab_larger_than_weights": (edit_config(vocab_size=5000),
                                  "{root}: weight lm_head.weight has shape [1024, 128] but config.json implies "
                                  "[5000, 128] (first of 2 mismatched)"),
    "remote_code": (with_remote_code, "{root}: cannot load the model: The repository {root} contains custom code "
                                      "which must be executed to correctly load the model."),
    "corrupt_safetensors": (lambda root: (root / "model.safetensors").write_bytes(b"\x10" + b"\x00" * 7 + b"{garbage"),
                            "{root}: cannot load the model: Error while deserializing header:"),
    "truncated_safetensors": (lambda root: (root / "model.safetensors").write_bytes(
        (root / "model.safetensors").read_bytes()[:10_000]),
        "{root}: cannot load the model: Error while deserializing"),
    "bad_architecture": (edit_config(num_attention_heads=3),
                         "{root}: cannot load the model: Class validation error for validator 'validate_architecture': "
                         "ValueError: The hidden size (128) is not a multiple of the number of attention heads (3)."),
    "fewer_layers_than_weights": (edit_config(num_hidden_layers=1),
                                  "{root}: weight model.layers.1.input_layernorm.weight is not used by the model "
                                  "config.json describes (first of 9 unused)"),
    "more_layers_than_weights": (edit_config(num_hidden_layers=3),
                                 "{root}: weight model.layers.2.input_layernorm.weight is missing from the "
                                 "safetensors files (first of 9 missing); refusing to replay random weights"),
}


@pytest.mark.parametrize("case", sorted(CHECKPOINTS))
def test_bad_checkpoint_is_one_line_and_exit_2(case, tiny_checkpoint, tmp_path, capsys):
    edit, expected = CHECKPOINTS[case]
    root = broken_checkpoint(tiny_checkpoint, tmp_path, edit)
    rollouts = write_lines(tmp_path / "r.jsonl", ROLLOUTS_OK)
    # --json: no progress bar, so this checks the loader's message alone (the test below checks the bar).
    message = audit_fails(root, rollouts, tmp_path, capsys, "--json")
    assert message.startswith(expected.format(root=root)), message
    assert len(message) < 500
    assert not (tmp_path / "UNPICKLED").exists() and not (tmp_path / "IMPORTED").exists()


def test_checkpoint_that_fails_to_load_prints_no_progress_bar(tiny_checkpoint, tmp_path, capsys):
    # The error comes while the first engine loads; no progress bar may have been drawn by then.
    edit, expected = CHECKPOINTS["vocab_larger_than_weights"]
    root = broken_checkpoint(tiny_checkpoint, tmp_path, edit)
    rollouts = write_lines(tmp_path / "r.jsonl", ROLLOUTS_OK)
    assert audit_fails(root, rollouts, tmp_path, capsys) == expected.format(root=root)


def test_load_model_itself_refuses_pickle_weights(tiny_checkpoint, tmp_path):
    # An info made before the weights were swapped (or by hand) must not get past load_model either.
    root = broken_checkpoint(tiny_checkpoint, tmp_path, lambda root: None)
    info = checkpoint_info(root)
    to_pickle_weights(root)
    with pytest.raises(CheckpointError, match=r"weights are pickle files \(\.bin/\.pt\)"):
        load_model(info, dtype="float32", attn="sdpa", device="cpu")
    with pytest.raises(CheckpointError, match=r"weights are pickle files"):
        load_model(CheckpointInfo(path=root, model_type="llama", vocab_size=VOCAB, dtype="float32"),
                   dtype="auto", attn="sdpa", device="cpu")
    assert not (tmp_path / "UNPICKLED").exists()


def test_tokenizer_from_another_model(tiny_checkpoint, tmp_path, capsys):
    # Rollouts tokenized with a 128k-vocab tokenizer, audited against a 1024-vocab checkpoint.
    other = {"id": "r-1", "branches": [{"id": "main", "segments": [
        {"role": "user", "tokens": [128000, 882, 1024, 1023]}]}]}
    path = write_lines(tmp_path / "r.jsonl", [GOOD, other])
    assert audit_fails(tiny_checkpoint, path, tmp_path, capsys) == (
        f"{path}:2: rollout 'r-1': branches[0].segments[0].tokens: token id 128000 at index 0 is >= vocab size "
        "1024 (first of 2 out of vocab)")


def test_trust_remote_code_is_never_turned_on():
    pattern = re.compile(r"trust_remote_code['\"]?\s*[=:]\s*True")
    sources = [p for folder in ("mismatch", "probes", "reports") for p in (REPO / folder).rglob("*.py")]
    assert len(sources) > 20
    offenders = [f"{p.relative_to(REPO)}:{n}" for p in sources
                 for n, line in enumerate(p.read_text().splitlines(), start=1) if pattern.search(line)]
    assert offenders == []
    # And the loaders say False explicitly rather than relying on a default.
    checkpoint_source = (REPO / "mismatch" / "checkpoint.py").read_text()
    assert checkpoint_source.count("trust_remote_code=False") == 2


# ---------------------------------------------------------------------------------------------
# Fuzz: whatever the bytes, the loader reports; only MismatchError may escape


GOOD_LINE = json.dumps({**GOOD, "branches": [*GOOD["branches"], {
    "id": "sub", "kind": "subagent", "parent": "main", "fork_at": 3,
    "segments": [{"role": "tool", "tokens": [9]}, {"role": "summary", "tokens": [4], "logprobs": [-2.0],
                                                   "extra_logprobs": {"ref": [-1.5]}}]}]}).encode()

json_scalars = (st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70) | st.floats()
                | st.text(max_size=4) | st.sampled_from(["main", "assistant", "user", "sub", "subagent"]))
json_values = st.recursive(json_scalars, lambda kids: st.lists(kids, max_size=4) | st.dictionaries(
    st.sampled_from(["id", "branches", "segments", "role", "tokens", "logprobs", "parent", "fork_at", "kind",
                     "trainable", "meta", "extra_logprobs"]) | st.text(max_size=3), kids, max_size=5),
    max_leaves=25)


@st.composite
def mutated_line(draw) -> bytes:
    """A valid rollout line after a few byte-level edits: cuts, flips, inserts, splices."""
    line = bytearray(GOOD_LINE)
    for _ in range(draw(st.integers(1, 4))):
        at = draw(st.integers(0, len(line)))
        op = draw(st.sampled_from(["cut", "flip", "insert", "splice"]))
        if op == "cut":
            del line[at:]
        elif op == "flip" and at < len(line):
            line[at] = draw(st.integers(0, 255))
        elif op == "insert":
            line[at:at] = draw(st.sampled_from([b"[", b"{", b"-", b"1e999", b"NaN", b"\xff", b"9" * 5000, b"\"",
                                                b",", b"null", b"\n"]))
        else:
            line[at:at] = GOOD_LINE[draw(st.integers(0, len(GOOD_LINE))):][:draw(st.integers(0, 50))]
    return bytes(line)


lines = st.one_of(
    mutated_line(),
    json_values.map(lambda v: json.dumps(v).encode()),
    st.binary(max_size=200),
    st.just(b"[" * 5000),
)


# The module-scoped dir is rewritten per example (fine); the strategies filter and grow on purpose.
FUZZ_HEALTH_CHECKS_OFF = [HealthCheck.function_scoped_fixture, HealthCheck.filter_too_much, HealthCheck.too_slow,
                          HealthCheck.data_too_large]


@pytest.fixture(scope="module")
def fuzz_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


def load_everything(path: Path) -> None:
    """Run both entry points; any exception other than a MismatchError fails the test."""
    report = validate_file(path, vocab_size=VOCAB)
    assert all(isinstance(e, RolloutError) and "\n" not in str(e) for e in report.errors)
    assert report.ok == (not report.errors)
    try:
        for rollout in iter_rollouts(path, vocab_size=VOCAB):
            for branch in rollout.branches:
                context_tokens(rollout, branch.id)
    except MismatchError as e:
        assert "\n" not in str(e)


@settings(max_examples=300, deadline=None, suppress_health_check=FUZZ_HEALTH_CHECKS_OFF)
@given(st.lists(lines, max_size=6))
def test_fuzz_jsonl_loader(fuzz_dir, content):
    path = fuzz_dir / "fuzz.jsonl"
    path.write_bytes(b"\n".join(content))
    load_everything(path)


@settings(max_examples=60, deadline=None, suppress_health_check=FUZZ_HEALTH_CHECKS_OFF)
@given(st.lists(json_values.filter(lambda v: isinstance(v, dict) and v), min_size=1, max_size=3),
       st.data())
def test_fuzz_parquet_loader(fuzz_dir, rows, data):
    try:  # Arrow must be able to infer one schema for the rows; skip the ones it refuses
        table = pa.Table.from_pylist(rows)
    except (pa.ArrowException, ValueError, TypeError, OverflowError):
        assume(False)
    path = fuzz_dir / "fuzz.parquet"
    try:
        pq.write_table(table, path)
    except (pa.ArrowException, ValueError):
        assume(False)
    if data.draw(st.booleans()):  # and sometimes damage the bytes too
        raw = bytearray(path.read_bytes())
        for _ in range(data.draw(st.integers(1, 8))):
            raw[data.draw(st.integers(0, len(raw) - 1))] = data.draw(st.integers(0, 255))
        path.write_bytes(bytes(raw))
    try:
        load_everything(path)
    except MismatchError:  # an unreadable file raises at open, by design
        pass


def test_depth_is_checked_before_parsing_and_ignores_brackets_in_strings(tmp_path):
    from mismatch.rollouts.decode import MAX_JSON_DEPTH, deeper_than as _deeper_than

    deep = "[" * (MAX_JSON_DEPTH + 1) + "]" * (MAX_JSON_DEPTH + 1)
    assert _deeper_than(deep, MAX_JSON_DEPTH) and not _deeper_than(deep[1:-1], MAX_JSON_DEPTH)
    # Brackets in strings, escaped quotes and escaped backslashes: a flat object, many '[' characters.
    text = json.dumps({"code": "[" * 1000, "quote": '\\"[[[', "slash": "\\\\" + "{" * 500})
    assert not _deeper_than(text, MAX_JSON_DEPTH) and not _deeper_than(text.encode(), MAX_JSON_DEPTH)
    assert json.loads(text)["code"] == "[" * 1000


def test_other_commands_inputs_are_one_line_too(tiny_checkpoint, tmp_path, capsys):
    """A lone-surrogate id, over-deep JSON handed to report and import, a file where a dir belongs."""
    surrogate = tmp_path / "surrogate.jsonl"
    surrogate.write_text(json.dumps(GOOD).replace('"r-0"', '"\\ud800"') + "\n")
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000)
    results = tmp_path / "results"
    results.mkdir()
    (results / "summary.json").write_text("[" * 100_000)
    cases = [
        (["audit", str(tiny_checkpoint), "--rollouts", str(surrogate), "--out", str(tmp_path / "o")],
         f"{surrogate}:1: id: must be valid Unicode text"),
        (["report", str(deep)], f"{deep}: not a directory"),
        (["report", str(results)], f"{results / 'summary.json'}: not valid JSON (nested too deeply)"),
        (["import", "verl", str(deep), "--out", str(tmp_path / "x.jsonl")], f"{deep}: invalid JSON: maximum recursion"),
        (["gate", str(results), "--max", "kl_k3=1"], "not valid JSON (nested too deeply)"),
    ]
    for args, message in cases:
        assert main(args) == 2, args
        err = capsys.readouterr().err
        assert err.startswith("mismatch: error: ") and message in err and "Traceback" not in err, err
    assert not (tmp_path / "o").exists() and not (tmp_path / "x.jsonl").exists()
