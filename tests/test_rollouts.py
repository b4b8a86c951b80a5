"""Rollout format v1: loading, the branch tree, and the exact message for each kind of bad input."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mismatch.errors import RolloutError
from mismatch.rollouts import (
    BRANCH_KINDS,
    ROLES,
    Rollout,
    check_rollout,
    context_tokens,
    full_routed_experts,
    full_tokens,
    iter_rollouts,
    load_rollouts,
    validate_file,
)


def make_rollout(rollout_id: str = "r-1") -> dict:
    """A 3-level tree: main <- sub-1 (forks at 5) <- sub-2 (forks at 3)."""
    return {
        "id": rollout_id,
        "meta": {"checkpoint": "step-120", "sampler": {"engine": "vllm", "temperature": 1.0}},
        "messages": [{"role": "user", "content": "hi"}],
        "branches": [
            {"id": "main", "kind": "main", "parent": None, "fork_at": None, "segments": [
                {"role": "system", "tokens": [1, 5, 9]},
                {"role": "user", "tokens": [7, 7, 2]},
                {"role": "assistant", "tokens": [4, 8], "logprobs": [-0.21, -1.7],
                 "extra_logprobs": {"ref": [-0.2, -1.5]}},
                {"role": "tool", "tokens": [3, 3]},
                {"role": "assistant", "tokens": [6], "logprobs": [0.0]}]},
            {"id": "sub-1", "kind": "subagent", "parent": "main", "fork_at": 5, "segments": [
                {"role": "user", "tokens": [10, 11]},
                {"role": "assistant", "tokens": [12, 13, 14], "logprobs": [-1.0, -2.0, -3.0],
                 "trainable": False}]},
            {"id": "sub-2", "kind": "subagent_summary", "parent": "sub-1", "fork_at": 3, "segments": [
                {"role": "summary", "tokens": [20, 21], "logprobs": [-0.5, -0.25]},
                {"role": "user", "tokens": [22], "trainable": True}]},
        ],
    }


def write_jsonl(path: Path, rows: list) -> Path:
    lines = [r if isinstance(r, str) else json.dumps(r) for r in rows]
    path.write_text("".join(line + "\n" for line in lines))
    return path


def as_plain(rollout: Rollout) -> dict:
    """Everything a rollout holds, as plain Python with dtypes, for exact comparison."""
    def arr(a):
        return None if a is None else (str(a.dtype), a.tolist())
    return {
        "id": rollout.id, "meta": rollout.meta, "messages": rollout.messages, "line": rollout.line,
        "branches": [
            {"id": b.id, "kind": b.kind, "parent": b.parent, "fork_at": b.fork_at, "segments": [
                {"role": s.role, "tokens": arr(s.tokens), "logprobs": arr(s.logprobs), "trainable": s.trainable,
                 "extra": {k: arr(v) for k, v in s.extra_logprobs.items()}}
                for s in b.segments]}
            for b in rollout.branches],
    }


# ---------------------------------------------------------------------------------------------
# Valid input


def test_valid_tree_round_trips(tmp_path):
    path = write_jsonl(tmp_path / "r.jsonl", [make_rollout("r-1"), "", make_rollout("r-2")])
    rollouts = load_rollouts(path, vocab_size=23)

    assert [r.id for r in rollouts] == ["r-1", "r-2"]
    assert [r.line for r in rollouts] == [1, 3]  # the blank line 2 is skipped but still counted
    r = rollouts[0]
    assert r.file == str(path)
    assert r.meta == make_rollout()["meta"]
    assert r.messages == [{"role": "user", "content": "hi"}]
    assert [(b.id, b.kind, b.parent, b.fork_at, b.num_tokens) for b in r.branches] == [
        ("main", "main", None, None, 11), ("sub-1", "subagent", "main", 5, 5),
        ("sub-2", "subagent_summary", "sub-1", 3, 3)]

    main = r.branch("main")
    assert [s.role for s in main.segments] == ["system", "user", "assistant", "tool", "assistant"]
    assert [s.trainable for s in main.segments] == [False, False, True, False, True]
    assert [s.generated for s in main.segments] == [False, False, True, False, True]
    seg = main.segments[2]
    assert seg.tokens.dtype == np.int64 and seg.tokens.tolist() == [4, 8]
    assert seg.logprobs.dtype == np.float64 and seg.logprobs.tolist() == [-0.21, -1.7]
    assert list(seg.extra_logprobs) == ["ref"]
    assert seg.extra_logprobs["ref"].dtype == np.float64 and seg.extra_logprobs["ref"].tolist() == [-0.2, -1.5]
    assert main.segments[0].logprobs is None and main.segments[0].extra_logprobs == {}
    assert main.segments[4].logprobs.tolist() == [0.0]  # exactly zero is a valid log-prob

    # The overrides: a generated segment that is not trained on, a user segment that is.
    sub1, sub2 = r.branch("sub-1"), r.branch("sub-2")
    assert (sub1.segments[1].generated, sub1.segments[1].trainable) == (True, False)
    assert (sub2.segments[0].generated, sub2.segments[0].trainable) == (True, True)
    assert (sub2.segments[1].generated, sub2.segments[1].trainable) == (False, True)

    assert main.stream().tolist() == [1, 5, 9, 7, 7, 2, 4, 8, 3, 3, 6]
    assert sub1.stream().tolist() == [10, 11, 12, 13, 14]


def test_context_and_full_tokens_of_a_three_level_tree(tmp_path):
    (r,) = load_rollouts(write_jsonl(tmp_path / "r.jsonl", [make_rollout()]))
    expected_context = {"main": [], "sub-1": [1, 5, 9, 7, 7], "sub-2": [1, 5, 9, 7, 7, 10, 11, 12]}
    expected_full = {"main": [1, 5, 9, 7, 7, 2, 4, 8, 3, 3, 6], "sub-1": [1, 5, 9, 7, 7, 10, 11, 12, 13, 14],
                     "sub-2": [1, 5, 9, 7, 7, 10, 11, 12, 20, 21, 22]}
    for branch_id in expected_context:
        context, full = context_tokens(r, branch_id), full_tokens(r, branch_id)
        assert context.dtype == np.int64 and context.tolist() == expected_context[branch_id]
        assert full.dtype == np.int64 and full.tolist() == expected_full[branch_id]
    with pytest.raises(KeyError):
        r.branch("nope")


def test_minimal_rollout_defaults(tmp_path):
    raw = {"id": "x", "branches": [{"id": "b", "segments": [{"role": "user", "tokens": [0]}]}]}
    (r,) = load_rollouts(write_jsonl(tmp_path / "r.jsonl", [raw]))
    assert (r.meta, r.messages) == ({}, None)
    assert (r.branches[0].kind, r.branches[0].parent, r.branches[0].fork_at) == ("main", None, None)


def test_constants():
    assert ROLES == ("system", "user", "assistant", "tool", "summary")
    assert BRANCH_KINDS == ("main", "subagent", "summary", "subagent_summary")


def test_parquet_loads_like_jsonl(tmp_path):
    rows = [make_rollout(f"r-{i}") for i in range(3)]
    rows[1]["branches"][0]["segments"][1]["trainable"] = True  # a field only some rows have (null elsewhere)
    jsonl = load_rollouts(write_jsonl(tmp_path / "r.jsonl", rows))

    # meta/messages as JSON strings: the usual way to keep free-form fields in a Parquet schema.
    as_strings = [{**r, "meta": json.dumps(r["meta"]), "messages": json.dumps(r["messages"])} for r in rows]
    pq.write_table(pa.Table.from_pylist(as_strings), tmp_path / "s.parquet")
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "t.parquet")  # meta/messages as structs
    for name in ("s.parquet", "t.parquet"):
        parquet = load_rollouts(tmp_path / name)
        assert [as_plain(r) for r in parquet] == [as_plain(r) for r in jsonl]
        assert parquet[0].file == str(tmp_path / name)


def test_parquet_rows_are_numbered_across_batches(tmp_path):
    rows = [make_rollout(f"r-{i}") for i in range(300)]  # > one batch of 256
    rows[289]["branches"][0]["segments"][2]["logprobs"] = [-0.1, 0.5]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "r.parquet")
    report = validate_file(tmp_path / "r.parquet")
    assert (report.num_rollouts, report.num_invalid) == (299, 1)
    assert [str(e) for e in report.errors] == [
        f"{tmp_path / 'r.parquet'}:290: rollout 'r-289': branches[0].segments[2].logprobs: "
        "logprob at index 1 is 0.5 > 0"]


def test_parquet_bad_json_string_and_bad_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    pq.write_table(pa.Table.from_pylist([{**make_rollout(), "meta": "{oops"}]), "r.parquet")
    report = validate_file("r.parquet")
    assert [str(e) for e in report.errors] == [
        "r.parquet:1: rollout 'r-1': meta: invalid JSON: Expecting property name enclosed in double quotes "
        "at column 2"]
    Path("junk.parquet").write_text("not parquet")
    with pytest.raises(RolloutError, match=r"^junk\.parquet: not a readable Parquet file: "):
        load_rollouts("junk.parquet")


# ---------------------------------------------------------------------------------------------
# Bad input: each yields exactly one error with an exact message


def mutate(fn) -> dict:
    raw = make_rollout()
    fn(raw)
    return raw


def seg(raw: dict, branch: int, segment: int) -> dict:
    return raw["branches"][branch]["segments"][segment]


MAIN = "r.jsonl:1: rollout 'r-1': "

BAD_LINES = [
    ('{"id": "r-1", ', "r.jsonl:1: invalid JSON: Expecting property name enclosed in double quotes at column 15"),
    ("[1, 2]", "r.jsonl:1: rollout must be a JSON object, got array"),
    ("null", "r.jsonl:1: rollout must be a JSON object, got null"),
    (mutate(lambda r: r.pop("id")), "r.jsonl:1: id: missing required field"),
    (mutate(lambda r: r.update(id=7)), "r.jsonl:1: id: must be a non-empty string, got 7"),
    (mutate(lambda r: r.update(id="")), 'r.jsonl:1: id: must be a non-empty string, got ""'),
    (mutate(lambda r: r.pop("branches")), MAIN + "branches: missing required field"),
    (mutate(lambda r: r.update(branches=None)), MAIN + "branches: required field is null"),
    (mutate(lambda r: r.update(branches={})), MAIN + "branches: must be an array, got object"),
    (mutate(lambda r: r.update(branches=[])), MAIN + "branches: empty branch list"),
    (mutate(lambda r: r.update(meta=[])), MAIN + "meta: must be an object, got array"),
    (mutate(lambda r: r.update(messages="hi")), MAIN + "messages: must be an array, got string"),
    (mutate(lambda r: r["branches"].__setitem__(2, 5)), MAIN + "branches[2]: must be an object, got number"),
    (mutate(lambda r: r["branches"][2].pop("id")), MAIN + "branches[2].id: missing required field"),
    (mutate(lambda r: r["branches"][0].pop("segments")), MAIN + "branches[0].segments: missing required field"),
    (mutate(lambda r: r["branches"][0].update(segments=[])), MAIN + "branches[0].segments: empty segment list"),
    (mutate(lambda r: r["branches"][0]["segments"].__setitem__(1, "user")),
     MAIN + "branches[0].segments[1]: must be an object, got string"),
    (mutate(lambda r: seg(r, 0, 1).pop("role")), MAIN + "branches[0].segments[1].role: missing required field"),
    (mutate(lambda r: seg(r, 0, 1).pop("tokens")), MAIN + "branches[0].segments[1].tokens: missing required field"),
    (mutate(lambda r: seg(r, 0, 1).update(role="robot")),
     MAIN + "branches[0].segments[1].role: unknown role 'robot' "
            "(expected one of: system, user, assistant, tool, summary)"),
    (mutate(lambda r: seg(r, 0, 1).update(role=3)),
     MAIN + "branches[0].segments[1].role: must be a string, got number"),
    (mutate(lambda r: seg(r, 0, 1).update(tokens="7 7 2")),
     MAIN + "branches[0].segments[1].tokens: must be an array of integers, got string"),
    (mutate(lambda r: seg(r, 0, 1).update(tokens=[])), MAIN + "branches[0].segments[1].tokens: empty token list"),
    (mutate(lambda r: seg(r, 0, 1).update(tokens=[7, 1.5, 2])),
     MAIN + "branches[0].segments[1].tokens: token at index 1 is not an integer: 1.5"),
    (mutate(lambda r: seg(r, 0, 1).update(tokens=[True, 7, 2])),
     MAIN + "branches[0].segments[1].tokens: token at index 0 is not an integer: true"),
    (mutate(lambda r: seg(r, 0, 1).update(tokens=[7, "7", 2])),
     MAIN + 'branches[0].segments[1].tokens: token at index 1 is not an integer: "7"'),
    (mutate(lambda r: seg(r, 0, 1).update(tokens=[7, -1, 2])),
     MAIN + "branches[0].segments[1].tokens: token id -1 at index 1 is negative"),
    (mutate(lambda r: seg(r, 0, 1).update(tokens=[7, 2**64, 2])),
     MAIN + "branches[0].segments[1].tokens: token id 18446744073709551616 at index 1 does not fit in int64"),
    (mutate(lambda r: seg(r, 0, 2).update(logprobs="-0.2")),
     MAIN + "branches[0].segments[2].logprobs: must be an array of numbers, got string"),
    (mutate(lambda r: seg(r, 0, 2).update(logprobs=[-0.2, False])),
     MAIN + "branches[0].segments[2].logprobs: logprob at index 1 is not a number: false"),
    (mutate(lambda r: seg(r, 0, 2).update(logprobs=[-0.2, -0.1, -0.3])),
     MAIN + "branches[0].segments[2].logprobs: 3 logprobs for 2 tokens"),
    (mutate(lambda r: seg(r, 0, 2).update(logprobs=[-0.2, float("nan")])),
     MAIN + "branches[0].segments[2].logprobs: logprob at index 1 is nan"),
    (mutate(lambda r: seg(r, 0, 2).update(logprobs=[float("inf"), -0.1])),
     MAIN + "branches[0].segments[2].logprobs: logprob at index 0 is inf"),
    (mutate(lambda r: seg(r, 0, 2).update(logprobs=[-0.1, float("-inf")])),
     MAIN + "branches[0].segments[2].logprobs: logprob at index 1 is -inf"),
    (mutate(lambda r: seg(r, 0, 2).update(logprobs=[0.5, -0.1])),
     MAIN + "branches[0].segments[2].logprobs: logprob at index 0 is 0.5 > 0"),
    (mutate(lambda r: seg(r, 0, 2).update(logprobs=[-0.1, 1e-6])),
     MAIN + "branches[0].segments[2].logprobs: logprob at index 1 is 1e-06 > 0"),
    (mutate(lambda r: seg(r, 1, 1).update(logprobs=[0.1, 0.2, -0.3])),
     MAIN + "branches[1].segments[1].logprobs: logprob at index 0 is 0.1 > 0 (first of 2 positive)"),
    (mutate(lambda r: seg(r, 0, 2).update(extra_logprobs={"ref": [-0.2]})),
     MAIN + "branches[0].segments[2].extra_logprobs.ref: 1 logprobs for 2 tokens"),
    (mutate(lambda r: seg(r, 0, 2).update(extra_logprobs={"ref model": [-0.2, float("nan")]})),
     MAIN + 'branches[0].segments[2].extra_logprobs["ref model"]: logprob at index 1 is nan'),
    (mutate(lambda r: seg(r, 0, 2).update(extra_logprobs=[-0.2, -1.0])),
     MAIN + "branches[0].segments[2].extra_logprobs: must be an object, got array"),
    (mutate(lambda r: seg(r, 0, 2).update(routed_experts="1 2")),
     MAIN + "branches[0].segments[2].routed_experts: must be an array (one [layers][top-k] array of expert ids "
            "per token), got string"),
    (mutate(lambda r: seg(r, 0, 2).update(routed_experts=[[[1, 2]]])),
     MAIN + "branches[0].segments[2].routed_experts: 1 rows for 2 tokens (one [layers][top-k] row per token, "
            "null for a token the engine routed none)"),
    (mutate(lambda r: seg(r, 0, 2).update(routed_experts=[[[1, 2]], [[1]]])),
     MAIN + "branches[0].segments[2].routed_experts: token 1: must be [layers][top-k] expert ids (like token "
            "0's 1 layers x top-2), got [[1]]"),
    (mutate(lambda r: seg(r, 0, 2).update(routed_experts=[None, [1, 2]])),
     MAIN + "branches[0].segments[2].routed_experts: token 1: must be [layers][top-k] expert ids (a non-empty "
            "array of equally long non-empty arrays), got [1, 2]"),
    (mutate(lambda r: seg(r, 0, 2).update(routed_experts=[[[1, 2]], [[1, 2.0]]])),
     MAIN + "branches[0].segments[2].routed_experts: token 1 layer 0: expert id at index 1 is not an integer: 2.0"),
    (mutate(lambda r: seg(r, 0, 2).update(routed_experts=[[[1, 2], [0, 3]], [[1, 2], [-1, 3]]])),
     MAIN + "branches[0].segments[2].routed_experts: token 1 layer 1: expert id -1 is negative"),
    (mutate(lambda r: seg(r, 0, 2).update(routed_experts=[[[2, 2]], None])),
     MAIN + "branches[0].segments[2].routed_experts: token 0 layer 0: expert 2 appears twice in one top-k"),
    (mutate(lambda r: (seg(r, 0, 2).update(routed_experts=[[[1, 2]], None]),
                       seg(r, 1, 0).update(routed_experts=[[[1]], [[3]]]))),
     MAIN + "branches[1].segments[0].routed_experts: 1 layers x top-1 per token, but "
            "branches[0].segments[2].routed_experts has 1 layers x top-2 (one model routes a rollout)"),
    (mutate(lambda r: seg(r, 0, 2).update(trainable="yes")),
     MAIN + 'branches[0].segments[2].trainable: must be true or false, got "yes"'),
    (mutate(lambda r: r["branches"][1].update(kind="robot")),
     MAIN + "branches[1].kind: unknown branch kind 'robot' (expected one of: main, subagent, summary, "
            "subagent_summary)"),
    (mutate(lambda r: r["branches"][1].pop("kind")),
     MAIN + "branches[1].kind: missing required field (for a branch with a parent)"),
    (mutate(lambda r: r["branches"][1].update(parent="nope")),
     MAIN + "branches[1].parent: parent 'nope' is not a branch of this rollout"),
    (mutate(lambda r: r["branches"][1].update(parent=0)),
     MAIN + "branches[1].parent: must be a non-empty string, got 0"),
    (mutate(lambda r: r["branches"][2].update(id="sub-1")),
     MAIN + "branches[2].id: duplicate branch id 'sub-1' (also branches[1])"),
    (mutate(lambda r: r["branches"][1].update(parent="sub-2")),
     MAIN + "branches[1].parent: parent links form a cycle: sub-1 -> sub-2 -> sub-1"),
    (mutate(lambda r: r["branches"][2].update(parent="sub-2")),
     MAIN + "branches[2].parent: parent links form a cycle: sub-2 -> sub-2"),
    (mutate(lambda r: r["branches"][1].update(fork_at=12)),
     MAIN + "branches[1].fork_at: fork_at 12 is outside 0..11 (the length of parent 'main')"),
    (mutate(lambda r: r["branches"][2].update(fork_at=-1)),
     MAIN + "branches[2].fork_at: fork_at -1 is outside 0..5 (the length of parent 'sub-1')"),
    (mutate(lambda r: r["branches"][1].update(fork_at=None)),
     MAIN + "branches[1].fork_at: missing required field (for a branch with a parent)"),
    (mutate(lambda r: r["branches"][1].update(fork_at=True)),
     MAIN + "branches[1].fork_at: must be an integer or null, got true"),
    (mutate(lambda r: r["branches"][0].update(fork_at=0)),
     MAIN + "branches[0].fork_at: must be null for a root branch (parent null), got 0"),
    (mutate(lambda r: r["branches"][2].update(parent=None, fork_at=None)),
     MAIN + "branches[2].parent: a second root branch (parent null) besides branches[0]; exactly one is allowed"),
]


@pytest.mark.parametrize(("line", "expected"), BAD_LINES, ids=[e.split(": ", 2)[-1][:60] for _, e in BAD_LINES])
def test_bad_input_has_one_exact_error(tmp_path, monkeypatch, line, expected):
    monkeypatch.chdir(tmp_path)
    write_jsonl(tmp_path / "r.jsonl", [line])
    report = validate_file("r.jsonl")
    assert [str(e) for e in report.errors] == [expected]
    assert (report.num_rollouts, report.num_invalid) == (0, 1)
    with pytest.raises(RolloutError) as raised:
        load_rollouts("r.jsonl")
    assert str(raised.value) == expected


def test_error_fields_are_structured():
    raw = mutate(lambda r: seg(r, 0, 2).update(logprobs=[-0.2, float("nan")]))
    rollout, errors = check_rollout(raw, file="f.jsonl", line=4, vocab_size=None)
    assert rollout is None
    (e,) = errors
    assert (e.file, e.line, e.rollout, e.field, e.reason) == (
        "f.jsonl", 4, "r-1", "branches[0].segments[2].logprobs", "logprob at index 1 is nan")


def test_json_nan_and_infinity_literals_are_flagged(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    line = json.dumps(make_rollout()).replace("[-0.21, -1.7]", "[NaN, -Infinity]")
    write_jsonl(tmp_path / "r.jsonl", [line])
    assert [str(e) for e in validate_file("r.jsonl").errors] == [
        MAIN + "branches[0].segments[2].logprobs: logprob at index 0 is nan (first of 2 non-finite)"]


def test_vocab_size(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    raw = mutate(lambda r: seg(r, 0, 0).update(tokens=[1, 5, 9, 5000]))
    assert validate_file(write_jsonl(tmp_path / "r.jsonl", [raw]), vocab_size=6000).ok
    assert [str(e) for e in validate_file("r.jsonl", vocab_size=1024).errors] == [
        MAIN + "branches[0].segments[0].tokens: token id 5000 at index 3 is >= vocab size 1024"]
    # The bound is exclusive (token 9 with vocab size 9 is out), and every segment reports its own.
    assert [str(e) for e in validate_file("r.jsonl", vocab_size=9).errors] == [
        MAIN + "branches[0].segments[0].tokens: token id 9 at index 2 is >= vocab size 9 (first of 2 out of vocab)",
        MAIN + "branches[1].segments[0].tokens: token id 10 at index 0 is >= vocab size 9 (first of 2 out of vocab)",
        MAIN + "branches[1].segments[1].tokens: token id 12 at index 0 is >= vocab size 9 (first of 3 out of vocab)",
        MAIN + "branches[2].segments[0].tokens: token id 20 at index 0 is >= vocab size 9 (first of 2 out of vocab)",
        MAIN + "branches[2].segments[1].tokens: token id 22 at index 0 is >= vocab size 9"]


def test_routed_experts_follow_the_tree_and_the_checkpoint(tmp_path, monkeypatch):
    """A branch's routing is its context's (the parent's rows up to fork_at) then its own; null rows
    and segments without routing are -1; ids are sorted per top-k and bounded by the model's experts."""
    monkeypatch.chdir(tmp_path)
    raw = make_rollout()
    seg(raw, 0, 0).update(routed_experts=[[[3, 1], [0, 2]], [[1, 0], [2, 3]], None])
    seg(raw, 0, 1).update(routed_experts=[[[1, 2], [3, 0]]] * 3)
    seg(raw, 1, 1).update(routed_experts=[[[0, 1], [2, 3]], None, [[9, 1], [2, 3]]])
    write_jsonl(tmp_path / "r.jsonl", [raw])
    [rollout] = load_rollouts("r.jsonl")
    routed = full_routed_experts(rollout, "sub-2", (2, 2))
    assert routed.shape == (len(full_tokens(rollout, "sub-2")), 2, 2) and routed.dtype == np.int16
    assert routed[0].tolist() == [[1, 3], [0, 2]] and routed[2].tolist() == [[-1, -1], [-1, -1]]
    assert routed[3:5].tolist() == [[[1, 2], [0, 3]]] * 2  # main's tokens up to sub-1's fork_at 5
    assert (routed[5:7] == -1).all() and routed[7].tolist() == [[0, 1], [2, 3]]  # sub-1's, up to fork_at 3
    assert len(routed) == 11 and (routed[8:] == -1).all()  # sub-2's own tokens: no routing stored
    assert [str(e) for e in validate_file("r.jsonl", num_experts=8).errors] == [
        MAIN + "branches[1].segments[1].routed_experts: token 2 layer 0: expert id 9 is >= the checkpoint's "
               "8 experts"]
    other = make_rollout("r-2")
    seg(other, 0, 4).update(routed_experts=[[[1, 2, 3]]])
    write_jsonl(tmp_path / "two.jsonl", [raw, other])
    assert [str(e) for e in validate_file("two.jsonl").errors] == [
        "two.jsonl:2: rollout 'r-2': branches[0].segments[4].routed_experts: 1 layers x top-3 per token, but "
        "line 1 stores 2 layers x top-2 (one model routes a file)"]


def test_no_root_is_reported_with_its_cause(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    raw = mutate(lambda r: r["branches"][0].update(parent="sub-2", fork_at=0))
    write_jsonl(tmp_path / "r.jsonl", [raw])
    assert [str(e) for e in validate_file("r.jsonl").errors] == [
        MAIN + "branches: no root branch; exactly one branch must have parent null",
        MAIN + "branches[0].parent: parent links form a cycle: main -> sub-2 -> sub-1 -> main"]


# ---------------------------------------------------------------------------------------------
# Whole files


def test_validate_file_collects_errors_across_lines(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    two_problems = mutate(lambda r: (r.update(id="r-2"), seg(r, 0, 1).update(role="robot", tokens=[1.5])))
    rows = [make_rollout("r-1"), two_problems, "", "{", make_rollout("r-3"), make_rollout("r-1"), "7"]
    write_jsonl(tmp_path / "r.jsonl", rows)
    report = validate_file("r.jsonl")
    assert [str(e) for e in report.errors] == [
        "r.jsonl:2: rollout 'r-2': branches[0].segments[1].role: unknown role 'robot' "
        "(expected one of: system, user, assistant, tool, summary)",
        "r.jsonl:2: rollout 'r-2': branches[0].segments[1].tokens: token at index 0 is not an integer: 1.5",
        "r.jsonl:4: invalid JSON: Expecting property name enclosed in double quotes at column 2",
        "r.jsonl:6: rollout 'r-1': id: duplicate rollout id (first at line 1)",
        "r.jsonl:7: rollout must be a JSON object, got number"]
    assert (report.num_rollouts, report.num_invalid, report.truncated) == (2, 4, False)
    assert (report.num_branches, report.num_tokens) == (6, 2 * 19)
    # trainable: main's two assistant segments (3) + sub-2's summary and user override (3)
    assert report.num_trainable_tokens == 2 * 6

    capped = validate_file("r.jsonl", max_errors=3)
    assert [str(e) for e in capped.errors] == [str(e) for e in report.errors[:3]]
    assert (capped.truncated, capped.num_invalid) == (True, 4)

    # iter_rollouts stops at the first bad rollout, after yielding the good ones before it.
    rollouts = iter_rollouts("r.jsonl")
    assert next(rollouts).id == "r-1"
    with pytest.raises(RolloutError, match=r"^r\.jsonl:2: rollout 'r-2': branches\[0\]\.segments\[1\]\.role: "):
        next(rollouts)


def test_duplicate_rollout_id_is_caught_even_when_the_first_is_invalid(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    bad_first = mutate(lambda r: r.update(branches=[]))
    write_jsonl(tmp_path / "r.jsonl", [bad_first, make_rollout()])
    assert [str(e) for e in validate_file("r.jsonl").errors] == [
        MAIN + "branches: empty branch list",
        "r.jsonl:2: rollout 'r-1': id: duplicate rollout id (first at line 1)"]


@pytest.mark.parametrize("content", ["", "\n  \n"])
def test_empty_file(tmp_path, monkeypatch, content):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "r.jsonl").write_text(content)
    with pytest.raises(RolloutError) as raised:
        load_rollouts("r.jsonl")
    assert str(raised.value) == "r.jsonl: no rollouts (empty file)"
    report = validate_file("r.jsonl")
    assert [str(e) for e in report.errors] == ["r.jsonl: no rollouts (empty file)"]
    assert report.num_rollouts == 0


def test_empty_parquet(tmp_path):
    table = pa.Table.from_pylist([make_rollout()]).slice(0, 0)
    pq.write_table(table, tmp_path / "r.parquet")
    with pytest.raises(RolloutError, match=r"no rollouts \(empty file\)$"):
        load_rollouts(tmp_path / "r.parquet")


def test_missing_file_fails_at_call_time(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RolloutError) as raised:
        iter_rollouts("nope.jsonl")  # no next(): the path is checked before iterating
    assert str(raised.value) == "nope.jsonl: no such file"
    with pytest.raises(RolloutError, match=r"^nope\.parquet: no such file$"):
        validate_file("nope.parquet")
    with pytest.raises(RolloutError, match=r"^\.: not a file$"):
        load_rollouts(".")


def test_invalid_utf8(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "r.jsonl").write_bytes(b'{"id": "\xff"}\n')
    assert [str(e) for e in validate_file("r.jsonl").errors] == [
        "r.jsonl:1: invalid JSON: not UTF-8 (byte 0xff at offset 8)"]


# ---------------------------------------------------------------------------------------------
# Property: check_rollout reports, never crashes

KEYS = ["id", "meta", "messages", "branches", "segments", "role", "tokens", "logprobs", "trainable",
        "extra_logprobs", "kind", "parent", "fork_at", "main", "assistant"]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.sampled_from(KEYS) | st.text(max_size=5),
    lambda children: st.lists(children, max_size=5)
    | st.dictionaries(st.sampled_from(KEYS) | st.text(max_size=5), children, max_size=6),
    max_leaves=30,
)


def _check_never_raises(raw: object) -> None:
    rollout, errors = check_rollout(raw, file="f.jsonl", line=1, vocab_size=100)
    assert (rollout is None) == bool(errors)
    assert all(isinstance(e, RolloutError) and e.file == "f.jsonl" and e.line == 1 for e in errors)
    assert all("\n" not in str(e) for e in errors)  # one line each


@settings(max_examples=300, deadline=None)
@given(json_values)
def test_check_rollout_never_raises_on_json_values(raw):
    _check_never_raises(raw)


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_check_rollout_never_raises_on_near_valid_rollouts(data):
    # Replace one random node of a valid rollout by an arbitrary value, to reach the deep checks.
    raw = make_rollout()
    _replace_a_node(raw, data)
    _check_never_raises(raw)


def _replace_a_node(raw: dict, data: st.DataObject) -> None:
    """One node of `raw`, drawn by walking down from the top, replaced by any JSON value."""
    node, path = raw, []
    while isinstance(node, (dict, list)) and node and data.draw(st.booleans()):
        key = data.draw(st.sampled_from(sorted(node) if isinstance(node, dict) else range(len(node))))
        path.append(key)
        node = node[key]
    if path:
        parent = raw
        for key in path[:-1]:
            parent = parent[key]
        parent[path[-1]] = data.draw(json_values)


_expert_ids = st.one_of(st.integers(-2, 40000), st.integers(), st.booleans(), st.floats(), st.none(), st.just([1]))
routed_values = st.one_of(json_values, st.lists(st.one_of(st.none(), st.lists(
    st.lists(_expert_ids, max_size=3), max_size=3)), max_size=3))


@settings(max_examples=300, deadline=None)
@given(routed_values)
def test_check_rollout_never_raises_on_any_routed_experts(value):
    raw = make_rollout()
    seg(raw, 0, 2)["routed_experts"] = value
    _check_never_raises(raw)


def _assert_same_rollout(a: Rollout, b: Rollout) -> None:
    """Field for field, arrays by value and dtype."""
    assert (a.id, a.meta, a.messages, a.file, a.line) == (b.id, b.meta, b.messages, b.file, b.line)
    for p, q in zip(a.branches, b.branches, strict=True):
        assert (p.id, p.kind, p.parent, p.fork_at) == (q.id, q.kind, q.parent, q.fork_at)
        for x, y in zip(p.segments, q.segments, strict=True):
            assert (x.role, x.trainable, list(x.extra_logprobs)) == (y.role, y.trainable, list(y.extra_logprobs))
            for u, v in [(x.tokens, y.tokens), (x.logprobs, y.logprobs), (x.routed_experts, y.routed_experts),
                         *((x.extra_logprobs[k], y.extra_logprobs[k]) for k in x.extra_logprobs)]:
                assert (u is None) == (v is None)
                if u is not None:
                    assert u.dtype == v.dtype
                    np.testing.assert_array_equal(u, v)


def _from_a_line(text: str, **checks) -> tuple[Rollout | None, list[str]]:
    """check_rollout of a JSONL line as the file readers decode it (typed where it fits)."""
    from mismatch.rollouts.decode import decode_line as _decode_line

    raw, why = _decode_line(text.encode())
    assert why is None
    rollout, errors = check_rollout(raw, file="f.jsonl", line=1, **checks)
    return rollout, [str(e) for e in errors]


def _from_a_dict(text: str, **checks) -> tuple[Rollout | None, list[str]]:
    rollout, errors = check_rollout(json.loads(text), file="f.jsonl", line=1, **checks)
    return rollout, [str(e) for e in errors]


def test_every_path_of_the_checker_gives_the_same_rollouts(monkeypatch) -> None:
    """A file's line decoded into the format's types, a dict checked a branch at a time, a dict
    checked a segment at a time: the same rollouts, field for field."""
    import mismatch.rollouts as rollouts_module

    example = Path(__file__).resolve().parents[1] / "examples" / "rollouts.jsonl"
    lines = [line for line in example.read_text().splitlines() if line.strip()]
    typed = rollouts_module.load_rollouts(example)
    by_branch = [_from_a_dict(line, vocab_size=None)[0] for line in lines]
    monkeypatch.setattr(rollouts_module.decode, "fast_segments", lambda *args, **kwargs: None)
    by_segment = [_from_a_dict(line, vocab_size=None)[0] for line in lines]
    assert len(typed) == len(lines) > 1
    for a, b, c in zip(typed, by_branch, by_segment, strict=True):
        assert b is not None and c is not None
        _assert_same_rollout(replace(a, file="f.jsonl", line=1), b)
        _assert_same_rollout(b, c)
    routed = make_rollout()
    seg(routed, 0, 2)["routed_experts"] = [[[3, 1], [0, 2]], [[1, 2], [2, 0]]]
    text = json.dumps(routed)
    found, expected = _from_a_line(text, vocab_size=100, num_experts=4), _from_a_dict(text, vocab_size=100, num_experts=4)
    assert found[1] == expected[1] == []
    _assert_same_rollout(found[0], expected[0])


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_a_line_decoded_into_the_types_is_checked_as_its_dict_is(data):
    # One node of a valid rollout replaced by any JSON value (routed experts included): the typed
    # path takes the line or hands it on, and either way the errors, or the rollout, are the dict's.
    raw = make_rollout()
    if data.draw(st.booleans()):
        seg(raw, 0, 2)["routed_experts"] = data.draw(routed_values)
    _replace_a_node(raw, data)
    text = json.dumps(raw)
    found, expected = _from_a_line(text, vocab_size=100, num_experts=8), _from_a_dict(text, vocab_size=100, num_experts=8)
    assert found[1] == expected[1]
    assert (found[0] is None) == (expected[0] is None)
    if found[0] is not None:
        _assert_same_rollout(found[0], expected[0])


def test_a_field_the_format_does_not_name_is_read_as_strictly_as_before(tmp_path) -> None:
    """msgspec skips an unknown field's value without checking its UTF-8: such a line takes the
    untyped path, which refuses it as invalid JSON; a clean unknown field is refused by name (a
    misspelt field would otherwise drop its data without a word), and `meta` takes anything."""
    text = json.dumps(make_rollout()).encode()
    bad = text[:-1] + b', "note": "caf\xe9"}'
    path = tmp_path / "r.jsonl"
    other = json.dumps({**make_rollout(), "id": "r-2"}).encode()
    path.write_bytes(bad + b"\n" + text[:-1] + b', "note": "fine"}\n' + other + b"\n")
    report = validate_file(path)
    assert [str(e) for e in report.errors] == [
        f"{path}:1: invalid JSON: not UTF-8 (byte 0xe9 at offset {len(bad) - 3})",
        f"{path}:2: rollout 'r-1': unknown field 'note' (valid: id, branches, meta, messages)"]
    assert report.num_rollouts == 1
