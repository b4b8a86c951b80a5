"""--distribution (issue #48): the whole next-token distribution compared between two sides.

By hand on small rows (exact terms, the bounds of a top-K side), then real audits on the tiny
checkpoint: a planted lm_head fault on a token no rollout samples, which the sampled-token metrics
call negligible and the distribution pass finds and names; two identical sides, whose bitwise claim
holds on the whole distribution; the gate on `dist.kl`; bad input refused before any model loads.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

import mismatch
from mismatch.advise.gate import parse_limits, run_gate
from mismatch.advise.off_sample import OFF_SAMPLE_FACTOR, off_sample
from mismatch.cli import app, main
from mismatch.engines.distributions import TERMS, FullRows, TopRows, compare_rows
from mismatch.errors import MismatchError, SpecError
from mismatch.present.headline import audit_banner
from mismatch.results import validate_summary
from mismatch.results.summary_model import partial_summary
from mismatch.rollouts import iter_rollouts

pytestmark = pytest.mark.usefixtures("one_torch_thread")
T = {name: i for i, name in enumerate(TERMS)}


def _top(logp_CV: torch.Tensor, sampled: np.ndarray, k: int) -> TopRows:
    """A top-k side as vLLM reports one: its k best plus the sampled token, and that token's rank."""
    values, ids = logp_CV.topk(k, dim=-1)
    ids_CK = np.full((len(sampled), k + 1), -1)
    logp_CK = np.full((len(sampled), k + 1), -np.inf)
    ids_CK[:, :k], logp_CK[:, :k] = ids.numpy(), values.double().numpy()
    picked = logp_CV.gather(1, torch.from_numpy(sampled)[:, None])[:, 0]
    for row, token in enumerate(sampled):
        if token not in ids_CK[row, :k]:
            ids_CK[row, k], logp_CK[row, k] = token, float(picked[row])
    rank = (logp_CV >= picked[:, None]).sum(-1).numpy()
    return TopRows(ids_CK=ids_CK, logp_CK=logp_CK, sampled_logp_C=picked.double().numpy(), sampled_rank_C=rank, k=k)


def test_full_rows_by_hand() -> None:
    a = torch.log(torch.tensor([[0.5, 0.25, 0.25], [0.9, 0.05, 0.05]]))
    b = torch.log(torch.tensor([[0.25, 0.5, 0.25], [0.9, 0.05, 0.05]]))
    terms = compare_rows(FullRows(logp_CV=a), FullRows(logp_CV=b), np.array([1, 0]), 2, 3)
    kl = 0.5 * np.log(2) + 0.25 * np.log(0.5)
    assert terms[0, T["kl_ab"]] == pytest.approx(kl) and terms[0, T["kl_ba"]] == pytest.approx(kl)
    assert terms[0, T["tv"]] == pytest.approx(0.25) and terms[0, T["tv_hi"]] == terms[0, T["tv"]]
    assert terms[0, T["argmax_agree"]] == 0 and terms[0, T["token"]] in (0, 1)
    assert (terms[0, T["rank_a"]], terms[0, T["rank_b"]]) == (3, 1)  # ties counted in, as vLLM does
    assert terms[1, T["kl_ab"]] == 0 and terms[1, T["row_equal"]] == 1 and terms[1, T["sampled_equal"]] == 1
    assert terms[:, T["exact"]].tolist() == [1, 1]


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), k=st.integers(1, 12), scale=st.floats(0.1, 4.0))
@example(seed=264, k=9, scale=3.875)  # B's top-9 holds all but ~1e-17 of A's mass: 1 − Σ rounds to 0
def test_a_top_k_side_bounds_the_exact_terms(seed: int, k: int, scale: float) -> None:
    """KL and TV from B's top-k are lower bounds of the exact ones (merging outcomes lowers an
    f-divergence), tv_hi an upper bound; overlap, argmax and ranks are the exact ones."""
    generator = torch.Generator().manual_seed(seed)
    a = torch.log_softmax(torch.randn(6, 16, generator=generator) * scale, -1)
    b = torch.log_softmax(a + 0.5 * torch.randn(6, 16, generator=generator), -1)
    sampled = torch.randint(0, 16, (6,), generator=generator).numpy()
    exact = compare_rows(FullRows(logp_CV=a), FullRows(logp_CV=b), sampled, k, 16)
    bounded = compare_rows(FullRows(logp_CV=a), _top(b, sampled, k), sampled, k, 16)
    for name in ("kl_ab", "kl_ba", "tv"):
        assert (bounded[:, T[name]] <= exact[:, T[name]] + 1e-6).all(), name
    assert (bounded[:, T["tv_hi"]] >= exact[:, T["tv"]] - 1e-6).all()
    for name in ("overlap", "argmax_agree", "rank_a", "rank_b", "tail_a", "tail_b"):
        np.testing.assert_allclose(bounded[:, T[name]], exact[:, T[name]], atol=1e-6, err_msg=name)
    assert bounded[:, T["exact"]].tolist() == [0] * 6


