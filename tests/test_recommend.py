"""Recommendation rule on hand-made evidence, source fixes, and config snippets that parse with real keys."""

from __future__ import annotations

import sys

import numpy as np
import pandas as pd
import pytest
import yaml

from mismatch.advise.corrections import summary_corrections
from mismatch.errors import MismatchError
from mismatch.analysis.metrics import summarize_pairs
from mismatch.frameworks import FRAMEWORKS
from mismatch.advise.diagnose import diagnose as diagnose_summary
from mismatch.advise.readers import batch_variant_from_probes
from mismatch.advise.recommend import recommend as recommend_summary
from mismatch.advise.snippets import render_config
from mismatch.frameworks.protocol import Recommendation
from mismatch.results.section_records import Alignment, Drift
from mismatch.results.summary_model import ProbeResult, from_builtins, partial_summary, probe_results

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

SMALL = {"n_tokens": 1000, "kl_k3": 1e-4, "frac_outside_2": 0.0, "bitwise_equal_frac": 0.0,
         "ratio_q001": 0.97, "ratio_q999": 1.04}


def trunc(mode: str, cap: float, frac: float, ess: float) -> dict:
    return {"mode": mode, "params": {"cap": cap}, "frac_tokens_affected": frac, "frac_rollouts_affected": frac,
            "weight_mean": 1.0, "weight_max": cap, "ess": ess}


def _typed(findings: dict) -> dict:
    """Findings given beside a summary as plain data (probe results, drift, alignment) as records."""
    types = {"probes": list[ProbeResult], "drift": Drift, "alignment": Alignment}
    return {name: from_builtins(value, types[name]) if name in types and value is not None else value
            for name, value in findings.items()}


def diagnose(summary: dict, **findings):
    """The diagnosis of a hand-made summary, read as read_summary reads one (partial_summary)."""
    return diagnose_summary(partial_summary(summary), **_typed(findings))


def recommend(summary: dict, *args, **findings) -> list[Recommendation]:
    """The rule on a hand-made summary, read as read_summary reads one (partial_summary)."""
    return recommend_summary(partial_summary(summary), *args, **_typed(findings))


def summary(metrics: dict | None = None, corrections: list | None = None, **extra) -> dict:
    return {"schema": "mismatch.summary/v1", "pairs": {"train/sampler": metrics or SMALL},
            "counts": {"tokens": 12_345, "trainable_tokens": 4_321},
            "engines": {"sampler": {"kind": "stored", "meta": {"dtype": "float32"}}, "train": {"dtype": "float32"}},
            "corrections": corrections if corrections is not None else [], **extra}


TOKEN_CAPS = [trunc("token_truncate", 1.5, 0.05, 0.95), trunc("token_truncate", 2.0, 0.008, 0.93),
              trunc("token_truncate", 3.0, 0.001, 0.91)]


def the(recs: list[Recommendation], kind: str) -> Recommendation:
    [rec] = [r for r in recs if r.kind == kind]
    return rec


def test_smallest_cap_with_99pct_unclipped_and_ess_09_is_chosen_and_explained():
    rec = the(recommend(summary(corrections=TOKEN_CAPS)), "correction")
    assert rec.params["mode"] == "token_truncate" and rec.params["cap"] == 2.0 and rec.params["meets_rule"]
    assert "token_truncate cap 2 keeps the most ESS of the 3 simulated corrections a framework can express " \
           "that change at most 1% of trainable tokens with ESS >= 0.9 (ESS 0.930, 0.80% of tokens clipped" in rec.why
    assert "cap 1.5 would clip 5.00% (ESS 0.950)" in rec.why
    assert "kl_k3 0.0001" in rec.why and "token-level modes (the position trend was not measured" in rec.why


def test_a_cap_failing_ess_is_skipped():
    caps = [trunc("token_truncate", 1.5, 0.005, 0.85), trunc("token_truncate", 2.0, 0.001, 0.92)]
    assert the(recommend(summary(corrections=caps)), "correction").params["cap"] == 2.0


