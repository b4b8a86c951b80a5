"""The two torch engines on the tiny checkpoint: chunked extraction, batching, spec options, paths."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from mismatch.checkpoint import checkpoint_info, load_model
from mismatch.engines import ReplayRequest, check_spec, load_engine, parse_spec
from mismatch.engines.micro_batches import padded_by_budget
from mismatch.engines.hf_decode import feed_chunks
from mismatch.errors import SpecError
from mismatch.engines.logprobs import token_logprobs


def _requests(vocab: int, lengths: list[int], seed: int = 0) -> list[ReplayRequest]:
    rng = np.random.default_rng(seed)
    out = []
    for length in lengths:
        generated = rng.random(length) < 0.5
        out.append(ReplayRequest(tokens=rng.integers(0, vocab, length), generated=generated,
                                 score_from=min(3, length - 1)))
    return out


def test_token_logprobs_matches_full_log_softmax_for_any_chunk() -> None:
    torch.manual_seed(0)
    head = torch.nn.Linear(16, 50, bias=False)
    hidden = torch.randn(37, 16)
    target = torch.randint(0, 50, (37,))
    expected = torch.log_softmax(head(hidden).float(), -1).gather(1, target[:, None])[:, 0].double()
    for chunk in (1, 5, 37, 100):
        got = token_logprobs(hidden, target, head, chunk=chunk)
        assert got.dtype == torch.float64
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_pack_batches_sorts_longest_first_and_respects_the_budget() -> None:
    lengths = [5, 100, 7, 98, 6, 300]
    batches = padded_by_budget(lengths, budget=210)
    assert batches == [[5], [1, 3], [2, 4, 0]]
    assert all(len(b) * lengths[b[0]] <= 210 for b in batches if len(b) > 1)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))


def test_feed_chunks_end_right_before_each_generated_token() -> None:
    generated = np.array([0, 0, 0, 1, 1, 1, 0, 0, 1, 1], bool)
    # prompt 0..2 prefilled; 3,4 fed alone (their successors were sampled); 5..7 is the next prompt
    assert feed_chunks(generated, prefill=True) == [(0, 3), (3, 4), (4, 5), (5, 8), (8, 9)]
    assert feed_chunks(generated, prefill=False) == [(j, j + 1) for j in range(9)]
    assert feed_chunks(np.zeros(4, bool), prefill=True) == [(0, 3)]


def test_unknown_option_names_the_valid_keys(tiny_checkpoint) -> None:
    with pytest.raises(SpecError) as err:
        load_engine("hf:dtyp=bfloat16", str(tiny_checkpoint))
    assert str(err.value) == ("engine 'hf': unknown option 'dtyp' "
                              "(valid: attn, balance, batch_tokens, checkpoint, chunk, device, device_map, dtype, entropy, micro_batch, "
                              "packing, routing, sampling, temperature)")
    with pytest.raises(SpecError, match=r"^engine 'hf-decode': option prefill='sometimes' is not one of"):
        load_engine("hf-decode:prefill=sometimes", str(tiny_checkpoint))
    for kind in ("hf", "hf-decode"):  # refused with the spec, before any model loads
        with pytest.raises(SpecError, match=rf"^engine '{kind}': option sampling='always' is not one of: own, replay"):
            check_spec(f"{kind}:sampling=always")
    with pytest.raises(SpecError, match=r"^unknown engine 'hff' in spec 'hff:dtype=x'"):
        load_engine("hff:dtype=x", str(tiny_checkpoint))
    with pytest.raises(SpecError, match=r"option batch_tokens='many' is not a valid int"):
        load_engine("hf:batch_tokens=many", str(tiny_checkpoint))


def test_spec_from_toml(tmp_path) -> None:
    path = tmp_path / "e.toml"
    path.write_text('engine = "hf-decode"\ndtype = "bfloat16"\nchunk = 64\n')
    spec = parse_spec(str(path))
    assert (spec.kind, spec.options, spec.text) == ("hf-decode", {"dtype": "bfloat16", "chunk": 64}, str(path))


def test_hf_engine_equals_the_models_own_logits(tiny_checkpoint) -> None:
    """The chunked extraction is the trainer's `model(ids).logits.float().log_softmax()`.

    Equal to fp32 rounding, not bitwise: the lm_head matmul over a chunk of rows may round
    differently from one over the whole [B, L] block (another M picks another kernel blocking).
    """
    info = checkpoint_info(tiny_checkpoint)
    model = load_model(info, dtype="float32", attn="sdpa", device="cpu")
    requests = _requests(info.vocab_size, [40, 17, 33])
    engine = load_engine("hf:dtype=float32,chunk=7", str(tiny_checkpoint))
    got = engine.replay(requests)
    for request, logp in zip(requests, got):
        ids = torch.from_numpy(request.tokens)[None]
        with torch.no_grad():
            full = torch.log_softmax(model(ids).logits.float(), -1)[0]
        expected = full[:-1].gather(1, ids[0, 1:, None])[:, 0].double().numpy()[request.score_from - 1:]
        assert logp.shape == (request.num_scored,)
        np.testing.assert_allclose(logp, expected, rtol=1e-6, atol=1e-6)


def test_hf_engine_records_the_entropy_of_each_scored_distribution(tiny_checkpoint) -> None:
    """recorded_entropy() is torch's own Categorical entropy of the model's fp32 logits at each
    scored position, NaN where the log-prob is (position 0); none after a processed replay."""
    from mismatch.streams import Sampling

    info = checkpoint_info(tiny_checkpoint)
    model = load_model(info, dtype="float32", attn="sdpa", device="cpu")
    requests = [*_requests(info.vocab_size, [40, 17]),
                ReplayRequest(tokens=np.arange(1, 9), generated=np.zeros(8, bool), score_from=0)]
    engine = load_engine("hf:dtype=float32,chunk=5", str(tiny_checkpoint))
    logps, entropies = engine.replay(requests), engine.recorded_entropy()
    for request, logp, entropy in zip(requests, logps, entropies):
        with torch.no_grad():
            logits = model(torch.from_numpy(request.tokens)[None]).logits.float()[0, :-1]
        # The exact entropy (float64) of the same fp32 logits. The engine sums -p log p from fp32
        # log-probs: off by up to ~eps_fp32 * max|log p| (~2e-6 here), how much depends on the machine.
        expected = torch.distributions.Categorical(logits=logits.double()).entropy().numpy()
        first = max(request.score_from, 1)
        assert entropy.shape == logp.shape
        np.testing.assert_allclose(entropy[-len(expected[first - 1:]):], expected[first - 1:], rtol=1e-5, atol=5e-6)
        assert np.isnan(entropy[0]) == (request.score_from == 0)
    engine.replay(requests[:1], processing=Sampling(temperature=0.7))
    assert engine.recorded_entropy() is None  # another distribution's: not recorded as the trainer's
    spared = load_engine("hf:dtype=float32,chunk=5,entropy=false", str(tiny_checkpoint))
    np.testing.assert_array_equal(np.concatenate(spared.replay(requests)), np.concatenate(logps))
    assert spared.recorded_entropy() is None


def test_batching_changes_a_row_only_by_rounding(tiny_checkpoint) -> None:
    """A row padded into a batch vs replayed alone: equal to fp32 rounding in fp32.

    Not bitwise in bf16 on this CPU: a short row padded to a long batch goes through matmuls with
    another M, whose blocking rounds differently (measured max |Δlogp| 0.014) — batch variance is a
    real mismatch source, which is why `batch_tokens=1` exists.
    """
    info = checkpoint_info(tiny_checkpoint)
    requests = _requests(info.vocab_size, [50, 12, 49, 30, 8], seed=1)
    batched = load_engine("hf:dtype=float32", str(tiny_checkpoint)).replay(requests)
    engine = load_engine("hf:dtype=float32,batch_tokens=1", str(tiny_checkpoint))
    alone = engine.replay(requests)
    assert engine.describe()["num_forward_calls"] == len(requests)
    for a, b in zip(batched, alone):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_decode_path_agrees_in_fp32_and_differs_in_bf16(tiny_checkpoint) -> None:
    info = checkpoint_info(tiny_checkpoint)
    requests = _requests(info.vocab_size, [60, 45], seed=2)
    full32 = np.concatenate(load_engine("hf:dtype=float32", str(tiny_checkpoint)).replay(requests))
    dec32 = np.concatenate(load_engine("hf-decode:dtype=float32", str(tiny_checkpoint)).replay(requests))
    dec16 = np.concatenate(load_engine("hf-decode:dtype=bfloat16,prefill=none",
                                       str(tiny_checkpoint)).replay(requests))
    assert np.max(np.abs(full32 - dec32)) < 1e-4
    assert np.max(np.abs(full32 - dec16)) > 1e-3


def test_score_from_zero_gives_nan_first(tiny_checkpoint) -> None:
    request = ReplayRequest(tokens=np.array([1, 2, 3, 4]), generated=np.zeros(4, bool), score_from=0)
    for spec in ("hf", "hf-decode"):
        logp = load_engine(spec, str(tiny_checkpoint)).replay([request])[0]
        assert logp.shape == (4,) and np.isnan(logp[0]) and np.all(np.isfinite(logp[1:]))
        assert np.all(logp[1:] <= 0)


def test_every_spec_is_checked_before_any_replay(tiny_checkpoint, tmp_path, capsys) -> None:
    """A typo in the second engine's spec: one line, exit 2, no model loaded, no work dir left."""
    import time

    from mismatch.cli import main

    rollouts = Path(__file__).resolve().parents[1] / "examples" / "rollouts.jsonl"
    cases = {"vllm:dtyp=bfloat16": "engine 'vllm': unknown option 'dtyp' (valid: ",
             "hf-decode:dtype=bf17": "engine 'hf-decode': unknown dtype 'bf17' (expected one of: ",
             "hf:batch_tokens=many": "engine 'hf': option batch_tokens='many' is not a valid int",
             "hff": "unknown engine 'hff' in spec 'hff' (known: "}
    for spec, message in cases.items():
        started = time.perf_counter()
        code = main(["audit", str(tiny_checkpoint), "--rollouts", str(rollouts), "--out", str(tmp_path / "x"),
                     "--infer", spec])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith(f"mismatch: error: {message}") and err.count("\n") == 1, err
        assert time.perf_counter() - started < 10
        assert sorted(p.name for p in tmp_path.iterdir()) == []  # neither results nor a work dir