def _never_sampled_fault(checkpoint: Path, rollouts: Path, out: Path) -> tuple[Path, int]:
    """A copy of the checkpoint with one lm_head row doubled: of the tokens no rollout holds, the one
    whose doubling moves the most probability mass while moving every sampled token's log-prob by
    less than 0.01 (bf16 noise here is 0.058 at most; MACHINE.md) and their kl_k3 below 2e-7,
    worked out in closed form on the model's own logits."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    streams = [[t for segment in branch.segments for t in segment.tokens]
               for rollout in iter_rollouts(rollouts) for branch in rollout.branches]
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    with torch.no_grad():
        hidden = torch.cat([model.model(input_ids=torch.tensor([s])).last_hidden_state[0, :-1] for s in streams])
        logits = hidden @ model.lm_head.weight.T
    # Doubling token t's logit l_t multiplies the normalizer by 1 - p_t + p_t·exp(l_t): every other
    # token's log-prob moves by minus its log, and t's probability becomes p_t·exp(l_t) over it.
    probs = torch.softmax(logits.double(), -1)
    growth = 1 - probs + probs * logits.double().exp()
    moved = probs * logits.double().exp() / growth - probs
    unseen = torch.tensor(sorted(set(range(logits.shape[1])) - {t for s in streams for t in s}))
    ratio = 1 / growth[:, unseen]  # each sampled token's probability ratio, faulty over sound
    k3 = (ratio - 1 - ratio.log()).mean(0)  # what the verdict reads (advise/levels.py: negligible below 1e-6)
    quiet = (ratio.log().abs().max(0).values < 0.01) & (k3 < 2e-7)
    mass = moved[:, unseen].abs().mean(0).masked_fill(~quiet, -1.0)
    best = int(unseen[int(mass.argmax())])
    assert mass.max() > 0, "no never-sampled token to plant the fault on"
    faulty = out / "faulty"
    shutil.copytree(checkpoint, faulty)
    weights = load_file(faulty / "model.safetensors")
    weights["lm_head.weight"][best] *= 2
    save_file(weights, faulty / "model.safetensors", metadata={"format": "pt"})
    return faulty, best


def test_planted_fault_off_the_sampled_tokens_is_found_and_named(tiny_checkpoint, sampled_rollouts,
                                                                   tmp_path) -> None:
    faulty, token = _never_sampled_fault(tiny_checkpoint, sampled_rollouts, tmp_path)
    result = mismatch.audit(tiny_checkpoint, sampled_rollouts, train=f"hf:checkpoint={faulty}", infer="hf",
                            distribution="full", out=tmp_path / "out")
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    validate_summary(summary)
    assert result.summary["verdicts"]["train/infer"]["level"] == "negligible"  # the sampled tokens say so
    found = summary["distribution"]["train/infer"]
    assert found["exact"] and found["views"] == {"train": "full", "infer": "full"}
    assert found["tokens"][0]["token_id"] == token and found["tokens"][0]["tv_share"] > 0.9
    assert all(row["moved_token"] == token for row in found["worst"][:3])
    assert found["worst"][0]["kl_ab"] > 1000 * summary["pairs"]["train/infer"]["kl_k3"]
    assert not found["bitwise"]["holds"]
    # The first line the user reads names it: the weights diff of the two checkpoints leads (it names
    # the tensor), the distribution's cause follows with the token, and its fix is listed.
    causes = {c["kind"]: c for c in summary["diagnosis"]["causes"]}
    assert list(causes)[:2] == ["weights", "off_sample"] and causes["weights"]["where"]["words"] == "lm_head"
    assert causes["off_sample"]["pair"] == "train/infer" and causes["off_sample"]["where"]["token_id"] == token
    banner = audit_banner(result.record)
    assert banner.headline.startswith("The weights infer ran differ from the trainer's in lm_head")
    assert any(f"in token {token}" in line for line in banner.details if line.startswith("Also found:"))
    assert "inspect_token_rows" in [r["kind"] for r in summary["recommendations"]]
    # Where the fault is: the positions tokens.parquet names, one column per term.
    import pandas as pd

    table = pd.read_parquet(tmp_path / "out" / "tokens.parquet")
    worst = table.loc[table["dist_train_infer_kl_ab"].idxmax()]
    assert int(worst["dist_train_infer_token"]) == token and int(worst["pos"]) == found["worst"][0]["pos"]
    from mismatch.trend import load_steps

    for name in ("step_1", "step_2"):  # the same run as two steps: the trend reads each one's distribution
        shutil.copytree(tmp_path / "out", tmp_path / "steps" / name)
    steps = load_steps([tmp_path / "steps" / "step_1", tmp_path / "steps" / "step_2"])
    assert [step.value("train/infer", "dist.kl") for step in steps] == [found["kl"]] * 2
    page = (tmp_path / "out" / "index.html").read_text()
    assert 'id="next-token"' in page and "Tokens whose probability moved most" in page
    # The gate reads it; the sampled-token gate would pass the same run.
    assert not run_gate(summary, maxima=parse_limits(["dist.kl=1e-6"])).passed
    assert run_gate(summary, maxima=parse_limits(["train/infer.kl_k3=1e-6"])).passed


def test_identical_sides_agree_on_the_whole_distribution_bit_for_bit(tiny_checkpoint, sampled_rollouts,
                                                                      tmp_path) -> None:
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["audit", str(tiny_checkpoint), "--rollouts", str(sampled_rollouts),
                                      "--out", str(out), "--train", "hf", "--infer", "hf", "--distribution", "5"])
    assert result.exit_code == 0, result.output
    assert "bitwise equal on every sampled token and on the whole distribution" in result.output
    found = json.loads((out / "summary.json").read_text())["distribution"]["train/infer"]
    assert found["bitwise"]["holds"] and found["kl"] == 0 and found["tv_max"] == 0
    assert found["topk_overlap_mean"] == 1 and found["k"] == 5
    gate = CliRunner().invoke(app, ["gate", str(out), "--max", "dist.kl=0"])
    assert gate.exit_code == 0, gate.output


@pytest.mark.parametrize(("value", "message"), [
    ("0", "--distribution '0': the top-K size must be at least 1"),
    ("twenty", "--distribution 'twenty': expected a top-K size (an integer ≥ 1) or 'full'"),
])
def test_a_bad_distribution_is_one_line_before_any_model(tiny_checkpoint, sampled_rollouts, tmp_path, capsys,
                                                         value: str, message: str) -> None:
    code = main(["audit", str(tiny_checkpoint), "--rollouts", str(sampled_rollouts), "--out", str(tmp_path / "o"),
                 "--distribution", value])
    assert code == 2
    assert capsys.readouterr().err.strip() == f"mismatch: error: {message}"
    assert not (tmp_path / "o").exists()


def test_an_engine_without_a_distribution_is_refused(tiny_checkpoint, sampled_rollouts, tmp_path) -> None:
    with pytest.raises(SpecError, match="cannot give its next-token distribution"):
        mismatch.audit(tiny_checkpoint, sampled_rollouts, train="hf", infer="sampler", distribution=5,
                       out=tmp_path / "o")
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize(("kl", "k3", "named"), [
    (4.5e-5, 2.0e-5, False),     # bf16 rounding (vLLM top-20 vs hf): the whole distribution moves as its samples do
    (9.0e-6, 1.0e-7, False),     # many times its estimate, but negligible: under 10x NEGLIGIBLE_KL
    (2.0e-4, 1.0e-7, True),      # off the sampled tokens
    (2.0e-4, 2.1e-5, False),     # a real sampled gap the distribution only confirms (under 10x)
    (float("nan"), 1e-7, False),  # no distribution measured
])
def test_off_sample_is_earned_by_its_size(kl, k3, named) -> None:
    """The off_sample cause needs the whole-distribution KL at OFF_SAMPLE_FACTOR times its sampled
    estimate (kl_k3) and that times the negligible level; a token is named only when it carries
    half the moved probability."""
    entry = {"kl": kl, "exact": True, "n_positions": 40, "argmax_agree_frac": 1.0,
             "tokens": [{"token_id": 7, "tv_share": 0.4, "n_positions": 3}], "worst": []}
    summary = partial_summary({"pairs": {"train/infer": {"n_tokens": 40, "kl_k3": k3}},
                               "distribution": {"train/infer": entry}})
    cause = off_sample(summary)
    assert (cause is not None) == named
    if cause is not None:
        assert cause.where.token_id is None and cause.title.endswith("in tokens that were not sampled")
        assert f"{kl / k3:.3g}x the sampled tokens' kl_k3" in cause.evidence[0] and OFF_SAMPLE_FACTOR == 10


def test_a_gap_off_the_sampled_tokens_leads_when_nothing_else_explains_it() -> None:
    """Sides whose weights no diff can compare (an HTTP engine, one checkpoint path) and whose sampled
    tokens agree to rounding: the distribution's cause is the answer's first clause."""
    from mismatch.advise.advice import advise
    from mismatch.pipeline.summary import with_parts

    pair = {"n_tokens": 40, "n_rollouts": 2, "kl_k3": 1e-8, "frac_outside_2": 0.0, "bitwise_equal_frac": 0.5}
    entry = {"kl": 3e-3, "exact": True, "n_positions": 40, "argmax_agree_frac": 0.9,
             "tokens": [{"token_id": 7, "tv_share": 0.97, "n_positions": 38}],
             "worst": [{"rollout": "r1", "pos": 12, "kl_ab": 0.02}]}
    summary = partial_summary({"pairs": {"train/infer": pair, "train/sampler": pair, "infer/sampler": pair},
                               "engines": {"train": {"kind": "hf", "spec": "hf"}, "infer": {"kind": "http", "spec": "x"},
                                           "sampler": {"kind": "stored"}},
                               "distribution": {"train/infer": entry}})
    advised = with_parts(summary, advise(summary).parts())
    assert advised.diagnosis.causes[0].kind == "off_sample"
    headline = audit_banner(advised).headline
    assert headline.startswith("The whole next-token distribution differs off the sampled tokens, in token 7 — "
                               "fix: token 7's rows on both sides"), headline
    assert "correct with" not in headline  # the ratio does not show it: nothing to correct


def test_gate_keys_of_the_distribution() -> None:
    assert parse_limits(["dist.kl=1e-3"]) == {"train/infer.dist.kl": 1e-3}
    assert parse_limits(["a/reference.dist.tv_mean=0.1"]) == {"a/reference.dist.tv_mean": 0.1}
    with pytest.raises(MismatchError, match="unknown distribution metric 'kll'"):
        parse_limits(["dist.kll=1"])
    summary = {"schema": "mismatch.summary/v1", "pairs": {"train/infer": {"n_tokens": 3}}}
    check = run_gate(summary, maxima={"dist.kl": 1.0}).checks[-1]
    assert not check.passed and "measured with --distribution K" in check.message


def test_layers_localize_on_the_distribution(tiny_checkpoint, tmp_path) -> None:
    """A fault in layer 1's MLP moves the read-out distribution first after layer 1; one in the
    lm_head moves every layer's read-out, so it shows at layer 0 (localize/lens_distribution.py)."""
    from safetensors.torch import load_file, save_file

    from mismatch.localize.layers import compare_layers

    def planted(tensor: str, name: str) -> Path:
        root = tmp_path / name
        shutil.copytree(tiny_checkpoint, root)
        weights = load_file(root / "model.safetensors")
        weights[tensor] = weights[tensor] * 1.5
        save_file(weights, root / "model.safetensors", metadata={"format": "pt"})
        return root

    tokens = [[1, 5, 9, 14, 22, 30, 41, 57, 63, 70, 88, 95]]
    mlp = compare_layers(tiny_checkpoint, tokens, a=f"hf:checkpoint={planted('model.layers.1.mlp.down_proj.weight', 'mlp')}",
                         b="hf").to_dict()
    residual = [row for row in mlp["by_layer"] if row["block"] == "residual"]
    assert mlp["dist_jump_layer"] == 1 and residual[0]["logit_lens_kl"] == 0 and residual[1]["logit_lens_kl"] > 0
    head = compare_layers(tiny_checkpoint, tokens, a=f"hf:checkpoint={planted('lm_head.weight', 'head')}", b="hf")
    assert head.dist_jump_layer == 0
    same = compare_layers(tiny_checkpoint, tokens, a="hf", b="hf")
    assert same.dist_jump_layer is None and all(row.logit_lens_kl == 0 for row in same.residual())


def test_diff_names_the_config_closer_on_the_whole_distribution(tiny_checkpoint, sampled_rollouts, tmp_path) -> None:
    from mismatch.pipeline.diff import diff

    faulty, token = _never_sampled_fault(tiny_checkpoint, sampled_rollouts, tmp_path)
    summary = diff(tiny_checkpoint, sampled_rollouts, a=f"hf:checkpoint={faulty}", b="hf", reference="hf",
                   distribution="full").summary
    validate_summary(summary)
    closer = summary["diff"]["distribution"]
    assert closer["exact"] and closer["closer"] == "b" and closer["kl"]["b"] == 0 < closer["kl"]["a"]
    assert summary["distribution"]["a/reference"]["tokens"][0]["token_id"] == token
