"""Correction simulator: every mode against a hand-computed case, TRL's contract modes against TRL's code."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest

from mismatch.advise.corrections import (DEFAULT_CORRECTIONS, MODES, Correction, correction_weights,
                                  effective_sample_size, simulate, simulate_table, summary_corrections)
from mismatch.results.summary_model import to_builtins
from mismatch.errors import MismatchError

# Three sequences over two rollouts, token ratios chosen so every threshold below is easy to check by hand:
#   A = r0/main: ratios 4, 0.5   -> sequence ratio 2,   geometric sqrt(2) = 1.414
#   B = r0/sub:  ratio 1.5       -> sequence ratio 1.5, geometric 1.5
#   C = r1/main: ratios 1, 0.25, 8 -> sequence ratio 2, geometric 2^(1/3) = 1.26
# plus a non-trainable token (ratio 100) in A and a NaN (no sampler log-prob) in C: both must be dropped.
RATIOS = [4.0, 100.0, 0.5, 1.5, 1.0, 0.25, float("nan"), 8.0]
SEQ = ["r0/main", "r0/main", "r0/main", "r0/sub", "r1/main", "r1/main", "r1/main", "r1/main"]
ROLLOUT = ["r0", "r0", "r0", "r0", "r1", "r1", "r1", "r1"]
TURN = [0, 0, 1, 1, 0, 0, 1, 1]
TRAINABLE = [True, False, True, True, True, True, True, True]
LOG_RATIO = np.log(RATIOS)
# The sampler's probabilities, for the probability-gap modes: pi_train = ratio * pi_sampler, so the
# gaps pi_train - pi_sampler of the kept tokens are 0.3 -0.3 0.2 0 -0.6 0.35.
P_SAMPLER = [0.1, 0.005, 0.6, 0.4, 0.5, 0.8, 0.3, 0.05]
LOGP_SAMPLER = np.log(P_SAMPLER)
G2, G3 = math.sqrt(2), 2 ** (1 / 3)

# mode, params, expected weight and affected flag of the 6 kept tokens A0 A1 B0 C0 C1 C2.
HAND_CASES = [
    ("token_truncate", {"cap": 2.0}, [2, .5, 1.5, 1, .25, 2], [1, 0, 0, 0, 0, 1]),
    ("token_mask", {"cap": 3.0}, [0, .5, 1.5, 1, .25, 0], [1, 0, 0, 0, 0, 1]),
    ("sequence_truncate", {"cap": 1.8}, [1.8, 1.8, 1.5, 1.8, 1.8, 1.8], [1, 1, 0, 1, 1, 1]),
    ("sequence_mask", {"cap": 1.8}, [0, 0, 1.5, 0, 0, 0], [1, 1, 0, 1, 1, 1]),
    ("geometric_truncate", {"cap": 1.3}, [1.3, 1.3, 1.3, G3, G3, G3], [1, 1, 1, 0, 0, 0]),
    # 0.5 sits exactly on the lower bound: kept, as clamp / >= keep it.
    ("token_clip", {"low": .5, "high": 2.0}, [2, .5, 1.5, 1, .5, 2], [1, 0, 0, 0, 1, 1]),
    ("token_icepop", {"low": .5, "high": 5.0}, [4, .5, 1.5, 1, 0, 0], [0, 0, 0, 0, 1, 1]),
    # TRL sequence_truncate with clip_min: A and C (sequence ratio 2) clamp to 1.8, B (1.5) is inside.
    ("sequence_clip", {"low": .5, "high": 1.8}, [1.8, 1.8, 1.5, 1.8, 1.8, 1.8], [1, 1, 0, 1, 1, 1]),
    ("sequence_icepop", {"low": .5, "high": 1.8}, [0, 0, 1.5, 0, 0, 0], [1, 1, 0, 1, 1, 1]),
    ("geometric_icepop", {"low": 1.3, "high": 1.45}, [G2, G2, 0, 0, 0, 0], [0, 0, 1, 1, 1, 1]),
    # OpenRLHF seq-mask-tis: A's geometric ratio passes, so A keeps its raw token ratios 4 and 0.5.
    ("seq_mask_tis", {"low": 1.3, "high": 1.45}, [4, .5, 0, 0, 0, 0], [0, 0, 1, 1, 1, 1]),
    # prime-rl sequence_mask_low/high: C holds a 0.25 < 0.3, so all of C goes.
    ("sequence_minmax_mask", {"low": .3, "high": 5.0}, [4, .5, 1.5, 0, 0, 0], [0, 0, 0, 1, 1, 1]),
    # r0's ratio is 2 * 1.5 = 3 -> 2.5 on all of A and B; r1's is 2, inside.
    ("rollout_clip", {"low": .5, "high": 2.5}, [2.5, 2.5, 2.5, 2, 2, 2], [1, 1, 1, 0, 0, 0]),
    # Both rollouts hold 3 tokens, so the rebalancing factor is 1 here (see the unbalanced test below).
    ("rollout_balanced_truncate", {"cap": 2.0}, [2, .5, 1.5, 1, .25, 2], [1, 0, 0, 0, 0, 1]),
    # verl k1 bounds apply to -log ratio: kept when 0.2 <= 1/ratio <= 1, i.e. 1 <= ratio <= 5.
    ("rs_token_k1", {"low": .2, "high": 1.0}, [1, 0, 1, 1, 0, 0], [0, 1, 0, 0, 1, 1]),
    # k2 = log(r)^2/2: 0.961 0.240 0.082 0 0.961 2.162
    ("rs_token_k2", {"high": .5}, [0, 1, 1, 1, 0, 0], [1, 0, 0, 0, 1, 1]),
    # k3 = r - 1 - log r: 1.614 0.193 0.095 0 0.636 4.921
    ("rs_token_k3", {"high": 1.0}, [0, 1, 1, 1, 1, 0], [1, 0, 0, 0, 0, 1]),
    # sum of -log r: A -0.693, B -0.405, C -0.693; kept within [log 0.6, log 2] = [-0.511, 0.693]
    ("rs_seq_sum_k1", {"low": .6, "high": 2.0}, [0, 0, 1, 0, 0, 0], [1, 1, 0, 1, 1, 1]),
    # sum of k2: A 1.201, B 0.082, C 3.123
    ("rs_seq_sum_k2", {"high": 1.5}, [1, 1, 1, 0, 0, 0], [0, 0, 0, 1, 1, 1]),
    # sum of k3: A 1.807, B 0.095, C 5.557
    ("rs_seq_sum_k3", {"high": 1.0}, [0, 0, 1, 0, 0, 0], [1, 1, 0, 1, 1, 1]),
    # mean of -log r: A -0.347, B -0.405, C -0.231; kept within [log 0.68, log 0.8] = [-0.386, -0.223]
    ("rs_seq_mean_k1", {"low": .68, "high": .8}, [1, 1, 0, 1, 1, 1], [0, 0, 1, 0, 0, 0]),
    # mean of k2: A 0.601, B 0.082, C 1.041
    ("rs_seq_mean_k2", {"high": .7}, [1, 1, 1, 0, 0, 0], [0, 0, 0, 1, 1, 1]),
    # mean of k3: A 0.903, B 0.095, C 1.852
    ("rs_seq_mean_k3", {"high": .5}, [0, 0, 1, 0, 0, 0], [1, 1, 0, 1, 1, 1]),
    # max of k2: A 0.961, B 0.082, C 2.162
    ("rs_seq_max_k2", {"high": 1.0}, [1, 1, 1, 0, 0, 0], [0, 0, 0, 1, 1, 1]),
    # max of k3: A 1.614, B 0.095, C 4.921
    ("rs_seq_max_k3", {"high": 1.5}, [0, 0, 1, 0, 0, 0], [1, 1, 0, 1, 1, 1]),
    # slime's veto: C holds a ratio 0.25 < 0.3, so C is rejected whole; A and B are kept (weight 1).
    ("veto_mask", {"threshold": .3}, [1, 1, 1, 0, 0, 0], [0, 0, 0, 1, 1, 1]),
    # prime-rl IPO: |gap| > 0.25 masks A0 (0.3), A1 (-0.3), C1 (-0.6), C2 (0.35); kept tokens keep their ratio.
    ("ipo_mask", {"threshold": .25}, [0, 0, 1.5, 1, 0, 0], [1, 1, 0, 0, 1, 1]),
    # prime-rl DPPO, positive advantage: gap > 0.25 masks A0 and C2.
    ("dppo_positive", {"high": .25}, [0, .5, 1.5, 1, .25, 0], [1, 0, 0, 0, 0, 1]),
    # prime-rl DPPO, negative advantage: gap < -0.25 masks A1 and C1.
    ("dppo_negative", {"low": .25}, [4, 0, 1.5, 1, 0, 8], [0, 1, 0, 0, 1, 0]),
]


def kept(values: list) -> list:
    """The 6 tokens that survive (drop the non-trainable index 1 and the NaN index 6)."""
    return [v for i, v in enumerate(values) if i not in (1, 6)]


def test_every_mode_has_a_hand_case():
    assert sorted(mode for mode, *_ in HAND_CASES) == sorted(MODES)


@pytest.mark.parametrize(("mode", "params", "weight", "affected"), HAND_CASES, ids=[c[0] for c in HAND_CASES])
def test_mode_matches_hand_computed_case(mode, params, weight, affected):
    keep = np.array(TRAINABLE) & ~np.isnan(LOG_RATIO)
    got_weight, got_affected = correction_weights(LOG_RATIO[keep], Correction(mode=mode, params=params),
                                                  seq=np.array(SEQ)[keep], rollout=np.array(ROLLOUT)[keep],
                                                  logp_sampler=LOGP_SAMPLER[keep])
    assert got_weight.tolist() == pytest.approx(weight, rel=1e-12)
    assert got_affected.tolist() == [bool(a) for a in affected]


@pytest.mark.parametrize(("mode", "params"), [("token_mask", {"cap": 4.0}), ("token_truncate", {"cap": 4.0}),
                                               ("token_icepop", {"low": .25, "high": 4.0})])
def test_a_ratio_equal_to_the_bound_is_kept(mode, params):
    # TRL masks ratio > cap and clamps at cap; verl IcePop keeps low <= ratio <= high: ties stay untouched.
    weight, affected = correction_weights(np.log([4.0, 0.25]), Correction(mode=mode, params=params), seq=[0, 0])
    assert weight.tolist() == [4.0, 0.25] and not affected.any()


def test_stats_of_token_truncate_by_hand():
    [result] = simulate(LOG_RATIO, [Correction(mode="token_truncate", params={"cap": 2.0})], seq=SEQ,
                        rollout=ROLLOUT, turn=TURN, trainable=TRAINABLE)
    weight = [2, .5, 1.5, 1, .25, 2]
    mean = sum(weight) / 6
    assert (result.n_tokens, result.n_sequences, result.n_rollouts) == (6, 3, 2)
    assert result.frac_tokens_affected == 2 / 6
    assert result.frac_sequences_affected == 2 / 3  # A and C
    assert result.frac_rollouts_affected == 1.0
    assert result.weight_mean == pytest.approx(mean, rel=1e-12)
    assert result.weight_std == pytest.approx(math.sqrt(sum((w - mean) ** 2 for w in weight) / 6), rel=1e-12)
    assert result.weight_max == pytest.approx(2.0, rel=1e-12)
    assert result.ess == pytest.approx(sum(weight) ** 2 / (6 * sum(w * w for w in weight)), rel=1e-12)
    # turn 0: A0 (2), C0 (1), C1 (0.25); turn 1: A1 (0.5), B0 (1.5), C2 (2, capped)
    assert [(t.turn, t.n_tokens, t.frac_tokens_affected, t.weight_mean) for t in result.by_turn] == [
        (0, 3, 1 / 3, pytest.approx(3.25 / 3)), (1, 3, 1 / 3, pytest.approx(4 / 3))]


def test_rollouts_affected_counts_a_rollout_once_any_token_is():
    icepop, geometric = simulate(LOG_RATIO, [Correction(mode="token_icepop", params={"low": .5, "high": 5.0}),
                                             Correction(mode="geometric_truncate", params={"cap": 1.3})],
                                 seq=SEQ, rollout=ROLLOUT, trainable=TRAINABLE)
    assert (icepop.frac_tokens_affected, icepop.frac_rollouts_affected) == (2 / 6, 0.5)  # only r1
    assert (geometric.frac_tokens_affected, geometric.frac_rollouts_affected) == (3 / 6, 0.5)  # only r0


def test_balanced_truncate_gives_each_rollout_the_same_mass():
    # r0: one token; r1: a main branch and two subagents, three tokens; all ratios 1.
    weight, _ = correction_weights(np.zeros(4), Correction(mode="rollout_balanced_truncate", params={"cap": 2.0}),
                                   seq=["r0/m", "r1/m", "r1/s1", "r1/s2"], rollout=["r0", "r1", "r1", "r1"])
    assert weight.tolist() == pytest.approx([2, 2 / 3, 2 / 3, 2 / 3])


def test_trl_modes_match_trl_code_on_a_padded_batch():
    """TRL's own code path (trl/trainer/grpo_trainer.py), transcribed, on (B, T) with a mask."""
    torch = pytest.importorskip("torch")
    old = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-0.3, -4.0, 0.0, 0.0]], dtype=torch.float64)
    sampling = torch.tensor([[-1.5, -1.0, -0.5, -9.0], [-0.1, -2.0, -7.0, -7.0]], dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.float64)
    per_token_logps_diff = (old - sampling) * mask
    for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"):
        for cap in (1.2, 2.0, 3.0):
            if mode.startswith("sequence"):
                logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True)
            else:
                logps_diff = per_token_logps_diff
            ratio = torch.exp(logps_diff)
            if mode.endswith("truncate"):
                expected = torch.clamp(ratio, max=cap)
            else:
                expected = ratio.masked_fill(ratio > cap, value=0.0)
            expected = expected.expand_as(mask)[mask.bool()]
            seq = torch.arange(2).unsqueeze(1).expand_as(mask)[mask.bool()]
            weight, _ = correction_weights(per_token_logps_diff[mask.bool()],
                                           Correction(mode=mode, params={"cap": cap}), seq=seq)
            # Same formula; numpy's and torch's exp may differ in the last bit on some CPUs.
            torch.testing.assert_close(weight, expected, rtol=1e-14, atol=0, msg=f"{mode} cap {cap}")


