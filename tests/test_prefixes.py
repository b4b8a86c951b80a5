"""Prefix consistency: the same token after the same prefix must get the same log-prob from one
engine config, whatever request it came in."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd

from mismatch.analysis.prefixes import prefix_consistency, prefix_keys
from mismatch.audit import audit
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
