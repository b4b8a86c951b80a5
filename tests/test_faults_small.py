"""The fault sweep's smaller items kept as tests: the gate's JUnit path and summaries it must refuse,
report under the results lock, a tree that replays too many tokens, unknown rollout fields, and
validate's context check. Each is bad input: one line and exit 2, never a traceback or a pass."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mismatch.advise.consistency import check_summary
from mismatch.advise.gate import load_summary
from mismatch.cli import main
from mismatch.errors import ResultsError
from mismatch.results import results_lock
from mismatch.rollouts import validate_file
from mismatch.rollouts.rules import MAX_REPLAY_TOKENS
from test_golden import GOLDEN, stored_checkpoint

ROLLOUTS = GOLDEN / "rollouts.jsonl"


def one_line(capsys) -> str:
    """The one error line a command printed (no traceback), without its prefix."""
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1 and err.startswith("mismatch: error: "), err[:2000]
    return err.rstrip("\n").removeprefix("mismatch: error: ")


@pytest.fixture(scope="module")
def audited(tmp_path_factory) -> Path:
    """A real results dir: the stored-only audit of the golden rollouts (no model load, ~2 s)."""
    root = tmp_path_factory.mktemp("audited")
    checkpoint = stored_checkpoint(root / "ckpt")
    out = root / "out"
    assert main(["audit", str(checkpoint), "--rollouts", str(ROLLOUTS), "--train", "stored:trainer",
                 "--infer", "stored:engine", "--out", str(out)]) == 0
    return out


def edited(audited: Path, tmp_path: Path, edit, *, text_edit=None) -> Path:
    """A copy of the audit's summary.json (alone in a dir), edited as a hand or a bad disk would."""
    summary = json.loads((audited / "summary.json").read_text())
    edit(summary)
    text = json.dumps(summary)
    out = tmp_path / "edited"
    out.mkdir()
    (out / "summary.json").write_text(text if text_edit is None else text_edit(text))
    return out


# ---------------------------------------------------------------------------------------------
# 1. gate --junit PATH that cannot be written


@pytest.mark.parametrize("where", ["parent_is_a_file", "path_is_a_dir"])
def test_gate_junit_to_an_unwritable_path_is_refused_before_gating(audited, tmp_path, capsys, where):
    (tmp_path / "file").write_text("")
    (tmp_path / "dir").mkdir()
    junit = tmp_path / "file" / "gate.xml" if where == "parent_is_a_file" else tmp_path / "dir"
    code = main(["gate", str(audited), "--max", "kl_k3=1", "--junit", str(junit)])  # every check passes
    message = one_line(capsys)
    assert code == 2
    assert message.startswith(f"--junit {junit}: cannot be written (")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "file"] and not list((tmp_path / "dir").iterdir())


def test_gate_junit_is_written_atomically_where_it_can_be(audited, tmp_path, capsys):
    junit = tmp_path / "ci" / "gate.xml"
    assert main(["gate", str(audited), "--max", "kl_k3=1", "--junit", str(junit)]) == 0
    assert "<testsuites" in junit.read_text() and sorted(p.name for p in junit.parent.iterdir()) == ["gate.xml"]


# ---------------------------------------------------------------------------------------------
# 2. a null pair, a number JSON overflows to inf


@pytest.mark.parametrize(("edit", "text_edit", "message"), [
    (lambda s: s["pairs"].__setitem__("train/sampler", None), None,
     "pairs['train/sampler'] is null, not an object of metrics"),
    (lambda s: s["pairs"]["train/sampler"].__setitem__("n_tokens", 12345.5), lambda t: t.replace("12345.5", "1e400"),
     "pairs['train/sampler'].n_tokens overflows to inf (a number no summary.json holds: it writes null)"),
    (lambda s: s["pairs"]["infer/sampler"].__setitem__("kl_k2", 12345.5), lambda t: t.replace("12345.5", "-1e999"),
     "pairs['infer/sampler'].kl_k2 overflows to -inf (a number no summary.json holds: it writes null)"),
    (lambda s: s["pairs"]["train/sampler"].__setitem__("kl_k3", "0.1"), None,
     "pairs['train/sampler'].kl_k3 is \"0.1\", not a number or null"),
])
def test_gate_refuses_a_null_pair_or_an_overflowed_number_naming_file_and_key(audited, tmp_path, capsys, edit,
                                                                            text_edit, message):
    results = edited(audited, tmp_path, edit, text_edit=text_edit)
    code = main(["gate", str(results), "--max", "kl_k3=1"])
    assert (code, one_line(capsys)) == (2, f"{results / 'summary.json'}: {message}")


def test_a_null_metric_still_fails_closed_not_refused(audited, tmp_path, capsys):
    # NaN is written as null: a real run can hold it, so it is a failed check (exit 1), not bad input.
    results = edited(audited, tmp_path, lambda s: s["pairs"]["train/sampler"].__setitem__("kl_k3", None))
    assert main(["gate", str(results), "--max", "kl_k3=1"]) == 1
    assert "FAIL  train/sampler.kl_k3: NaN (max 1.0)" in capsys.readouterr().out