def test_when_no_cap_meets_the_rule_the_highest_ess_is_taken_and_said():
    caps = [trunc("token_truncate", 1.5, 0.2, 0.5), trunc("token_truncate", 3.0, 0.05, 0.8)]
    rec = the(recommend(summary(corrections=caps)), "correction")
    assert rec.params["cap"] == 3.0 and rec.params["meets_rule"] is False
    assert "no simulated correction a framework can express changes at most 1% of tokens with ESS >= 0.9; " \
           "token_truncate cap 3 keeps the most ESS" in rec.why


def test_sequence_level_when_mismatch_grows_with_position():
    caps = [*TOKEN_CAPS, trunc("sequence_truncate", 2.0, 0.02, 0.9), trunc("sequence_truncate", 5.0, 0.004, 0.95)]
    rec = the(recommend(summary(corrections=caps), grows_with_position=True), "correction")
    assert (rec.params["mode"], rec.params["cap"]) == ("sequence_truncate", 5.0)
    assert "sequence-level modes only, because the mismatch grows with position" in rec.why


def test_position_trend_is_read_from_the_turns_localizer():
    caps = [*TOKEN_CAPS, trunc("sequence_truncate", 5.0, 0.004, 0.95)]
    located = summary(corrections=caps, localization={"turns": {"position_slope": {"grows_with_position": True}}})
    assert the(recommend(located), "correction").params["mode"] == "sequence_truncate"


@pytest.mark.parametrize(("metrics", "gap"), [
    ({**SMALL, "kl_k3": 1e-8}, "negligible"), ({**SMALL, "bitwise_equal_frac": 1.0}, "exact"),
    ({**SMALL, "n_tokens": 0}, "unknown")])
def test_no_correction_and_no_source_fix_without_a_gap(metrics, gap):
    recs = recommend(summary(metrics, corrections=TOKEN_CAPS))
    assert [(r.kind, r.params) for r in recs] == [("no_correction", {"gap": gap})]


LARGE = {**SMALL, "kl_k3": 5e-3, "frac_outside_2": 0.004}


def test_a_small_gap_gets_the_cap_alone():
    bf16 = summary(corrections=TOKEN_CAPS)
    bf16["engines"]["sampler"]["meta"]["dtype"] = "bfloat16"
    assert [r.kind for r in recommend(bf16)] == ["correction"]  # no recompute pass, no fp16 migration


def bf16_rounding(metrics: dict) -> dict:
    """A bf16 sampler whose rounding the dtype probes confirm: a numeric cause no fix removes."""
    found = summary(metrics, corrections=TOKEN_CAPS)
    found["engines"]["sampler"]["meta"]["dtype"] = "bfloat16"
    return found


def test_recompute_states_its_cost_from_the_counts():
    rec = the(recommend(bf16_rounding(LARGE), probes=DTYPE_PROBES), "recompute_old_logprobs")
    assert rec.params == {"extra_forward_tokens": 12_345, "trainable_tokens": 4_321}
    assert rec.why.endswith("cost: one extra forward pass (no backward) over N = 12,345 tokens per batch "
                            "like this one (4,321 of them trainable)")


DTYPE_PROBES = [{"source": "dtype", "applicable": True, "bitwise_equal_frac": 0.0}]


def test_fp16_only_where_the_evidence_says_the_gap_is_bf16_rounding():
    assert "fp16" not in [r.kind for r in recommend(summary(LARGE, corrections=TOKEN_CAPS), probes=DTYPE_PROBES)]
    bf16 = summary(LARGE, corrections=TOKEN_CAPS)
    bf16["engines"]["sampler"]["meta"]["dtype"] = "bfloat16"
    # A bf16 sampler alone is no evidence: the gap could be weights, a harness or kernels.
    assert "fp16" not in [r.kind for r in recommend(bf16)]
    assert the(recommend(bf16, probes=DTYPE_PROBES), "fp16").params["sources"] == ["sampler"]
    # A small bf16 gap: the cause is named, the correction alone is recommended (fp16 is a migration).
    small = summary(corrections=TOKEN_CAPS)
    small["engines"]["sampler"]["meta"]["dtype"] = "bfloat16"
    assert diagnose(small, probes=DTYPE_PROBES).lead.kind == "precision"
    assert [r.kind for r in recommend(small, probes=DTYPE_PROBES)] == ["correction"]
    # A bf16 replay of the trainer's weights reproducing the sampler confirms it too.
    replayed = {**bf16, "pairs": {**bf16["pairs"], "infer/sampler": {**SMALL, "kl_k3": 1e-8},
                                  "train/infer": LARGE},
                "engines": {**bf16["engines"], "infer": {"kind": "hf-decode", "dtype": "bfloat16"}}}
    fp16 = the(recommend(replayed), "fp16")
    assert fp16.params["bf16_source"] == "sampler" and "reproduces sampler" in fp16.why
    # meta.sampler says bf16, but an fp32 replay gives the stored log-probs bit for bit: not bf16.
    wrong = {**replayed, "pairs": {**replayed["pairs"], "infer/sampler": {**SMALL, "bitwise_equal_frac": 1.0}},
             "engines": {**bf16["engines"], "infer": {"kind": "hf-decode", "dtype": "float32"}}}
    assert "fp16" not in [r.kind for r in recommend(wrong, probes=DTYPE_PROBES)]


