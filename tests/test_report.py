"""The HTML report: built from a results dir alone, self-contained, escaped, and checked in a browser.

Browser tests drive Debian's /usr/bin/chromium through playwright (fresh profile per launch) from a
file:// URL and are skipped, with the reason, when either is missing; everything else runs always.
"""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from conftest import REPO
from mismatch.present.headline import banner
from mismatch.reports.aggregate import histogram
from mismatch.reports.build import REPORT_FILE, ReportError, build_report, plotly_js, script_json
from mismatch.reports.worst import WorstOptions, select_rows
from mismatch.results.summary_model import partial_summary

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--disable-quic"]
ARTIFACTS = REPO / "tests/artifacts"
SCRIPT = "<script>alert(1)</script>"
IMG = '"><img src=x onerror=alert(1)>'
VOCAB = ["<|system|>", "<|user|>", "<|assistant|>", "<|tool|>", "<|end|>", "\n", "Compute", " 2+2", ".",
         "The", " answer", " is", " 4", "<tool_call>", "calc", "</tool_call>", SCRIPT, IMG]
WORD = {word: i for i, word in enumerate(VOCAB)}


# --- synthetic results dirs ----------------------------------------------------------------------

def ids(*words: str) -> list[int]:
    return [WORD[w] for w in words]


def rollout(rid: str, *, tool_text: tuple[str, ...] = (" 4",), subagent: bool = False) -> dict[str, Any]:
    main = [("system", ids("<|system|>", "Compute", ".", "<|end|>")),
            ("user", ids("<|user|>", "Compute", " 2+2", "<|end|>", "<|assistant|>")),
            ("assistant", ids("<tool_call>", "calc", " 2+2", "</tool_call>", "<|end|>")),
            ("tool", ids("<|tool|>", *tool_text, "<|end|>", "<|assistant|>")),
            ("assistant", ids("The", " answer", " is", " 4", ".", "<|end|>"))]
    branches = [{"id": "main", "kind": "main", "start": 0, "segments": main}]
    if subagent:
        branches.append({"id": "sub-1", "kind": "subagent", "start": 9,
                         "segments": [("user", ids("<|user|>", " 2+2", "<|end|>")),
                                      ("assistant", ids("The", " answer", " is", " 4", "<|end|>"))]})
    return {"id": rid, "branches": branches}


def token_table(rollouts: list[dict[str, Any]]) -> pd.DataFrame:
    rows = []
    for r in rollouts:
        for b in r["branches"]:
            pos, turn = b["start"], 0
            for s, (role, token_ids) in enumerate(b["segments"]):
                for token_id in token_ids:
                    rows.append({"rollout": r["id"], "branch": b["id"], "branch_kind": b["kind"], "turn": turn,
                                 "segment": s, "pos": pos, "role": role, "token_id": token_id,
                                 "trainable": role in ("assistant", "summary")})
                    pos += 1
                turn += role in ("assistant", "summary")  # a model segment closes its turn
    table = pd.DataFrame(rows)
    for column in ("rollout", "branch", "branch_kind", "role"):
        table[column] = table[column].astype("category")
    for column in ("turn", "segment", "pos"):
        table[column] = table[column].astype(np.int32)
    return table


def tokenizer_file(path: Path) -> Path:
    """A word-level tokenizer whose tokens include the XSS payloads, so decoded text carries them."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    Tokenizer(WordLevel(vocab=dict(WORD), unk_token="<|end|>")).save(str(path))
    return path


def audit_dir(root: Path, rollouts: list[dict[str, Any]], *, seed: int = 0, worst: str | None = None,
              extra: dict[str, Any] | None = None) -> Path:
    """An audit results dir from mismatch's own summary builder; `worst` gets one big log-ratio."""
    from mismatch.results.chunks import table_chunks
    from mismatch.pipeline.audit import AUDIT_PAIRS
    from mismatch.pipeline.summary import build_summary, with_parts
    from mismatch.results import write_results

    rng = np.random.default_rng(seed)
    table = token_table(rollouts)
    num = len(table)
    logp_train = -rng.exponential(1.0, num)
    logp_infer = np.minimum(logp_train + rng.normal(0.0, 0.01, num), 0.0)  # a log-prob is <= 0 (the report checks)
    logp_sampler = logp_infer.copy()
    if worst is not None:
        first = np.flatnonzero((table["rollout"] == worst).to_numpy() & table["trainable"].to_numpy())[0]
        logp_sampler[first] -= 2.0
    logp_sampler[~table["trainable"].to_numpy()] = np.nan
    table["logp_sampler"], table["logp_train"], table["logp_infer"] = logp_sampler, logp_train, logp_infer
    engines = {"sampler": {"kind": "stored", "spec": "sampler"}, "train": {"kind": "hf", "spec": "hf"},
               "infer": {"kind": "hf-decode", "spec": "hf-decode:dtype=bfloat16"}}
    summary = build_summary(table_chunks(table), engines=engines, checkpoint="ckpt", rollouts_file="rollouts.jsonl",
                            pairs=AUDIT_PAIRS, command="audit")
    return write_results(root, tokens=table, summary=with_parts(summary, extra or {}), force=False)


