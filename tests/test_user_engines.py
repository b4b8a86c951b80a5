"""Bring-your-own specs: `python:MODULE:CALLABLE` and `stored:NAME` inside a real audit."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO
from mismatch.pipeline.audit import audit
from mismatch.cli import main
from mismatch.engines import load_engine, parse_spec
from mismatch.errors import SpecError
from mismatch.identity import engine_identity
from test_golden import GOLDEN, stored_checkpoint

CUSTOM = f"python:{REPO / 'examples/custom_engine.py'}:make_engine"


def test_python_engine_from_a_file_matches_the_hf_engine(tiny_checkpoint, sampled_rollouts) -> None:
    result = audit(tiny_checkpoint, sampled_rollouts, train=CUSTOM, infer="hf:dtype=float32")
    pair = result.summary["pairs"]["train/infer"]
    assert pair["n_tokens"] > 100 and pair["log_ratio_abs_max"] < 1e-5
    assert result.summary["engines"]["train"]["module"] == "LogitsOnly(float32)"


def _with_extra(src: Path, dst: Path, name: str, shift: float) -> None:
    """Copy rollouts, storing the sampler's log-probs (minus `shift`) as extra_logprobs[name]."""
    lines = []
    for line in src.read_text().splitlines():
        raw = json.loads(line)
        for branch in raw["branches"]:
            for segment in branch["segments"]:
                if "logprobs" in segment:
                    segment["extra_logprobs"] = {name: [lp - shift for lp in segment["logprobs"]]}
        lines.append(json.dumps(raw))
    dst.write_text("\n".join(lines) + "\n")


def test_stored_logprobs_audit_without_replay(tiny_checkpoint, sampled_rollouts, tmp_path) -> None:
    path = tmp_path / "with_trainer.jsonl"
    _with_extra(sampled_rollouts, path, "trainer", shift=0.25)
    result = audit(tiny_checkpoint, path, train="stored:trainer", infer="sampler")
    pairs = result.summary["pairs"]
    assert pairs["infer/sampler"]["bitwise_equal_frac"] == 1.0
    # train = sampler - 0.25 on every trainable token: log_ratio is -0.25 up to float rounding.
    np.testing.assert_allclose(pairs["train/sampler"]["log_ratio_mean"], -0.25, rtol=1e-12)
    assert result.summary["engines"]["train"] == {"kind": "stored", "spec": "stored:trainer",
                                                  "name": "trainer"}


def test_missing_stored_name_is_bad_input(tiny_checkpoint, sampled_rollouts, tmp_path, capsys) -> None:
    out = tmp_path / "out"
    code = main(["audit", str(tiny_checkpoint), "--rollouts", str(sampled_rollouts), "--out", str(out),
                 "--train", "stored:megatron"])
    assert code == 2 and not out.exists()
    assert capsys.readouterr().err.strip() == ("mismatch: error: --train stored:megatron: no segment "
                                               "of the rollouts carries extra_logprobs['megatron'] "
                                               "(found: sampler)")


def test_python_spec_errors(tiny_checkpoint) -> None:
    from mismatch.engines import load_engine

    with pytest.raises(SpecError, match=r"^engine spec 'python:nocolon': expected python:MODULE:CALLABLE$"):
        parse_spec("python:nocolon")
    with pytest.raises(SpecError, match=r"has no attribute 'nope'"):
        load_engine(f"python:{REPO / 'examples/custom_engine.py'}:nope", str(tiny_checkpoint))
    with pytest.raises(SpecError, match=r"cannot import no_such_module_x"):
        load_engine("python:no_such_module_x:f", str(tiny_checkpoint))


def test_python_engine_from_toml_takes_checkpoint_and_options(tiny_checkpoint, sampled_rollouts,
                                                             tmp_path) -> None:
    toml = tmp_path / "mine.toml"
    toml.write_text(f'engine = "python"\ntarget = "{REPO / "examples/custom_engine.py"}:make_engine"\n'
                    f'checkpoint = "{tiny_checkpoint}"\ndtype = "bfloat16"\n')
    result = audit(tiny_checkpoint, sampled_rollouts,
                   train=str(toml), infer="hf:dtype=bfloat16")
    assert result.summary["engines"]["train"]["module"] == "LogitsOnly(bfloat16)"
    assert result.summary["pairs"]["train/infer"]["log_ratio_abs_max"] < 0.1


