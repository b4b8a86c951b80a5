"""The report's first screen in Chromium: no value, badge or headline spills out of its card.

A results dir with the longest things a summary holds (a ratio range like 1.222e−5 – 5.584e4, counts
in the hundreds of millions, long role names, a long headline, NEGLIGIBLE / NOT JUDGED / FIX AT THE
SOURCE badges) is rendered at a laptop's viewport, a narrow window and a phone; a script in the page measures
every box of the banner and of the pair cards against the card that holds it.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from mismatch.reports.build import build_report
from mismatch.results.summary_model import Summary
from test_report import browser, rollout, token_table  # noqa: F401 (browser: the shared Chromium fixture)

# Role names as long as a user's engines are named; the pair names are "a/b" of these.
TRAIN, SAMPLER, INFER = "trainer_megatron_bf16", "sampler_vllm_fp8_kvcache", "infer_hf_decode_bf16"
PAIRS = ((TRAIN, SAMPLER), (TRAIN, INFER), (INFER, SAMPLER))
FOCUS = f"{TRAIN}/{SAMPLER}"
# The widest values each number format gives (reports.html.num, pct): 4 significant digits with an
# exponent and a minus sign, counts with separators, percentages below 1%.
LONG_METRICS = {"kl_k3": 1.234e-7, "log_ratio_abs_mean": -1.234e-5, "log_ratio_abs_max": 10.98,
                "ratio_q001": 1.222e-5, "ratio_q999": 5.584e4, "chi2_token": -2.345e-7, "ess": 0.9999,
                "frac_outside_2": 0.001234, "bitwise_equal_frac": 0.000123, "n_tokens": 123_456_789}
FIX = {"kind": "fix_weight_sync", "why": "w",
       "params": {"at": "step 1200 (the sampler's weights lag the trainer's by one optimizer step)"}}
CORRECTION = {"kind": "correction", "why": "w",
              "params": {"mode": "sequence_mask", "threshold": 1.5e-3, "low": 0.5, "high": 2.0, "meets_rule": False}}
VIEWPORTS = [(1280, 800), (800, 800), (390, 800)]

# For every card of the first screen (the banner, its tiles and pill, the pair cards and their
# badges), the boxes inside it that lie outside it, and every box whose content is wider (or
# taller) than the box itself: text that spills over its edge even when the box stays inside.
MEASURE = """() => {
  const CARDS = '#verdict, #verdict .banner-head, #verdict .tiles, #verdict .tile, #verdict .pill, '
      + '#gaps .card, #gaps .card header, #gaps .card .level, #gaps .card dl.metrics > div';
  const name = el => el.tagName.toLowerCase() + (el.id ? '#' + el.id : '')
      + (typeof el.className === 'string' && el.className.trim() ? '.' + el.className.trim().split(/\\s+/).join('.') : '');
  const text = el => el.textContent.trim().replace(/\\s+/g, ' ').slice(0, 50);
  const out = [];
  // Each box against the nearest card around it: its border box, and for text the text's own
  // rect (a range reaches past a box its text overflows). Content may reach the card's padding,
  // never past its border.
  const inner = card => { const c = card.getBoundingClientRect(), s = getComputedStyle(card);
    return {left: c.left + parseFloat(s.borderLeftWidth), right: c.right - parseFloat(s.borderRightWidth),
            top: c.top + parseFloat(s.borderTopWidth), bottom: c.bottom - parseFloat(s.borderBottomWidth)}; };
  const check = (el, r, card) => {
    if (!card || (r.width === 0 && r.height === 0)) return;
    const c = inner(card);
    const spill = Math.max(c.left - r.left, r.right - c.right, c.top - r.top, r.bottom - c.bottom);
    if (spill > 1) out.push(`${name(el)} "${text(el)}" spills ${spill.toFixed(0)}px out of ${name(card)} "${text(card)}"`);
  };
  for (const root of document.querySelectorAll('#verdict, #gaps .card')) {
    check(root, root.getBoundingClientRect(), root.parentElement.closest('.panel, main'));  // the card itself
    for (const el of root.querySelectorAll('*')) check(el, el.getBoundingClientRect(), el.parentElement.closest(CARDS));
    const walker = document.createTreeWalker(root, NodeFilter.SHOW_TEXT);
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
      if (!node.textContent.trim()) continue;
      const range = document.createRange();
      range.selectNodeContents(node);
      check(node.parentElement, range.getBoundingClientRect(), node.parentElement.closest(CARDS));
    }
    // A box that holds text and is narrower (or shorter) than that text: it spills even where the
    // box itself stays inside its card.
    for (const el of [root, ...root.querySelectorAll('*')]) {
      if (![...el.childNodes].some(n => n.nodeType === Node.TEXT_NODE && n.textContent.trim())) continue;
      if (el.clientWidth === 0 && el.clientHeight === 0) continue;  // inline: its rect is checked above
      const wide = el.scrollWidth - el.clientWidth, tall = el.scrollHeight - el.clientHeight;
      if (wide > 1 || tall > 1) out.push(`${name(el)} "${text(el)}" overflows itself by ${wide}px wide, ${tall}px tall`);
    }
  }
  return [...new Set(out)];
}"""


def long_summary(table) -> Summary:
    from mismatch.results.chunks import table_chunks
    from mismatch.pipeline.summary import build_summary
    from mismatch.results.summary_model import from_builtins

    engines = {TRAIN: {"kind": "hf", "spec": "hf:dtype=bfloat16,attn_implementation=flash_attention_2"},
               SAMPLER: {"kind": "stored", "spec": "vllm:quantization=fp8,kv_cache_dtype=fp8_e5m2"},
               INFER: {"kind": "hf-decode", "spec": "hf-decode:dtype=bfloat16"}}
    summary = build_summary(table_chunks(table), engines=engines, checkpoint="checkpoints/qwen3-30b-a3b-step-1200",
                            rollouts_file="rollouts/step-1200-agentic.jsonl", pairs=PAIRS, command="audit").to_dict()
    for pair in summary["pairs"]:
        summary["pairs"][pair].update(LONG_METRICS)
    # LARGE, NEGLIGIBLE, and a pair without a verdict: NOT JUDGED.
    summary["verdicts"] = {pair: {"level": level, "meaning": "what the RL ratio sees",
                                  "text": f"the PPO ratio is {level} (kl_k3 1.234e-7, …)"}
                           for pair, level in ((FOCUS, "large"), (f"{TRAIN}/{INFER}", "negligible"))}
    summary["counts"] = {"rollouts": 1_234_567, "branches": 2_345_678, "tokens": 987_654_321,
                         "trainable_tokens": 123_456_789}
    summary["clip"] = {"eps_low": 0.2, "eps_high": 0.28, "range": [0.8, 1.28], "pairs": {FOCUS: 0.001234}}
    summary["recommendations"] = [FIX, CORRECTION]
    summary.pop("diagnosis", None)
    return from_builtins(summary)


@pytest.fixture(scope="module")
def long_report(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from mismatch.results import write_results

    rng = np.random.default_rng(0)
    table = token_table([rollout(f"r-{i}") for i in range(3)])
    logp = -rng.exponential(1.0, len(table))
    for role, noise in ((TRAIN, 0.0), (INFER, 0.01), (SAMPLER, 0.02)):
        table[f"logp_{role}"] = np.minimum(logp + rng.normal(0.0, noise, len(table)), 0.0)  # log-probs are <= 0
    out = write_results(tmp_path_factory.mktemp("long") / "audit", tokens=table, summary=long_summary(table), force=False)
    return build_report(out, verify=False)  # its counts are stretched on purpose: the layout is tested, not the table


@pytest.mark.parametrize(("width", "height"), VIEWPORTS)
def test_nothing_on_the_first_screen_spills_out_of_its_card(browser, long_report: Path, width: int, height: int) -> None:
    page = browser.new_page(viewport={"width": width, "height": height})
    page.goto(long_report.resolve().as_uri())
    page.wait_for_selector("body[data-ready='1']", timeout=30_000)
    shown = page.inner_text("#verdict") + page.inner_text("#gaps")
    for text in ("1.222e−5 – 5.584e4", "FIX AT THE SOURCE", "NEGLIGIBLE", "NOT JUDGED", "123,456,789", FOCUS):
        assert text in shown  # the long values are there to be measured
    spills = page.evaluate(MEASURE)
    page.close()
    assert spills == [], "\n".join(spills)