def test_torch_tensors_in_give_tensors_out_and_match_numpy():
    torch = pytest.importorskip("torch")
    correction = Correction(mode="sequence_truncate", params={"cap": 1.8})
    keep = np.array(TRAINABLE) & ~np.isnan(LOG_RATIO)
    seq = torch.tensor([0, 0, 1, 2, 2, 2])
    weight, affected = correction_weights(torch.tensor(LOG_RATIO[keep], dtype=torch.float32), correction, seq=seq)
    assert weight.dtype == torch.float32 and affected.dtype == torch.bool
    np_weight, _ = correction_weights(LOG_RATIO[keep], correction, seq=seq.numpy())
    assert weight.tolist() == pytest.approx(np_weight.tolist(), rel=1e-6)
    [from_tensor] = simulate(torch.tensor(LOG_RATIO), [correction], seq=torch.tensor([0, 0, 0, 1, 2, 2, 2, 2]),
                             rollout=torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]), trainable=torch.tensor(TRAINABLE))
    [from_lists] = simulate(LOG_RATIO, [correction], seq=SEQ, rollout=ROLLOUT, trainable=TRAINABLE)
    assert from_tensor.to_record() == from_lists.to_record()


def test_nan_log_ratio_gets_nan_weight_and_is_not_affected():
    weight, affected = correction_weights([math.log(4.0), float("nan")],
                                          Correction(mode="token_truncate", params={"cap": 2.0}), seq=[0, 0])
    assert weight[0] == 2.0 and math.isnan(weight[1])
    assert affected.tolist() == [True, False]


