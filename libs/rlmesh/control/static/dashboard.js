// The rlmesh dashboard: polls the control plane's REST API every few seconds and draws the run.
// Per-step metrics come from /run/metrics (the learner's history, so a page opened late shows the
// whole run); tokens/s per replica and queue depths are live readings, kept from page open on.
// Each chart's container carries data-points (its longest series) for tests and scripts.
"use strict";

const API = new URL("../api/v1/", location.href).href;
const TOKEN_KEY = "rlmesh.token";
const POLL_MS = Number(new URLSearchParams(location.search).get("poll_ms")) || 3000;
const LIVE_POINTS = 600; // live readings kept per chart (30 minutes at 3 s)
// The thresholds of deploy/alerts.yml that the page can check from the API's data.
const KL_HIGH = 0.03, GRAD_NORM_HIGH = 5.0, VAL_DROP = 0.05, STALL_S = 30 * 60;

// Per-step charts: the metric keys each may show; a key the run never logged is left out.
const STEP_CHARTS = [
  {id: "reward", title: "Reward", keys: ["critic/score/mean", "critic/rewards/mean"]},
  {id: "kl", title: "KL", keys: ["actor/reward_kl_penalty", "actor/kl_loss", "actor/ppo_kl"]},
  {id: "kl_coef", title: "KL coefficient",
    keys: ["actor/reward_kl_penalty_coeff", "actor/kl_coef", "hparams/kl_coef", "hparams/kl_loss_coef"]},
  {id: "grad_norm", title: "Actor grad norm", keys: ["actor/grad_norm"]},
  {id: "entropy", title: "Entropy", keys: ["actor/entropy", "actor/entropy_loss"]},
  {id: "validation", title: "Validation score", keys: ["val/score"]},
  {id: "step_time", title: "Step time (s)",
    keys: ["timing_s/step", "timing_s/gen", "timing_s/update_actor", "timing_s/push_weights"]},
];
const LIVE_CHARTS = [
  {id: "tokens", title: "Generation tokens/s per replica"},
  {id: "queues", title: "Queue depth"},
];
const COLORS = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#4b5563", "#ca8a04"];

const state = {
  steps: new Map(), // step -> metrics, from the learner's history
  validation: new Map(), // step -> val/score
  live: {tokens: new Map(), queues: new Map()}, // chart -> series name -> [[unix s, value]]
  charts: {}, // id -> {plot, keys, el}
  status: null, replicas: [], queues: null, auto: null,
  hparamFields: null, armed: null,
};
window.rlmeshDashboard = state; // for tests and the browser console

const $ = (sel) => document.querySelector(sel);
const text = (v) => (v === null || v === undefined ? "" : typeof v === "object" ? JSON.stringify(v) : String(v));
// Tick labels with as many decimals as the tick spacing needs: uPlot's own keep 3, so a KL
// coefficient moving around 0.001 read 0.001 at every tick.
function ticks(u, values, axis, space, incr) {
  let decimals = 0;
  while (decimals < 12 && Math.abs(Math.round(incr * 10 ** decimals) - incr * 10 ** decimals) > 1e-6 * incr * 10 ** decimals) decimals++;
  return values.map((v) => (v === null ? "" : v.toFixed(decimals)));
}
const labelWidth = (u, values) => (values ? Math.max(4, ...values.map((v) => v.length)) * 7 + 16 : 50);
const num = (v, digits = 4) => (typeof v === "number" ? Number(v.toPrecision(digits)).toString() : text(v));

function el(tag, attrs = {}, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "class") node.className = v;
    else if (k.startsWith("on")) node.addEventListener(k.slice(2), v);
    else node.setAttribute(k, v);
  }
  for (const c of children) node.append(c instanceof Node ? c : text(c));
  return node;
}

// ----- the API -----
class Unauthorized extends Error {}

async function api(path, options = {}) {
  // The audit log's "who": this page, with the caller's address the plane adds.
  const headers = {"X-Rlmesh-User": "dashboard", ...(options.headers || {})};
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (token) headers.Authorization = `Bearer ${token}`;
  if (options.body !== undefined) headers["Content-Type"] = "application/json";
  const r = await fetch(API + path, {...options, headers});
  if (r.status === 401) throw new Unauthorized("the token was refused");
  const body = await r.json().catch(() => ({}));
  if (!r.ok) throw new Error(detailOf(body) || `${r.status} ${r.statusText}`);
  return body;
}

// FastAPI's own 422s list {loc, msg}; the plane's errors are one string naming the field.
function detailOf(body) {
  const d = body && body.detail;
  if (Array.isArray(d)) return d.map((e) => `${(e.loc || []).filter((p) => p !== "body").join(".")}: ${e.msg}`).join("; ");
  return d ? text(d) : body && body.message;
}

