"""mismatch.present: the words and numbers the terminal and the report share, read from the typed
summary; the sections the model keeps open read through typed views (present/views.py)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from mismatch.cli.printing import print_findings
from mismatch.present.headline import banner, cause_line, verdict_line
from mismatch.present.numbers import formatted, num, pct, plain
from mismatch.reports.sections import findings_section
from mismatch.results.summary_model import partial_summary

PAIR = "train/sampler"


def summary(**sections: Any):
    return partial_summary({"command": "audit", "pairs": {PAIR: {"n_tokens": 10}}, **sections})


def test_one_number_reads_one_way_per_screen() -> None:
    assert (num(1.23456e-5), num(-0.5), num(12345), num(None), num(float("inf"))) == ("1.235e−5", "−0.5", "12,345", "–", "∞")
    assert (pct(0.00123), pct(0), formatted((0.5, 2.0), "range"), formatted((None, 1.0), "ci")) == (
        "0.123%", "0%", "0.5 – 2", "[–, 1]")
    assert (plain(1.23456e-5), plain(12345), plain(None)) == ("1.235e-05", "12,345", "-")  # ASCII for a log


def test_a_cause_and_a_verdict_read_the_same_in_the_terminal_and_on_the_page() -> None:
    cause = {"kind": "weights", "pair": PAIR, "title": "the weights differ in layer 1", "evidence": ["e"],
             "rules_out": ["r"], "fix": "fix_weight_sync", "where": {}}
    found = summary(diagnosis={"causes": [cause, {**cause, "minor": True, "title": "a few redrawn tokens"}],
                               "findings": []},
                    verdicts={PAIR: {"level": "large", "meaning": "what the RL ratio sees",
                                     "text": "the weights differ in layer 1 (kl_k3 0.3)"}},
                    recommendations=[{"kind": "fix_weight_sync", "params": {"at": "layer 1"}, "why": "w"}])
    first, minor = found.diagnosis.causes
    assert (cause_line(first, 1), cause_line(minor)) == (
        "cause 1: the weights differ in layer 1 [train/sampler]", "cause (minor): a few redrawn tokens [train/sampler]")
    assert verdict_line(PAIR, found.verdicts[PAIR]) == (
        "train/sampler (what the RL ratio sees): large: the weights differ in layer 1 (kl_k3 0.3)")
    top = banner(found)
    assert (top.label, top.headline) == ("FIX AT THE SOURCE", "The weights differ in layer 1 — fix: the weight sync of layer 1")
    assert top.details[:3] == ["Evidence: e.", "Not the others: r.", "Also found: a few redrawn tokens."]


def test_an_older_summary_reads_as_far_as_it_goes(capsys) -> None:
    """Sections without the fields a later run writes: nothing is invented, nothing raises."""
    old = summary(alignment={"stored": "sampler"}, drift={"spans": []}, localization={"turns": {"n_tokens": 5}})
    print_findings(old)
    assert capsys.readouterr().out == "alignment: shift +0, stored log-probs unknown\n"
    page = str(findings_section(old))
    assert "Render drift: 0 drifted spans" in page and "Stored log-probs fit better shifted" not in page


@pytest.mark.parametrize(("sections", "field"), [
    ({"alignment": {"stored": "sampler", "shift": "one"}}, "alignment/shift"),
    ({"drift": {"num_rollouts_checked": 3, "spans": {"rollout": "r-0"}}}, "drift/spans"),
])
def test_a_section_of_the_wrong_type_is_one_line_on_reading(tmp_path, sections: dict, field: str) -> None:
    """alignment and drift are records of the model: a field of a type no run writes is refused as
    the summary is read, in one line naming the file and the field, before the terminal or the page
    reads it."""
    from mismatch.errors import ResultsError
    from mismatch.results import read_summary

    data = {"schema": "mismatch.summary/v1", "command": "audit", "pairs": {PAIR: {"n_tokens": 10}}, **sections}
    (tmp_path / "summary.json").write_text(json.dumps(data))
    with pytest.raises(ResultsError) as error:
        read_summary(tmp_path)
    line = str(error.value)
    assert line.startswith(f"{tmp_path / 'summary.json'}: not a summary.json a run writes (") and field in line
    assert "\n" not in line