def test_overflowing_sequence_ratio_truncates_to_cap_and_is_masked():
    log_ratio = np.full(3, 400.0)  # exp(1200) overflows float64
    truncate, mask = simulate(log_ratio, [Correction(mode="sequence_truncate", params={"cap": 2.0}),
                                          Correction(mode="sequence_mask", params={"cap": 2.0})],
                              seq=[0, 0, 0], rollout=[0, 0, 0])
    assert (truncate.weight_max, truncate.ess, truncate.frac_tokens_affected) == (2.0, 1.0, 1.0)
    assert (mask.weight_max, mask.ess) == (0.0, 0.0)


def test_ess():
    assert effective_sample_size(np.array([1.0, 1.0, 1.0])) == 1.0
    assert effective_sample_size(np.array([2.0, 0.0])) == 0.5
    assert effective_sample_size(np.array([np.inf, 1.0, 1.0, np.inf])) == 0.5
    assert effective_sample_size(np.zeros(3)) == 0.0
    assert math.isnan(effective_sample_size(np.array([])))


def test_no_tokens_gives_nan_stats():
    [result] = simulate([float("nan")], [Correction(mode="token_truncate", params={"cap": 2.0})],
                        seq=[0], rollout=[0])
    assert result.n_tokens == 0 and math.isnan(result.ess) and math.isnan(result.frac_tokens_affected)


