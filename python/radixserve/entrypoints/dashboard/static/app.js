// The dashboard: polls dashboard/state once a second, keeps the last minutes of each series,
// draws the charts and tables, and runs the playground on the OpenAI chat route.
// Every value from the server is written as text (textContent), never as HTML.
"use strict";

const POLL_MS = 1000;
const KEEP_S = 300; // seconds of history kept per series
const KEY_STORAGE = "radixserve.apiKey";
const {LineChart, PALETTE} = window.RadixCharts;

const dash = {
  apiKey: sessionStorage.getItem(KEY_STORAGE) || "",
  history: new Map(), // series name -> [[t, v], ...]
  polls: 0,
  errors: 0,
  lastState: null,
  charts: {},
  model: null,
};
window.radixDashboard = dash; // for the browser test and for curious operators

function headers(extra = {}) {
  const h = {...extra};
  if (dash.apiKey) h.Authorization = `Bearer ${dash.apiKey}`;
  return h;
}

function $(id) { return document.getElementById(id); }

function setStatus(text, kind) {
  const el = $("status");
  el.textContent = text;
  el.className = `status ${kind || ""}`;
}

// ------------------------------------------------------------------ polling
async function poll() {
  let resp;
  try {
    resp = await fetch("dashboard/state?max_rows=50", {headers: headers(), cache: "no-store"});
  } catch (err) {
    dash.errors++;
    setStatus(`server unreachable (${err.message})`, "error");
    return;
  }
  if (resp.status === 401) {
    $("auth").hidden = false;
    setStatus("API key needed", "error");
    return;
  }
  if (!resp.ok) {
    dash.errors++;
    setStatus(`server answered ${resp.status}`, "error");
    return;
  }
  $("auth").hidden = true;
  const state = await resp.json();
  dash.polls++;
  dash.lastState = state;
  render(state);
  setStatus(`live · ${new Date(state.time * 1000).toLocaleTimeString()}`, "ok");
}

function loop() {
  poll().finally(() => setTimeout(loop, POLL_MS));
}

// ------------------------------------------------------------------ series
function record(name, t, value) {
  let points = dash.history.get(name);
  if (!points) { points = []; dash.history.set(name, points); }
  points.push([t, value === undefined ? null : value]);
  while (points.length && points[0][0] < t - KEEP_S) points.shift();
}

function series(names) {
  return names.map((name, i) => ({name, color: PALETTE[i % PALETTE.length], points: dash.history.get(name) || []}));
}

function replicaName(state, d, what) {
  return state.dp_size > 1 ? `${what} (replica ${d})` : what;
}

function recordState(state) {
  const t = state.time;
  const names = {requests: [], memory: [], hits: [], throughput: [], ttft: [], itl: []};
  const add = (chart, name, value) => { record(name, t, value); names[chart].push(name); };
  for (const r of state.replicas) {
    const n = (what) => replicaName(state, r.dp_rank, what);
    add("requests", n("running"), r.num_running_reqs);
    add("requests", n("queued"), r.num_waiting_reqs + r.num_grammar_queue_reqs);
    add("memory", n("KV used %"), 100 * r.kv_usage);
    add("memory", n("radix cache %"), 100 * r.cache_usage);
    if (r.ranks.length > 1) {
      for (const k of r.ranks) {
        add("memory", n(`KV used % tp${k.tp_rank} pp${k.pp_rank}`), 100 * k.used_tokens / Math.max(k.max_total_num_tokens, 1));
      }
    }
    add("hits", n("hit rate %"), r.cache_hit_rate === null ? null : 100 * r.cache_hit_rate);
    add("throughput", n("prefill tok/s"), r.prefill_tokens_per_s);
    add("throughput", n("decode tok/s"), r.decode_tokens_per_s);
    for (const [chart, label] of [["ttft", "TTFT"], ["itl", "ITL"]]) {
      const p = r[chart];
      for (const q of ["p50", "p90", "p99"]) {
        add(chart, n(`${label} ${q}`), p && p[q] !== null ? 1000 * p[q] : null);
      }
    }
  }
  return names;
}

// ------------------------------------------------------------------ rendering
function render(state) {
  if (dash.model === null) {
    dash.model = state.model;
    $("model").textContent = state.model;
    $("layout").textContent = `dp ${state.dp_size} · tp ${state.tp_size} · pp ${state.pp_size}`;
    for (const el of document.querySelectorAll(".rate-window")) el.textContent = state.rate_window_s;
    for (const el of document.querySelectorAll(".latency-window")) el.textContent = state.latency_window_s;
  }
  const names = recordState(state);
  $("latency-note").hidden = state.metrics_enabled;
  dash.charts.ttft.message = dash.charts.itl.message = state.metrics_enabled ? "no requests in the window" : "needs --enable-metrics";
  for (const [key, chart] of Object.entries(dash.charts)) chart.draw(series(names[key]), state.time);
  renderRanks(state);
  renderRequests(state);
  renderBatches(state);
}