FLAT_ENGINE = '''
import numpy as np

class Flat:
    def __init__(self, got):
        self.got = got

    def describe(self):
        return {"got": self.got, "logprob_semantics": "raw"}

    def replay(self, requests, progress=None):
        return [np.full(r.num_scored, float(self.got.get("logp", -1.0))) for r in requests]

def make(checkpoint: str, logp: float = -1.0, exact: bool = False, label: str = "flat", note=None):
    return Flat({"checkpoint": checkpoint, "logp": logp, "exact": exact, "label": label, "note": note})

def make_any(checkpoint, **options):
    return Flat({"checkpoint": checkpoint, **options})
'''


@pytest.fixture
def flat_engine(tmp_path: Path) -> Path:
    """A factory file that loads no model: its engine answers a constant and tells what it got."""
    path = tmp_path / "flat_engine.py"
    path.write_text(FLAT_ENGINE)
    return path


def test_inline_options_reach_the_factory_typed_by_its_annotations(flat_engine, tmp_path) -> None:
    checkpoint = stored_checkpoint(tmp_path / "ckpt")
    spec = f"python:{flat_engine}:make,logp=-0.5, exact=yes,label=a:b=c,note=7"
    result = audit(checkpoint, GOLDEN / "rollouts.jsonl", train=spec, infer="sampler")
    train = result.summary["engines"]["train"]
    # Annotated float and bool are typed as an options dataclass would type them; a str stays one
    # (colons and '=' after the first included); an unannotated parameter gets the text as written.
    assert train["got"] == {"checkpoint": str(checkpoint), "logp": -0.5, "exact": True,
                            "label": "a:b=c", "note": "7"}
    assert train["options"] == {"logp": -0.5, "exact": True, "label": "a:b=c", "note": "7",
                                "checkpoint": None}
    assert result.summary["inputs"]["engines"]["train"]["options"] == {
        "target": f"{flat_engine}:make", "logp": "-0.5", "exact": "yes", "label": "a:b=c", "note": "7"}


def test_inline_checkpoint_replaces_the_first_argument_and_dotted_modules_take_options(
        flat_engine, monkeypatch) -> None:
    engine = load_engine(f"python:{flat_engine}:make_any,checkpoint=/elsewhere,n=3", "/audited")
    assert engine.inner.got == {"checkpoint": "/elsewhere", "n": "3"}  # **options: text as written
    monkeypatch.syspath_prepend(str(flat_engine.parent))
    engine = load_engine("python:flat_engine:make,exact=off", "/audited")
    assert engine.inner.got["exact"] is False and engine.inner.got["checkpoint"] == "/audited"
    assert parse_spec("python:flat_engine:make").options == {"target": "flat_engine:make"}


def test_inline_options_are_part_of_the_run_identity(flat_engine) -> None:
    base = f"python:{flat_engine}:make"
    same = engine_identity(parse_spec(f"{base},logp=-0.5"))
    assert same == engine_identity(parse_spec(f"{base}, logp=-0.5 "))
    assert same != engine_identity(parse_spec(f"{base},logp=-0.25"))
    assert same != engine_identity(parse_spec(base))
    assert same["module"] == engine_identity(parse_spec(base))["module"] is not None


@pytest.mark.parametrize(("suffix", "message"), [
    (",exact", "engine spec '{spec}': expected KEY=VALUE, got 'exact'"),
    (",=yes", "engine spec '{spec}': expected KEY=VALUE, got '=yes'"),
    (",target=x:y", "engine spec '{spec}': 'target' is not an option here: MODULE:CALLABLE comes "
                    "before the first comma"),
    (",lgp=-1", "python engine '{spec}': unknown option 'lgp' (valid: checkpoint, exact, label, "
                "logp, note)"),
    (",logp=low", "python engine '{spec}': option logp='low' is not a valid float"),
])
def test_a_bad_inline_option_is_one_line_and_exit_2(flat_engine, tmp_path, capsys, suffix,
                                                    message) -> None:
    checkpoint = stored_checkpoint(tmp_path / "ckpt")
    spec = f"python:{flat_engine}:make{suffix}"
    out = tmp_path / "out"
    code = main(["audit", str(checkpoint), "--rollouts", str(GOLDEN / "rollouts.jsonl"),
                 "--train", spec, "--infer", "sampler", "--out", str(out)])
    assert code == 2 and not out.exists()
    assert capsys.readouterr().err.strip() == "mismatch: error: " + message.format(spec=spec)