def test_bad_corrections_are_user_errors():
    with pytest.raises(MismatchError, match=r"^unknown correction mode 'tis' \(valid: token_truncate, token_mask, "):
        Correction(mode="tis", params={"cap": 2.0})
    with pytest.raises(MismatchError) as info:
        Correction(mode="token_truncate", params={"high": 2.0})
    assert str(info.value) == "correction token_truncate: needs params cap; got high"
    with pytest.raises(MismatchError) as info:
        Correction(mode="token_icepop", params={"low": 5.0, "high": 0.5})
    assert str(info.value) == "correction token_icepop: low 5.0 is above high 0.5"
    with pytest.raises(MismatchError) as info:
        Correction(mode="token_truncate", params={"cap": 0})
    assert str(info.value) == "correction token_truncate: cap must be a positive number, got 0"


def test_misaligned_inputs_are_rejected():
    with pytest.raises(ValueError, match="1-D arrays of one length"):
        simulate([0.0, 0.0], seq=[0], rollout=[0, 0])


def table() -> pd.DataFrame:
    return pd.DataFrame({
        "rollout": pd.Categorical(ROLLOUT), "branch": pd.Categorical([s.split("/")[1] for s in SEQ]),
        "turn": np.array(TURN, dtype=np.int32), "trainable": TRAINABLE,
        "logp_train": LOG_RATIO - 1.0, "logp_sampler": np.full(len(SEQ), -1.0)})


