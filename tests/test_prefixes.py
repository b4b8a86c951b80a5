"""Prefix consistency: the same token after the same prefix must get the same log-prob from one
engine config, whatever request it came in."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from mismatch.analysis.prefixes import prefix_consistency, prefix_keys
from mismatch.pipeline.audit import audit
from mismatch.engines import ReplayRequest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "rollouts.jsonl"


def _request(tokens: list[int], score_from: int = 1) -> ReplayRequest:
    return ReplayRequest(tokens=np.array(tokens), generated=np.zeros(len(tokens), bool), score_from=score_from)


def test_keys_are_equal_exactly_for_equal_prefixes() -> None:
    keys = prefix_keys([_request([5, 6, 7, 8]), _request([5, 6, 7, 9]), _request([4, 6, 7, 8])])
    first, second, third = keys[:3], keys[3:6], keys[6:]
    assert list(first[:2] == second[:2]) == [True, True] and first[2] != second[2]
    assert not np.intersect1d(first, third).size  # another first token: nothing shared after it


def test_a_spread_on_a_shared_prefix_is_found_and_named() -> None:
    requests = [_request([5, 6, 7]), _request([5, 6, 7]), _request([5, 6, 9])]
    table = pd.DataFrame({"rollout": ["a", "a", "b", "b", "c", "c"], "pos": [1, 2, 1, 2, 1, 2],
                          "logp_x": [-1.0, -2.0, -1.0, -2.5, -1.0, -3.0],
                          "logp_y": [-1.0, -2.0, -1.0, -2.0, -1.0, -3.0]})
    found = prefix_consistency(table, prefix_keys(requests), ["x", "y", "absent"])
    assert set(found) == {"x", "y"}
    # Position 1 is shared by all three (the prefix [5, 6]); position 2 by a and b only ([5, 6, 7]).
    assert (found["x"]["n_shared_tokens"], found["x"]["n_prefixes"]) == (5, 2)
    assert found["x"]["frac_prefixes_bitwise_equal"] == 0.5 and found["x"]["max_abs_spread"] == 0.5
    assert found["x"]["worst"] == {"rollouts": ["a", "b"], "pos": 2, "spread": 0.5}
    assert found["y"]["frac_prefixes_bitwise_equal"] == 1.0 and found["y"]["worst"] is None


def test_a_missing_log_prob_is_left_out_of_its_columns_groups_only(tmp_path) -> None:
    """NaN (no log-prob for that token in that column) counts for nothing in that column's groups:
    not a member, not a bound of the spread; the other columns' groups keep the row. The same
    on a table in memory and on the files an audit's store writes."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    requests = [_request([5, 6, 7]), _request([5, 6, 7]), _request([5, 6, 7])]
    nan = float("nan")
    table = pd.DataFrame({"rollout": ["a", "a", "b", "b", "c", "c"], "pos": [1, 2, 1, 2, 1, 2],
                          "logp_x": [-1.0, -2.0, nan, -2.0, -1.0, nan],
                          "logp_y": [-1.0, -2.0, -1.5, -2.0, -1.0, -2.0]})
    keys = prefix_keys(requests)
    pq.write_table(pa.Table.from_pandas(table, preserve_index=False), tmp_path / "tokens.parquet")
    pq.write_table(pa.table({"key": pa.array(keys, pa.uint64())}), tmp_path / "keys.parquet")
    for found in (prefix_consistency(table, keys, ["x", "y"]),
                  prefix_consistency(tmp_path / "tokens.parquet", tmp_path / "keys.parquet", ["x", "y"])):
        # x: position 1 shared by a and c (b has none), position 2 by a and b (c has none): both equal.
        assert (found["x"]["n_shared_tokens"], found["x"]["n_prefixes"]) == (4, 2)
        assert found["x"]["frac_prefixes_bitwise_equal"] == 1.0 and found["x"]["worst"] is None
        # y: all three at both positions; b's -1.5 at position 1 is the spread.
        assert (found["y"]["n_shared_tokens"], found["y"]["n_prefixes"]) == (6, 2)
        assert found["y"]["max_abs_spread"] == 0.5 and found["y"]["worst"] == {"rollouts": ["a", "b", "c"], "pos": 1,
                                                                               "spread": 0.5}


