"""Each rollout's meta.checkpoint against the audited checkpoint (rollouts/declared_checkpoint.py):
declared and matching says nothing; another name the data agree with is a notice, not a cause;
mixed declarations are said with counts; weight digests decide by content; another model's
rollouts get the identity cause, quoting the declaration, and the disagreement is the first line
of the output and of the report's banner."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import faults_matrix as fm
from mismatch.cli import main
from mismatch.pipeline.audit import audit
from mismatch.rollouts.declared_checkpoint import compare_declared, declared_line

F32 = "hf:dtype=float32"


def _digests(checkpoint: Path) -> dict[str, str]:
    from mismatch.identity import checkpoint_identity

    return {entry["file"]: entry["sha256"] for entry in checkpoint_identity(checkpoint) if "sha256" in entry}


def _declaring(src: Path, dst: Path, declare, *, keep: bool = True) -> Path:
    """`src` with meta.checkpoint set to declare(index) on each rollout; where None, left as the
    example declares it (the demo's checkpoint path), or with `keep=False` undeclared."""
    lines = []
    for index, line in enumerate(src.read_text().splitlines()):
        rollout = json.loads(line)
        value = declare(index)
        if value is not None:
            rollout["meta"]["checkpoint"] = value
        elif not keep:
            rollout["meta"].pop("checkpoint", None)
        lines.append(json.dumps(rollout))
    dst.write_text("\n".join(lines) + "\n")
    return dst


@pytest.fixture(scope="module")
def base(tiny_checkpoint, tmp_path_factory) -> Path:
    """The example rollouts with the tiny checkpoint's own fp32 log-probs stored: the data agree with it."""
    return fm.write_stored(fm.EXAMPLE_ROLLOUTS, tmp_path_factory.mktemp("declared") / "base.jsonl",
                           fm.replayed_logprobs(tiny_checkpoint, fm.EXAMPLE_ROLLOUTS), meta=fm.sampler_meta())


def test_declarations_are_matched_by_name_or_by_weight_digests(tiny_checkpoint, tmp_path) -> None:
    identity = [{"file": name, "size": 1, "sha256": digest} for name, digest in _digests(tiny_checkpoint).items()]
    same = compare_declared([str(tiny_checkpoint)] * 3, tiny_checkpoint, identity)
    assert same.agrees and same.declared[0].match == "same name"
    assert declared_line(same, str(tiny_checkpoint), identity_cause=False) is None
    assert compare_declared([None, None], tiny_checkpoint, identity) is None  # nothing declared: nothing said
    by_name = compare_declared([tiny_checkpoint.name + "/"], tmp_path / "x" / tiny_checkpoint.name, identity)
    assert by_name.declared[0].match == "same name"  # the directory's name, wherever it lies
    copy = {"path": "/elsewhere/copy-of-tiny", "sha256": _digests(tiny_checkpoint)}
    assert compare_declared([copy], tiny_checkpoint, identity).declared[0].match == "same weights"
    other = {"path": str(tiny_checkpoint), "sha256": {name: "0" * 64 for name in _digests(tiny_checkpoint)}}
    found = compare_declared([other], tiny_checkpoint, identity)
    assert found.declared[0].match == "other weights" and not found.agrees and found.by_weights
    assert "their weight digests differ from its files'" in declared_line(found, "C", identity_cause=False)


def test_declared_and_matching_says_nothing(tiny_checkpoint, base, tmp_path, capsys) -> None:
    rollouts = _declaring(base, tmp_path / "r.jsonl", lambda i: str(tiny_checkpoint))
    assert main(["audit", str(tiny_checkpoint), "--rollouts", str(rollouts), "--train", F32, "--infer", "sampler",
                 "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert "checkpoint:" not in out and "meta.checkpoint" not in out
    found = json.loads((tmp_path / "o" / "summary.json").read_text())["declared_checkpoint"]
    assert found == {"rollouts": 12, "undeclared": 0, "agrees": True, "by_weights": False, "line": None,
                     "declared": [{"checkpoint": str(tiny_checkpoint), "rollouts": 12, "match": "same name"}]}


def test_another_name_the_data_agree_with_is_a_notice_on_the_first_line_not_a_cause(tiny_checkpoint, base,
                                                                                      tmp_path, capsys) -> None:
    rollouts = _declaring(base, tmp_path / "r.jsonl", lambda i: "/ckpts/copy-of-tiny")
    assert main(["audit", str(tiny_checkpoint), "--rollouts", str(rollouts), "--train", F32, "--infer", "sampler",
                 "--out", str(tmp_path / "o")]) == 0
    first = capsys.readouterr().out.splitlines()[0]
    assert first == (f"checkpoint: the rollouts declare meta.checkpoint /ckpts/copy-of-tiny (12 of 12 rollouts, "
                     f"another name); this audit replays {tiny_checkpoint}: notice, not a cause: the data agree "
                     "with this checkpoint (a copy under another name?)"), first
    summary = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert "identity" not in [c["kind"] for c in summary["diagnosis"]["causes"]]
    assert "match_checkpoint" not in [r["kind"] for r in summary["recommendations"]]
    from mismatch.present.headline import audit_banner
    from mismatch.results.summary_model import partial_summary

    banner = audit_banner(partial_summary(summary))  # a notice: the first detail under the headline, which it does not take
    assert banner.details[0].startswith("Checkpoint: the rollouts declare meta.checkpoint /ckpts/copy-of-tiny")
    assert "meta.checkpoint" not in banner.headline
    # The same copy declared by its weights' digests is the same checkpoint: nothing said.
    digests = _digests(tiny_checkpoint)
    rollouts = _declaring(base, tmp_path / "d.jsonl", lambda i: {"path": "/ckpts/copy-of-tiny", "sha256": digests})
    found = audit(tiny_checkpoint, rollouts, train="stored:sampler", infer="sampler", out=tmp_path / "d")
    declared = found.summary["declared_checkpoint"]
    assert declared["agrees"] and declared["by_weights"] and declared["line"] is None


def test_mixed_declarations_are_said_with_counts(tiny_checkpoint, base, tmp_path) -> None:
    """A stored-only audit (the file read once, in the store pass) of a file whose rollouts declare
    two checkpoints, and some none."""
    rollouts = _declaring(base, tmp_path / "r.jsonl",
                          lambda i: str(tiny_checkpoint) if i < 7 else ("step-999" if i < 10 else None),
                          keep=False)
    summary = audit(tiny_checkpoint, rollouts, train="stored:sampler", infer="sampler", out=tmp_path / "o").summary
    found = summary["declared_checkpoint"]
    assert (found["rollouts"], found["undeclared"], found["agrees"]) == (12, 2, False)
    assert found["line"].startswith(f"the rollouts declare meta.checkpoint {tiny_checkpoint} (7 of 12 rollouts, "
                                    "same name); step-999 (3 of 12 rollouts, another name); 2 undeclared; "
                                    f"this audit replays {tiny_checkpoint}"), found["line"]


def test_another_models_rollouts_get_the_identity_cause_quoting_their_declaration(
        tiny_checkpoint, architecture_checkpoint, tmp_path) -> None:
    other = architecture_checkpoint("llama3")
    rollouts = fm.write_stored(fm.EXAMPLE_ROLLOUTS, tmp_path / "other.jsonl",
                               fm.replayed_logprobs(other, fm.EXAMPLE_ROLLOUTS), meta=fm.sampler_meta(),
                               edit=lambda rollout: rollout["meta"].update(checkpoint="/ckpts/llama3-other"))
    summary = audit(tiny_checkpoint, rollouts, train=F32, infer="sampler", out=tmp_path / "o").summary
    (cause,) = [c for c in summary["diagnosis"]["causes"] if c["kind"] == "identity"]
    quoted = ("the rollouts declare meta.checkpoint /ckpts/llama3-other (12 of 12 rollouts, another name); "
              f"this audit replays {tiny_checkpoint}")
    assert quoted in cause["evidence"] and cause["where"]["declared_by_rollouts"] == ["/ckpts/llama3-other"]
    assert summary["declared_checkpoint"]["line"] == f"{quoted}: the data agree that they were not sampled by it"
    from mismatch.present.headline import audit_banner
    from mismatch.results.summary_model import partial_summary

    headline = audit_banner(partial_summary(summary)).headline
    assert headline.startswith(f"These rollouts were not sampled by this checkpoint ({quoted}: the data agree"), headline


@pytest.mark.parametrize("value, message", [
    ("", "meta.checkpoint: must be a non-empty path or name, got an empty string"),
    (7, "meta.checkpoint: must be a path or name, or an object with path and sha256, got number"),
    ({"path": "x", "hash": "y"}, "meta.checkpoint: unknown field 'hash' (valid: path, name, sha256)"),
    ({"path": "x", "sha256": {"model.safetensors": "abc"}},
     "meta.checkpoint.sha256: must map each weight file's name to its SHA-256 (64 lowercase hex digits)"),
    ({}, "meta.checkpoint: must name the checkpoint (path or name) or give its weights' sha256"),
])
def test_a_bad_declaration_is_one_line_before_any_model_loads(tiny_checkpoint, base, tmp_path, capsys,
                                                              value, message) -> None:
    rollouts = _declaring(base, tmp_path / "r.jsonl", lambda i: value if i == 3 else None)
    assert main(["audit", str(tiny_checkpoint), "--rollouts", str(rollouts), "--train", F32,
                 "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "r.jsonl:4: rollout 'r-3': " + message in err, err
    assert not (tmp_path / "o").exists()