# ---------------------------------------------------------------------------------------------
# 3. a summary that contradicts itself


def _set(pair: str, **values):
    return lambda s: s["pairs"][pair].update(values)


@pytest.mark.parametrize(("edit", "message"), [
    (_set("train/sampler", ratio_q001=5.0),
     "pairs['train/sampler']: ratio_q001 = 5 > ratio_q01 = 0.885845"),
    (_set("train/sampler", log_ratio_abs_max=0.001),
     "pairs['train/sampler']: log_ratio_abs_mean = 0.0174495 > log_ratio_abs_max = 0.001"),
    (_set("infer/sampler", ess=7),  # not gated: every pair's every metric is checked
     "pairs['infer/sampler']: ess = 7 is impossible (ess lies in [0, 1])"),
    (_set("train/sampler", n_rollouts=49),
     "pairs['train/sampler']: n_rollouts = 49 > counts.rollouts = 48"),
    (_set("train/sampler", n_tokens=2700.5),
     "pairs['train/sampler']: n_tokens = 2700.5 is not a whole count"),
    (_set("train/sampler", kl_k1=0.5),
     "pairs['train/sampler']: kl_k1 = 0.5 is not -log_ratio_mean = 0.000259617"),
    (_set("train/sampler", ess=1e-6),
     "pairs['train/sampler']: ess = 1e-06 < 1 / n_tokens = 0.00037037"),
])
def test_gate_refuses_a_summary_that_contradicts_itself(audited, tmp_path, capsys, edit, message):
    results = edited(audited, tmp_path, edit)
    code = main(["gate", str(results), "--max", "kl_k3=1"])
    assert (code, one_line(capsys)) == (2, f"{results / 'summary.json'}: {message} (edited or corrupted)")


def test_real_summaries_pass_the_consistency_check(audited, tmp_path):
    # The golden fixture, a real audit, a merged one and the per-group metrics of both (ties, empty
    # groups' nulls) are what runs write: none may be refused.
    golden = json.loads((GOLDEN / "expected_summary.json").read_text())
    real = load_summary(audited)
    for summary in (golden, real):
        check_summary(summary, where="x")
        for breakdown in ("turns", "roles", "branch_kinds"):
            for group in summary.get(breakdown) or []:
                check_summary({"pairs": group["pairs"]}, where=f"x {breakdown}")
    assert any(v is None for g in real["roles"] for p in g["pairs"].values() for v in p.values())


def test_an_api_summary_with_a_null_pair_fails_closed_without_a_traceback():
    from mismatch.advise.gate import run_gate

    result = run_gate({"schema": "mismatch.summary/v1", "pairs": {"train/sampler": None}}, maxima={"kl_k3": 1})
    assert result.exit_code == 1
    assert "train/sampler.kl_k3: pair 'train/sampler' is not an object (max 1)" in [c.message for c in result.failures]


# ---------------------------------------------------------------------------------------------
# 4. report holds the results lock


def test_report_holds_the_results_lock(audited, capsys):
    with results_lock(audited):  # a merge --force or an audit writing the same dir
        code = main(["report", str(audited)])
    message = one_line(capsys)
    assert code == 2 and message.startswith(f"{audited}: another mismatch run is writing it (pid ")
    assert main(["report", str(audited)]) == 0  # and once it is free, it builds the page
    assert not (audited.parent / f".{audited.name}.lock").exists()


def test_report_of_a_missing_dir_creates_nothing(tmp_path, capsys):
    missing = tmp_path / "no" / "results"
    assert main(["report", str(missing)]) == 2
    assert one_line(capsys).startswith(f"{missing}: not a directory")
    assert list(tmp_path.iterdir()) == []


# ---------------------------------------------------------------------------------------------
# 5. a tree whose branches replay too many tokens


def wide_tree(context: int, leaves: int) -> dict:
    """A root of `context` tokens and `leaves` one-token subagents forked at its end: each replays it all."""
    root = {"id": "main", "segments": [{"role": "user", "tokens": [1] * context}]}
    subs = [{"id": f"s{i}", "kind": "subagent", "parent": "main", "fork_at": context,
             "segments": [{"role": "assistant", "tokens": [2], "logprobs": [-0.5]}]} for i in range(leaves)]
    return {"id": "wide", "branches": [root, *subs]}