def test_an_audit_reports_prefix_consistency_per_source(tiny_checkpoint, tmp_path) -> None:
    # A GRPO-like group: the example's first rollout three times, under new ids.
    lines = EXAMPLE.read_text().splitlines()
    first = json.loads(lines[0])
    copies = [json.dumps({**first, "id": f"{first['id']}-copy{i}"}) for i in range(2)]
    rollouts = tmp_path / "group.jsonl"
    rollouts.write_text("\n".join([*lines, *copies]) + "\n")
    summary = audit(tiny_checkpoint, rollouts, train="hf", infer="hf:dtype=bfloat16", out=tmp_path / "o").summary
    found = summary["prefix_consistency"]
    own_tokens = sum(len(s["tokens"]) for b in first["branches"] for s in b["segments"])
    for source in ("train", "infer"):
        assert found[source]["n_shared_tokens"] >= 3 * own_tokens - 3  # the copies share every token
        assert 0.0 <= found[source]["frac_prefixes_bitwise_equal"] <= 1.0
    assert found["sampler"]["n_shared_tokens"] <= found["train"]["n_shared_tokens"]


SPLIT = {"n_shared_tokens": 120, "n_prefixes": 41, "frac_prefixes_bitwise_equal": 8 / 41, "max_abs_spread": 0.013,
         "worst": {"rollouts": ["r-1", "r-7"], "pos": 12, "spread": 0.013}}
EQUAL = {"n_shared_tokens": 120, "n_prefixes": 41, "frac_prefixes_bitwise_equal": 1.0, "max_abs_spread": 0.0,
         "worst": None}


def test_a_split_prefix_in_an_inference_source_is_said_and_advised() -> None:
    """The sampler's or an inference engine's split prefixes advise the batch-invariant mode (unless
    probes ran and show no batch variance); the trainer's own replay does not: it is not the
    rollout engine."""
    from mismatch.present.headline import prefix_sentence
    from mismatch.results.section_records import PrefixConsistency
    from mismatch.results.summary_model import EngineEntry, from_builtins, partial_summary
    from tests.test_recommend import TOKEN_CAPS, recommend
    from tests.test_recommend import summary as make_summary

    engines = {"sampler": {"kind": "stored"}, "train": {"kind": "hf"}, "infer": {"kind": "vllm"}}
    for found, advised in [({"sampler": EQUAL, "train": SPLIT, "infer": EQUAL}, ()),
                           ({"sampler": EQUAL, "train": EQUAL, "infer": SPLIT}, ("infer",)),
                           ({"sampler": SPLIT, "train": SPLIT, "infer": SPLIT}, ("sampler", "infer"))]:
        summary = make_summary(corrections=TOKEN_CAPS, prefix_consistency=found)
        summary["engines"] = engines
        assert set(partial_summary(summary).split_prefixes()) == {s for s, item in found.items() if item is SPLIT}
        kinds = {rec.kind: rec for rec in recommend(summary)}
        assert ("batch_invariant" in kinds) == bool(advised)
        if advised:
            why = kinds["batch_invariant"].why
            assert why.startswith("the inference engine's log-probs change with what else is in the batch")
            assert all(f"{source} gave one prefix different log-probs in different requests" in why
                       for source in advised)
            no_variance = [{"source": "batch_size", "applicable": True, "bitwise_equal_frac": 1.0}]
            assert "batch_invariant" not in {rec.kind for rec in recommend(summary, probes=no_variance)}
    assert prefix_sentence("infer", from_builtins(SPLIT, PrefixConsistency), EngineEntry(kind="vllm")) == (
        "infer (vllm): the same prefix got different log-probs in different requests: 8 of 41 shared prefixes "
        "bitwise equal, spread up to 0.013 (rollouts r-1, r-7 at position 12): batch variance, or an engine bug "
        "(one request at a time tells them apart)")


def test_the_report_and_the_terminal_show_split_prefixes(capsys) -> None:
    from mismatch.cli import print_pairs
    from mismatch.reports.sections import findings_section
    from mismatch.results.summary_model import partial_summary
    from tests.test_recommend import summary as make_summary

    summary = make_summary(prefix_consistency={"sampler": EQUAL, "infer": SPLIT})
    summary["engines"]["infer"] = {"kind": "vllm"}
    summary["pairs"]["train/sampler"]["n_tokens"] = 10
    summary = partial_summary(summary)
    print_pairs(summary)
    printed = capsys.readouterr().out.replace("\n", " ")
    assert "infer (vllm): the same prefix got different log-probs in different requests: 8 of 41" in printed
    assert "sampler" not in printed.split("infer (vllm)")[1]  # the equal source is not flagged
    page = str(findings_section(summary))
    assert "Prefix consistency" in page and "8 of 41 shared prefixes bitwise equal" in page
    assert findings_section(partial_summary(make_summary(prefix_consistency={"sampler": EQUAL}))) is not None  # the table alone