def test_dtype_aliases_are_the_dtypes_they_name() -> None:
    from mismatch.checkpoint import normalize_dtype
    from mismatch.engines import check_spec

    assert [normalize_dtype(d) for d in ("bf16", "fp16", "half", "fp32", "float", "auto")] == [
        "bfloat16", "float16", "float16", "float32", "float32", "auto"]
    assert check_spec("hf-decode:dtype=bf16").options == {"dtype": "bf16"}


def test_a_pip_installed_package_registers_a_spec_kind(tmp_path, monkeypatch) -> None:
    """An entry point in the `mismatch.engines` group (as `pip install` writes one) adds a kind that
    every command takes, with its options checked like a built-in's."""
    import sys

    from mismatch.engines import check_spec, engine_kinds, load_engine
    from mismatch.errors import SpecError

    package = tmp_path / "site"
    (package / "fake_engine_pkg").mkdir(parents=True)
    (package / "fake_engine_pkg" / "__init__.py").write_text(
        "from dataclasses import dataclass\n"
        "import numpy as np\n"
        "from mismatch.engines.spec import options_from\n\n"
        "@dataclass(frozen=True)\n"
        "class Options:\n"
        "    level: float = -1.0\n\n"
        "class Constant:\n"
        "    kind = 'constant'\n"
        "    options_cls = Options\n"
        "    def __init__(self, options):\n"
        "        self.options = options\n"
        "    @classmethod\n"
        "    def from_spec(cls, spec, checkpoint):\n"
        "        return cls(options_from(Options, spec))\n"
        "    def describe(self):\n"
        "        return {'kind': 'constant', 'spec': 'constant', 'logprob_semantics': 'raw'}\n"
        "    def replay(self, requests, progress=None):\n"
        "        return [np.full(r.num_scored, self.options.level) for r in requests]\n"
        "    def close(self):\n"
        "        pass\n")
    info = package / "fake_engine_pkg-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: fake-engine-pkg\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[mismatch.engines]\nconstant = fake_engine_pkg:Constant\n"
                                           "hf = fake_engine_pkg:Constant\n")  # cannot shadow a built-in
    monkeypatch.syspath_prepend(str(package))
    assert "constant" in engine_kinds() and engine_kinds().count("hf") == 1
    assert check_spec("constant:level=-0.5").kind == "constant"
    with pytest.raises(SpecError, match="unknown option 'levle'"):
        check_spec("constant:levle=-0.5")
    engine = load_engine("constant:level=-0.5", "unused")
    assert type(engine).__module__ == "fake_engine_pkg"
    from mismatch.cli import main
    from test_golden import GOLDEN, stored_checkpoint

    assert main(["audit", str(stored_checkpoint(tmp_path / "ckpt")), "--rollouts", str(GOLDEN / "rollouts.jsonl"),
                 "--train", "stored:trainer", "--infer", "constant:level=-0.5", "--out", str(tmp_path / "o")]) == 0
    assert json.loads((tmp_path / "o" / "summary.json").read_text())["engines"]["infer"]["kind"] == "constant"
    sys.modules.pop("fake_engine_pkg", None)