def test_simulate_table_uses_rollout_and_branch_as_the_sequence():
    [from_table] = simulate_table(table(), [Correction(mode="sequence_truncate", params={"cap": 1.8})])
    assert from_table.n_sequences == 3
    assert from_table.frac_tokens_affected == 5 / 6
    assert from_table.weight_mean == pytest.approx((1.8 * 5 + 1.5) / 6, rel=1e-12)


def test_summary_corrections_hold_trl_modes_with_contract_keys():
    corrections = [to_builtins(c) for c in summary_corrections(table())]
    assert len(corrections) == len(DEFAULT_CORRECTIONS)
    keys = ["mode", "params", "frac_tokens_affected", "frac_rollouts_affected", "weight_mean", "weight_max", "ess"]
    assert all(list(c)[:7] == keys for c in corrections)
    listed = {(c["mode"], c["params"].get("cap")) for c in corrections}
    for mode in ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask"):
        assert {(mode, 2.0), (mode, 3.0)} <= listed


def test_missing_column_is_a_user_error():
    with pytest.raises(MismatchError) as info:
        simulate_table(table().drop(columns="logp_sampler"))
    assert str(info.value).startswith("token table has no column 'logp_sampler' (columns: rollout, branch")


def test_importable_without_torch_or_the_cli():
    import subprocess
    import sys

    code = ("import sys, mismatch.advise.corrections, mismatch.advise.advice, mismatch.advise.gate; "
            "print(sorted(m for m in ('torch', 'typer', 'rich', 'plotly', 'vllm') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def prime_rl_kept(logp_train: list[float], logp_infer: list[float], advantage: list[float], *,
                  loss_type: str, ipo_threshold: float = 0.1, dppo_low: float = 0.2,
                  dppo_high: float = 0.2) -> list[bool]:
    """prime-rl's token keep mask, transcribed token by token from src/prime_rl/trainer/rl/loss.py
    @559b44772e47 (:130-146 default/DPPO, :177-185 IPO): dp = exp(train) - exp(infer)."""
    kept = []
    for train, infer, adv in zip(logp_train, logp_infer, advantage):
        dp = math.exp(train) - math.exp(infer)
        if loss_type == "ipo":
            kept.append(not abs(dp) > ipo_threshold)
        else:
            kept.append(not ((adv > 0 and dp > dppo_high) or (adv < 0 and dp < -dppo_low)))
    return kept