def diff_dir(root: Path) -> Path:
    from mismatch.results.chunks import table_chunks
    from mismatch.analysis.comparison import compare_configs
    from mismatch.pipeline.diff import DIFF_PAIRS
    from mismatch.pipeline.summary import build_summary, with_parts
    from mismatch.results import write_results

    rng = np.random.default_rng(1)
    table = token_table([rollout(f"r-{i}", subagent=i % 2 == 0) for i in range(8)])
    reference = -rng.exponential(1.0, len(table))
    table["logp_a"] = np.minimum(reference + rng.normal(0.0, 0.05, len(table)), 0.0)  # bf16-like: farther
    table["logp_b"] = np.minimum(reference + rng.normal(0.0, 0.001, len(table)), 0.0)
    table["logp_reference"] = reference
    engines = {"a": {"spec": "hf:dtype=bfloat16", "tokens_per_s": 900.0},
               "b": {"spec": "hf:dtype=float32", "tokens_per_s": 500.0}, "reference": {"spec": "hf"}}
    summary = build_summary(table_chunks(table), engines=engines, checkpoint="ckpt", rollouts_file="rollouts.jsonl",
                            pairs=DIFF_PAIRS, command="diff")
    summary = with_parts(summary, {"diff": {**compare_configs(table_chunks(table), num_bootstrap=200),
                                            "throughput_tokens_per_s": {"a": 900.0, "b": 500.0}}})
    return write_results(root, tokens=table, summary=summary, force=False)


FULL_EXTRA: dict[str, Any] = {
    "localization": {
        "turns": {"onset_turn": 1, "position_slope": {"slope_per_1k": 1.2e-5, "ci95_per_1k": [0.8e-5, 1.6e-5]},
                  # The report draws these buckets as the analysis wrote them, never its own.
                  "pair": "train/sampler",
                  "by_prob_bucket": [{"bucket": label, "n_tokens": 10 * (i + 1), "log_ratio_abs_mean": 0.01 / (i + 1),
                                      "log_ratio_abs_max": 0.1 / (i + 1), "kl_k3": 1e-4 / (i + 1),
                                      "frac_outside_2": 0.0}
                                     for i, label in enumerate(("p<0.001", "0.001-0.01", f"{IMG}"))]},
        "layers": {"jump_layer": 2, "jump_block": "mlp",
                   "by_layer": [{"layer": i, "block": block, "rel_error": 1e-4 * (1 + i) * (30 if i >= 2 else 1)}
                                for i in range(4) for block in ("attn", "mlp")]},
        "kernels": {"by_module": [{"name": f"layers.{i}.mlp.{IMG}", "rel_error": 1e-3 / (i + 1)}
                                  for i in range(5)]}},
    "alignment": {"shift": 1, "padded_zero_frac": 0.0, "logprob_semantics": "raw"},
    "drift": {"spans": [{"rollout": "r-0", "turn": 1, "stored": SCRIPT, "rendered": IMG}]},
    "corrections": [{"mode": mode, "params": {"cap": cap}, "frac_tokens_affected": 0.01 / cap,
                     "frac_rollouts_affected": 0.2 / cap, "weight_mean": 0.99, "weight_max": float(cap),
                     "ess": 0.98} for mode in ("token_truncate", "token_mask") for cap in (2, 3)],
    # The shape mismatch.advise.recommend writes (kind "correction", the chosen mode and cap in params).
    "recommendations": [{"kind": "correction", "why": f"99% of tokens unclipped at cap 2 {SCRIPT}",
                         "params": {"mode": "token_truncate", "cap": 2, "frac_tokens_affected": 0.005,
                                    "frac_rollouts_affected": 0.1, "ess": 0.98, "meets_rule": True}}],
    "config_snippets": {"trl": f"vllm_importance_sampling_mode: token_truncate  # {IMG}\n"
                               "vllm_importance_sampling_cap: 2"},
}