def test_source_fixes_from_probes_drift_and_alignment():
    probes = [{"source": "batch_size", "applicable": True, "bitwise_equal_frac": 0.97},
              {"source": "dtype", "applicable": True, "bitwise_equal_frac": 0.0}]
    recs = recommend(summary(LARGE, corrections=TOKEN_CAPS), probes=probes, drift={"spans": [{}, {}]},
                     alignment={"shift": 0, "logprob_semantics": "processed"})
    kinds = [r.kind for r in recs]
    # Processed log-probs first (the raw pair is not like for like), then the harness, then the engine;
    # no recompute: the gap has causes a fix removes, which a second forward pass would only hide.
    assert kinds == ["raw_logprobs", "fix_renderer", "batch_invariant", "correction"]
    assert the(recs, "fix_renderer").params["spans"] == 2
    assert the(recs, "batch_invariant").params["vllm_env"] == "VLLM_BATCH_INVARIANT=1"


def test_a_shift_is_fixed_first_and_alone():
    # Misaligned pairs make every ratio meaningless: no cap, no recompute, no fp16 from them.
    recs = recommend(summary(LARGE, corrections=TOKEN_CAPS), drift={"spans": [{}]},
                     alignment={"shift": -1, "logprob_semantics": "processed"})
    assert [r.kind for r in recs] == ["fix_alignment"]
    assert recs[0].params == {"shift": -1, "rollouts": []} and "shifted by -1" in recs[0].why


def test_batch_variance_from_probes():
    assert batch_variant_from_probes([]) is None
    assert batch_variant_from_probes(probe_results([{"source": "batch_size", "applicable": True, "bitwise_equal_frac": 1.0}])) is False
    assert batch_variant_from_probes(probe_results([{"source": "split_kv", "applicable": True, "bitwise_equal_frac": 0.5}])) is True
    assert batch_variant_from_probes(probe_results([{"source": "tf32", "applicable": True, "bitwise_equal_frac": 0.5}])) is None


def test_missing_simulations_are_a_user_error():
    with pytest.raises(MismatchError) as info:
        recommend(summary())
    assert str(info.value) == ("no simulated corrections that a framework can express: summary.json has no "
                               "'corrections' (simulate them with mismatch.advise.corrections.summary_corrections)")


def test_the_mode_is_chosen_by_the_measured_trade_off_and_the_winner_is_explained():
    """A heavy two-sided tail: the band (IcePop) keeps more ESS than any cap within 1% dropped."""
    band = {"mode": "token_icepop", "params": {"low": 0.5, "high": 5.0}, "frac_tokens_affected": 0.004,
            "frac_rollouts_affected": 0.1, "weight_mean": 0.99, "weight_max": 5.0, "ess": 0.97}
    rec = the(recommend(summary(corrections=[*TOKEN_CAPS, band])), "correction")
    assert (rec.params["mode"], rec.params["low"], rec.params["high"]) == ("token_icepop", 0.5, 5.0)
    assert "token_icepop [0.5, 5] keeps the most ESS of the 4 simulated corrections" in rec.why
    assert "0.40% of tokens dropped" in rec.why and "the best other mode, token_truncate cap 2" in rec.why
    assert [r["mode"] for r in rec.params["ranked"]][:2] == ["token_icepop", "token_truncate"]