function askForToken(message) {
  $("#token-form").hidden = false;
  $("#token-error").textContent = message || "";
  $("#token").focus();
}

$("#token-form").addEventListener("submit", (e) => {
  e.preventDefault();
  sessionStorage.setItem(TOKEN_KEY, $("#token").value.trim());
  $("#token").value = "";
  $("#token-form").hidden = true;
  poll();
});

// ----- charts -----
function chartCard(id, title) {
  const box = el("div", {class: "plot"});
  const card = el("div", {class: "card chart", "data-chart": id, "data-points": "0"}, el("h3", {}, title), box);
  $("#charts").append(card);
  state.charts[id] = {plot: null, keys: [], el: card, box, title};
}

function draw(id, names, data, time) {
  const chart = state.charts[id];
  const width = Math.max(240, chart.box.clientWidth);
  if (!chart.plot || chart.keys.join("\n") !== names.join("\n")) {
    if (chart.plot) chart.plot.destroy();
    chart.box.textContent = "";
    chart.plot = new uPlot({
      width, height: 180,
      scales: {x: {time}},
      legend: {live: false},
      axes: [{size: 30}, {size: labelWidth, values: ticks}],
      series: [{label: time ? "time" : "step"},
        ...names.map((n, i) => ({label: n, stroke: COLORS[i % COLORS.length], width: 1.5, spanGaps: true,
          points: {show: data[0].length < 40}}))],
    }, data, chart.box);
    chart.keys = names;
  } else {
    chart.plot.setData(data);
  }
  const points = Math.max(0, ...data.slice(1).map((s) => s.filter((v) => v !== null && v !== undefined).length));
  chart.el.dataset.points = String(points);
  chart.el.classList.toggle("empty", points === 0);
}

function drawStepCharts() {
  for (const spec of STEP_CHARTS) {
    const rows = spec.id === "validation"
      ? [...state.validation.entries()].sort((a, b) => a[0] - b[0]).map(([s, v]) => [s, {"val/score": v}])
      : [...state.steps.entries()].filter(([s]) => s > 0).sort((a, b) => a[0] - b[0]);
    const keys = spec.keys.filter((k) => rows.some(([, m]) => typeof m[k] === "number"));
    const data = [rows.map(([s]) => s), ...keys.map((k) => rows.map(([, m]) => (typeof m[k] === "number" ? m[k] : null)))];
    draw(spec.id, keys, data, false);
  }
}

function record(chart, name, t, value) {
  const series = state.live[chart];
  if (!series.has(name)) series.set(name, []);
  const points = series.get(name);
  points.push([t, value]);
  if (points.length > LIVE_POINTS) points.shift();
}

function drawLiveChart(id) {
  const series = state.live[id];
  const names = [...series.keys()].sort();
  const times = [...new Set(names.flatMap((n) => series.get(n).map(([t]) => t)))].sort((a, b) => a - b);
  const data = [times, ...names.map((n) => {
    const at = new Map(series.get(n));
    return times.map((t) => (at.has(t) ? at.get(t) : null));
  })];
  draw(id, names, data, true);
}

// ----- the parts of the page -----
function showStatus() {
  const s = state.status;
  const eta = s.eta_s === null ? "" : ` · ETA ${Math.round(s.eta_s)} s`;
  // Paused, the learner's message says by whom and how it goes on; the phase is said once.
  const phase = s.phase === "paused" ? s.message || "paused"
    : `${s.phase}${s.paused ? " (pausing after this step)" : ""}`;
  $("#run").textContent = `run ${s.run_id} · step ${s.step}/${s.total_steps} · ${phase}`
    + ` · policy v${s.policy_version} · ${s.live_replicas} replica(s)` + eta
    + (s.mean_step_s === null ? "" : ` · ${s.mean_step_s} s/step`);
}

function showReplicas() {
  const body = $("#replicas tbody");
  body.textContent = "";
  for (const r of state.replicas) {
    const id = r.replica_id;
    const armed = state.armed === id;
    // Two clicks, not confirm(): a modal dialog would stop the page's polling.
    const button = el("button", {
      class: armed ? "danger" : "", "data-replica": id,
      onclick: () => (armed ? drain(id) : ((state.armed = id), showReplicas())),
    }, armed ? "confirm drain" : "drain");
    body.append(el("tr", {},
      el("td", {}, id), el("td", {}, r.address), el("td", {class: r.health === "SERVING" ? "ok" : "bad"}, r.health),
      el("td", {}, r.state), el("td", {}, r.policy_version), el("td", {}, num(r.tokens_per_s)),
      el("td", {}, text(r.tasks_in_flight)), el("td", {}, text(r.tasks_done)),
      el("td", {}, `${num(r.heartbeat_age_s, 2)} s ago`), el("td", {}, button)));
  }
  if (!state.replicas.length) body.append(el("tr", {}, el("td", {colspan: "10", class: "note"}, "no live replica")));
}