def test_a_tree_that_replays_too_many_tokens_is_refused(tmp_path, capsys):
    context = 40_000
    leaves = MAX_REPLAY_TOKENS // context  # one more token than the limit, with the root's own
    path = tmp_path / "wide.jsonl"
    path.write_text(json.dumps(wide_tree(context, leaves)) + "\n")
    assert path.stat().st_size < 400_000  # a small file
    total = context + leaves * (context + 1)
    assert total > MAX_REPLAY_TOKENS
    assert main(["validate", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"{path}:1: rollout 'wide': branches: {total:,} tokens to replay (each branch's context plus its " \
           f"own tokens, over its {leaves + 1} branches); at most {MAX_REPLAY_TOKENS:,} per rollout" in err
    path.write_text(json.dumps(wide_tree(context, leaves - 2)) + "\n")  # just under: a real wide tree
    assert validate_file(path).ok


# ---------------------------------------------------------------------------------------------
# 6. unknown fields; validate --checkpoint checks the context as audit does


GOOD = {"id": "r-0", "branches": [{"id": "main", "segments": [
    {"role": "user", "tokens": [1, 2, 3]},
    {"role": "assistant", "tokens": [5, 6], "logprobs": [-0.5, -1.0]}]}]}


def _renamed(obj: dict, old: str, new: str) -> dict:
    return {new if k == old else k: v for k, v in obj.items()}


@pytest.mark.parametrize(("edit", "error"), [
    (lambda r: r["branches"][0]["segments"].__setitem__(1, _renamed(r["branches"][0]["segments"][1], "logprobs",
                                                                     "logprob")),
     "rollout 'r-0': branches[0].segments[1]: unknown field 'logprob' (did you mean 'logprobs'?)"),
    (lambda r: r["branches"][0]["segments"][0].update(weight=[1, 1, 1]),
     "rollout 'r-0': branches[0].segments[0]: unknown field 'weight' (valid: role, tokens, logprobs, trainable, "
     "extra_logprobs, routed_experts, sampling_mask, indexer_topk)"),
    (lambda r: r.update(mesages=[]), "rollout 'r-0': unknown field 'mesages' (did you mean 'messages'?)"),
    (lambda r: r["branches"][0].update(knd="main"), "rollout 'r-0': branches[0]: unknown field 'knd' "
                                                   "(did you mean 'kind'?)"),
])
def test_an_unknown_field_is_a_problem_with_a_suggestion(tmp_path, capsys, edit, error):
    raw = json.loads(json.dumps(GOOD))
    edit(raw)
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(GOOD).replace('"r-0"', '"r-x"') + "\n" + json.dumps(raw) + "\n")
    assert [str(e) for e in validate_file(path).errors] == [f"{path}:2: {error}"]
    assert main(["validate", str(path)]) == 2
    assert f"{path}:2: {error}" in capsys.readouterr().err


def test_meta_and_messages_stay_free_form_and_a_parquet_null_is_absent(tmp_path):
    import pandas as pd
    import pyarrow as pa
    import pyarrow.parquet as pq

    free = json.loads(json.dumps(GOOD)) | {"meta": {"anything": {"logprob": 1}}, "messages": [{"x": 1}]}
    path = tmp_path / "r.jsonl"
    path.write_text(json.dumps(free) + "\n")
    assert validate_file(path).ok
    # A Parquet file gives every row every struct field another row has, null where it had none:
    # the first row's null `logprob` is absent, the second row's misspelled one is not.
    typo = json.loads(json.dumps(GOOD)) | {"id": "r-1"}
    typo["branches"][0]["segments"][1] = _renamed(typo["branches"][0]["segments"][1], "logprobs", "logprob")
    pq.write_table(pa.Table.from_pylist([GOOD, typo]), tmp_path / "r.parquet")
    assert [str(e) for e in validate_file(tmp_path / "r.parquet").errors] == [
        f"{tmp_path / 'r.parquet'}:2: rollout 'r-1': branches[0].segments[1]: unknown field 'logprob' "
        "(did you mean 'logprobs'?)"]
    # pandas writes a DataFrame's index beside its columns: not a field of the rollout.
    frame = pd.DataFrame({"id": ["r-0"], "branches": [GOOD["branches"]]}, index=[7])
    frame.to_parquet(tmp_path / "indexed.parquet")
    assert validate_file(tmp_path / "indexed.parquet").ok


def test_validate_with_a_checkpoint_checks_the_context_as_audit_does(tmp_path, capsys):
    checkpoint = stored_checkpoint(tmp_path / "ckpt")
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 16}))
    assert main(["audit", str(checkpoint), "--rollouts", str(ROLLOUTS), "--train", "hf", "--infer", "stored:engine",
                 "--out", str(tmp_path / "o")]) == 2
    audit_says = one_line(capsys)
    assert "past the model's context of 16 (config.json)" in audit_says
    assert main(["validate", str(ROLLOUTS), "--checkpoint", str(checkpoint)]) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [audit_says]
    assert "1 error(s)" in captured.out
    assert main(["validate", str(ROLLOUTS), "--checkpoint", str(checkpoint), "--json"]) == 2
    assert json.loads(capsys.readouterr().out)["errors"] == [audit_says]
    (checkpoint / "config.json").write_text(json.dumps(config))  # no limit declared: nothing to refuse
    assert main(["validate", str(ROLLOUTS), "--checkpoint", str(checkpoint)]) == 0


def test_the_checked_summary_error_is_a_results_error(tmp_path):
    with pytest.raises(ResultsError):
        check_summary({"pairs": {"a/b": None}}, where="x")
