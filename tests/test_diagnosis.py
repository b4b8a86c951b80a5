"""The diagnosis on planted faults: each fault, built on the tiny checkpoint, is audited in process and
must come out as the lead cause (mismatch.advise.diagnose), pointing where it was planted, with its
source fix as the first recommendation (mismatch.advise.recommend) and its words in the report's
headline (present.headline).

The base of most cases: examples/rollouts.jsonl without `messages` (no render drift) and with the
stored log-probs an fp32 `hf` replay of the clean checkpoint, meta.sampler declaring that replay: so
train `hf:dtype=float32` reproduces the sampler bit for bit, and each case plants one fault on top.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import faults_matrix as fm
from mismatch.pipeline.audit import audit
from mismatch.advise.diagnose import ROUTING_SHARE
from test_layers import planted

pytestmark = pytest.mark.usefixtures("one_torch_thread")

F32 = "hf:dtype=float32"
WEIGHT_FAULTS = {  # (layer, block) -> the tensor planted with noise (test_layers.planted)
    (0, "attn"): "model.layers.0.self_attn.o_proj.weight",
    (1, "attn"): "model.layers.1.self_attn.o_proj.weight",
    (0, "mlp"): "model.layers.0.mlp.down_proj.weight",
    (1, "mlp"): "model.layers.1.mlp.down_proj.weight",
    (0, "norm"): "model.layers.0.input_layernorm.weight",
    (1, "norm"): "model.layers.1.post_attention_layernorm.weight",
}
# Qwen3-MoE (8 experts a layer, stored one tensor per expert). Expert 5's gate in layer 0 moves
# layer 1's router input: it flips routing downstream, and those flips carry most of the gap.
MOE_FAULTS = {"layer0-expert5-gate": (0, 5, "model.layers.0.mlp.experts.5.gate_proj.weight"),
              "layer1-expert3-down": (1, 3, "model.layers.1.mlp.experts.3.down_proj.weight")}
# Faults on the sampler's side of an MoE (the replays run the clean checkpoint): an expert, the router.
MOE_SAMPLER_FAULTS = {"expert": "model.layers.0.mlp.experts.5.gate_proj.weight",
                      "router": "model.layers.1.mlp.gate.weight"}
BF16_DECODE = "hf-decode:dtype=bfloat16"
SMALL_ROLLOUTS = 4  # of the example's: the bf16 decode cases replay token by token
DRIFTED = {"r-1", "r-4", "r-9"}  # rollouts whose messages carry another last answer than was sampled
TEMPERATURES = (0.7, 1.3)


class Matrix:
    """Every case's inputs, built on first use and kept for the module, and its audit, run once:
    the diagnosis test and the headline test of a case read the same summary."""

    def __init__(self, tiny: Path, moe: Callable[[], Path], root: Path,
                 other: Callable[[], Path] | None = None) -> None:
        self.tiny, self._moe, self.root, self._other = tiny, moe, root, other
        self._built: dict[str, Any] = {}
        self._summaries: dict[str, dict[str, Any]] = {}

    def once(self, key: str, build: Callable[[], Any]) -> Any:
        if key not in self._built:
            self._built[key] = build()
        return self._built[key]

    # --- inputs ---

    def clean_logprobs(self) -> np.ndarray:
        return self.once("clean", lambda: fm.replayed_logprobs(self.tiny, fm.EXAMPLE_ROLLOUTS))

    def base(self) -> Path:
        return self.once("base", lambda: fm.write_stored(fm.EXAMPLE_ROLLOUTS, self.root / "base.jsonl",
                                                         self.clean_logprobs(), meta=fm.sampler_meta()))

    def faulty(self, tensor: str) -> Path:
        return planted(self.tiny, self.root / "faulty", tensor)

    def moe(self) -> Path:
        return self.once("moe", self._moe)

    def moe_base(self) -> Path:
        return self.once("moe_base", lambda: fm.write_stored(
            fm.EXAMPLE_ROLLOUTS, self.root / "moe_base.jsonl", fm.replayed_logprobs(self.moe(), fm.EXAMPLE_ROLLOUTS),
            meta=fm.sampler_meta()))

    # --- the cases: name -> (checkpoint, rollouts, audit options) ---

    def inputs(self, case: str) -> tuple[Path, Path, dict[str, Any]]:
        kind, _, arg = case.partition(":")
        if kind == "clean":
            return self.tiny, self.base(), {"train": F32, "infer": F32}
        if kind in ("weights", "weights_localized"):
            layer, block = arg.split("-")
            faulty = self.faulty(WEIGHT_FAULTS[int(layer), block])
            return self.tiny, self.base(), {"train": F32, "infer": f"{F32},checkpoint={faulty}",
                                            "localize_models": kind == "weights_localized"}
        if kind == "sampler_weights":  # the sampler ran the faulty copy; both replays the clean one
            path = self.once(case, lambda: fm.write_stored(
                fm.EXAMPLE_ROLLOUTS, self.root / "sampler_weights.jsonl",
                fm.replayed_logprobs(self.faulty(WEIGHT_FAULTS[1, "mlp"]), fm.EXAMPLE_ROLLOUTS),
                meta=fm.sampler_meta()))
            return self.tiny, path, {"train": F32, "infer": F32}
        if kind == "turn":
            path = self.once(case, lambda: fm.rewrite(self.base(), self.root / f"turn-{arg}.jsonl",
                                                      fm.step_from_turn(int(arg), -0.05)))
            return self.tiny, path, {"train": F32, "infer": F32}
        if kind == "processed":
            temperature, _, jitter = arg.partition("-")
            path = self.once(case, lambda: self._processed(float(temperature), jitter == "jitter"))
            return self.tiny, path, {"train": F32, "infer": F32}
        if kind == "render_drift":
            path = self.once(case, lambda: fm.write_stored(
                fm.EXAMPLE_ROLLOUTS, self.root / "render_drift.jsonl", self.clean_logprobs(), meta=fm.sampler_meta(),
                keep_messages=True,
                edit=fm.rewritten_answers(DRIFTED, "I would rather not say what the calculator returned to me.")))
            return self.tiny, path, {"train": F32, "infer": F32}
        if kind == "shift":
            path = self.once(case, lambda: fm.rewrite(self.base(), self.root / "shift.jsonl", fm.shifted_by_one))
            return self.tiny, path, {"train": F32, "infer": F32}
        if kind == "moe":
            faulty = planted(self.moe(), self.root / "moe_faulty", MOE_FAULTS[arg][2])
            return self.moe(), self.moe_base(), {"train": F32, "infer": f"{F32},checkpoint={faulty}"}
        if kind == "batch_variance":
            return self.tiny, self.base(), {"train": F32, "infer": fm.BATCH_VARIANT}
        if kind == "other_model":  # another model's rollouts (same tokenizer), audited against this one
            path = self.once(kind, lambda: fm.write_stored(
                fm.EXAMPLE_ROLLOUTS, self.root / "other_model.jsonl",
                fm.replayed_logprobs(self.once("other", self._other), fm.EXAMPLE_ROLLOUTS), meta=fm.sampler_meta()))
            return self.tiny, path, {"train": F32, "infer": arg}
        if kind == "noised":  # the bf16 sampler's log-probs, replaced by noised ones before they were stored
            path = self.once(kind, lambda: fm.write_stored(
                self.small(), self.root / "noised.jsonl", fm.noised(self.bf16_decode(self.tiny), 0.2),
                meta=fm.sampler_meta(engine="hf-decode", dtype="bfloat16")))
            return self.tiny, path, {"train": F32, "infer": arg}
        if kind in ("sampler_planted", "sampler_stale", "sampler_clean"):  # the bf16 sampler's weights
            copy = (self.faulty(WEIGHT_FAULTS[1, "mlp"]) if kind == "sampler_planted"
                    else fm.edited_copy(self.tiny, self.root / "stale", fm.adam_step) if kind == "sampler_stale"
                    else self.tiny)
            path = self.once(kind, lambda: fm.write_stored(
                self.small(), self.root / f"{kind}.jsonl", self.bf16_decode(copy),
                meta=fm.sampler_meta(engine="hf-decode", dtype="bfloat16")))
            return self.tiny, path, {"train": F32, "infer": arg}
        if kind == "moe_sampler":  # the sampler ran a faulty expert or router, and returned its routing
            name, _, spec = arg.partition(":")
            path = self.once(f"moe_sampler:{name}", lambda: self._moe_sampler(name))
            return self.moe(), path, {"train": F32, "infer": spec}
        raise KeyError(case)

    def small(self) -> Path:
        """The first SMALL_ROLLOUTS example rollouts: the bf16 decode cases replay token by token."""
        return self.once("small", lambda: fm.rewrite_lines(fm.EXAMPLE_ROLLOUTS, self.root / "small.jsonl",
                                                           SMALL_ROLLOUTS))

    def bf16_decode(self, checkpoint: Path) -> np.ndarray:
        return self.once(f"bf16:{checkpoint}", lambda: fm.replayed_logprobs(checkpoint, self.small(), BF16_DECODE))

    def _moe_sampler(self, name: str) -> Path:
        from mismatch.engines import load_engine
        from mismatch.replay import plan_replay
        from mismatch.rollouts import load_rollouts
        from test_routing import _store_sampler

        faulty = planted(self.moe(), self.root / "moe_sampler", MOE_SAMPLER_FAULTS[name])
        engine = load_engine(F32, str(faulty))
        try:
            logps = engine.replay(plan_replay(load_rollouts(fm.EXAMPLE_ROLLOUTS)).requests)
            routed = list(engine.routed)
        finally:
            engine.close()
        stored = _store_sampler(fm.EXAMPLE_ROLLOUTS, routed, logps, self.root / f"moe_sampler-{name}-raw.jsonl")
        return fm.rewrite(stored, self.root / f"moe_sampler-{name}.jsonl", _declared_fp32)

    def _processed(self, temperature: float, jitter: bool) -> Path:
        """Stored log-probs processed at `temperature` (declared in meta.sampler, as vLLM's
        processed_logprobs mode stores them); with `jitter`, also 3% multiplicative noise, so the
        like-for-like pair keeps a gap a correction is chosen on."""
        values = fm.replayed_logprobs(self.tiny, fm.EXAMPLE_ROLLOUTS, temperature=temperature)
        if jitter:
            values = values * (1 + np.random.default_rng(0).normal(0, 0.03, len(values)))
        name = f"processed-{temperature}{'-jitter' if jitter else ''}.jsonl"
        return fm.write_stored(fm.EXAMPLE_ROLLOUTS, self.root / name, values,
                               meta=fm.sampler_meta(logprobs="processed", temperature=temperature))

    def summary(self, case: str) -> dict[str, Any]:
        if case not in self._summaries:
            checkpoint, rollouts, options = self.inputs(case)
            self._summaries[case] = audit(checkpoint, rollouts, **options).summary
        return self._summaries[case]


def _declared_fp32(rollout: dict[str, Any]) -> None:
    rollout.pop("messages", None)
    rollout["meta"]["sampler"] = fm.sampler_meta()


@pytest.fixture(scope="module")
def matrix(tiny_checkpoint, architecture_checkpoint, tmp_path_factory) -> Matrix:
    return Matrix(tiny_checkpoint, lambda: architecture_checkpoint("qwen3_moe"), tmp_path_factory.mktemp("faults"),
                  other=lambda: architecture_checkpoint("llama3"))


def lead(summary: dict[str, Any]) -> dict[str, Any]:
    causes = [c for c in summary["diagnosis"]["causes"] if not c["minor"]]
    assert causes, f"no cause diagnosed; recommendations {kinds(summary)}"
    return causes[0]


def kinds(summary: dict[str, Any]) -> list[str]:
    return [r["kind"] for r in summary["recommendations"]]


def causes(summary: dict[str, Any]) -> list[tuple[str, str]]:
    return [(c["kind"], c["title"]) for c in summary["diagnosis"]["causes"]]


def first(summary: dict[str, Any]) -> dict[str, Any]:
    return summary["recommendations"][0]


def headline(summary: dict[str, Any]) -> str:
    from mismatch.present.headline import banner
    from mismatch.results.summary_model import partial_summary

    return banner(partial_summary(summary)).headline


# --- 1. clean control -------------------------------------------------------------------------

def test_clean_replay_has_no_cause_and_no_correction(matrix) -> None:
    from mismatch.present.headline import banner
    from mismatch.results.summary_model import partial_summary

    summary = matrix.summary("clean")
    assert {pair: v["level"] for pair, v in summary["verdicts"].items()} == dict.fromkeys(
        ("train/sampler", "train/infer", "infer/sampler"), "exact")
    assert summary["diagnosis"]["causes"] == []
    assert kinds(summary) == ["no_correction"]
    assert banner(partial_summary(summary)).status == "healthy"


# --- 2. weight faults in one tensor of the engine's checkpoint ---------------------------------

@pytest.mark.parametrize(("layer", "block"), list(WEIGHT_FAULTS), ids=[f"layer{l}-{b}" for l, b in WEIGHT_FAULTS])
def test_a_weight_fault_is_named_by_its_tensor_and_fixed_at_the_weight_sync(matrix, layer, block) -> None:
    summary = matrix.summary(f"weights:{layer}-{block}")
    module = WEIGHT_FAULTS[layer, block].removesuffix(".weight")
    assert summary["weights"]["infer"]["differing"][0]["name"] == WEIGHT_FAULTS[layer, block]
    cause = lead(summary)
    assert (cause["kind"], cause["pair"], cause["fix"]) == ("weights", "train/infer", "fix_weight_sync"), causes(summary)
    assert cause["where"]["layers"] == [layer] and cause["where"]["modules"] == [module]
    assert f"layers.{layer}" in cause["title"] and module in cause["title"] and "weights" in cause["title"]
    fix = first(summary)
    assert fix["kind"] == "fix_weight_sync" and module in fix["params"]["at"], kinds(summary)
    assert "fp16" not in kinds(summary) and "recompute_old_logprobs" not in kinds(summary)


def test_the_kernel_localizer_names_the_faulty_module_too(matrix) -> None:
    """With the model localizers, the kernel localizer (each module fed the same input) finds the
    error in the planted module only, and the weights cause says so."""
    summary = matrix.summary("weights_localized:1-mlp")
    module = "model.layers.1.mlp.down_proj"
    by_module = summary["localization"]["kernels"]["by_module"]
    worst = max(by_module, key=lambda m: m["rel_error"] or 0.0)
    assert worst["name"] == module and worst["rel_error"] > 0
    assert all(m["rel_error"] == 0.0 for m in by_module if m["name"] != module and m["rel_error"] is not None)
    cause = lead(summary)
    assert cause["kind"] == "weights" and cause["where"]["modules"] == [module], causes(summary)
    assert any("kernel localizer" in line and module in line for line in cause["evidence"]), cause["evidence"]
    assert first(summary)["kind"] == "fix_weight_sync" and "fp16" not in kinds(summary)


# --- 3. the sampler ran other weights ----------------------------------------------------------

def test_a_sampler_that_ran_other_weights_is_told_from_the_replays(matrix) -> None:
    summary = matrix.summary("sampler_weights")
    levels = {pair: v["level"] for pair, v in summary["verdicts"].items()}
    assert levels["train/infer"] == "exact" and levels["infer/sampler"] in ("small", "large")
    cause = lead(summary)
    assert (cause["kind"], cause["pair"], cause["fix"]) == ("sampler_weights", "infer/sampler", "fix_weight_sync"), \
        causes(summary)
    assert cause["where"]["source"] == "sampler"
    fix = first(summary)
    assert fix["kind"] == "fix_weight_sync" and fix["params"]["cause"] == "sampler_weights", kinds(summary)
    assert "fp16" not in kinds(summary)
    assert "recompute_old_logprobs" not in kinds(summary)  # a fault the fix removes: recomputing would hide it


# --- 4. a step in the stored log-probs at one turn ----------------------------------------------

@pytest.mark.parametrize("turn", [1, 2])
def test_a_step_at_a_turn_leads_with_that_turn(matrix, turn) -> None:
    summary = matrix.summary(f"turn:{turn}")
    assert summary["localization"]["turns"]["onset_turn"] == turn
    cause = lead(summary)
    assert (cause["kind"], cause["where"].get("turn")) == ("turn_onset", turn), causes(summary)
    assert f"turn {turn}" in cause["title"]
    fix = first(summary)
    assert (fix["kind"], fix["params"].get("turn")) == ("inspect_turn", turn), kinds(summary)
    assert fix["params"]["rollouts"]  # the rollouts that step up there, to read


# --- 5. processed (temperature) stored log-probs ------------------------------------------------

PROCESSED = [f"{t}{suffix}" for t in TEMPERATURES for suffix in ("", "-jitter")]


@pytest.mark.parametrize("variant", PROCESSED)
def test_processed_logprobs_lead_and_the_correction_is_like_for_like(matrix, variant) -> None:
    summary = matrix.summary(f"processed:{variant}")
    assert summary["alignment"]["logprob_semantics"] == "processed"
    assert "train_processed/sampler" in summary["pairs"]
    cause = lead(summary)
    assert (cause["kind"], cause["fix"]) == ("processed_logprobs", "raw_logprobs"), causes(summary)
    assert cause["where"]["like_for_like"] == "train_processed/sampler"
    assert first(summary)["kind"] == "raw_logprobs", kinds(summary)
    corrections = [r for r in summary["recommendations"] if r["kind"] == "correction"]
    for rec in corrections:  # chosen on the pair with the sampler's processing, never the raw one
        assert rec["params"].get("pair") == "train_processed/sampler", rec["params"]
    if variant.endswith("-jitter"):  # a gap left like for like: a correction is chosen on it
        assert corrections, kinds(summary)
    else:  # the trainer at the sampler's temperature reproduces it: nothing to correct
        assert summary["pairs"]["train_processed/sampler"]["bitwise_equal_frac"] == 1.0
        [none] = [r for r in summary["recommendations"] if r["kind"] == "no_correction"]
        assert "train_processed/sampler" in none["why"]
    assert "fp16" not in kinds(summary) and "recompute_old_logprobs" not in kinds(summary)


@pytest.mark.parametrize("temperature", TEMPERATURES)
def test_processed_logprobs_are_not_blamed_on_the_sampler_weights(matrix, temperature) -> None:
    """The trainer at the sampler's temperature reproduces the stored log-probs bit for bit: the
    sampler ran these weights, and the infer/sampler gap (raw against processed) is the processing."""
    summary = matrix.summary(f"processed:{temperature}")
    assert summary["pairs"]["train_processed/sampler"]["bitwise_equal_frac"] == 1.0
    assert [kind for kind, _ in causes(summary)
            if kind in ("sampler_weights", "sampler_config", "weights")] == [], causes(summary)
    assert "fix_weight_sync" not in kinds(summary) and "match_sampler_config" not in kinds(summary)


# --- 6. render drift -----------------------------------------------------------------------------

def test_render_drift_names_its_rollouts_and_turns(matrix) -> None:
    summary = matrix.summary("render_drift")
    path = matrix.inputs("render_drift")[1]
    planted_at = {(r["id"], fm.last_assistant_turn(r)) for r in map(json.loads, path.read_text().splitlines())
                  if r["id"] in DRIFTED}
    cause = lead(summary)
    assert (cause["kind"], cause["fix"]) == ("render_drift", "fix_renderer"), causes(summary)
    assert DRIFTED <= set(cause["where"]["rollouts"])
    assert planted_at <= {(p["rollout"], p["turn"]) for p in cause["where"]["places"]}
    fix = first(summary)
    assert fix["kind"] == "fix_renderer", kinds(summary)
    assert DRIFTED <= set(fix["params"]["rollouts"])
    assert planted_at <= {(p["rollout"], p["turn"]) for p in fix["params"]["places"]}
    for rollout, turn in planted_at:
        assert f"{rollout} turn {turn}" in fix["why"] and f"{rollout} turn {turn}" in cause["title"]


# --- 7. an off-by-one ----------------------------------------------------------------------------

def test_an_off_by_one_is_fixed_first_and_alone(matrix) -> None:
    summary = matrix.summary("shift")
    cause = lead(summary)
    assert (cause["kind"], cause["where"]["shift"], cause["fix"]) == ("alignment_shift", 1, "fix_alignment"), \
        causes(summary)
    assert [c["kind"] for c in summary["diagnosis"]["causes"]] == ["alignment_shift"]
    assert kinds(summary) == ["fix_alignment"] and first(summary)["params"]["shift"] == 1


# --- 8. one expert's weights in an MoE -------------------------------------------------------------

@pytest.mark.parametrize("fault", list(MOE_FAULTS))
def test_a_faulty_expert_is_named_and_never_hidden_by_routing_replay(matrix, fault) -> None:
    from mismatch.analysis.routing import routing_share

    layer, expert, tensor = MOE_FAULTS[fault]
    summary = matrix.summary(f"moe:{fault}")
    module = tensor.removesuffix(".weight")
    cause = lead(summary)
    assert (cause["kind"], cause["pair"]) == ("weights", "train/infer"), causes(summary)
    assert cause["where"]["layers"] == [layer] and cause["where"]["modules"] == [module]
    assert f"experts.{expert}." in cause["title"] and f"layers.{layer}" in cause["title"]
    assert first(summary)["kind"] == "fix_weight_sync" and f"experts.{expert}" in first(summary)["params"]["at"]
    assert "routing_replay" not in kinds(summary) and "fp16" not in kinds(summary)
    assert "routing_flips" not in [kind for kind, _ in causes(summary)]
    if fault == "layer0-expert5-gate":  # the flips downstream carry most of the gap: R3 would hide the fault
        assert routing_share(summary["routing"]["train/infer"]) >= ROUTING_SHARE


# --- 9. a batch-variant engine ---------------------------------------------------------------------

def test_a_batch_variant_engine_is_named_by_its_split_prefixes(matrix) -> None:
    summary = matrix.summary("batch_variance")
    assert summary["prefix_consistency"]["infer"]["frac_prefixes_bitwise_equal"] < 1.0
    assert summary["prefix_consistency"]["train"]["frac_prefixes_bitwise_equal"] == 1.0
    cause = lead(summary)
    assert (cause["kind"], cause["pair"], cause["where"]["sources"]) == ("batch_variance", "train/infer", ["infer"]), \
        causes(summary)
    assert first(summary)["kind"] == "batch_invariant", kinds(summary)
    assert "fp16" not in kinds(summary)


# --- 10. a cause is earned, or not claimed (issue 43) ------------------------------------------------

def advised_infer(summary: dict[str, Any]) -> str:
    """The engine spec the tool's own advice says to audit again with, where the user reads it: the
    match_sampler_config recommendation, or the next command of an unexplained gap."""
    import shlex

    cause = lead(summary)
    if cause["kind"] == "unexplained":
        words = shlex.split(cause["where"]["next"].split(";")[-1])
        return words[words.index("--infer") + 1]
    fix = first(summary)
    assert fix["kind"] == "match_sampler_config", (kinds(summary), causes(summary))
    return fix["params"]["infer"]


@pytest.mark.parametrize("infer", ["sampler", F32])
def test_another_models_rollouts_were_not_sampled_by_this_checkpoint(matrix, infer) -> None:
    """Another model (same tokenizer) sampled them: no gap that size is rounding, with the stored
    stream as its own witness (`--infer sampler`) or a real replay."""
    summary = matrix.summary(f"other_model:{infer}")
    assert summary["pairs"]["train/sampler"]["frac_outside_2"] > 0.5
    assert [c["kind"] for c in summary["diagnosis"]["causes"]] == ["identity"], causes(summary)
    assert lead(summary)["title"] == "these rollouts were not sampled by this checkpoint"
    assert kinds(summary) == ["match_checkpoint"]
    text = headline(summary)
    assert text.startswith("These rollouts were not sampled by this checkpoint"), text
    assert "fp16" not in text and "rounding" not in text.split(" — ")[0]


def test_a_stored_stream_is_no_witness_and_the_gap_is_unexplained_until_the_replay_answers(matrix) -> None:
    """`--infer sampler` replays nothing: the triangle says so and claims no fidelity, bf16 is not
    confirmed by it, the processing is not claimed against its own like-for-like gap, and the
    answer is "unexplained" with its next command; following it, the second audit answers."""
    summary = matrix.summary("noised:sampler")
    verdicts = summary["verdicts"]
    for pair in ("train/infer", "infer/sampler"):
        assert verdicts[pair]["meaning"] == "stored, not replayed", verdicts[pair]
        assert "faithful" not in verdicts[pair]["text"] and "bit for bit" not in verdicts[pair]["text"]
    cause = lead(summary)
    assert cause["kind"] == "unexplained" and cause["fix"] == "", causes(summary)
    found = [c["kind"] for c in summary["diagnosis"]["causes"]]
    assert not {"precision", "processed_logprobs", "sampler_weights", "fp16"} & set(found), found
    for refused in summary["diagnosis"]["refused"]:  # found, but contradicted by its own evidence
        assert (refused["kind"], refused["test"]) == ("processed_logprobs", "consistency"), refused
    assert kinds(summary) == ["correction"]  # the correction meanwhile, never a default cause
    text = headline(summary)
    assert text.startswith("Unexplained: the train/sampler gap, kl_k3 "), text
    assert "stored, not replayed" in text and f"next: mismatch audit {matrix.tiny}" in text
    assert "meanwhile correct with" in text
    spec = advised_infer(summary)
    assert spec == BF16_DECODE  # the sampler's declared config
    followed = matrix.summary(f"noised:{spec}")
    cause = lead(followed)
    assert (cause["kind"], cause["pair"], cause["fix"]) == ("sampler_weights", "infer/sampler", "fix_weight_sync"), \
        causes(followed)
    assert followed["diagnosis"]["envelope"]["pair"] == "train/infer"  # the bf16 gap measured on these weights
    assert first(followed)["kind"] == "fix_weight_sync"
    assert "other weights or an undeclared config" in headline(followed)


@pytest.mark.parametrize("kind", ["sampler_planted", "sampler_stale"])
def test_a_bf16_sampler_on_other_weights_is_decided_once_its_config_is_replayed(matrix, kind) -> None:
    """The sampler ran a faulty copy, or one an Adam step stale, in bf16. The fp32 replay defers to
    the sampler's config; the audit that follows that advice decides, and names the check that
    separates other weights from an undeclared config."""
    deferred = matrix.summary(f"{kind}:{F32}")
    assert lead(deferred)["kind"] == "sampler_config", causes(deferred)
    spec = advised_infer(deferred)
    assert spec == BF16_DECODE
    summary = matrix.summary(f"{kind}:{spec}")
    cause = lead(summary)
    assert (cause["kind"], cause["pair"], cause["fix"]) == ("sampler_weights", "infer/sampler", "fix_weight_sync"), \
        causes(summary)
    assert any(f"mismatch weights {matrix.tiny}" in line for line in cause["rules_out"]), cause["rules_out"]
    assert first(summary)["kind"] == "fix_weight_sync" and first(summary)["params"]["cause"] == "sampler_weights"
    assert not {"fp16", "recompute_old_logprobs", "match_sampler_config"} & set(kinds(summary)), kinds(summary)
    assert "the sampler ran other weights or an undeclared config" in headline(summary).lower()
    # Following the check it names: `mismatch weights` against the copy the sampler loaded says which.
    from mismatch.weights import diff_checkpoints

    copy = (matrix.faulty(WEIGHT_FAULTS[1, "mlp"]) if kind == "sampler_planted"
            else fm.edited_copy(matrix.tiny, matrix.root / "stale", fm.adam_step))
    report = diff_checkpoints(matrix.tiny, copy)
    if kind == "sampler_planted":
        assert [t.name for t in report.differing] == [WEIGHT_FAULTS[1, "mlp"]]
    else:
        assert report.optimizer_step is not None and len(report.differing) == len(report.tensors)


def test_the_clean_bf16_sampler_replayed_in_its_config_is_precision_not_the_sampler(matrix) -> None:
    """The neighbour of the two above: the same bf16 sampler on the right weights."""
    summary = matrix.summary(f"sampler_clean:{BF16_DECODE}")
    assert summary["pairs"]["infer/sampler"]["bitwise_equal_frac"] == 1.0
    assert [c["kind"] for c in summary["diagnosis"]["causes"] if not c["minor"]] == ["precision"], causes(summary)
    assert summary["diagnosis"]["refused"] == []


def test_a_sampler_that_declares_truncated_sampling_is_not_blamed_on_its_weights(matrix) -> None:
    """The same evidence, had the sampler declared top_p 0.8: the replay does not apply it, so the
    gap is not shown to be the weights; "unexplained" (issue 46's truncation cause names it)."""
    from mismatch.advise.advice import advise
    from mismatch.pipeline.summary import with_parts
    from mismatch.results.summary_model import from_builtins

    summary = json.loads(json.dumps(matrix.summary(f"sampler_planted:{BF16_DECODE}")))
    summary["engines"]["sampler"]["meta"]["top_p"] = 0.8
    record = from_builtins(summary)
    summary = with_parts(record, advise(record).parts()).to_dict()
    assert lead(summary)["kind"] == "unexplained", causes(summary)
    [refused] = [r for r in summary["diagnosis"]["refused"] if r["kind"] == "sampler_weights"]
    assert refused["test"] == "consistency" and "top_p 0.8" in refused["why"]
    assert "fix_weight_sync" not in kinds(summary) and kinds(summary)[0] == "correction"


@pytest.mark.parametrize("fault", list(MOE_SAMPLER_FAULTS))
def test_a_sampler_side_expert_or_router_fault_is_never_routing_replay(matrix, fault) -> None:
    """The sampler ran a faulty expert or router and returned its routing: the flips against the
    trainer are the fault's, not rounding at the router's ties, so R3 is never the answer."""
    from mismatch.analysis.routing import routing_share

    summary = matrix.summary(f"moe_sampler:{fault}:{F32}")
    share = routing_share(summary["routing"]["train/sampler"])
    assert "routing_flips" not in [kind for kind, _ in causes(summary)] and "routing_replay" not in kinds(summary)
    cause = lead(summary)
    assert (cause["kind"], cause["fix"]) == ("sampler_weights", "fix_weight_sync"), causes(summary)
    assert first(summary)["kind"] == "fix_weight_sync"
    refused = [r for r in summary["diagnosis"]["refused"] if r["kind"] == "routing_flips"]
    if share is not None and share >= ROUTING_SHARE:  # the old rule would have said R3: refused, and why
        assert refused and "sampler" in refused[0]["why"], summary["diagnosis"]["refused"]
    if fault == "expert":
        assert share >= ROUTING_SHARE


# --- 11. clean controls: sampled for real, nothing planted ------------------------------------------

CONTROL_SEEDS = 20
NUMERICS = {"precision", "kernel_path"}  # what a clean control may be blamed on


@pytest.fixture(scope="module")
def clean_controls(tiny_checkpoint, tmp_path_factory) -> Callable[[str, str], Path]:
    """Rollouts the toy agent samples from the tiny checkpoint, one file per sampler config, built
    once, without their messages: one rollout per sampling seed, seeds 0-19."""
    from mismatch.demo.toy_agent import HarnessConfig, write_rollouts

    root = tmp_path_factory.mktemp("controls")

    def build(engine: str, dtype: str) -> Path:
        path = root / f"{engine}-{dtype}.jsonl"
        if path.exists():
            return path
        runs = [(seed, 1) for seed in range(CONTROL_SEEDS)]
        lines = []
        for seed, count in runs:
            one = root / f"{engine}-{dtype}-{seed}.jsonl"
            write_rollouts(tiny_checkpoint, one, HarnessConfig(num_rollouts=count, seed=seed, engine=engine,
                                                                dtype=dtype, max_turns=2, max_turn_tokens=16))
            # Without `messages`: a sampled token sequence that re-renders to other tokens is real render
            # drift (benchmarks/RESULTS.md), not a threshold's false alarm; these controls test thresholds.
            lines += [json.dumps({k: v for k, v in fm.renamed(json.loads(line), f"s{seed}-").items()
                                  if k != "messages"}) for line in one.read_text().splitlines()]
        path.write_text("\n".join(lines) + "\n")
        return path
    return build


# hf-decode bf16 here (the gap a threshold could mistake). fp32, vLLM (about 80 s here: an engine load
# and its first compile) and one audit per seed: benchmarks/clean_controls.py, results in RESULTS.md.
@pytest.mark.parametrize("config", ["hf-decode:bfloat16"])
def test_clean_controls_raise_no_cause_but_the_numerics(tiny_checkpoint, clean_controls, config) -> None:
    """Sampled rollouts audited with an fp32 trainer and a replay of the sampler's own config: no
    fault, no "unexplained", no drift; at most precision (bf16) or the kernels (fp32)."""
    engine, dtype = config.split(":")
    summary = audit(tiny_checkpoint, clean_controls(engine, dtype), train=F32, infer=f"{engine}:dtype={dtype}").summary
    leading = [c["kind"] for c in summary["diagnosis"]["causes"] if not c["minor"]]
    assert set(leading) <= NUMERICS, causes(summary)
    if dtype == "bfloat16" and summary["verdicts"]["train/sampler"]["level"] in ("small", "large"):
        assert leading[:1] == ["precision"], causes(summary)
    assert summary["diagnosis"]["refused"] == [], summary["diagnosis"]["refused"]
    assert kinds(summary)[0] in ("correction", "no_correction"), kinds(summary)
    assert not headline(summary).startswith("Unexplained")


# --- the headline: the lead cause in its own words (present.headline) ---------------------------------

# case -> words the headline must hold besides the lead cause's title
HEADLINES = {
    **{f"weights:{l}-{b}": ("weights", f"layers.{l}", WEIGHT_FAULTS[l, b].removesuffix(".weight"))
       for l, b in WEIGHT_FAULTS},
    "sampler_weights": ("sampler", "weights"),
    "turn:1": ("turn 1",), "turn:2": ("turn 2",),
    **{f"processed:{v}": ("processed",) for v in PROCESSED},
    "render_drift": tuple(sorted(DRIFTED)),
    "shift": ("shifted", "+1"),
    **{f"moe:{f}": ("weights", f"layers.{MOE_FAULTS[f][0]}", f"experts.{MOE_FAULTS[f][1]}") for f in MOE_FAULTS},
    "batch_variance": ("batch",),
}


@pytest.mark.parametrize("case", list(HEADLINES))
def test_the_headline_leads_with_the_cause(matrix, case) -> None:
    """The contract with present/headline.py: the headline leads with the diagnosis' lead cause, in
    its title's words, naming where it is."""
    summary = matrix.summary(case)
    text = headline(summary)
    cause = lead(summary)
    assert cause["title"].lower() in text.lower(), (text, cause["title"])
    for word in HEADLINES[case]:
        assert word in text, (word, text)


# --- where the user reads it: the terminal audit, `recommend`, the snippets -------------------------

def comment_lines(snippet: str) -> list[str]:
    """A snippet's comments as written, before wrapping ("#   " continues the line above)."""
    out: list[str] = []
    for line in snippet.splitlines():
        if line.startswith("#   ") and out:
            out[-1] += " " + line[4:]
        elif line.startswith("# "):
            out.append(line)
    return out


def test_the_terminal_audit_and_recommend_lead_with_a_weight_fault(matrix, tmp_path, capsys) -> None:
    from mismatch.cli import main

    checkpoint, rollouts, options = matrix.inputs("weights:1-attn")
    out = tmp_path / "audit"
    assert main(["audit", str(checkpoint), "--rollouts", str(rollouts), "--out", str(out),
                 "--train", options["train"], "--infer", options["infer"]]) == 0
    printed = capsys.readouterr().out
    module = "model.layers.1.self_attn.o_proj"
    assert f"cause 1: the weights infer ran differ from the trainer's in layer 1 ({module})" in printed
    assert "alignment: shift +0, stored log-probs raw" in printed
    answer = next(line for line in printed.splitlines() if line.startswith("answer: "))
    assert module in answer and "fix: the weight sync" in answer and "fp16" not in answer

    assert main(["recommend", str(out)]) == 0
    text = capsys.readouterr().out
    assert text.startswith(f"cause: the weights infer ran differ from the trainer's in layer 1 ({module})")
    assert main(["recommend", str(out), "--json"]) == 0
    advice = json.loads(capsys.readouterr().out)
    assert advice["diagnosis"]["causes"][0]["kind"] == "weights"
    assert advice["recommendations"][0]["kind"] == "fix_weight_sync"
    for framework in ("verl", "openrlhf"):
        assert main(["recommend", str(out), "--for", framework]) == 0
        snippet = capsys.readouterr().out
        comments = comment_lines(snippet)
        assert comments[1].startswith("# cause: the weights infer ran differ") and "float16" not in snippet


def test_a_processed_snippet_stores_raw_logprobs_first_and_sets_no_precision(matrix) -> None:
    summary = matrix.summary("processed:1.3-jitter")
    for framework, snippet in summary["config_snippets"].items():
        comments = comment_lines(snippet)
        named = [line for line in comments if line.startswith("# cause: ")]
        assert "processed log-probs" in named[0], (framework, snippet)
        first_fix = next(line for line in comments[1:] if not line.startswith(("# cause: ", "# note: ")))
        assert first_fix.startswith("# raw_logprobs: "), (framework, snippet)
        assert "float16" not in snippet, framework