def test_probability_gap_modes_equal_prime_rl_transcription():
    rng = np.random.default_rng(7)
    n = 500
    logp_infer = np.log(rng.uniform(0.01, 1.0, n))
    logp_train = np.minimum(logp_infer + rng.normal(0, 0.4, n), 0.0)
    log_ratio, seq = logp_train - logp_infer, np.repeat(np.arange(10), n // 10)
    cases = [("ipo_mask", {"threshold": 0.1}, "ipo", 1.0), ("dppo_positive", {"high": 0.2}, "default", 1.0),
             ("dppo_negative", {"low": 0.2}, "default", -1.0)]
    for mode, params, loss_type, sign in cases:
        weight, affected = correction_weights(log_ratio, Correction(mode=mode, params=params), seq=seq,
                                              logp_sampler=logp_infer)
        kept = prime_rl_kept(list(logp_train), list(logp_infer), [sign] * n, loss_type=loss_type)
        assert (~affected).tolist() == kept, mode
        assert 0 < sum(kept) < n  # both kinds of token occur
        # Kept tokens weigh their raw ratio (prime-rl does not clip it); masked ones 0.
        np.testing.assert_allclose(weight, np.where(kept, np.exp(log_ratio), 0.0), rtol=1e-12)


def test_probability_gap_modes_need_the_sampler_logprobs():
    with pytest.raises(MismatchError, match="need both log-probs"):
        correction_weights(LOG_RATIO[:1], Correction(mode="ipo_mask", params={"threshold": 0.1}), seq=[0])
    # Without them, the default simulation leaves exactly those modes out (and says so in its docstring).
    results = simulate(np.log([1.5, 0.9]), seq=[0, 0], rollout=[0, 0])
    assert {r.mode for r in results} == {c.mode for c in DEFAULT_CORRECTIONS} - {"ipo_mask", "dppo_positive",
                                                                                 "dppo_negative"}
