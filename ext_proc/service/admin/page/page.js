// The operator's page: polls /ui/feed for what changed since its last poll and redraws.
// Everything it shows comes from the router's admin port; nothing is fetched elsewhere.
"use strict";

const POLL_MS = 1000;
// The cost terms, as the feed names them (its `terms`: every registered cost term, in
// their order); a feed candidate is [backend, score, cached, uncached, ...one value per term].
let TERMS = [];
let TERM_NAMES = {};
const C = { backend: 0, score: 1, cached: 2, uncached: 3, terms: 4 };

function useTerms(terms) {
  if (!terms || TERMS.join() === terms.map((t) => t.name).join()) return;
  TERMS = terms.map((t) => t.name);
  TERM_NAMES = Object.fromEntries(terms.map((t) => [t.name, t.label]));
  $("term-legend").innerHTML = TERMS.map((k) => `<i class="t-${esc(k)}"></i>${esc(TERM_NAMES[k])}`).join(" ");
}

const page = {
  seq: 0, // the log's change count seen last
  steps: "", // the tuner path's key seen last
  decisions: new Map(), // decision number -> row
  logSize: 1000,
  feed: null,
  path: [],
  selected: null, // request id shown in the detail panel
  detail: null,
  drawn: false,
};

const $ = (id) => document.getElementById(id);
const esc = (v) => String(v ?? "").replace(/[&<>"']/g, (c) => `&#${c.charCodeAt(0)};`);
const ms = (v) => (v === null || v === undefined ? "–" : v >= 100 ? v.toFixed(0) : v.toFixed(1));
const pct = (v) => (v === null || v === undefined ? "–" : `${(100 * v).toFixed(0)} %`);

async function poll() {
  try {
    const url = `/ui/feed?since=${page.seq}&steps=${encodeURIComponent(page.steps)}`;
    const r = await fetch(url, { cache: "no-store" });
    if (!r.ok) throw new Error(`HTTP ${r.status}`);
    apply(await r.json());
    setLive(true, "live");
  } catch (e) {
    setLive(false, `no answer from the router: ${e.message}`);
    console.error("gorgo page: the feed failed:", e); // a drawing error too: its stack
  }
  setTimeout(poll, document.hidden ? 5 * POLL_MS : POLL_MS); // a background tab: slower
}

function setLive(ok, text) {
  const el = $("live");
  el.className = `live ${ok ? "ok" : "bad"}`;
  el.textContent = ok ? `${text}, updated ${new Date().toLocaleTimeString()}` : text;
}

function apply(f) {
  if (f.seq < page.seq) resetDecisions(); // a restarted router: its log began again
  page.feed = f;
  useTerms(f.terms);
  page.seq = f.seq;
  page.logSize = f.log_size;
  // Wall-clock time of each new decision, from the router's clock (its own, monotonic).
  const nowMs = Date.now();
  for (const d of f.decisions) {
    const known = page.decisions.get(d.n);
    d.atMs = known ? known.atMs : nowMs - (f.now_s - d.at_s) * 1000;
    page.decisions.set(d.n, d);
  }
  // Keep what the router keeps: its newest log_size decisions.
  const evicted = [];
  if (page.decisions.size > page.logSize) {
    const keys = [...page.decisions.keys()].sort((a, b) => a - b);
    for (const k of keys.slice(0, keys.length - page.logSize)) {
      page.decisions.delete(k);
      evicted.push(k);
    }
  }
  const moved = Boolean(f.tuner && f.tuner.steps !== null);
  if (moved) {
    page.path = f.tuner.steps;
    page.steps = f.tuner.steps_key;
  }
  drawSummary(f);
  drawFleet(f);
  drawQueue(f.flow);
  drawTuner(f.tuner, moved || !page.drawn);
  drawDecisions(f.decisions, evicted);
  // When the first answer was drawn, in ms since navigation began (the render bench's).
  if (!page.drawn) document.body.dataset.firstDrawMs = performance.now().toFixed(1);
  page.drawn = true;
}

function drawSummary(f) {
  const w = f.weights ? `w_rtt ${f.weights.rtt.toFixed(3)}, w_queue ${f.weights.queue.toFixed(3)}` : "no weights";
  $("summary").textContent =
    `policy ${f.policy} (${w}) · ${f.decisions_total} decisions · ${f.in_flight} in flight · ${f.backends.length} backends`;
}

function hitRatios() {
  const sums = new Map();
  for (const d of page.decisions.values()) {
    const c = d.candidates[0]; // the chosen one
    const s = sums.get(d.backend) || [0, 0];
    s[0] += c[C.cached];
    s[1] += c[C.cached] + c[C.uncached];
    sums.set(d.backend, s);
  }
  return sums;
}

function drawFleet(f) {
  const hits = hitRatios();
  const rows = f.backends.map((b) => {
    const badges = [`<span class="badge b-${esc(b.lifecycle)}">${esc(b.lifecycle)}</span>`];
    if (b.suspect) badges.push('<span class="badge b-suspect">suspect</span>');
    if (b.ejected) badges.push('<span class="badge b-ejected">ejected</span>');
    const e = b.engine;
    const engine = e
      ? `${e.running ?? "–"} / ${e.waiting ?? "–"}, KV ${pct(e.kv_usage)} <span class="muted">${e.age_s.toFixed(1)} s ago</span>`
      : '<span class="muted">no report</span>';
    const h = hits.get(b.id);
    const bias = b.ttft_bias_ms === null ? "" : ` <span class="muted">bias ${ms(b.ttft_bias_ms)} ms</span>`;
    const step = b.step_model === null ? ""
      : `<div class="why" title="${esc(b.step_model_why)}">step model: ${esc(b.step_model)}</div>`;
    return `<tr data-backend="${esc(b.id)}">
      <td><b>${esc(b.id)}</b></td><td>${esc(b.region)}</td><td>${badges.join("")}</td>
      <td class="num">${ms(b.rtt_ms)} ± ${ms(b.rtt_std_ms)}</td><td class="num">${ms(b.queue_ms)}</td>
      <td class="num">${b.in_flight}</td><td>${engine}</td>
      <td><span class="badge b-${esc(b.prefix_state)}">${esc(b.prefix_state)}</span><div class="why">${esc(b.prefix_why)}</div></td>
      <td class="num">${h && h[1] ? pct(h[0] / h[1]) : "–"}</td>
      <td class="num">${pct(b.ttft_mape)}${bias}${step}</td>
      <td class="why">${b.models === null ? '<span class="muted">unknown</span>' : esc(b.models.join(", "))}</td></tr>`;
  });
  document.querySelector("#fleet tbody").innerHTML = rows.join("");
}

// The gateway queue (flow control): what waits for room, by band and tenant, and what
// it did. Hidden when flow control is off.
function drawQueue(q) {
  $("queue-section").hidden = !(q && q.enabled);
  if (!q || !q.enabled) return;
  $("queue-status").textContent = `${q.waiting} waiting`;
  $("queue-text").textContent = q.waiting
    ? `oldest waiting ${q.oldest_wait_s.toFixed(1)} s`
    : "every backend has room: requests pass straight through";
  const list = (m) =>
    Object.entries(m || {})
      .map(([k, v]) => `<div><b>${esc(k)}</b> <span class="num">${v}</span></div>`)
      .join("") || '<span class="muted">none</span>';
  document.querySelector("#queue tbody").innerHTML =
    `<tr><td>${list(q.bands)}</td><td>${list(q.tenants)}</td><td>${list(q.outcomes)}</td></tr>`;
}

function drawTuner(t, moved) {
  const status = $("tuner-status");
  const svg = $("tuner-chart");
  if (!t) {
    status.textContent = "(off)";
    $("tuner-text").textContent = "No tuner: the policy has no weights, or tuner.mode is off.";
    svg.innerHTML = "";
    return;
  }
  const path = page.path;
  const accepted = path.filter((s) => s.accepted).length;
  const verdicts = path.filter((s) => !s.confirming && !s.tie).length;
  status.innerHTML = `<span class="badge ${t.frozen ? "b-active" : "b-warming"}">${t.frozen ? "frozen" : "exploring"}</span>`;
  $("tuner-text").textContent =
    `${t.mode}, objective ${t.objective} · parent w_rtt ${t.weights.rtt.toFixed(3)} w_queue ${t.weights.queue.toFixed(3)}` +
    ` · child w_rtt ${t.child.rtt.toFixed(3)} w_queue ${t.child.queue.toFixed(3)} · sigma ${t.sigma.toFixed(3)}` +
    ` · ${t.samples} completions · rounds: ${accepted} accepted, ${verdicts - accepted} rejected`;
  if (moved) svg.innerHTML = tunerChart(path); // a path of <= 500 rounds: only when it grew
}

function tunerChart(path) {
  const W = 900, H = 180, P = 36;
  if (!path.length) {
    return `<text x="${W / 2}" y="${H / 2}" text-anchor="middle" fill="#777">no round finished yet</text>`;
  }
  const xs = path.map((s) => s.samples);
  const x0 = Math.min(...xs), x1 = Math.max(...xs, x0 + 1);
  const logs = path.flatMap((s) => [Math.log(s.parent[0]), Math.log(s.parent[1])]);
  const y0 = Math.min(...logs, -0.1), y1 = Math.max(...logs, 0.1);
  const sMax = Math.max(...path.map((s) => s.sigma), 1e-9);
  const X = (v) => P + ((v - x0) / (x1 - x0)) * (W - 2 * P);
  const Y = (v) => H - P - ((v - y0) / (y1 - y0)) * (H - 2 * P);
  const S = (v) => H - P - (v / sMax) * (H - 2 * P);
  const line = (f, cls, dash = "") =>
    `<polyline fill="none" stroke="var(--${cls})" stroke-width="2"${dash} points="${path.map((s) => `${X(s.samples).toFixed(1)},${f(s).toFixed(1)}`).join(" ")}"/>`;
  const label = (v) => `<text x="2" y="${(Y(v) + 4).toFixed(1)}" fill="#777" font-size="10">${Math.exp(v).toFixed(2)}</text>`;
  const dots = path.map((s) => {
    const color = s.confirming || s.tie ? "#aaa" : s.accepted ? "#2a2" : "#c22";
    return `<circle cx="${X(s.samples).toFixed(1)}" cy="${Y(Math.log(s.parent[0])).toFixed(1)}" r="3" fill="${color}"><title>after ${s.samples} completions: ${s.accepted ? "accepted" : "rejected"} ${esc(s.note)}</title></circle>`;
  });
  return [
    `<line x1="${P}" x2="${W - P}" y1="${Y(0)}" y2="${Y(0)}" stroke="#ddd"/>`,
    `<text x="${P}" y="12" fill="#777" font-size="11">the parent's weights after each round (log scale), sigma dashed on its own scale (top: ${sMax.toFixed(2)})</text>`,
    label(y0), label(0), label(y1),
    line((s) => S(s.sigma), "sigma", ' stroke-dasharray="6 4"'),
    line((s) => Y(Math.log(s.parent[0])), "rtt"),
    line((s) => Y(Math.log(s.parent[1])), "queue"),
    ...dots,
    `<text x="${P}" y="${H - 6}" fill="#777" font-size="11">${x0}</text>`,
    `<text x="${W - P}" y="${H - 6}" fill="#777" font-size="11" text-anchor="end">${x1} completions</text>`,
  ].join("");
}

function terms(c) {
  return Object.fromEntries(TERMS.map((k, i) => [k, c[C.terms + i]]));
}

// Each term as it counts in the score: times the policy's weight for it when the score is
// their weighted sum (gorgo: w_rtt, w_queue, w_queue, 1, decode_stall_weight, kv_weight), so a bar's
// length is the score and the shortest won; else the raw ms.
function weighted(c, tw) {
  const t = terms(c);
  if (tw) TERMS.forEach((k, i) => (t[k] *= tw[i]));
  return t;
}

function termsTitle(c, tw) {
  const t = terms(c);
  return TERMS.map((k, i) => `${TERM_NAMES[k]} ${ms(t[k])} ms${tw && tw[i] !== 1 ? ` x${tw[i]}` : ""}`).join(", ");
}

function bar(c, scale, tw) {
  const t = weighted(c, tw);
  return `<span class="bar">${TERMS.map((k) => (t[k] > 0 ? `<i class="t-${k}" style="width:${((100 * t[k]) / scale).toFixed(2)}%"></i>` : "")).join("")}</span>`;
}

const sum = (c, tw) => TERMS.reduce((a, k) => a + Math.max(0, weighted(c, tw)[k]), 0);

function candidates(d) {
  const tw = d.term_weights;
  const scale = Math.max(...d.candidates.map((c) => sum(c, tw)), 1e-9);
  const lines = d.candidates.map((c, i) => {
    const score = c[C.score] === null ? "" : ` ${ms(c[C.score])}`;
    return `<div class="cand${i === 0 ? " chosen" : ""}" title="${esc(`${c[C.backend]}: ${termsTitle(c, tw)}`)}">` +
      `<span class="cn">${esc(c[C.backend])}</span>${bar(c, scale, tw)}<span class="cs">${score}</span></div>`;
  });
  if (d.of > d.candidates.length) lines.push(`<div class="muted">and ${d.of - d.candidates.length} more</div>`);
  return lines.join("");
}

function traceCell(d) {
  if (!d.trace_id) return '<span class="muted">–</span>';
  const url = page.feed && page.feed.trace_url;
  const short = esc(d.trace_id.slice(0, 8));
  return url ? `<a href="${esc(url.replace("{trace_id}", d.trace_id))}" target="_blank" rel="noopener">${short}</a>` : short;
}

// A disaggregated decision: its prefill engine, the KV it sends, the transfer predicted /
// observed (the decode's first byte tells it).
function prefilled(d) {
  const p = d.prefill;
  if (!p) return "";
  const seen = d.observed && d.observed.kv_transfer_ms != null ? ms(d.observed.kv_transfer_ms) : "–";
  return `, prefilled on <b id="detail-prefill">${esc(p.backend)}</b> ` +
    `(KV ${(p.kv_bytes / 1e6).toFixed(1)} MB, transfer ${ms(p.transfer_ms)} / ${seen} ms predicted / came)`;
}

function came(d, i) {
  const o = d.observed;
  const predicted = ms(d.predicted[i]);
  if (!o) return `${predicted} / <span class="muted">in flight</span>`;
  const v = i === 0 ? o.ttft_ms : o.e2e_ms;
  const status = o.status === "ok" ? "" : ` <span class="status-${esc(o.status)}">${esc(o.status)}</span>`;
  return `${predicted} / ${v === null ? '<span class="muted">–</span>' : ms(v)}${status}`;
}

const rowsById = new Map(); // decision number -> its row

function resetDecisions() {
  page.decisions.clear();
  rowsById.clear();
  $("decision-rows").innerHTML = "";
}

function rowHtml(d) {
  const q = $("search").value.trim();
  const hidden = q && !d.id.includes(q) ? " hidden" : "";
  const selected = d.id === page.selected ? " selected" : "";
  return `<div class="drow${selected}" data-n="${d.n}" data-request-id="${esc(d.id)}"${hidden}>
    <span class="num">${new Date(d.atMs).toLocaleTimeString()}</span><span>${esc(d.id)}</span><span>${esc(d.model ?? "–")}</span>
    <span class="num">${d.tokens}</span><span><b>${esc(d.backend)}</b></span><span>${candidates(d)}</span>
    <span class="num">${came(d, 0)}</span><span class="num">${came(d, 1)}</span><span>${traceCell(d)}</span></div>`;
}

// Only what changed is drawn: new decisions go on top, a closed one's outcome is filled in,
// evicted ones leave; a poll under load touches tens of rows, not the table.
function drawDecisions(changed, evicted) {
  const list = $("decision-rows");
  for (const n of evicted) {
    const tr = rowsById.get(n);
    if (tr) tr.remove();
    rowsById.delete(n);
  }
  const fresh = [];
  for (const d of changed) {
    if (!page.decisions.has(d.n)) continue; // evicted in the same poll
    const row = rowsById.get(d.n);
    if (row) {
      // Closed (or traced) since: only its outcome and trace cells change.
      const cells = row.children;
      cells[6].innerHTML = came(d, 0);
      cells[7].innerHTML = came(d, 1);
      cells[8].innerHTML = traceCell(d);
    } else {
      fresh.push(d);
    }
  }
  fresh.sort((a, b) => b.n - a.n);
  if (fresh.length) {
    list.insertAdjacentHTML("afterbegin", fresh.map(rowHtml).join(""));
    for (let i = 0; i < fresh.length; i++) rowsById.set(fresh[i].n, list.children[i]);
  }
  countShown();
  if (page.selected && page.detail) {
    const d = changed.find((x) => x.id === page.selected);
    if (d && d.seq > page.detail.seq) showDetail(page.selected); // its outcome came
  }
}

function countShown() {
  let shown = 0;
  for (const row of rowsById.values()) shown += row.hidden ? 0 : 1;
  $("decision-count").textContent = `(${shown} shown of the last ${page.decisions.size}; the router keeps ${page.logSize})`;
}

function filter() {
  const q = $("search").value.trim();
  for (const [n, tr] of rowsById) tr.hidden = Boolean(q) && !page.decisions.get(n).id.includes(q);
  countShown();
}

function markSelected() {
  for (const row of rowsById.values()) row.classList.toggle("selected", row.dataset.requestId === page.selected);
}

async function showDetail(requestId) {
  page.selected = requestId;
  const el = $("detail");
  const r = await fetch(`/ui/decision?request_id=${encodeURIComponent(requestId)}`, { cache: "no-store" });
  const d = await r.json();
  el.hidden = false;
  if (!r.ok) {
    page.detail = null;
    el.innerHTML = `<b>${esc(requestId)}</b>: ${esc(d.error)}`;
    return;
  }
  page.detail = d;
  const tw = d.term_weights;
  const scale = Math.max(...d.candidates.map((c) => sum(c, tw)), 1e-9);
  const rows = d.candidates.map((c) => `<tr class="${c[C.backend] === d.backend ? "chosen" : ""}" data-candidate="${esc(c[C.backend])}">
    <td>${esc(c[C.backend])}</td>${TERMS.map((k) => `<td class="num" data-term="${k}">${ms(terms(c)[k])}</td>`).join("")}
    <td class="num">${c[C.cached]} / ${c[C.uncached]}</td><td class="num">${c[C.score] === null ? "–" : ms(c[C.score])}</td><td>${bar(c, scale, tw)}</td></tr>`);
  el.innerHTML = `<div>Request <b id="detail-id">${esc(d.id)}</b> (${esc(d.model ?? "no model")}, ${d.tokens} tokens, policy ${esc(d.policy)})
    went to <b id="detail-backend">${esc(d.backend)}</b>${prefilled(d)}${d.hold_ms ? `, held ${ms(d.hold_ms)} ms by pacing` : ""}.
    TTFT ${came(d, 0)} ms, E2E ${came(d, 1)} ms (predicted / came). Trace: ${traceCell(d)}</div>
    <div class="muted">${tw ? `score = ${TERMS.map((k, i) => `${tw[i]} x ${TERM_NAMES[k]}`).join(" + ")}; the bars draw each term at its weight` : "the bars draw the raw terms: this policy's score is not their sum"}</div>
    <table><thead><tr><th>candidate</th>${TERMS.map((k) => `<th>${TERM_NAMES[k]} ms</th>`).join("")}
    <th>cached / uncached tokens</th><th>score</th><th></th></tr></thead><tbody>${rows.join("")}</tbody></table>`;
  markSelected();
}

$("decisions").addEventListener("click", (ev) => {
  const row = ev.target.closest(".drow[data-request-id]");
  if (row && !ev.target.closest("a")) showDetail(row.dataset.requestId);
});
$("search").addEventListener("input", () => {
  const q = $("search").value.trim();
  const exact = [...page.decisions.values()].some((d) => d.id === q);
  if (exact) showDetail(q);
  filter();
});
$("search").addEventListener("keydown", (ev) => {
  const q = $("search").value.trim();
  if (ev.key === "Enter" && q) showDetail(q); // asks the router: older than the page
});
poll();
