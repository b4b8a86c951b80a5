"""The README is the first hour, so every command it shows runs here, as written: each ```bash block
is either the quickstart (.ci/run runs it; tests/test_demo.py holds it) or a `<!-- run: NAME -->`
block run below in a directory laid out as the README says (`ckpt/` the tiny checkpoint,
`dumps/` a verl dump, `ppo.yaml` a verl config, `rollouts.jsonl` what the TRL hook writes).

The rollouts are the tiny model's own text; the sampler's log-probs are the tiny model's in
bf16 (transformers), the trainer's old ones in fp32: a real, small precision gap.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import numpy as np
import pytest

from conftest import REPO
from mismatch.cli import EXIT_CODES, main
from test_report import Opened, browser  # noqa: F401  (the report's Chromium fixture)
from test_trend import responses  # noqa: F401  (the tiny model's own text, with its fp32 log-probs)
from test_trend_faults import sampler_logprobs  # noqa: F401  (the same text's bf16 log-probs)

README = REPO / "README.md"
# Pages the README links that other branches add (the lead merges them): named, not assumed.
PAGES_ADDED_ELSEWHERE = {"docs/configs.md", "docs/hooks.md", "docs/truncated-sampling.md", "docs/architectures.md",
                         "docs/distribution.md"}


def blocks(text: str) -> list[tuple[str | None, list[str]]]:
    """Each ```bash block as (the name of its `<!-- run: NAME -->` marker, or "quickstart", or None; its commands)."""
    found = []
    for match in re.finditer(r"(?:<!-- (quickstart|run: (\S+)) -->\s*)?```(?:bash|sh)\n(.*?)```", text, re.S):
        name = "quickstart" if match.group(1) == "quickstart" else match.group(2)
        found.append((name, [line for line in match.group(3).splitlines() if line.strip() and not line.startswith("#")]))
    return found


def test_the_readme_is_short_and_every_page_it_links_is_there() -> None:
    text = README.read_text()
    assert len(text.splitlines()) <= 250
    assert "open `reports/demo/audit/index.html`" in text
    for target in re.findall(r"\]\(((?:docs/)?[\w./-]+\.md)\)", text):
        assert (REPO / target).is_file() or target in PAGES_ADDED_ELSEWHERE, target
    for page in (REPO / "docs").glob("*.md"):
        for target in re.findall(r"\]\(([\w./-]+\.md)\)", page.read_text()):
            linked = (page.parent / target).resolve().relative_to(REPO).as_posix()
            assert (REPO / linked).is_file() or linked in PAGES_ADDED_ELSEWHERE, f"{page.name}: {target}"


def test_every_command_block_of_the_readme_is_run_by_a_test() -> None:
    found = blocks(README.read_text())
    assert [name for name, _ in found] == ["quickstart", "verl", "trl"], found
    assert all(line.startswith("mismatch ") for name, lines in found if name != "quickstart" for line in lines)


def test_the_exit_codes_are_stated_once_the_same_in_the_readme_and_the_help(capsys) -> None:
    line = README.read_text().split("<!-- exit-codes -->\n", 1)[1].splitlines()[0]
    assert line == EXIT_CODES
    assert main(["--help"]) == 0
    assert " ".join(EXIT_CODES.split()) in " ".join(capsys.readouterr().out.split())


@pytest.fixture()
def run_dir(tmp_path: Path, tiny_checkpoint: Path, monkeypatch) -> Path:
    (tmp_path / "ckpt").symlink_to(tiny_checkpoint, target_is_directory=True)
    monkeypatch.chdir(tmp_path)
    return tmp_path


def run_block(name: str, capsys) -> dict[str, str]:
    """Run the README block `name` line by line through the CLI; each must exit 0. Its outputs by command."""
    (commands,) = [lines for found, lines in blocks(README.read_text()) if found == name]
    outputs = {}
    for line in commands:
        capsys.readouterr()
        argv = shlex.split(line)
        code = main(argv[1:])
        captured = capsys.readouterr()
        assert code == 0, f"{line}\n{captured.out}\n{captured.err}"
        outputs[argv[1]] = captured.out
    return outputs


def test_the_verl_path_runs_as_written(run_dir, responses, sampler_logprobs, capsys, browser) -> None:  # noqa: F811
    """verl's AgentLoopOutput rows (one step's dump) → import → audit with verl's config → recommend → gate.
    verl's old-log-prob forward runs in bf16 (its default mixed precision): the sampler here is fp32."""
    dumps = run_dir / "dumps" / "step_3"
    dumps.mkdir(parents=True)
    rows = [{"prompt_ids": prompt, "response_ids": response, "response_mask": [1] * len(response),
             "response_logprobs": np.asarray(fp32).tolist(), "num_turns": 2}
            for prompt, response, fp32, _ in responses[:12]]
    (dumps / "agent_loop.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (run_dir / "ppo.yaml").write_text("actor_rollout_ref:\n  model:\n    use_remove_padding: true\n"
                                      "  actor:\n    ppo_micro_batch_size_per_gpu: 4\n"
                                      "  rollout:\n    name: vllm\n    temperature: 1.0\n"
                                      "    log_prob_micro_batch_size_per_gpu: 4\n")
    outputs = run_block("verl", capsys)
    summary = json.loads((run_dir / "audit/summary.json").read_text())
    assert summary["pairs"]["train/sampler"]["n_tokens"] == sum(len(r[1]) for r in responses[:12])
    assert 0 < summary["pairs"]["train/sampler"]["kl_k3"] < 0.05  # bf16 against fp32: a small, real gap
    assert "rollout_correction" in outputs["recommend"], outputs["recommend"]
    # The report knows the framework from --train verl:…: its snippet on the first screen, the
    # recommendation's parameters as a table, never a Python repr.
    html = (run_dir / "audit/index.html").read_text()
    assert "Paste into your verl config" in html and html.index('id="snippet"') < html.index('id="gaps"')
    assert "{&#x27;" not in html and "{'" not in html and "ranked=" not in html
    opened = Opened(browser, run_dir / "audit/index.html", width=1280)
    box = opened.page.query_selector("#snippet pre").bounding_box()
    assert box["y"] < 900, box  # it starts on the first screen
    assert opened.page.query_selector("#corrections table.params") is not None
    opened.assert_clean()


def test_the_trl_path_runs_as_written(run_dir, responses, sampler_logprobs, capsys) -> None:  # noqa: F811
    """What MismatchDumpMixin writes (the sampler's and the trainer's old log-probs) → audit → recommend → gate."""
    lines = []
    for i, (prompt, response, trainer, _) in enumerate(responses[:12]):
        lines.append(json.dumps({"id": f"trl-{i}", "meta": {"step": 1, "sampler": {
            "engine": "vllm", "dtype": "bfloat16", "temperature": 1.0, "logprobs": "raw"}},
            "branches": [{"id": "main", "kind": "main", "parent": None, "fork_at": None, "segments": [
                {"role": "user", "tokens": prompt},
                {"role": "assistant", "tokens": response, "logprobs": sampler_logprobs["clean"][i].tolist(),
                 "extra_logprobs": {"trainer_old": np.asarray(trainer).tolist()}}]}]}))
    (run_dir / "rollouts.jsonl").write_text("\n".join(lines) + "\n")
    outputs = run_block("trl", capsys)
    summary = json.loads((run_dir / "audit/summary.json").read_text())
    assert 0 < summary["pairs"]["train/sampler"]["kl_k3"] < 0.05
    assert "vllm_importance_sampling" in outputs["recommend"], outputs["recommend"]


def test_the_glossary_defines_every_term_the_outputs_use() -> None:
    """Every summary.json pair metric, every simulated correction mode (its table is generated from
    correction_modes.MODES), and the field's words the outputs print."""
    from mismatch.advise.correction_modes import MODES
    from mismatch.analysis.metrics import PAIR_METRICS

    glossary = (REPO / "docs/glossary.md").read_text()
    for metric in PAIR_METRICS:
        assert f"`{metric}`" in glossary, metric
    rows = ["| mode | params | level | weight (and where the field ships it) |", "|---|---|---|---|"]
    rows += [f"| `{name}` | {', '.join(spec.params)} | {spec.level} | {spec.doc} |" for name, spec in MODES.items()]
    block = re.search(r"<!-- modes -->\n(.*?)<!-- /modes -->", glossary, re.S)
    assert block is not None and block.group(1) == "\n".join(rows) + "\n"
    for word in ("**IS**", "**TIS**", "**MIS**", "**RS**", "**ESS**", "**k1**", "**k2**", "**k3**", "**χ²**",
                 "**IcePop**", "**triangle**", "**R3**", "**replay fidelity**", "**change point**", "**jump**",
                 "`frac_outside_clip`", "**level**", "**strata**"):
        assert word in glossary, word