def test_capabilities_are_declared_by_the_backend_and_known_before_it_loads() -> None:
    """The torch engines declare routing recorded, experts forced and processed log-probs; an HTTP
    server its top-K rows (--distribution K); every other kind (and a `python:` engine) the basic
    contract only, read without loading a model."""
    from mismatch.engines import BASIC, engine_capabilities

    for spec in ("hf", "hf-decode:dtype=bfloat16"):
        declared = engine_capabilities(spec)
        assert declared.records_routing and declared.forced_experts and declared.processing
    assert engine_capabilities("hf").records_entropy and not engine_capabilities("hf-decode").records_entropy
    assert engine_capabilities("http://localhost:1") == dataclasses.replace(BASIC, top_logprobs=True)
    for spec in ("python:x.py:make", "stored:trainer"):
        assert engine_capabilities(spec) == BASIC


def test_replay_asks_an_engine_only_the_keywords_it_declares() -> None:
    """An engine of describe/replay/close only is never passed a capability keyword; a capable one
    gets each one asked of it, and a replay that asks one an engine lacks is refused before it loads."""
    from mismatch.engines.contract import Capabilities, recorded_routing
    from mismatch.engines.processing import Sampling
    from mismatch.replay import replay_column

    request = ReplayRequest(tokens=np.array([1, 2, 3]), generated=np.array([False, True, True]), score_from=1)

    class Basic:
        def replay(self, requests, progress=None):  # no **kwargs: a keyword would fail here
            return [np.full(r.num_scored, -1.0) for r in requests]

    class Capable:
        capabilities = Capabilities(forced_experts=True, processing=True)

        def replay(self, requests, *, progress=None, forced_experts=None, processing=None):
            self.asked = (forced_experts, processing)
            return [np.full(r.num_scored, -2.0) for r in requests]

    assert replay_column([request], Basic()).tolist() == [-1.0, -1.0]
    assert recorded_routing(Basic()) is None  # no getattr probing: it declares none
    capable, forced = Capable(), [np.zeros((2, 1, 1), dtype=np.int64)]
    assert replay_column([request], capable, forced_experts=forced, processing=Sampling(temperature=0.5)).tolist() \
        == [-2.0, -2.0]
    assert capable.asked == (forced, Sampling(temperature=0.5))
    replay_column([request], capable)
    assert capable.asked == (None, None)


def test_routing_replay_on_an_engine_that_cannot_force_experts_is_refused_before_it_loads(tmp_path) -> None:
    from mismatch.replay import replay_processed
    from test_golden import GOLDEN, stored_checkpoint
    from mismatch.engines.processing import Sampling
    from mismatch.replay import plan_replay, replay_sources
    from mismatch.rollouts import load_rollouts

    checkpoint = stored_checkpoint(tmp_path / "ckpt")
    rollouts = GOLDEN / "rollouts.jsonl"
    with pytest.raises(SpecError, match=r"^--infer python:nowhere.py:make,routing=replay: option routing=replay: "
                                        r"engine 'python' cannot follow another pass's experts"):
        replay_sources(checkpoint, rollouts, {"train": "hf", "infer": "python:nowhere.py:make,routing=replay"})
    plan = plan_replay(load_rollouts(rollouts))
    with pytest.raises(SpecError, match=r"^http://localhost:1: recomputing under the sampler's temperature/top-k/top-p "
                                        r"needs a torch engine \(hf, hf-decode\)$"):
        replay_processed(plan, "http://localhost:1", checkpoint, Sampling(temperature=0.7))