@pytest.fixture(scope="module")
def word_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tokenizer_file(tmp_path_factory.mktemp("tok") / "tokenizer.json")


@pytest.fixture(scope="module")
def hostile_report(tmp_path_factory: pytest.TempPathFactory, word_tokenizer: Path) -> Path:
    """Every optional section present, and XSS payloads in tool output, ids, drift, snippets, names."""
    rollouts = [rollout("r-0", tool_text=(SCRIPT, IMG), subagent=True),
                rollout(IMG, tool_text=(IMG,)), *(rollout(f"r-{i}", subagent=i % 3 == 0) for i in range(2, 9))]
    out = audit_dir(tmp_path_factory.mktemp("hostile") / "audit", rollouts, worst="r-0", extra=FULL_EXTRA)
    return build_report(out, tokenizer_path=word_tokenizer)


@pytest.fixture(scope="module")
def demo_report(tiny_checkpoint: Path, sampled_rollouts: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's audit (tiny checkpoint, toy-agent rollouts, fp32 trainer vs bf16 decode), reported."""
    from mismatch.pipeline.audit import audit
    from mismatch.demo import DEMO_INFER, DEMO_TRAIN

    out = tmp_path_factory.mktemp("demo") / "audit"
    # sampled_rollouts come from the hf-decode sampler: the demo replays a sampler with its own path.
    audit(tiny_checkpoint, sampled_rollouts, train=DEMO_TRAIN, infer=DEMO_INFER["hf-decode"], out=out)
    return build_report(out)


# --- without a browser -----------------------------------------------------------------------------

def test_reports_never_import_torch_or_the_engines(tmp_path: Path) -> None:
    out = audit_dir(tmp_path / "audit", [rollout("r-0"), rollout("r-1")])
    code = ("import json, sys\nfrom pathlib import Path\nfrom mismatch.reports.build import build_report\n"
            f"build_report(Path({str(out)!r}))\nprint(json.dumps(sorted(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    modules = json.loads(done.stdout)
    heavy = [m for m in modules if m.split(".")[0] in ("torch", "transformers", "vllm")]
    assert heavy == [], heavy
    # Of the core (the reports' own modules aside), only its light packages: the package root, the
    # errors (ReportError), the results contract, the streams' data, the analysis (terms, chunked
    # reductions, prefix findings' wording), their worker processes, the frameworks' metric
    # names (numpy and pandas only) and the words it shares with the terminal (present); never an engine, the replay, the rollouts loader, a localizer,
    # the probes, the checkpoint, the advice or an orchestration.
    core = {m.split(".")[1] if "." in m else m for m in modules
            if m.split(".")[0] == "mismatch" and m.split(".")[1:2] != ["reports"]}
    assert core <= {"mismatch", "errors", "version", "results", "streams", "analysis", "workers", "frameworks",
                    "present"}, core
    assert {"mismatch", "errors", "results", "analysis", "frameworks"} <= core, core
    assert (out / REPORT_FILE).is_file()


def test_report_is_self_contained_and_embeds_plotly_once(hostile_report: Path) -> None:
    page = hostile_report.read_text()
    assert page.count(plotly_js()) == 1
    assert page.count("<script") == 3  # the data block, plotly, the app: nothing else
    assert not re.search(r"<(script|img|iframe|link)[^>]*\s(src|href)=[\"']?(https?:)?//", page, re.I)
    assert not re.search(r"@import|url\(\s*['\"]?https?:", page, re.I)
    assert "default-src 'none'" in page  # CSP: even a missed fetch would be refused


def test_payloads_never_appear_unescaped_in_the_html(hostile_report: Path) -> None:
    page = hostile_report.read_text()
    assert SCRIPT not in page and "<img" not in page.lower()
    data = re.search(r'<script type="application/json" id="report-data">(.*?)</script>', page, re.S).group(1)
    assert "<" not in data and ">" not in data and "&" not in data
    texts = json.loads(data)["worst"]["text"]
    assert texts[str(WORD[SCRIPT])] == SCRIPT and texts[str(WORD[IMG])] == IMG  # round-trips intact


def test_script_json_is_inert_and_round_trips() -> None:
    value = {"t": "</script><!-- & \u2028", "n": float("nan"), "x": [1.5, float("inf")]}
    text = script_json(value)
    assert not set("<>&") & set(text)
    assert json.loads(text) == {"t": "</script><!-- & \u2028", "n": None, "x": [1.5, None]}


def test_histogram_counts_every_token_and_says_what_it_clipped() -> None:
    log_ratio = np.array([-5.0, -0.1, 0.0, 0.0, 0.05, 0.1, 7.0, np.inf])
    hist = histogram(log_ratio, limit=0.2, num_bins=5)
    assert sum(hist["counts"]) == len(log_ratio)
    assert (hist["n_below"], hist["n_above"], hist["counts"][2]) == (1, 2, 2)


def test_long_rollouts_keep_windows_around_their_worst_tokens() -> None:
    abs_lr = np.full(1000, 0.001)
    abs_lr[[100, 700]] = [5.0, 3.0]
    abs_lr[:50] = np.nan  # context: never a window centre
    rows = select_rows(abs_lr, budget=50, context=10)
    assert len(rows) <= 50 and {100, 700} <= set(rows) and set(range(90, 111)) <= set(rows)
    assert list(select_rows(abs_lr[:30], budget=50, context=10)) == list(range(30))


def verdict_summary(level: str, *recs: dict[str, Any]) -> dict[str, Any]:
    return {"command": "audit", "pairs": {"train/sampler": {"n_tokens": 10, "kl_k3": 1e-4}},
            "verdicts": {"train/sampler": {"level": level, "meaning": "what the RL ratio sees",
                                           "text": f"the PPO ratio is {level} (kl_k3 1e-4, …)"}},
            "recommendations": list(recs)}


CORRECTION = {"kind": "correction", "params": {"mode": "token_truncate", "cap": 1.5, "meets_rule": True}, "why": "w"}
RECOMPUTE = {"kind": "recompute_old_logprobs", "params": {"extra_forward_tokens": 10}, "why": "w"}


@pytest.mark.parametrize(("level", "recs", "label", "headline"), [
    ("negligible", [{"kind": "no_correction", "params": {"gap": "negligible"}, "why": "w"}], "HEALTHY",
     "The PPO ratio is negligible"),
    ("small", [CORRECTION, RECOMPUTE], "CORRECT", "Correct with token_truncate (cap=1.5)"),
    ("large", [CORRECTION, RECOMPUTE], "FIX AT THE SOURCE",
     "Fix at the source: recompute old log-probs with the trainer — meanwhile correct with token_truncate (cap=1.5)"),
    ("small", [{**CORRECTION, "params": {**CORRECTION["params"], "meets_rule": False}}, RECOMPUTE],
     "FIX AT THE SOURCE", "Fix at the source: recompute old log-probs with the trainer — meanwhile correct with "
                          "token_truncate (cap=1.5)"),
    ("small", [{"kind": "fix_alignment", "params": {"shift": 1}, "why": "w"}, CORRECTION], "FIX AT THE SOURCE",
     "Fix at the source: the log-prob alignment (off by +1)"),  # never "correct" a misaligned comparison
    ("small", [], "SMALL GAP", "The PPO ratio is small"),
])
def test_banner_leads_with_the_right_action(level: str, recs: list, label: str, headline: str) -> None:
    top = banner(partial_summary(verdict_summary(level, *recs)))
    assert (top.label, top.headline) == (label, headline)


def test_no_verdict_is_never_healthy() -> None:
    assert banner(partial_summary({**verdict_summary("exact"), "verdicts": {}})).status == "unknown"


def test_large_rollout_sets_stay_small(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("report_size", REPO / "benchmarks/report_size.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "big"
    bench.write_synthetic(out, num_rollouts=300, seed=0)
    options = WorstOptions(num_rollouts=5, max_tokens_per_rollout=200, context=20)
    page = build_report(out, worst_options=options).read_text()
    data = json.loads(re.search(r'id="report-data">(.*?)</script>', page, re.S).group(1))
    shown = [len(r["token_id"]) for r in data["worst"]["rollouts"]]
    assert len(shown) == 5 and max(shown) <= 200
    assert len(page) - len(plotly_js()) < 1_000_000


def test_rebuild_replaces_the_page_atomically_and_bad_dirs_fail_clearly(tmp_path: Path) -> None:
    out = audit_dir(tmp_path / "audit", [rollout("r-0")])
    (out / REPORT_FILE).write_text("old")
    build_report(out)
    assert (out / REPORT_FILE).read_text().startswith("<!doctype html>")
    assert sorted(p.name for p in out.iterdir()) == ["index.html", "summary.json", "tokens.parquet"]
    with pytest.raises(ReportError, match=r"no summary\.json: not a mismatch results dir"):
        build_report(tmp_path)


# --- in the browser --------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed")
    if not CHROMIUM.is_file():
        pytest.skip(f"{CHROMIUM} not found (apt-get install chromium)")
    with sync_api.sync_playwright() as playwright:
        # launch() gives a fresh temporary profile; the flags keep Chromium off the network.
        chromium = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


class Opened:
    """A report loaded from file:// with everything the page did recorded."""

    def __init__(self, browser, path: Path, width: int = 1360) -> None:
        self.url = path.resolve().as_uri()
        self.page = browser.new_page(viewport={"width": width, "height": 900})
        self.requests: list[str] = []
        self.errors: list[str] = []
        self.dialogs: list[str] = []
        self.page.on("request", lambda request: self.requests.append(request.url))
        self.page.on("console", lambda msg: self.errors.append(msg.text) if msg.type == "error" else None)
        self.page.on("pageerror", lambda exc: self.errors.append(str(exc)))
        self.page.on("dialog", lambda dialog: (self.dialogs.append(dialog.message), dialog.dismiss()))
        self.page.goto(self.url)
        self.page.wait_for_selector("body[data-ready='1']", timeout=30_000)

    def charts(self) -> dict[str, bool]:
        return dict(self.page.eval_on_selector_all(
            ".chart", "els => els.map(e => [e.dataset.fig, e.querySelector('.main-svg') !== null])"))

    def assert_clean(self) -> None:
        assert self.errors == []
        assert self.requests == [self.url]  # the file itself, nothing else: no CDN, font or favicon


def test_demo_report_in_chromium(browser, demo_report: Path) -> None:
    summary = json.loads((demo_report.parent / "summary.json").read_text())
    opened = Opened(browser, demo_report)
    page = opened.page
    verdict = summary["verdicts"]["train/sampler"]["text"].split(" (kl_k3")[0]
    assert verdict.lower() in page.inner_text("#verdict").lower()  # the audit's own words, in the banner
    assert page.inner_text("#verdict .pill") in ("HEALTHY", "CORRECT", "FIX AT THE SOURCE", "SMALL GAP", "LARGE GAP")
    correction = next((r for r in summary["recommendations"] if r["kind"] == "correction"), None)
    if correction is not None:
        assert correction["params"]["mode"] in page.inner_text("#verdict-headline")
    charts = opened.charts()
    expected = {f"hist-{pair}" for pair in summary["pairs"]} | {"turn", "position", "prob", "branch_kind"}
    assert set(charts) == expected and all(charts.values()), charts
    if not summary["localization"].get("layers"):
        assert page.query_selector("#localization") is None  # not computed: said once, never invented
        assert "layer localization" in page.inner_text(".absent")
    assert "<|assistant|>" in page.inner_text("#worst-list")  # token text decoded from the checkpoint
    page.hover("#worst-list .tok:not(.ctx)")
    tooltip = page.inner_text("#tooltip")
    assert "logp train" in tooltip and "logp sampler" in tooltip and "ratio" in tooltip
    opened.assert_clean()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.mouse.move(0, 0)
    page.evaluate("window.scrollTo(0, 0)")  # the sticky header belongs at the top of the shot
    page.screenshot(path=str(ARTIFACTS / "report.png"), full_page=True)
    page.close()


def test_xss_payloads_in_rollouts_render_inert(browser, hostile_report: Path) -> None:
    opened = Opened(browser, hostile_report)
    page = opened.page
    page.hover("#worst-list .tok")  # run the tooltip path too
    page.click("#worst-list details:nth-of-type(2) > summary")  # and a second rollout's token view
    assert opened.dialogs == []
    assert page.query_selector("img[src=x]") is None and page.query_selector("img") is None
    assert len(page.query_selector_all("script")) == 3
    tokens = page.inner_text("#worst-list")
    assert SCRIPT in tokens and IMG in tokens  # shown as text
    assert SCRIPT in page.inner_text("#findings") and IMG in page.inner_text("#corrections")
    opened.assert_clean()
    page.close()


def test_every_section_renders_when_its_data_are_present(browser, hostile_report: Path) -> None:
    opened = Opened(browser, hostile_report)
    page = opened.page
    charts = opened.charts()
    assert {"layers", "kernels", "turn", "position", "prob", "branch_kind"} <= set(charts), charts
    assert all(charts.values()), charts
    assert page.inner_text("#verdict .pill") == "CORRECT"
    assert page.inner_text("#verdict-headline") == "Correct with token_truncate (cap=2)"
    assert "★ token_truncate" in page.inner_text("#corrections tr.highlight")
    assert "vllm_importance_sampling_cap: 2" in page.inner_text("#corrections pre.snippet")
    assert "shifted by +1" in page.inner_text("#findings")
    assert page.query_selector(".absent") is None  # everything was computed
    opened.assert_clean()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.evaluate("window.scrollTo(0, 0)")
    page.screenshot(path=str(ARTIFACTS / "report-full.png"), full_page=True)
    page.close()


def test_diff_report_shows_both_configs_side_by_side(browser, tmp_path: Path) -> None:
    out = diff_dir(tmp_path / "diff")
    summary = json.loads((out / "summary.json").read_text())
    opened = Opened(browser, build_report(out))
    page = opened.page
    closer = summary["diff"]["closer_to_reference"]
    assert closer == "b"
    assert page.inner_text("#verdict-headline") == "Config B (hf:dtype=float32) is closer to the reference"
    charts = opened.charts()
    assert {"hist-a/reference", "hist-b/reference", "hist-a/b"} <= set(charts) and all(charts.values())
    assert [c.strip() for c in page.locator("#gaps .card h3").all_inner_texts()] == list(summary["pairs"])
    assert "kl_k3" in page.inner_text("#diff table")
    opened.assert_clean()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "report-diff.png"), full_page=True)
    page.close()


def test_corrections_that_change_nothing_collapse_to_one_line_and_negative_chi2_is_explained() -> None:
    from mismatch.reports.advice import corrections_section
    from mismatch.reports.sections import gaps_section

    def row(mode: str, cap: float, frac: float) -> dict:
        return {"mode": mode, "params": {"cap": cap}, "frac_tokens_affected": frac, "frac_rollouts_affected": frac,
                "weight_mean": 1.0, "weight_max": 1.0, "ess": 1.0}

    corrections = [row("token_truncate", 2.0, 0.0), row("token_mask", 2.0, 0.0), row("sequence_mask", 3.0, 0.0),
                   row("token_truncate", 1.5, 0.004)]
    recs = [{"kind": "correction", "params": {"mode": "token_truncate", "cap": 1.5}, "why": "w"}]
    page = corrections_section(partial_summary({"corrections": corrections, "recommendations": recs}))
    assert "3 of them change no token here: token_truncate (cap=2), token_mask (cap=2), sequence_mask (cap=3)" \
        in page
    # The simulated corrections' table: the header, the collapsed line, the one that acts (recommended);
    # the recommendation's own parameters are a small table before it.
    table = page[page.rindex("<table"):]
    assert table.count("<tr") == 3
    metrics = {"n_tokens": 10, "chi2_token": -2e-7, "chi2_seq": 1e-3}
    summary = {"command": "audit", "pairs": {"train/sampler": metrics}}
    assert "A χ² below 0 is an estimate" in gaps_section(partial_summary(summary), ["train/sampler"],
                                                         {"train/sampler": "#000"})
    summary["pairs"]["train/sampler"]["chi2_token"] = 2e-7
    assert "A χ² below 0" not in gaps_section(partial_summary(summary), ["train/sampler"], {"train/sampler": "#000"})


@pytest.mark.parametrize("width", [390, 1440])
def test_the_page_never_scrolls_sideways(browser, hostile_report: Path, demo_report: Path, width: int) -> None:
    """A phone (390 px) or a laptop: wide tables scroll inside themselves, the page does not."""
    for report in (hostile_report, demo_report):
        opened = Opened(browser, report, width=width)
        assert opened.page.evaluate("document.documentElement.scrollWidth") <= width, report
        opened.page.close()


def test_the_demo_report_stays_small(demo_report: Path) -> None:
    # plotly's basic bundle (bar and scatter are all the report draws): 1.2 MB, not the full 4.8 MB.
    assert demo_report.stat().st_size <= 1.5 * 2**20
    assert "plotly.js (basic - minified) v4.1.1" in demo_report.read_text()


def test_a_few_redrawn_tokens_do_not_take_the_headline() -> None:
    from mismatch.present.headline import audit_banner

    def summary(touched: int) -> dict:
        return {"pairs": {"train/sampler": {"n_tokens": 598}},
                "verdicts": {"train/sampler": {"level": "small", "text": "small gap", "meaning": "m"}},
                "counts": {"trainable_tokens": 598}, "drift": {"trainable_tokens_touched": touched},
                "recommendations": [{"kind": "fix_renderer", "params": {"spans": 3}, "why": "w"},
                                    {"kind": "correction", "params": {"mode": "token_truncate", "cap": 2.0},
                                     "why": "w"}]}

    minor = audit_banner(partial_summary(summary(4)))  # 4 of 598 trained tokens: the gap's own answer leads
    assert minor.headline == "Correct with token_truncate (cap=2)" and "the renderer" in " ".join(minor.details)
    major = audit_banner(partial_summary(summary(100)))
    assert major.headline.startswith("Fix at the source: the renderer")


def test_the_audit_report_lists_its_worst_tokens(demo_report: Path) -> None:
    page = demo_report.read_text()
    assert "trainable tokens with the largest |log-ratio| on train/sampler" in page
    tokens = pd.read_parquet(demo_report.parent / "tokens.parquet")
    trainable = tokens[tokens["trainable"]]
    worst = (trainable["logp_train"] - trainable["logp_sampler"]).abs().max()
    from mismatch.present.numbers import num

    assert f"<td><span>{num(worst, 6)}</span></td></tr>" in page  # the largest gap, rendered as the table does


def test_an_audits_report_read_in_its_passes_is_the_report_built_from_its_results(tmp_path: Path,
                                                                                   monkeypatch) -> None:
    """The audit reads the page's data in its analysis's passes (report_digestion), not again
    after them; `mismatch report` on the same results dir writes the very same page."""
    import mismatch
    from mismatch.reports import build
    from tests.test_golden import GOLDEN, stored_checkpoint

    monkeypatch.setattr("mismatch.results.chunks.DEFAULT_CHUNK_ROWS", 97)
    with monkeypatch.context() as patched:
        patched.setattr(build, "digest", lambda *a, **k: pytest.fail("the audit's report read the tokens again"))
        mismatch.audit(stored_checkpoint(tmp_path / "ckpt"), GOLDEN / "rollouts.jsonl", train="stored:trainer",
                       infer="stored:engine", out=tmp_path / "out", block_size=4)
    first = (tmp_path / "out" / REPORT_FILE).read_bytes()
    build.build_report(tmp_path / "out")
    assert (tmp_path / "out" / REPORT_FILE).read_bytes() == first


def test_a_diffs_report_read_in_its_passes_is_the_report_built_from_its_results(tmp_path: Path,
                                                                                 monkeypatch) -> None:
    """diff reads its page's data in its analysis's passes too (report_digestion, without the
    audit's worst tokens), in forked readers and workers; `mismatch report` writes the same page."""
    from mismatch.pipeline.diff import diff
    from mismatch.reports import build
    from tests.test_golden import GOLDEN, stored_checkpoint

    monkeypatch.setattr("mismatch.results.chunks.DEFAULT_CHUNK_ROWS", 97)
    monkeypatch.setattr("mismatch.workers.MIN_ROWS_TO_FORK", 1)
    monkeypatch.setattr("mismatch.workers.MIN_BYTES_TO_FORK", 1)
    monkeypatch.setenv("MISMATCH_WORKERS", "2")
    with monkeypatch.context() as patched:
        patched.setattr(build, "digest", lambda *a, **k: pytest.fail("the diff's report read the tokens again"))
        diff(stored_checkpoint(tmp_path / "ckpt"), GOLDEN / "rollouts.jsonl", a="stored:trainer",
             b="stored:engine", reference="sampler", out=tmp_path / "out", block_size=4)
    first = (tmp_path / "out" / REPORT_FILE).read_bytes()
    build.build_report(tmp_path / "out")
    assert (tmp_path / "out" / REPORT_FILE).read_bytes() == first