async function drain(id) {
  state.armed = null;
  $("#replicas-msg").textContent = `draining ${id}…`;
  try {
    const r = await api(`replicas/${encodeURIComponent(id)}/drain`, {method: "POST", body: "{}"});
    $("#replicas-msg").textContent = `${id}: ${r.message || "drained"}`;
  } catch (e) {
    $("#replicas-msg").textContent = `${id}: ${e.message}`;
  }
  poll();
}

function showHparams(hp) {
  const body = $("#hparams tbody");
  if (!state.hparamFields) {
    state.hparamFields = hp.fields;
    for (const [name, f] of Object.entries(hp.fields)) {
      const range = `${f.min_exclusive ? "(" : "["}${f.min}, ${f.max}]`;
      body.append(el("tr", {"data-hparam": name},
        el("td", {}, name, el("div", {class: "note"}, f.description)), el("td", {}, el("code", {}, f.key)),
        el("td", {}, range), el("td", {class: "now"}),
        el("td", {}, el("input", {name, type: "number", step: "any", min: String(f.min), max: String(f.max),
          placeholder: "unchanged", "aria-label": name}))));
    }
  }
  for (const row of body.querySelectorAll("tr[data-hparam]")) {
    const value = hp.values[row.dataset.hparam];
    row.querySelector(".now").textContent = value === undefined ? "—" : num(value, 6);
  }
}

$("#hparams").addEventListener("submit", async (e) => {
  e.preventDefault();
  const msg = $("#hparams-msg");
  const changes = {};
  for (const input of $("#hparams").querySelectorAll("input[name]")) {
    if (input.value.trim() !== "") changes[input.name] = Number(input.value);
  }
  msg.className = "msg";
  if (!Object.keys(changes).length) {
    msg.textContent = "give a new value for at least one field";
    return;
  }
  msg.textContent = "sending…";
  try {
    const r = await api("hyperparams", {method: "PATCH", body: JSON.stringify(changes)});
    msg.textContent = `applies from step ${r.applies_from_step}: ${Object.keys(changes).map((k) => `${k}=${num(r.values[k], 6)}`).join(", ")}`;
    msg.classList.add("ok");
    for (const input of $("#hparams").querySelectorAll("input[name]")) input.value = "";
    poll();
  } catch (err) {
    msg.textContent = err.message;
    msg.classList.add("error");
  }
});

function showAudit(entries) {
  const body = $("#audit tbody");
  body.textContent = "";
  for (const a of entries) {
    const when = typeof a.time === "number" ? new Date(a.time * 1000).toLocaleTimeString() : text(a.time);
    body.append(el("tr", {}, el("td", {}, when), el("td", {}, a.who), el("td", {}, a.action), el("td", {}, a.target),
      el("td", {}, num(a.old, 6)), el("td", {}, num(a.new, 6)), el("td", {}, a.source)));
  }
}

// What the page can check itself, with deploy/alerts.yml's thresholds, beside Prometheus' own
// alerts (GET /api/v1/alerts, when the plane is given the Prometheus that evaluates the rules).
function alertsNow() {
  const out = [];
  const steps = [...state.steps.keys()].filter((s) => s > 0).sort((a, b) => a - b);
  const last = steps.length ? state.steps.get(steps[steps.length - 1]) : {};
  const kl = last["actor/reward_kl_penalty"] ?? last["actor/kl_loss"];
  if (typeof kl === "number" && kl > KL_HIGH) out.push(["KLHigh", `KL ${num(kl)} > ${KL_HIGH}`]);
  const grad = last["actor/grad_norm"];
  if (typeof grad === "number" && grad > GRAD_NORM_HIGH) out.push(["GradNormHigh", `actor grad norm ${num(grad)} > ${GRAD_NORM_HIGH}`]);
  const vals = [...state.validation.entries()].sort((a, b) => a[0] - b[0]).map(([, v]) => v);
  if (vals.length > 1 && Math.max(...vals) - vals[vals.length - 1] > VAL_DROP) {
    out.push(["ValidationScoreFalling", `val/score ${num(vals[vals.length - 1])}, best ${num(Math.max(...vals))}`]);
  }
  for (const r of state.replicas) {
    if (r.health !== "SERVING") out.push(["ReplicaUnhealthy", `${r.replica_id}: ${r.health}`]);
  }
  const dead = state.queues && state.queues.dead_letters ? state.queues.dead_letters.length : 0;
  if (dead > 0) out.push(["DeadLetters", `${dead} dead letter(s): GET /api/v1/dead-letters`]);
  const s = state.status;
  const lastTime = steps.length ? state.steps.get(steps[steps.length - 1]).__time : null;
  if (s && !["paused", "stopping", "finished", "failed"].includes(s.phase) && lastTime && Date.now() / 1000 - lastTime > STALL_S) {
    out.push(["LearnerStalled", `no step finished for ${Math.round((Date.now() / 1000 - lastTime) / 60)} min`]);
  }
  return out;
}