function fillTable(id, rows) {
  const body = $(id).tBodies[0];
  body.replaceChildren(...rows.map((cells) => {
    const tr = document.createElement("tr");
    for (const cell of cells) {
      const td = document.createElement("td");
      if (cell && typeof cell === "object") { td.className = cell.cls; td.textContent = cell.text; } else td.textContent = cell;
      tr.append(td);
    }
    return tr;
  }));
}

function renderRanks(state) {
  const rows = [];
  for (const r of state.replicas) {
    for (const k of r.ranks) {
      rows.push([r.dp_rank, k.tp_rank, k.pp_rank, k.used_tokens, k.evictable_tokens, k.max_total_num_tokens,
        k.mean_batch_ms === null ? "-" : k.mean_batch_ms.toFixed(1)]);
    }
  }
  fillTable("ranks", rows);
}

function renderRequests(state) {
  const rows = [];
  let live = 0;
  for (const r of state.replicas) {
    live += r.num_live_reqs;
    for (const q of r.requests) {
      rows.push([r.dp_rank, {cls: "rid", text: q.rid}, q.age_s.toFixed(1), q.prompt_tokens, q.output_tokens, q.cached_tokens, q.state]);
    }
  }
  $("requests-count").textContent = rows.length < live ? `(${rows.length} oldest of ${live})` : `(${live})`;
  fillTable("requests", rows);
}

function renderBatches(state) {
  const rows = [];
  for (const r of state.replicas) {
    for (const b of r.batches.slice(0, 20)) rows.push([r.dp_rank, b.mode, b.num_reqs, b.num_prefill_tokens, b.num_decode_tokens, b.ms.toFixed(1), b]);
  }
  rows.sort((a, b) => b[6].launched_at - a[6].launched_at);
  fillTable("batches", rows.slice(0, 20).map((row) => [...row.slice(0, 6), Math.max(state.time - row[6].launched_at, 0).toFixed(1)]));
}

// ------------------------------------------------------------------ playground
let controller = null;

async function sendChat(event) {
  event.preventDefault();
  const answer = $("answer"), stats = $("answer-stats");
  answer.textContent = "";
  stats.textContent = "";
  controller = new AbortController();
  $("send").disabled = true;
  $("stop").disabled = false;
  const body = {
    model: dash.model || "default",
    messages: [{role: "user", content: $("prompt").value}],
    max_tokens: Number($("max-tokens").value),
    temperature: Number($("temperature").value),
    stream: true,
    stream_options: {include_usage: true},
  };
  const started = performance.now();
  let first = null, usage = null;
  try {
    const resp = await fetch("v1/chat/completions", {
      method: "POST", headers: headers({"Content-Type": "application/json"}), body: JSON.stringify(body), signal: controller.signal,
    });
    if (!resp.ok) {
      const err = await resp.json().catch(() => ({}));
      stats.textContent = `error ${resp.status}: ${(err.error && err.error.message) || resp.statusText}`;
      return;
    }
    for await (const data of sseData(resp.body)) {
      if (data === "[DONE]") break;
      const chunk = JSON.parse(data);
      if (chunk.error) { stats.textContent = `error: ${chunk.error.message}`; break; }
      if (chunk.usage) usage = chunk.usage;
      const delta = chunk.choices && chunk.choices[0] && chunk.choices[0].delta;
      if (delta && delta.content) {
        if (first === null) first = performance.now();
        answer.textContent += delta.content;
      }
    }
    const total = (performance.now() - started) / 1000;
    const parts = [`${total.toFixed(2)} s`];
    if (first !== null) parts.push(`first token after ${((first - started) / 1000).toFixed(2)} s`);
    if (usage) parts.push(`${usage.prompt_tokens} prompt + ${usage.completion_tokens} completion tokens`);
    stats.textContent = parts.join(" · ");
  } catch (err) {
    stats.textContent = err.name === "AbortError" ? "stopped" : `error: ${err.message}`;
  } finally {
    $("send").disabled = false;
    $("stop").disabled = true;
    controller = null;
  }
}

// The `data:` payloads of a server-sent event stream.
async function* sseData(stream) {
  const reader = stream.pipeThrough(new TextDecoderStream()).getReader();
  let buffer = "";
  for (;;) {
    const {value, done} = await reader.read();
    if (done) return;
    buffer += value;
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (line.startsWith("data: ")) yield line.slice(6);
      }
    }
  }
}

// ------------------------------------------------------------------ start
function start() {
  const opts = {
    requests: {}, memory: {fixedMax: 100, unit: "%"}, hits: {fixedMax: 100, unit: "%"},
    throughput: {}, ttft: {}, itl: {},
  };
  for (const [key, o] of Object.entries(opts)) dash.charts[key] = new LineChart($(`chart-${key}`), $(`legend-${key}`), o);
  $("auth-form").addEventListener("submit", (event) => {
    event.preventDefault();
    dash.apiKey = $("api-key").value.trim();
    sessionStorage.setItem(KEY_STORAGE, dash.apiKey);
    poll();
  });
  $("playground").addEventListener("submit", sendChat);
  $("stop").addEventListener("click", () => controller && controller.abort());
  loop();
}

start();
