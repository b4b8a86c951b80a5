/* mismatch report: draws the charts and the token view from the JSON data block.
   Data only ever reaches the page through textContent and DOM properties: never parsed as HTML. */
"use strict";
(function () {
  const DATA = JSON.parse(document.getElementById("report-data").textContent);
  const PLOTLY_CONFIG = {
    displaylogo: false, responsive: true,
    modeBarButtonsToRemove: ["select2d", "lasso2d", "autoScale2d", "toggleSpikelines"],
    toImageButtonOptions: {format: "png", scale: 2},
  };

  function el(tag, className, text) {
    const node = document.createElement(tag);
    if (className) node.className = className;
    if (text !== undefined && text !== null) node.textContent = String(text);
    return node;
  }

  function fmt(x, digits) {
    if (x === null || x === undefined || Number.isNaN(x)) return "–";
    if (x === 0) return "0";
    return String(Number(x.toPrecision(digits || 4))).replace("-", "−");
  }

  function signed(x) {
    if (x === null || x === undefined) return "–";
    return (x > 0 ? "+" : "") + fmt(x);
  }

  function drawCharts() {
    const drawn = [];
    for (const div of document.querySelectorAll(".chart[data-fig]")) {
      const fig = DATA.figures[div.dataset.fig];
      if (!fig) continue;
      drawn.push(Plotly.newPlot(div, fig.data, fig.layout, PLOTLY_CONFIG));
    }
    return Promise.all(drawn);
  }

  /* ---- the worst rollouts, token by token ---- */

  const W = DATA.worst;
  const state = {pair: W ? W.focus : null};
  const tip = document.getElementById("tooltip");

  function tokenText(id) {
    const text = W.text ? W.text[String(id)] : undefined;
    if (text === undefined || text === "") return "⟨" + id + "⟩";
    return text;
  }

  function shown(text) {
    // A bare newline has no area to color: show it as a visible mark, then break the line.
    return text.replace(/\n/g, "↵\n");
  }

  function background(logRatio, scale) {
    if (logRatio === null || logRatio === undefined) return null;
    const t = Math.max(-1, Math.min(1, logRatio / scale));
    if (t === 0) return null;
    const alpha = (0.12 + 0.78 * Math.sqrt(Math.abs(t))).toFixed(3);  // sqrt: small gaps stay visible
    return t > 0 ? "rgba(224,49,49," + alpha + ")" : "rgba(25,113,194," + alpha + ")";
  }

  function paint(span, r, i) {
    const lr = r.log_ratio[state.pair] ? r.log_ratio[state.pair][i] : null;
    const bg = background(lr, W.scale[state.pair] || 1);
    span.style.backgroundColor = bg || "";
    span.style.color = bg && Math.abs(lr) > 0.6 * (W.scale[state.pair] || 1) ? "#fff" : "";
  }

  function marker(count) {
    return el("div", "gap-marker", "⋯ " + count.toLocaleString() + " tokens not shown ⋯");
  }

  function renderTokens(r, index) {
    const box = el("div", "tokens");
    box.dataset.rollout = String(index);
    let segText = null, segKey = null, lastBranch = -1;
    if (r.row.length && r.row[0] > 0) box.appendChild(marker(r.row[0]));
    for (let i = 0; i < r.token_id.length; i++) {
      if (i > 0 && r.row[i] !== r.row[i - 1] + 1) {
        box.appendChild(marker(r.row[i] - r.row[i - 1] - 1));
        segKey = null;
      }
      if (r.branch[i] !== lastBranch) {
        const b = r.branches[r.branch[i]];
        if (r.branches.length > 1) box.appendChild(el("div", "branch-head", "branch " + b.id + " · " + b.kind));
        lastBranch = r.branch[i];
        segKey = null;
      }
      const key = r.branch[i] + ":" + r.segment[i];
      if (key !== segKey) {
        const role = r.roles[r.role[i]];
        const seg = el("div", "seg");
        const label = el("div", "seg-label");
        label.appendChild(el("span", "role role-" + role.replace(/[^a-z_]/gi, ""), role));
        label.appendChild(el("div", null, "turn " + r.turn[i] + " · pos " + r.pos[i].toLocaleString()));
        segText = el("div", "seg-text");
        seg.append(label, segText);
        box.appendChild(seg);
        segKey = key;
      }
      const span = el("span", r.trainable[i] ? "tok" : "tok ctx", shown(tokenText(r.token_id[i])));
      span.dataset.i = String(i);
      paint(span, r, i);
      segText.appendChild(span);
    }
    const last = r.row.length ? r.row[r.row.length - 1] : -1;
    if (last < r.n_rows - 1) box.appendChild(marker(r.n_rows - 1 - last));
    return box;
  }

  function repaint() {
    for (const box of document.querySelectorAll(".tokens[data-rollout]")) {
      const r = W.rollouts[Number(box.dataset.rollout)];
      for (const span of box.querySelectorAll(".tok")) paint(span, r, Number(span.dataset.i));
    }
    const scale = W.scale[state.pair] || 1;
    document.getElementById("legend-low").textContent = "−" + fmt(scale, 3);
    document.getElementById("legend-high").textContent = "+" + fmt(scale, 3);
  }

  function row(table, name, value) {
    const tr = el("tr");
    tr.append(el("td", null, name), el("td", null, value));
    table.appendChild(tr);
  }

  function showTip(event, r, i) {
    tip.replaceChildren();
    const head = el("div");
    head.append("token " + r.token_id[i] + "  ", el("span", "tt-text", tokenText(r.token_id[i])));
    tip.appendChild(head);
    tip.appendChild(el("div", null, r.roles[r.role[i]] + " · turn " + r.turn[i] + " · pos " + r.pos[i].toLocaleString() +
      (r.trainable[i] ? " · trainable" : " · context, not trainable")));
    const table = el("table");
    for (const role of W.roles) row(table, "logp " + role, fmt(r.logp[role][i], 6));
    for (const pair of W.pairs) {
      const lr = r.log_ratio[pair][i];
      row(table, pair, lr === null ? "–" : "log-ratio " + signed(lr) + "   ratio " + fmt(Math.exp(lr), 5));
    }
    tip.appendChild(table);
    tip.hidden = false;
    const pad = 14, box = tip.getBoundingClientRect();
    const x = Math.min(event.clientX + pad, window.innerWidth - box.width - 8);
    const y = event.clientY + pad + box.height > window.innerHeight ? event.clientY - box.height - pad : event.clientY + pad;
    tip.style.left = Math.max(4, x) + "px";
    tip.style.top = Math.max(4, y) + "px";
  }

  function renderWorst() {
    const controls = document.getElementById("worst-controls");
    const list = document.getElementById("worst-list");
    if (!W || !controls || !list) return;
    const label = el("label", null, "Color by ");
    const select = el("select");
    select.id = "color-pair";
    for (const pair of W.pairs) {
      const option = el("option", null, pair);
      option.value = pair;
      option.selected = pair === state.pair;
      select.appendChild(option);
    }
    label.appendChild(select);
    const legend = el("span", "legend-bar");
    const low = el("span", null, ""), high = el("span", null, "");
    low.id = "legend-low";
    high.id = "legend-high";
    legend.append("log-ratio ", low, el("span", "ramp"), high);
    controls.append(label, legend);
    select.addEventListener("change", () => { state.pair = select.value; repaint(); });

    W.rollouts.forEach((r, index) => {
      const details = el("details", "rollout");
      const summary = el("summary");
      summary.append(el("span", "rank", "#" + (index + 1)), el("span", "rid", r.rollout),
        el("span", "stat", "max |log-ratio| " + fmt(r.max_abs_log_ratio)),
        el("span", "stat", "kl_k3 " + fmt(r.kl_k3_mean)),
        el("span", "stat", r.n_scored.toLocaleString() + " scored tokens"));
      if (r.row.length < r.n_rows) {
        summary.appendChild(el("span", "stat", "showing " + r.row.length.toLocaleString() + " of " +
          r.n_rows.toLocaleString() + " tokens (around the worst ones)"));
      }
      details.appendChild(summary);
      const draw = () => {
        if (details.open && !details.dataset.drawn) {
          details.appendChild(renderTokens(r, index));
          details.dataset.drawn = "1";
        }
      };
      details.addEventListener("toggle", draw);
      if (index === 0) { details.open = true; draw(); }
      list.appendChild(details);
    });
    repaint();

    list.addEventListener("mouseover", (event) => {
      const span = event.target.closest ? event.target.closest(".tok") : null;
      if (!span) { tip.hidden = true; return; }
      const box = span.closest(".tokens");
      showTip(event, W.rollouts[Number(box.dataset.rollout)], Number(span.dataset.i));
    });
    list.addEventListener("mouseleave", () => { tip.hidden = true; });
  }

  renderWorst();
  drawCharts().then(() => { document.body.dataset.ready = "1"; });
})();