function showAlerts() {
  const list = $("#alerts");
  list.textContent = "";
  const p = state.prometheus || {source: "none", alerts: []};
  const fromPrometheus = p.alerts.map((a) => [a.name, `${a.state} since ${a.active_at}: ${a.summary}`, a.state]);
  const firing = [...fromPrometheus, ...alertsNow().map(([name, why]) => [name, why, "firing"])];
  for (const [name, why, st] of firing) list.append(el("li", {class: st === "firing" ? "firing" : "pending"}, el("b", {}, name), ` ${why}`));
  if (!firing.length) list.append(el("li", {class: "ok"}, "none firing"));
  $("#alerts-card").dataset.firing = String(firing.length);
  $("#alerts-card").dataset.prometheus = String(fromPrometheus.length);
  const a = state.auto;
  const auto = !a ? "" : a.settings.enabled
    ? `Automatic responses on: ${a.actions_taken} action(s) taken.`
    : "Automatic responses off (rlmesh.control.auto.enabled).";
  const source = p.source === "none"
    ? "No Prometheus configured (rlmesh.control.prometheus_url): checked in this page from the run's metrics with deploy/alerts.yml's thresholds. "
    : p.source === "error" ? `Prometheus did not answer (${p.error}); the rest checked in this page. `
    : `From Prometheus at ${p.source}, and checked in this page from the run's metrics. `;
  $("#auto").textContent = source + auto;
}

// ----- polling -----
async function pollMetrics() {
  const known = [...state.steps.keys()];
  const start = known.length ? Math.max(...known) : 0; // the last step again: a resumed run redoes it
  const keys = [...new Set(STEP_CHARTS.flatMap((c) => c.keys))].join(",");
  const r = await api(`run/metrics?start=${start}&keys=${encodeURIComponent(keys)}`);
  for (const row of r.rows) state.steps.set(row.step, {...row.metrics, __time: row.time});
  const v = await api("run/validation");
  for (const row of v.rows) if (typeof row.metrics["val/score"] === "number") state.validation.set(row.step, row.metrics["val/score"]);
}

async function pollLive() {
  const now = Date.now() / 1000;
  const [rep, queues] = await Promise.all([api("replicas"), api("queues")]);
  state.replicas = rep.replicas;
  state.queues = queues;
  for (const r of state.replicas) if (typeof r.tokens_per_s === "number") record("tokens", r.replica_id, now, r.tokens_per_s);
  for (const [name, q] of Object.entries(queues)) {
    record("queues", name === "dead_letters" ? "dead letters" : `${name} length`, now, q.length);
    if (typeof q.pending === "number") record("queues", `${name} pending`, now, q.pending);
  }
}

let polling = null;
async function poll() {
  if (polling) return polling; // one poll at a time
  polling = (async () => {
    try {
      state.status = await api("run/status");
      showStatus();
      await Promise.all([pollMetrics(), pollLive()]);
      const [hp, audit, auto] = await Promise.all([api("hyperparams"), api("audit?limit=15"), api("auto")]);
      state.auto = auto;
      // Prometheus' own alerts when the plane knows it; a Prometheus down is said, not fatal.
      state.prometheus = await api("alerts").catch((e) => ({source: "error", error: e.message, alerts: []}));
      showHparams(hp);
      showAudit(audit.entries);
      showReplicas();
      drawStepCharts();
      for (const c of LIVE_CHARTS) drawLiveChart(c.id);
      showAlerts();
      $("#conn").textContent = `updated ${new Date().toLocaleTimeString()}`;
      $("#conn").className = "conn ok";
      document.body.dataset.polls = String(Number(document.body.dataset.polls || 0) + 1);
    } catch (e) {
      if (e instanceof Unauthorized) askForToken(sessionStorage.getItem(TOKEN_KEY) ? "that token was refused" : "");
      $("#conn").textContent = e.message;
      $("#conn").className = "conn error";
    } finally {
      polling = null;
    }
  })();
  return polling;
}

for (const c of STEP_CHARTS) chartCard(c.id, c.title);
for (const c of LIVE_CHARTS) chartCard(c.id, c.title);
window.addEventListener("resize", () => {
  for (const c of Object.values(state.charts)) if (c.plot) c.plot.setSize({width: Math.max(240, c.box.clientWidth), height: 180});
});
poll();
setInterval(() => {
  if ($("#token-form").hidden) poll();
}, POLL_MS);
