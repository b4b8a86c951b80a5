"""Turn/position localizer on hand-made token tables with planted faults, and on real replayed rollouts."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from mismatch.errors import MismatchError
from mismatch.localize.slope import position_slope, t_critical, t_sf2
from mismatch.localize.turns import PROB_LABELS, OnsetRule, localize_turns
from mismatch.rollouts import segment_turns

EXAMPLE_ROLLOUTS = Path(__file__).resolve().parents[1] / "examples" / "rollouts.jsonl"


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def make_table(*, num_rollouts: int = 6, num_turns: int = 8, prompt_len: int = 10, reply_len: int = 30,
               sigma: float = 0.01, onset: int | None = None, onset_sigma: float = 0.05,
               growth_per_1k: float = 0.0, seed: int = 0) -> pd.DataFrame:
    """A token table like plan_replay's: per turn a user prompt (not trainable), then a reply.

    log_ratio = logp_train - logp_sampler ~ N(0, sd) with sd = sigma + growth_per_1k * pos / 1000,
    or onset_sigma from turn `onset` on.
    """
    rng = np.random.default_rng(seed)
    rows = []
    for r in range(num_rollouts):
        pos = 0
        for turn in range(num_turns):
            for segment, (role, length) in enumerate([("user", prompt_len), ("assistant", reply_len)]):
                for _ in range(length):
                    trainable = role == "assistant"
                    rows.append((f"r{r}", "main", "main", turn, 2 * turn + segment, pos, role, trainable))
                    pos += 1
    table = pd.DataFrame(rows, columns=["rollout", "branch", "branch_kind", "turn", "segment", "pos", "role",
                                        "trainable"])
    n = len(table)
    table["token_id"] = rng.integers(10, 1000, n)
    logp_sampler = -rng.exponential(2.0, n)  # every probability bucket gets tokens
    sd = sigma + growth_per_1k * table["pos"].to_numpy() / 1000
    if onset is not None:
        sd = np.where(table["turn"].to_numpy() >= onset, onset_sigma, sd)
    table["logp_sampler"] = logp_sampler
    table["logp_train"] = logp_sampler + rng.normal(0.0, 1.0, n) * sd
    for key in ("rollout", "branch", "branch_kind", "role"):
        table[key] = table[key].astype("category")
    return table


@pytest.mark.parametrize("statistic", ["prob_adjusted", "raw"])
def test_planted_onset_at_turn_3_is_found(statistic: str) -> None:
    out = localize_turns(make_table(onset=3), rule=OnsetRule(statistic=statistic))
    assert out["onset_turn"] == 3
    assert [row["departs"] for row in out["by_turn"][:4]] == [False, False, False, True]
    assert out["by_turn"][3]["log_ratio_abs_mean"] > 3 * out["by_turn"][2]["log_ratio_abs_mean"]
    assert out["onset_params"]["statistic"] == statistic and "onset =" in out["onset_rule"]


def test_clean_table_has_no_onset_and_no_position_trend() -> None:
    out = localize_turns(make_table())
    assert out["onset_turn"] is None
    assert [row["turn"] for row in out["by_turn"]] == list(range(8))
    assert all(row["baseline"] is not None for row in out["by_turn"][1:])
    slope = out["position_slope"]
    lo, hi = slope["ci95_per_1k"]
    assert lo < 0 < hi and not slope["grows_with_position"]
    assert slope["p_value"] > 0.05


def test_linear_growth_with_position_is_detected_with_its_slope() -> None:
    growth = 0.02  # sd of log_ratio grows by 0.02 per 1k tokens; E|N(0, sd)| = sd * sqrt(2/pi)
    out = localize_turns(make_table(growth_per_1k=growth, num_turns=10))
    slope = out["position_slope"]
    assert slope["grows_with_position"]
    expected = growth * math.sqrt(2 / math.pi)
    lo, hi = slope["ci95_per_1k"]
    assert lo > 0 and lo < expected < hi
    lo, hi = slope["ci95_cluster_per_1k"]
    assert lo > 0 and slope["n_sequences"] == 6


def test_position_slope_matches_least_squares_and_t_tables() -> None:
    rng = np.random.default_rng(1)
    pos = rng.integers(0, 4000, 200)
    y = 0.01 + 0.003 * pos / 1000 + rng.normal(0, 0.01, 200)
    out = position_slope(pos, y)
    design = np.column_stack([np.ones(200), pos / 1000])
    coef, ssr, *_ = np.linalg.lstsq(design, y, rcond=None)
    cov = ssr[0] / 198 * np.linalg.inv(design.T @ design)
    assert out["slope_per_1k"] == pytest.approx(coef[1], rel=1e-9)
    assert out["intercept"] == pytest.approx(coef[0], rel=1e-9)
    assert out["se"] == pytest.approx(math.sqrt(cov[1, 1]), rel=1e-9)
    half = (out["ci95_per_1k"][1] - out["ci95_per_1k"][0]) / 2
    assert half == pytest.approx(1.9720174778338955 * out["se"], rel=1e-9)  # t(0.975, 198)
    # Student-t against printed tables.
    assert t_critical(0.975, 1) == pytest.approx(12.7062047, rel=1e-7)
    assert t_critical(0.975, 10) == pytest.approx(2.2281389, rel=1e-7)
    assert t_sf2(2.0, 5) == pytest.approx(0.1019395, rel=1e-6)
    assert position_slope(np.full(5, 7), np.arange(5.0))["slope_per_1k"] is None  # one position


def test_low_probability_tokens_carry_the_planted_mismatch() -> None:
    table = make_table(sigma=0.001)
    low = table["logp_sampler"] < math.log(1e-2)
    table.loc[low, "logp_train"] = table.loc[low, "logp_sampler"] + 0.3
    buckets = localize_turns(table)["by_prob_bucket"]
    assert [b["bucket"] for b in buckets] == list(PROB_LABELS)
    assert sum(b["n_tokens"] for b in buckets) == int(table["trainable"].sum())
    means = [b["log_ratio_abs_mean"] for b in buckets]
    assert means[0] == pytest.approx(0.3) and means[1] == pytest.approx(0.3)
    assert max(means[2:]) < 0.002


def test_empty_bucket_keeps_a_row_and_output_is_strict_json() -> None:
    table = make_table()
    table["logp_sampler"] = np.log(0.95)  # every token in the top bucket
    out = localize_turns(table)
    assert [b["n_tokens"] for b in out["by_prob_bucket"]][:5] == [0, 0, 0, 0, 0]
    assert out["by_prob_bucket"][0]["log_ratio_abs_mean"] is None
    json.dumps(out, allow_nan=False)


def test_turn_of_near_certain_tokens_does_not_make_the_next_turn_an_onset() -> None:
    """Same per-bucket mismatch; turn 0 is mostly p>0.9 tokens, later turns mostly p<0.1 ones."""
    rng = np.random.default_rng(2)
    table = make_table(num_turns=4)
    turn0 = table["turn"].to_numpy() == 0
    certain = rng.random(len(table)) < np.where(turn0, 0.9, 0.1)
    table["logp_sampler"] = np.where(certain, np.log(0.97), np.log(0.03))
    size = np.where(certain, 0.001, 0.02)  # mismatch depends on the probability only
    table["logp_train"] = table["logp_sampler"] + rng.normal(0, 1, len(table)) * size
    assert localize_turns(table, rule=OnsetRule(statistic="raw"))["onset_turn"] == 1
    assert localize_turns(table)["onset_turn"] is None


def test_roles_branch_kinds_and_trainable_filter() -> None:
    table = make_table(num_rollouts=4)
    table["branch_kind"] = table["branch_kind"].cat.add_categories(["subagent"])
    sub = table["rollout"].isin(["r3"])
    table.loc[sub, "branch_kind"] = "subagent"
    table.loc[sub, "logp_train"] = table.loc[sub, "logp_sampler"] - 0.1
    out = localize_turns(table)
    assert [r["role"] for r in out["by_role"]] == ["assistant"]
    kinds = {r["branch_kind"]: r for r in out["by_branch_kind"]}
    assert kinds["subagent"]["log_ratio_abs_mean"] == pytest.approx(0.1)
    assert kinds["main"]["log_ratio_abs_mean"] < 0.02
    everything = localize_turns(table, trainable_only=False)
    assert [r["role"] for r in everything["by_role"]] == ["assistant", "user"]
    assert everything["n_tokens"] == len(table)


def test_nan_log_probs_are_dropped_and_missing_columns_are_named() -> None:
    table = make_table()
    table.loc[table["turn"] == 0, "logp_sampler"] = np.nan  # a turn the sampler stored nothing for
    out = localize_turns(table)
    assert out["by_turn"][0]["turn"] == 1 and out["n_tokens"] == 6 * 7 * 30
    with pytest.raises(MismatchError) as err:
        localize_turns(table, "train", "infer")
    assert str(err.value).startswith("pair train/infer: token table has no column 'logp_infer' (columns: ")
    with pytest.raises(MismatchError, match=r"^onset statistic 'mean' is not one of: prob_adjusted, raw$"):
        OnsetRule(statistic="mean")


def _perturbed_rollouts(path: Path, *, from_turn: int, delta: float) -> Path:
    """examples/rollouts.jsonl with every stored sampler log-prob of turn >= from_turn shifted."""
    lines = []
    for line in EXAMPLE_ROLLOUTS.read_text().splitlines():
        rollout = json.loads(line)
        for branch in rollout["branches"]:
            turns = segment_turns([segment["role"] for segment in branch["segments"]])
            for segment, turn in zip(branch["segments"], turns):
                if turn >= from_turn and segment.get("logprobs"):
                    segment["logprobs"] = [value + delta for value in segment["logprobs"]]
        lines.append(json.dumps(rollout))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_replayed_rollouts_clean_and_with_a_planted_turn_fault(tiny_checkpoint, tmp_path) -> None:
    from mismatch.pipeline.audit import audit

    clean = audit(tiny_checkpoint, EXAMPLE_ROLLOUTS, train="hf", infer="sampler").tokens
    assert localize_turns(clean)["onset_turn"] is None
    for turn in (1, 2):
        faulty = _perturbed_rollouts(tmp_path / f"from-{turn}.jsonl", from_turn=turn, delta=-0.05)
        tokens = audit(tiny_checkpoint, faulty, train="hf", infer="sampler").tokens
        assert localize_turns(tokens)["onset_turn"] == turn