def test_each_framework_gets_the_best_mode_its_release_can_express():
    """prime-rl caps no ratio: its snippet carries the IPO mask simulated on the same tokens; TRL 1.16
    takes the band as token_mask with clip_min; a rejection filter is never the correction."""
    from mismatch.frameworks import parse_target

    ipo = {"mode": "ipo_mask", "params": {"threshold": 0.1}, "frac_tokens_affected": 0.004,
           "frac_rollouts_affected": 0.1, "weight_mean": 0.99, "weight_max": 3.0, "ess": 0.92}
    rs = {"mode": "rs_token_k3", "params": {"high": 0.01}, "frac_tokens_affected": 0.001,
          "frac_rollouts_affected": 0.1, "weight_mean": 1.0, "weight_max": 1.0, "ess": 0.999}
    found = summary(corrections=[*TOKEN_CAPS, ipo, rs])
    prime = the(recommend(found, parse_target("prime-rl", detect=False)), "correction")
    assert prime.params["mode"] == "ipo_mask" and prime.params["framework"].startswith("prime-rl ")
    assert the(recommend(found), "correction").params["mode"] == "token_truncate"
    assert the(recommend(found, parse_target("trl==1.16.0")), "correction").params["mode"] == "token_truncate"


def test_unknown_framework():
    with pytest.raises(MismatchError) as info:
        render_config([], "deepspeed-chat")
    assert str(info.value) == "unknown framework 'deepspeed-chat' (valid: verl, trl, slime, prime-rl, openrlhf, areal)"


def test_end_to_end_from_a_token_table_every_framework_gets_a_correction_it_can_run():
    """A bf16-like gap on a tiny token table: simulate, recommend per framework, render. Each snippet
    sets a correction its release expresses (tests/test_releases.py loads them into the releases)."""
    from mismatch.frameworks import module, parse_target

    rng = np.random.default_rng(0)
    n = 400
    rollout = np.repeat([f"r{i}" for i in range(8)], n // 8)
    table = pd.DataFrame({"rollout": rollout, "branch": "main", "turn": np.tile(np.repeat([0, 1], 25), 8),
                          "trainable": True, "logp_sampler": -rng.uniform(0.1, 3.0, n)})
    table["logp_train"] = table["logp_sampler"] + rng.normal(0, 0.05, n)
    pairs = summarize_pairs(table, [("train", "sampler")])
    result = summary(pairs["train/sampler"], corrections=summary_corrections(table))
    assert the(recommend(result), "correction").params["meets_rule"]
    for framework in FRAMEWORKS:
        target = parse_target(framework, detect=False)
        chosen = the(recommend(result, target), "correction")
        assert module(framework).express(chosen.params["mode"], chosen.params, target.release) is not None
        text = render_config(recommend(result, target), target)
        assert "cannot express" not in text and chosen.params["mode"] in text


def test_a_planted_off_by_one_gets_only_the_alignment_fix(tmp_path) -> None:
    """End to end: the golden fixture with every stored sampler log-prob moved one token left."""
    import json

    import mismatch
    from test_golden import GOLDEN, stored_checkpoint

    lines = []
    for line in (GOLDEN / "rollouts.jsonl").read_text().splitlines():
        rollout = json.loads(line)
        for branch in rollout["branches"]:
            for segment in branch["segments"]:
                if segment.get("logprobs"):  # stored[i] is now the log-prob of token i + 1
                    segment["logprobs"] = segment["logprobs"][1:] + segment["logprobs"][-1:]
        lines.append(json.dumps(rollout))
    shifted = tmp_path / "shifted.jsonl"
    shifted.write_text("\n".join(lines) + "\n")
    result = mismatch.audit(stored_checkpoint(tmp_path / "ckpt"), shifted, train="stored:trainer",
                            infer="stored:engine")
    assert result.summary["alignment"]["shift"] == 1
    assert [r["kind"] for r in result.summary["recommendations"]] == ["fix_alignment"]
    assert "rollout_correction" not in result.summary["config_snippets"]["verl"]


def test_every_recommendation_says_what_it_costs():
    from mismatch.frameworks.protocol import COSTS

    probes = [{"source": "batch_size", "applicable": True, "bitwise_equal_frac": 0.97}]
    bf16 = summary(LARGE, corrections=TOKEN_CAPS)
    bf16["engines"]["sampler"]["meta"]["dtype"] = "bfloat16"
    recs = recommend(bf16, probes=[*probes, *DTYPE_PROBES], drift={"spans": [{}]},
                     alignment={"logprob_semantics": "processed"})
    recs += recommend(bf16_rounding(LARGE), probes=DTYPE_PROBES)  # recompute: a large gap no fix removes
    assert {r.kind for r in recs} == {"fix_renderer", "correction", "recompute_old_logprobs", "fp16",
                                      "batch_invariant", "raw_logprobs"}
    assert all(r.cost == COSTS[r.kind] and r.to_dict()["cost"] for r in recs)
    assert "(cost: one extra forward pass" in render_config(recs, "verl")


def correction(mode: str, **params: float) -> list[Recommendation]:
    return [Recommendation(kind="correction", params={"mode": mode, **params}, why="test")]


def test_verl_k_statistic_rejection_is_never_turned_into_a_ratio_cap():
    for framework in ("trl", "slime", "prime-rl", "openrlhf", "areal"):
        text = render_config(correction("rs_token_k3", high=0.01), framework)
        flat = " ".join(line.removeprefix("#").strip() for line in text.splitlines())  # comments wrap
        assert "cannot express rs_token_k3 high 0.01: nothing to set for it" in flat
        assert "0.01" not in text.split("nothing to set for it")[-1]
    assert "rollout_rs: token_k3" in render_config(correction("rs_token_k3", high=0.01), "verl")


def _routing(with_k3: float, without_k3: float) -> dict:
    return {"train/infer": {"frac_tokens_with_flip": 0.014,
                            "with_flip": {"n_tokens": 9, "kl_k3": with_k3 / 9, "k3_sum": with_k3},
                            "without_flip": {"n_tokens": 623, "kl_k3": without_k3 / 623, "k3_sum": without_k3}}}


def routing_summary() -> dict:
    """Flips between two replays of one checkpoint (routing replay is claimed only with the same
    weights on both sides: a fault on one side flips routing too)."""
    found = {**summary(SMALL, corrections=TOKEN_CAPS), "routing": _routing(0.0014, 0.0008), "checkpoint": "ckpt"}
    found["engines"] = {**found["engines"], "train": {"kind": "hf", "dtype": "bfloat16"},
                        "infer": {"kind": "hf", "dtype": "float32"}}
    return found


def test_an_unexplained_large_gap_gets_the_correction_alone():
    """No cause passes its test: no fix, no fp16, no recompute, only the correction meanwhile."""
    recs = recommend(summary(LARGE, corrections=TOKEN_CAPS))
    assert [r.kind for r in recs] == ["correction"]


def test_routing_replay_when_routing_flips_carry_most_of_the_gap_with_each_frameworks_keys():
    base = summary(SMALL, corrections=TOKEN_CAPS)
    assert "routing_replay" not in [r.kind for r in recommend({**base, "routing": _routing(0.4, 0.6)})]
    recs = recommend(routing_summary())
    routing = next(r for r in recs if r.kind == "routing_replay")
    assert routing.params["pair"] == "train/infer" and abs(routing.params["k3_share"] - 0.636) < 1e-3
    snippets = {framework: render_config(recs, framework) for framework in FRAMEWORKS}
    verl = yaml.safe_load(snippets["verl"])  # the key verl 0.9.1's workers read (tests/test_releases.py)
    assert verl["actor_rollout_ref"]["actor"]["megatron"]["router_replay"]["mode"] == "R3"
    assert verl["actor_rollout_ref"]["rollout"]["enable_rollout_routing_replay"] is True
    assert "--use-rollout-routing-replay" in snippets["slime"]
    prime = tomllib.loads(snippets["prime-rl"])
    assert prime["trainer"]["enable_router_replay"] is True
    for framework in ("trl", "openrlhf"):
        assert "has no such option; verl, slime and prime-rl do" in snippets[framework]
    assert "does not replay them" in snippets["areal"]
