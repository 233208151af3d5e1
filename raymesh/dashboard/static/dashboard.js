/* raymesh dashboard: the runs page, the live job page and the mesh page.
 *
 * Plain JS with no build step and no library other than the vendored uPlot (the machine may be
 * offline). Each page says which it is with <body data-page="...">. Every piece of text that comes
 * from a run (names, causes, reasons) goes into the page through textContent, never innerHTML:
 * a failure's cause is a Python traceback and may hold "<".
 */
"use strict";

// ---------------------------------------------------------------- URLs, token, DOM helpers

// A dashboard started with a token wants it on every API request, as `Authorization: Bearer`.
// The page takes it from the URL's fragment (`#token=...`: browsers never send a fragment to a
// server, so no server, proxy or log sees it), or from an older dashboard's `?token=`, or from
// the form it shows when the API answers 401; keeps it in this tab's sessionStorage (gone when
// the tab closes; never on a link, so never in a history, a bookmark or a Referer); and takes it
// out of the address bar at once.
const TOKEN_KEY = "raymesh-dashboard-token";
const TOKEN = takeToken();

function takeToken() {
  const url = new URL(location.href);
  const given = new URLSearchParams(url.hash.slice(1)).get("token") ?? url.searchParams.get("token");
  if (given == null) {
    try { return sessionStorage.getItem(TOKEN_KEY); } catch { return null; }
  }
  try { sessionStorage.setItem(TOKEN_KEY, given); } catch { /* storage off: this page only */ }
  url.searchParams.delete("token");
  history.replaceState(null, "", url.pathname + url.search);
  return given;
}

const authHeaders = (headers) => (TOKEN ? {...headers, Authorization: "Bearer " + TOKEN} : headers);

// The API answered 401: ask for the token (again, when the one held was refused), then reload.
function askToken() {
  try { sessionStorage.removeItem(TOKEN_KEY); } catch { /* nothing held */ }
  if ($("#login")) return;
  const input = h("input", {type: "password", id: "token-input", autocomplete: "current-password", required: true});
  const text = TOKEN
    ? "That token was not accepted. This dashboard's token: "
    : "This dashboard needs its token (the one `raymesh dashboard` was given in --token or $RAYMESH_DASHBOARD_TOKEN): ";
  const form = h("form", {id: "login", class: "banner warn"}, h("label", {for: "token-input", text}), input, " ", h("button", {type: "submit", text: "open"}));
  form.addEventListener("submit", (ev) => {
    ev.preventDefault();
    try {
      sessionStorage.setItem(TOKEN_KEY, input.value);
    } catch {
      location.hash = "token=" + encodeURIComponent(input.value); // read (and removed) on reload
    }
    location.reload();
  });
  document.querySelector("main").before(form);
  input.focus();
}

// Run ids may hold slashes (a study's trials live in sub-folders): each segment is encoded on its
// own so that the slashes stay path separators.
const encodeId = (id) => id.split("/").map(encodeURIComponent).join("/");
const runLink = (id) => "/run/" + encodeId(id);
const meshLink = (id) => "/mesh/" + encodeId(id);

function runIdFromPath(prefix) {
  const path = location.pathname;
  if (!path.startsWith(prefix)) return "";
  try {
    return path.slice(prefix.length).replace(/\/+$/, "").split("/").map(decodeURIComponent).join("/");
  } catch {
    return ""; // a malformed %-escape: reported as "no run id" by the caller
  }
}

const $ = (sel) => document.querySelector(sel);

// h("td", {class: "x", text: "..."}, child, ...): strings become text nodes, never markup.
function h(tag, props, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(props || {})) {
    if (v == null || v === false) continue;
    if (k === "class") e.className = v;
    else if (k === "text") e.textContent = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else if (typeof v === "boolean") e[k] = v;
    else e.setAttribute(k, v);
  }
  for (const c of children.flat()) if (c != null && c !== false) e.append(c instanceof Node ? c : String(c));
  return e;
}

// Replace an element's children; like h(), skips null/false (a section that does not apply).
function fill(e, ...children) {
  e.replaceChildren(...children.flat().filter((c) => c != null && c !== false && c !== "").map((c) => (c instanceof Node ? c : String(c))));
  return e;
}

const num = (x) => (typeof x === "number" && Number.isFinite(x) ? x : null);
const NA = "–";

// ---------------------------------------------------------------- formatting

const fmtFixed = (x, d) => (num(x) == null ? NA : x.toFixed(d));
const fmtLoss = (x) => fmtFixed(x, 4);
const fmtInt = (x) => (num(x) == null ? NA : Math.round(x).toLocaleString("en-US"));
const fmtRate = (x) => (num(x) == null ? NA : x >= 100 ? fmtInt(x) : x.toFixed(1));

function fmtBytes(b) {
  if (num(b) == null) return b == null ? NA : String(b);
  const a = Math.abs(b);
  if (a >= 2 ** 30) return (b / 2 ** 30).toFixed(2) + " GiB";
  if (a >= 2 ** 20) return (b / 2 ** 20).toFixed(1) + " MiB";
  if (a >= 2 ** 10) return (b / 2 ** 10).toFixed(1) + " KiB";
  return b + " B";
}

function fmtCount(n) {
  if (num(n) == null) return NA;
  for (const [v, s] of [[1e12, "T"], [1e9, "B"], [1e6, "M"], [1e3, "k"]]) if (n >= v) return (n / v).toFixed(2) + " " + s;
  return String(n);
}

function fmtDuration(s) {
  if (num(s) == null) return NA;
  if (s < 120) return s.toFixed(1) + " s";
  if (s < 7200) return `${Math.floor(s / 60)}m ${String(Math.floor(s % 60)).padStart(2, "0")}s`;
  return `${Math.floor(s / 3600)}h ${String(Math.floor((s % 3600) / 60)).padStart(2, "0")}m`;
}

const fmtRel = (t, t0) => (num(t) == null || num(t0) == null ? NA : "+" + fmtDuration(Math.max(0, t - t0)));

function fmtDate(t) {
  if (num(t) == null) return NA;
  const d = new Date(t * 1000), p = (x) => String(x).padStart(2, "0");
  return `${d.getFullYear()}-${p(d.getMonth() + 1)}-${p(d.getDate())} ${p(d.getHours())}:${p(d.getMinutes())}:${p(d.getSeconds())}`;
}

// A CSV cell (a trial's value, state or param; the CSV gives strings): short floats, everything
// else as it came.
const isNumeric = (v) => typeof v === "number" || (typeof v === "string" && v.trim() !== "" && Number.isFinite(Number(v)));

function fmtCell(v) {
  if (v == null || v === "") return NA;
  if (typeof v === "string" && isNumeric(v) && /[.eE]/.test(v)) v = Number(v);
  if (typeof v === "number") return Number.isInteger(v) ? String(v) : String(Number(v.toPrecision(5)));
  if (typeof v === "object") return JSON.stringify(v);
  return String(v);
}

const cssName = (s) => String(s).replace(/[^A-Za-z0-9_-]/g, "");

function badge(status, id) {
  return h("span", {class: "badge status-" + cssName(status), id, text: status || "unknown"});
}

// One colour per rank on every chart and list, so rank 3 is the same purple everywhere.
// (Red is kept for failures.)
const PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f", "#393b79"];
const rankColor = (r) => PALETTE[((r % PALETTE.length) + PALETTE.length) % PALETTE.length];
const FAILURE_RED = "#d62728";

function rankChip(r) {
  return h("span", {class: "rank-chip", style: `--rank:${rankColor(r)}`, text: String(r)});
}

// ---------------------------------------------------------------- API and banners

class ApiError extends Error {
  constructor(message, status) { super(message); this.status = status; }
}

// Python's json.dumps writes a diverged loss as NaN, which is not JSON: read such a value as
// null (only where a value stands, so a cause saying "loss is NaN" stays as it is).
function parseJSON(text) {
  try {
    return JSON.parse(text);
  } catch (e) {
    const fixed = text.replace(/([:[,]\s*)-?(?:NaN|Infinity)(?=\s*[,\]}])/g, "$1null");
    if (fixed === text) throw e;
    return JSON.parse(fixed);
  }
}

async function getJSON(path) {
  let resp;
  try {
    resp = await fetch(path, {cache: "no-store", headers: authHeaders({Accept: "application/json"})});
  } catch (e) {
    throw new ApiError(`Cannot reach the dashboard server (${e.message}).`, 0);
  }
  let body = null;
  try { body = parseJSON(await resp.text()); } catch { /* an HTML error page from a proxy, an empty body */ }
  if (!resp.ok) {
    // raymesh's error shape: {"error": {"type", "message"}}
    const text = body && body.error && typeof body.error.message === "string" ? body.error.message : resp.statusText;
    throw new ApiError(`${text} (HTTP ${resp.status})`, resp.status);
  }
  if (body == null) throw new ApiError(`The server's answer to ${path} is not JSON.`, resp.status);
  return body;
}

function showError(msg) {
  const e = $("#error");
  e.textContent = msg || "";
  e.hidden = !msg;
}

function showList(container, title, items) {
  fill(container, h("strong", {text: title}), h("ul", null, items.map((w) => h("li", {text: w}))));
  container.hidden = items.length === 0;
}

// A 401 asks for the token and stops what asked (it resumes on the reload that follows).
function needsToken(e) {
  if (!e || e.status !== 401) return false;
  askToken();
  return true;
}

// A server-sent event stream read with fetch, not EventSource, which cannot send the token's
// header. `on(name, data)` for each message; `closed(error)` once the stream ends by itself
// (error null) or fails; nothing once `close()` was called.
function openStream(path, {opened, on, closed}) {
  const abort = new AbortController();
  (async () => {
    try {
      const resp = await fetch(path, {cache: "no-store", headers: authHeaders({Accept: "text/event-stream"}), signal: abort.signal});
      if (!resp.ok || !resp.body) throw new ApiError(`the stream answered HTTP ${resp.status}`, resp.status);
      opened();
      const reader = resp.body.pipeThrough(new TextDecoderStream()).getReader();
      let buffer = "";
      for (;;) {
        const {value, done} = await reader.read();
        if (done) break;
        buffer += value;
        let end;
        while ((end = buffer.indexOf("\n\n")) >= 0) {
          const block = buffer.slice(0, end);
          buffer = buffer.slice(end + 2);
          let name = "message";
          const data = [];
          for (const line of block.split("\n")) {
            if (line.startsWith("event:")) name = line.slice(6).trim();
            else if (line.startsWith("data:")) data.push(line.slice(5).replace(/^ /, ""));
          }
          if (data.length && !abort.signal.aborted) on(name, data.join("\n"));
        }
      }
      if (!abort.signal.aborted) closed(null);
    } catch (e) {
      if (!abort.signal.aborted) closed(e);
    }
  })();
  return {close: () => abort.abort()};
}

// ---------------------------------------------------------------- charts

// uPlot wants an explicit width: follow the container's, and rebuild the chart only when its
// series change (a new rank, data wait appearing); otherwise new rows go in with setData.
class LiveChart {
  constructor(container, height = 220) {
    this.container = container;
    this.height = height;
    this.u = null;
    this.key = null;
    new ResizeObserver(() => {
      const w = this.width();
      if (this.u && w !== this.u.width) this.u.setSize({width: w, height: this.height});
    }).observe(container);
  }

  width() { return Math.max(240, Math.floor(this.container.clientWidth)); }

  update({key, opts, data}) {
    if (!this.u || key !== this.key) {
      if (this.u) this.u.destroy();
      this.key = key;
      opts = {...opts, scales: {x: {time: false}, ...opts.scales}};
      this.u = new uPlot({...opts, width: this.width(), height: this.height}, data, this.container);
      this.extent = data[0].length ? [data[0][0], data[0][data[0].length - 1]] : null;
      return;
    }
    // Keep the user's zoom while points stream in; rescale when they look at the whole run.
    // (The columns grow in place, so the extent drawn last is remembered here.)
    const x = this.u.scales.x, [lo, hi] = this.extent || [];
    const zoomed = lo != null && hi > lo && x.min != null && (x.min > lo || x.max < hi);
    this.setData(data, !zoomed);
  }

  setData(data, rescale) {
    this.u.setData(data, rescale);
    const xs = data[0];
    this.extent = xs.length ? [xs[0], xs[xs.length - 1]] : null;
  }

  redraw() { if (this.u) this.u.redraw(false, false); }
}

// A vertical red line at each failure's step, labelled "rank R <kind>", drawn over the plot.
function failureMarkers(getMarks) {
  const draw = (u) => {
    const ctx = u.ctx, px = uPlot.pxRatio, {left, top, width, height} = u.bbox;
    ctx.save();
    ctx.strokeStyle = ctx.fillStyle = FAILURE_RED;
    ctx.lineWidth = 1.5 * px;
    ctx.font = `${11 * px}px system-ui, sans-serif`;
    getMarks().forEach((m, i) => {
      const x = Math.round(u.valToPos(m.step, "x", true));
      if (!(x >= left && x <= left + width)) return;
      ctx.setLineDash([5 * px, 3 * px]);
      ctx.beginPath();
      ctx.moveTo(x, top);
      ctx.lineTo(x, top + height);
      ctx.stroke();
      // Labels of failures close together are staggered so they stay readable.
      const y = top + (12 + 13 * (i % 4)) * px, w = ctx.measureText(m.label).width;
      const right = x + 4 * px + w > left + width;
      ctx.textAlign = right ? "right" : "left";
      ctx.fillStyle = "rgba(255,255,255,0.85)";
      ctx.fillRect(right ? x - 4 * px - w - 2 * px : x + 2 * px, y - 10 * px, w + 4 * px, 13 * px);
      ctx.fillStyle = FAILURE_RED;
      ctx.fillText(m.label, right ? x - 4 * px : x + 4 * px, y);
    });
    ctx.restore();
  };
  return {hooks: {draw: [draw]}};
}

const stepAxis = {label: "step", labelSize: 20, size: 36};
const yAxis = (label) => ({label, labelSize: 20, size: 60});
const rankSeries = (i, fmt) => ({label: `rank ${i}`, stroke: rankColor(i), width: 1, value: (u, v) => (v == null ? NA : fmt(v))});

// ---------------------------------------------------------------- run data and live stream

// The columns of a run's rows, grown one row at a time (rebuilding them on every streamed batch
// would cost the whole history each second on a long run).
class Columns {
  constructor() {
    Object.assign(this, {step: [], loss: [], evalLoss: [], sps: [], world: [], spares: [], wait: [], dataSps: [], derivedMs: [], rankLoss: [], rankMs: [], reward: [], staleness: [], tokensPs: []});
    this.hasWait = this.hasDataSps = this.hasEval = this.hasReward = this.hasTokens = false;
    this.lastEnd = null;
  }

  push(row) {
    const n = this.step.length;
    const prevStep = this.step[n - 1];
    this.step.push(row.step);
    this.loss.push(num(row.loss));
    this.evalLoss.push(num(row.eval_loss)); // only the steps that evaluated (Task.eval_dataset)
    this.hasEval ||= num(row.eval_loss) != null;
    this.sps.push(num(row.samples_per_s));
    this.world.push(num(row.world_size));
    this.spares.push(num(row.spares));
    const wait = num(row.data_wait);
    this.wait.push(wait == null ? null : wait * 100);
    this.hasWait ||= wait != null;
    this.dataSps.push(num(row.data_samples_per_s));
    this.hasDataSps ||= num(row.data_samples_per_s) != null;
    // An RL run's rows (raymesh.rl): GRPO's mean reward, or PPO's mean episode return.
    const reward = num(row.reward_mean) ?? num(row.episode_return_mean);
    this.reward.push(reward);
    this.hasReward ||= reward != null;
    this.staleness.push(num(row.staleness_mean));
    this.tokensPs.push(num(row.tokens_per_s));
    this.hasTokens ||= num(row.tokens_per_s) != null;
    // Old runs have no per-rank step times: their step time comes from the gap between steps' ends.
    const end = num(row.end);
    const ms = end != null && this.lastEnd != null && row.step > prevStep ? ((end - this.lastEnd) * 1000) / (row.step - prevStep) : null;
    this.derivedMs.push(ms == null ? null : Math.round(ms * 100) / 100);
    this.lastEnd = end;
    pushRanks(this.rankLoss, row.rank_loss, n, 1);
    pushRanks(this.rankMs, row.rank_step_s, n, 1000);
  }
}

function pushRanks(cols, values, n, scale) {
  const vals = Array.isArray(values) ? values : [];
  while (cols.length < vals.length) cols.push(new Array(n).fill(null));
  cols.forEach((c, i) => c.push(num(vals[i]) == null ? null : vals[i] * scale));
}

// window.dashboard is what a browser test reads: rows and events grow in place as they stream.
window.dashboard = {rows: [], events: [], warnings: [], summary: null, ready: false};

// One run: loaded with /api/run, then kept current with /api/stream (SSE). The view's render()
// is called at most every 100 ms with what changed since the last call.
class RunSession {
  constructor(id, view) {
    Object.assign(this, {id, view, source: null, retry: null, dirty: {}, flushing: null});
    this.rows = window.dashboard.rows;
    this.events = window.dashboard.events;
    this.warnings = window.dashboard.warnings;
    this.summary = null;
  }

  async load() {
    if (!this.id) return showError("This address names no run: open a run from the runs page.");
    let d;
    try {
      d = await getJSON("/api/run/" + encodeId(this.id));
    } catch (e) {
      if (needsToken(e)) return;
      showError(`Run "${this.id}": ${e.message}`);
      $("#run-name").textContent = this.id;
      document.body.classList.add("load-failed");
      if (e.status !== 404) setTimeout(() => this.load(), 5000); // the server may be restarting
      return;
    }
    showError("");
    document.body.classList.remove("load-failed");
    this.setSummary(d.summary);
    this.addRows(d.rows || []);
    this.addEvents(d.events || []);
    (d.warnings || []).forEach((w) => this.addWarning(w));
    this.flush();
    window.dashboard.ready = true;
    if (this.summary && this.summary.status === "running") this.open();
    else setLive("ended");
  }

  setSummary(s) {
    if (!s) return;
    this.summary = window.dashboard.summary = s;
    this.mark("summary");
  }
  addRows(rows) {
    for (const r of rows) {
      // A step trained again (healing from a checkpoint) replaces the rows from it on.
      while (this.rows.length && this.rows[this.rows.length - 1].step >= r.step) {
        this.rows.pop();
        this.dirty.rowsCut = true;
      }
      this.rows.push(r);
    }
    this.mark("rows");
  }
  addEvents(events) { for (const e of events) this.events.push(e); this.mark("events"); }
  addWarning(w) { if (!this.warnings.includes(w)) this.warnings.push(w); this.mark("warnings"); }

  mark(what) {
    this.dirty[what] = true;
    if (!this.flushing && window.dashboard.ready) this.flushing = setTimeout(() => this.flush(), 100);
  }

  flush() {
    clearTimeout(this.flushing);
    this.flushing = null;
    const dirty = this.dirty;
    this.dirty = {};
    try { this.view.render(this, dirty); } catch (e) { console.error(e); showError("The page failed to draw this run: " + e.message); }
  }

  // The stream resumes from the counts the page holds, so a reconnect never duplicates a row.
  open() {
    const q = `?rows=${this.rows.length}&events=${this.events.length}`;
    const handlers = {
      rows: (rows) => this.addRows(rows),
      events: (events) => this.addEvents(events),
      warning: (w) => this.addWarning(String(w)),
      summary: (s) => this.setSummary(s),
      end: (s) => { this.setSummary(s); this.close(); setLive("ended"); },
    };
    this.source = openStream("/api/stream/" + encodeId(this.id) + q, {
      opened: () => setLive("live"),
      on: (name, text) => {
        let data;
        try { data = parseJSON(text); } catch { return console.warn(`bad ${name} message`, text); }
        if (handlers[name]) handlers[name](data);
      },
      // Ended without its `end` message (the server stopped) or failed: reopen it, with the
      // counts the page has now, so that nothing is sent twice.
      closed: (error) => {
        this.close();
        if (needsToken(error)) return;
        setLive("reconnecting");
        this.retry = setTimeout(() => this.open(), 2000);
      },
    });
  }

  close() {
    if (this.source) this.source.close();
    this.source = null;
    clearTimeout(this.retry);
  }

  get running() { return !this.summary || this.summary.status === "running"; }
}

function setLive(state) {
  const e = $("#live");
  if (!e) return;
  e.className = "live live-" + state;
  e.textContent = {live: "live", reconnecting: "reconnecting…", ended: "ended"}[state] || state;
}

// The job's start: its `job` event, else the summary's start, else its first event.
function jobStart(session) {
  const job = session.events.find((e) => evName(e) === "job");
  return job ? job.t : num(session.summary && session.summary.started) ?? (session.events[0] || {}).t ?? null;
}

// events.jsonl names each event in "event"; a failure's "kind" is died/error/hung/stuck (the
// server passes on only events that have a name).
const evName = (e) => e.event;
const failKind = (e) => e.kind;
const ofKind = (events, name) => events.filter((e) => evName(e) === name);
const newest = (events, name) => { for (let i = events.length - 1; i >= 0; i--) if (evName(events[i]) === name) return events[i]; return null; };

// Failures paired with their healing: by rank and step, else the rank's oldest unhealed failure
// (a heal may be reported at the step the run resumed from).
function matchFailures(events) {
  const out = [];
  for (const e of events) {
    const name = evName(e);
    if (name === "failure") out.push({t: e.t, rank: e.rank, step: e.step, kind: failKind(e), cause: e.cause, healed: null});
    if (name !== "healed") continue;
    const m = out.find((f) => !f.healed && f.rank === e.rank && f.step === e.step) || out.find((f) => !f.healed && f.rank === e.rank);
    if (m) m.healed = e;
    else out.push({t: e.t, rank: e.rank, step: e.step, kind: failKind(e), cause: e.cause, healed: e});
  }
  return out;
}

// "replace: healed in 3.21 s (by spare-3 (pid 4242)), world 4"
function healText(e) {
  return `${e.action || "healed"}: healed in ${fmtFixed(e.recovery_s, 2)} s` +
    (e.replaced_by ? ` (by ${e.replaced_by})` : "") + (num(e.world_size) != null ? `, world ${e.world_size}` : "");
}

// Header shared by the job and mesh pages.
function renderHeader(session) {
  const s = session.summary || {}, last = session.rows[session.rows.length - 1] || {};
  document.title = `${s.name || session.id} · raymesh`;
  $("#run-name").textContent = s.name || session.id;
  $("#run-name").title = s.path || "";
  const st = $("#status");
  st.textContent = s.status || "unknown";
  st.className = "badge status-" + cssName(s.status);
  const step = Math.max(num(s.step) ?? 0, num(last.step) ?? 0);
  $("#step").textContent = String(step);
  const set = (sel, text) => { const e = $(sel); if (e) e.textContent = text; };
  set("#steps", num(s.steps) == null ? "?" : String(s.steps));
  const bar = $("#progress-bar");
  if (bar) bar.style.width = num(s.steps) ? `${Math.min(100, (100 * step) / s.steps).toFixed(1)}%` : "0";
  // An RL run leads with its reward: GRPO's mean reward, or PPO's mean episode return (the
  // newest row that has one: a row healed late, or a PPO minibatch's, may not).
  const rewardStat = $("#reward-stat");
  if (rewardStat) {
    let reward = null;
    for (let i = session.rows.length - 1; i >= 0 && reward == null; i--) reward = num(session.rows[i].reward_mean) ?? num(session.rows[i].episode_return_mean);
    reward ??= num(s.reward);
    const job = newest(session.events, "job") || {};
    rewardStat.hidden = s.kind !== "rl" && reward == null;
    set("#reward-label", job.algorithm === "PPO" ? "episode return" : "reward");
    set("#reward", reward == null ? NA : reward.toFixed(3));
  }
  set("#loss", fmtLoss(s.loss ?? last.loss));
  set("#sps", fmtRate(s.samples_per_s ?? last.samples_per_s));
  set("#world", fmtCell(s.world_size ?? last.world_size));
  set("#spares", fmtCell(s.spares ?? last.spares));
  set("#failure-count", fmtCell(s.failures));
  set("#strategy-name", s.strategy || NA);
  set("#started", fmtDate(s.started));
  set("#elapsed", num(s.started) && num(s.updated) ? fmtDuration(s.updated - s.started) : NA);
  const fc = $("#failure-count");
  if (fc) fc.classList.toggle("bad", (s.failures || 0) > 0);
}

// An RL run's roles ("role" events: generators or env runners, reward actors, the learner)
// and the workers it replaced ("replaced" events), from raymesh.rl's loop.
function renderRoles(roles, replaced, t0) {
  $("#roles-card").hidden = roles.length === 0 && replaced.length === 0;
  const count = (role) => replaced.filter((r) => r.role === role).length;
  fill($("#roles tbody"), ...roles.map((r) => h("tr", null,
    h("td", {text: r.role || NA}),
    h("td", {class: "num", text: fmtCell(r.count)}),
    h("td", {class: "small", text: Array.isArray(r.pids) ? r.pids.join(", ") : ""}),
    h("td", {class: "num" + (count(r.role) ? " bad" : ""), text: String(count(r.role))}))));
  $("#replacements").hidden = replaced.length === 0;
  fill($("#replacements tbody"), ...replaced.map((r) => h("tr", {class: "replaced"},
    h("td", {class: "num", text: fmtRel(r.t, t0)}),
    h("td", {text: r.role || NA}),
    h("td", {class: "num", text: fmtCell(r.index)}),
    h("td", {class: "num", text: fmtCell(r.pid)}),
    h("td", {class: "num", text: Array.isArray(r.keys) ? String(r.keys.length) : NA}),
    h("td", null, h("div", {class: "cause", text: r.cause || ""})))));
}

// ---------------------------------------------------------------- job page

class JobView {
  constructor() {
    this.cols = new Columns();
    this.marks = [];
    this.markers = failureMarkers(() => this.marks);
    this.charts = {
      loss: new LiveChart($("#loss-chart")),
      steptime: new LiveChart($("#steptime-chart")),
      throughput: new LiveChart($("#throughput-chart"), 180),
      world: new LiveChart($("#world-chart"), 180),
      reward: new LiveChart($("#reward-chart")),
    };
    this.session = null;
    // The last state's segment grows with the clock while the run goes on.
    setInterval(() => { if (this.session && this.session.running && this.session.events.length) this.renderTimeline(this.session); }, 1000);
  }

  render(session, dirty) {
    this.session = session;
    if (dirty.summary || dirty.rows) renderHeader(session);
    if (dirty.events || dirty.summary) {
      const t0 = jobStart(session);
      this.failures = matchFailures(session.events);
      this.marks = this.failures.map((f) => ({step: f.step, label: `rank ${f.rank} ${f.kind}` + (f.healed ? `, healed ${fmtFixed(f.healed.recovery_s, 1)} s` : "")}));
      this.renderTimeline(session);
      this.renderFailures(session, t0);
      this.renderJobMeta(session);
      renderStrategy(newest(session.events, "strategy"));
      renderPlacement(newest(session.events, "placement"));
      renderRebalances(ofKind(session.events, "rebalance"));
      // this session's (a resumed run appends a "job" event and its roles again)
      const since = (newest(session.events, "job") || {t: -Infinity}).t;
      const mine = (name) => ofKind(session.events, name).filter((e) => e.t >= since);
      renderRoles(mine("role"), mine("replaced"), t0);
    }
    if (dirty.rows) {
      if (dirty.rowsCut) this.cols = new Columns();
      while (this.cols.step.length < session.rows.length) this.cols.push(session.rows[this.cols.step.length]);
      this.updateCharts();
    } else if (dirty.events) {
      Object.values(this.charts).forEach((c) => c.redraw()); // new failure lines
    }
    if (dirty.warnings) showList($("#warnings"), "Warnings", session.warnings);
  }

  updateCharts() {
    const c = this.cols, base = {cursor: {sync: {key: "job"}}, legend: {live: true}};
    const ms = (v) => v.toFixed(1) + " ms";
    const nLoss = c.rankLoss.length, nMs = c.rankMs.length;
    const evalSeries = c.hasEval ? [{label: "eval", stroke: "#d62728", width: 2, spanGaps: true, points: {show: true, size: 6}, value: (u, v) => fmtLoss(v)}] : [];
    this.charts.loss.update({
      key: `loss-${nLoss}-${c.hasEval}`,
      data: [c.step, c.loss, ...(c.hasEval ? [c.evalLoss] : []), ...c.rankLoss],
      opts: {...base, plugins: [this.markers], axes: [stepAxis, yAxis("loss")],
        series: [{label: "step"}, {label: "mean", stroke: "#222", width: 2, value: (u, v) => fmtLoss(v)},
          ...evalSeries, ...c.rankLoss.map((_, i) => rankSeries(i, fmtLoss))]},
    });
    // Without per-rank times (older runs) show one line derived from the steps' end times.
    this.charts.steptime.update({
      key: `st-${nMs}`,
      data: nMs ? [c.step, ...c.rankMs] : [c.step, c.derivedMs],
      opts: {...base, plugins: [this.markers], axes: [stepAxis, yAxis("ms")],
        series: [{label: "step"}, ...(nMs ? c.rankMs.map((_, i) => rankSeries(i, ms)) : [{label: "step time (from end times)", stroke: "#555", value: (u, v) => (v == null ? NA : ms(v))}])]},
    });
    const tSeries = [{label: "step"}, {label: "samples/s", stroke: "#1f77b4", width: 2, value: (u, v) => fmtRate(v)}];
    const tData = [c.step, c.sps];
    if (c.hasDataSps) { tSeries.push({label: "data samples/s", stroke: "#17becf", dash: [6, 4], value: (u, v) => fmtRate(v)}); tData.push(c.dataSps); }
    if (c.hasTokens) { tSeries.push({label: "tokens/s", scale: "tok", stroke: "#9467bd", value: (u, v) => fmtRate(v)}); tData.push(c.tokensPs); }
    if (c.hasWait) { tSeries.push({label: "data wait", scale: "%", stroke: "#ff7f0e", fill: "rgba(255,127,14,0.12)", value: (u, v) => (v == null ? NA : v.toFixed(1) + " %")}); tData.push(c.wait); }
    this.charts.throughput.update({
      key: `tp-${c.hasDataSps}-${c.hasWait}-${c.hasTokens}`, data: tData,
      opts: {...base, series: tSeries, scales: {"%": {range: [0, 100]}},
        axes: [stepAxis, yAxis("samples/s"), ...(c.hasWait ? [{scale: "%", side: 1, grid: {show: false}, size: 50, values: (u, v) => v.map((x) => x + "%")}] : []),
          ...(c.hasTokens ? [{scale: "tok", side: 1, grid: {show: false}, size: 60}] : [])]},
    });
    $("#reward-card").hidden = !c.hasReward;
    if (c.hasReward) {
      this.charts.reward.update({
        key: "reward", data: [c.step, c.reward, c.staleness],
        opts: {...base, axes: [stepAxis, yAxis("reward"), {scale: "stale", side: 1, grid: {show: false}, size: 50}],
          // spanGaps: PPO has a reward in a version's last row only (a row is a train step)
          series: [{label: "step"}, {label: "reward", stroke: "#2ca02c", width: 2, spanGaps: true, value: (u, v) => (v == null ? NA : v.toFixed(3))},
            {label: "staleness", scale: "stale", stroke: "#7f7f7f", dash: [4, 3], spanGaps: true, value: (u, v) => (v == null ? NA : v.toFixed(2))}]},
      });
    }
    const stepped = uPlot.paths.stepped({align: 1});
    this.charts.world.update({
      key: "world", data: [c.step, c.world, c.spares],
      opts: {...base, axes: [stepAxis, yAxis("procs")], scales: {y: {range: (u, min, max) => [0, Math.max(1, max ?? 1) + 1]}},
        series: [{label: "step"}, {label: "world size", stroke: "#2ca02c", width: 2, paths: stepped}, {label: "spares", stroke: "#7f7f7f", width: 2, dash: [4, 3], paths: stepped}]},
    });
  }

  renderTimeline(session) {
    const states = ofKind(session.events, "state");
    const t0 = jobStart(session);
    const endEv = newest(session.events, "end");
    const now = session.running ? Date.now() / 1000 : endEv ? endEv.t : num(session.summary && session.summary.updated) ?? (states[states.length - 1] || {}).t;
    const band = $("#timeline");
    const total = states.length ? Math.max(1e-3, now - states[0].t) : 0;
    // Segments are updated in place when only the clock moved (a rebuilt one loses its tooltip).
    if (band.childElementCount !== states.length) {
      fill(band, ...states.map((s) => h("div", {class: "seg state-" + cssName(s.state)}, h("span", {text: s.state}))));
    }
    states.forEach((s, i) => {
      const until = i + 1 < states.length ? states[i + 1].t : Math.max(now, s.t);
      const dur = Math.max(0, until - s.t), seg = band.children[i];
      seg.style.flexGrow = String(Math.max(dur / total, 0.004));
      seg.title = `${s.state} at ${fmtRel(s.t, t0)} for ${fmtDuration(dur)}, step ${s.step ?? NA}${s.reason ? ": " + s.reason : ""}`;
    });
    $("#timeline-empty").hidden = states.length > 0;
    $("#timeline-start").textContent = states.length ? fmtRel(states[0].t, t0) : "";
    $("#timeline-end").textContent = states.length ? fmtRel(now, t0) : "";
    const list = $("#transitions tbody");
    if (list.childElementCount === states.length) return; // only the clock moved
    fill(list, ...states.map((s, i) => h("tr", null,
      h("td", {class: "num", text: fmtRel(s.t, t0)}),
      h("td", null, h("span", {class: "badge state-badge state-bg-" + cssName(s.state), text: s.state})),
      h("td", {class: "num", text: fmtCell(s.step)}),
      h("td", {class: "num", text: i + 1 < states.length ? fmtDuration(states[i + 1].t - s.t) : ""}),
      h("td", {class: "reason", text: s.reason || ""}))));
  }

  renderFailures(session, t0) {
    const tbody = $("#failures tbody");
    $("#failures-empty").hidden = this.failures.length > 0;
    fill(tbody, ...this.failures.map((f) => {
      const healed = f.healed;
      const unhealed = !healed && session.running;
      const outcome = healed
        ? h("td", {class: "healed", text: healText(healed)})
        : h("td", {class: unhealed ? "healing-cell" : "bad", text: unhealed ? "healing…" : "not healed"});
      return h("tr", {class: "failure" + (unhealed ? " healing" : "") + (healed || unhealed ? "" : " unhealed"), "data-rank": String(f.rank), "data-step": String(f.step)},
        h("td", {class: "num", text: fmtRel(f.t, t0)}),
        h("td", null, num(f.rank) == null ? NA : rankChip(f.rank)),
        h("td", {class: "num", text: fmtCell(f.step)}),
        h("td", null, h("span", {class: "kind kind-" + cssName(f.kind), text: f.kind || NA})),
        h("td", null, h("div", {class: "cause", text: f.cause || ""})),
        outcome,
        h("td", {class: "num", text: healed ? fmtCell(healed.steps_recomputed) : ""}));
    }));
  }

  renderJobMeta(session) {
    const job = newest(session.events, "job");
    const box = $("#job-meta");
    if (!job) return fill(box);
    const item = (k, v) => (v == null ? null : h("span", null, h("span", {class: "muted", text: k + " "}), String(v)));
    const w = Array.isArray(job.workers) ? job.workers : [];
    fill(box, item("host", job.host), item("pid", job.pid),
      item("workers", w.length ? (w[0] === w[1] ? w[0] : `${w[0]}–${w[1]}`) : null),
      item("global batch", job.global_batch_size), item("report every", job.report_every));
  }
}

function renderStrategy(ev) {
  const box = $("#strategy");
  if (!ev) return fill(box, h("p", {class: "muted", text: "No strategy chosen yet."}));
  const est = ev.estimate && typeof ev.estimate === "object" ? Object.entries(ev.estimate) : [];
  const budget = num(ev.budget_bytes);
  fill(box,
    h("div", {class: "kv"},
      h("span", {class: "strategy-name", text: ev.strategy || NA}),
      h("span", null, h("span", {class: "muted", text: "params "}), fmtCount(ev.params)),
      h("span", null, h("span", {class: "muted", text: "budget "}), fmtBytes(ev.budget_bytes), h("span", {class: "muted", text: " per rank"})),
      ev.shard_size != null && h("span", null, h("span", {class: "muted", text: "shard size "}), String(ev.shard_size)),
      ev.device && h("span", null, h("span", {class: "muted", text: "device "}), String(ev.device))),
    ev.reason && h("pre", {class: "reason", text: ev.reason}),
    est.length > 0 && h("table", {class: "small"},
      h("thead", null, h("tr", null, h("th", {text: "memory estimate"}), h("th", {class: "num", text: "bytes"}), h("th", {class: "num", text: "of budget"}))),
      h("tbody", null, est.map(([k, v]) => h("tr", null,
        h("td", {text: k.replace(/_bytes$/, "").replace(/_/g, " ")}),
        h("td", {class: "num", text: fmtBytes(v)}),
        h("td", {class: "num", text: budget && num(v) != null ? ((100 * v) / budget).toFixed(0) + " %" : ""}))))));
}

function renderPlacement(ev) {
  const box = $("#placement");
  if (!ev) return fill(box, h("p", {class: "muted", text: "No placement yet."}));
  const hosts = Array.isArray(ev.hosts) ? ev.hosts : [];
  const hasIp = hosts.some((x) => x.ip); // raymesh.train writes "name (ip)" in host instead
  fill(box,
    ev.reason && h("p", {class: "reason", text: ev.reason}),
    h("table", {class: "small"},
      h("thead", null, h("tr", null, ["host", hasIp && "ip", "node", "ranks"].filter(Boolean).map((t) => h("th", {text: t})))),
      h("tbody", null, hosts.map((x) => h("tr", null,
        h("td", {text: x.hostname || x.host || NA}), hasIp && h("td", {class: "mono", text: x.ip || ""}),
        h("td", {class: "mono", title: x.node_id || "", text: String(x.node_id || NA).slice(0, 12)}),
        h("td", null, (x.ranks || []).map(rankChip)))))),
    renderTopology(ev.topology));
}

// network[a][b] is the link from host a to host b: latency in µs over bandwidth in GB/s.
function renderTopology(topo) {
  if (!topo || !Array.isArray(topo.network) || !topo.network.length) return null;
  const names = (topo.hosts || []).map((x, i) => x.hostname || x.ip || `host ${i}`);
  const name = (i) => names[i] || `host ${i}`;
  return h("div", {class: "topology"},
    h("h3", {text: "Links (row → column): latency, bandwidth"}),
    h("table", {class: "small matrix"},
      h("thead", null, h("tr", null, h("th", {text: "from \\ to"}), topo.network.map((_, j) => h("th", {text: name(j)})))),
      h("tbody", null, topo.network.map((row, i) => h("tr", null, h("th", {text: name(i)}),
        (row || []).map((l) => !l ? h("td", {text: NA}) : h("td", {class: l.measured ? "measured" : "assumed", title: `${l.kind || "link"}, ${l.measured ? "measured" : "assumed"}`},
          h("div", {text: `${num(l.latency) == null ? NA : (l.latency * 1e6).toFixed(1)} µs`}),
          h("div", {text: `${num(l.bandwidth) == null ? NA : (l.bandwidth / 1e9).toFixed(2)} GB/s`}),
          h("div", {class: "muted", text: (l.kind || "") + (l.measured ? " ✓" : "")}))))))),
    h("p", {class: "muted small-note", text: "✓ measured; the other links are assumed from their kind."}));
}

function renderRebalances(list) {
  const card = $("#rebalances-card");
  card.hidden = list.length === 0;
  fill($("#rebalances"), ...list.map((r) => h("li", null,
    h("span", {class: "num", text: `step ${fmtCell(r.step)}: `}),
    h("span", {text: "sizes " + (r.sizes || []).join(" / ")}),
    r.flagged && r.flagged.length ? h("span", {class: "bad", text: ", flagged ranks " + r.flagged.join(", ")}) : null,
    r.reason ? h("div", {class: "reason", text: r.reason}) : null)));
}

// ---------------------------------------------------------------- mesh page

class MeshView {
  render(session, dirty) {
    if (dirty.summary || dirty.rows) renderHeader(session);
    if (dirty.warnings) showList($("#warnings"), "Warnings", session.warnings);
    if (!(dirty.events || dirty.summary)) return;
    const mesh = newest(session.events, "mesh");
    const placement = newest(session.events, "placement");
    this.renderProcs(mesh, placement);
    this.renderSupervision(session);
  }

  // Procs grouped by host: the newest mesh event says which procs there are, the placement
  // adds each host's address and lists hosts that hold no proc any more.
  renderProcs(mesh, placement) {
    const groups = new Map();
    const group = (key, host) => {
      if (!groups.has(key)) groups.set(key, {key, hostname: host.hostname || host.host || key, ip: host.ip, node_id: host.node_id, procs: []});
      const g = groups.get(key);
      g.ip ||= host.ip;
      return g;
    };
    const placed = placement && Array.isArray(placement.hosts) ? placement.hosts : [];
    for (const x of placed) group(x.node_id || x.hostname, x);
    const procs = mesh ? [...(mesh.ranks || []), ...(mesh.spares || []).map((p) => ({...p, spare: true}))] : [];
    for (const p of procs) {
      const key = p.node_id && groups.has(p.node_id) ? p.node_id : [...groups.values()].find((g) => g.hostname === p.host)?.key || p.node_id || p.host;
      group(key, {hostname: p.host, node_id: p.node_id}).procs.push(p);
    }
    const order = (p) => (p.spare || p.rank == null ? 1e9 + (p.pid || 0) : p.rank);
    const box = $("#procs");
    $("#procs-empty").hidden = procs.length > 0;
    fill(box, ...[...groups.values()].map((g) => h("section", {class: "host"},
      h("div", {class: "host-head"}, h("strong", {text: g.hostname}), h("span", {class: "mono muted", text: g.ip || ""}),
        h("span", {class: "mono muted", title: g.node_id || "", text: g.node_id ? "node " + String(g.node_id).slice(0, 12) : ""}),
        h("span", {class: "muted", text: `${g.procs.length} proc${g.procs.length === 1 ? "" : "s"}`})),
      h("div", {class: "proc-grid"}, g.procs.sort((a, b) => order(a) - order(b)).map(procCard)))));
  }

  renderSupervision(session) {
    const t0 = jobStart(session);
    const list = session.events.filter((e) => ["failure", "healed"].includes(evName(e))).sort((a, b) => a.t - b.t);
    $("#supervision-empty").hidden = list.length > 0;
    fill($("#supervision tbody"), ...list.map((e) => {
      const name = evName(e);
      return h("tr", {class: "sup-" + name},
        h("td", {class: "num", title: fmtDate(e.t), text: fmtRel(e.t, t0)}),
        h("td", null, h("span", {class: "badge " + (name === "failure" ? "status-failed" : "status-finished"), text: name})),
        h("td", null, num(e.rank) == null ? NA : rankChip(e.rank)),
        h("td", {class: "num", text: fmtCell(e.step)}),
        h("td", null, h("span", {class: "kind kind-" + cssName(failKind(e)), text: failKind(e) || NA})),
        h("td", null, h("div", {class: "cause", text: e.cause || ""})),
        h("td", {text: name === "healed" ? healText(e) : ""}));
    }));
  }
}

function procCard(p) {
  const spare = p.spare || p.rank == null;
  return h("div", {class: `proc proc-${cssName(p.state)}` + (spare ? " spare" : ""), "data-pid": String(p.pid), style: spare ? null : `--rank:${rankColor(p.rank)}`},
    h("div", {class: "proc-head"}, h("span", {class: "proc-rank", text: spare ? "spare" : `rank ${p.rank}`}),
      h("span", {class: "badge proc-state state-" + cssName(p.state), text: p.state || "unknown"})),
    h("div", {class: "proc-line"}, h("span", {class: "muted", text: "mesh "}), p.mesh || NA),
    h("div", {class: "proc-line"}, h("span", {class: "muted", text: "pid "}), h("span", {class: "mono", text: String(p.pid ?? NA)})),
    h("div", {class: "actors"}, (p.actors || []).map((a) => h("span", {class: "actor", text: a}))));
}

// ---------------------------------------------------------------- runs page

class RunsPage {
  constructor() {
    this.picked = new Set();
    this.cache = new Map(); // run id -> {rows, status} for the compare chart
    this.runs = [];
    this.lastJson = "";
    this.chart = new LiveChart($("#compare-chart"), 300);
    $("#compare-clear").addEventListener("click", () => { this.picked.clear(); this.renderRuns(); this.refreshCompare(); });
  }

  async poll() {
    try {
      const d = await getJSON("/api/runs");
      showError("");
      const json = JSON.stringify(d);
      if (json !== this.lastJson) { // unchanged data: leave the DOM (and the user's focus) alone
        this.lastJson = json;
        this.runs = d.runs || [];
        $("#root").textContent = d.root || "";
        showList($("#problems"), "Problems", d.problems || []);
        this.renderRuns();
        this.renderStudies(d.studies || []);
      }
      this.refreshCompare();
    } catch (e) {
      if (needsToken(e)) return;
      showError(e.message);
    }
    setTimeout(() => this.poll(), 3000);
  }

  renderRuns() {
    $("#runs-empty").hidden = this.runs.length > 0;
    fill($("#runs tbody"), ...this.runs.map((r) => h("tr", {class: "run", "data-id": r.id},
      h("td", null, h("input", {type: "checkbox", checked: this.picked.has(r.id), title: "compare", onchange: (e) => this.pick([r.id], e.target.checked)})),
      h("td", null, h("a", {href: runLink(r.id), text: r.name || r.id, title: r.path || r.id}),
        r.warnings ? h("span", {class: "warn-count", title: `${r.warnings} warnings`, text: ` ⚠ ${r.warnings}`}) : null,
        r.name !== r.id ? h("div", {class: "muted small-id", text: r.id}) : null),
      h("td", null, badge(r.status)),
      h("td", {class: "num"}, `${fmtInt(r.step)} / ${num(r.steps) == null ? "?" : fmtInt(r.steps)}`,
        num(r.steps) ? h("div", {class: "mini-progress"}, h("div", {style: `width:${Math.min(100, (100 * r.step) / r.steps)}%`})) : null),
      h("td", {class: "num", text: fmtLoss(r.loss)}),
      h("td", {class: "num", text: fmtRate(r.samples_per_s)}),
      h("td", {class: "num" + (r.failures ? " bad" : ""), text: fmtCell(r.failures)}),
      h("td", {class: "num", text: fmtCell(r.world_size) + (r.spares ? ` +${r.spares}` : "")}),
      h("td", {text: r.strategy || NA}),
      h("td", {class: "num", text: fmtDate(r.started)}))));
  }

  renderStudies(studies) {
    const names = new Map(this.runs.map((r) => [r.id, r.name || r.id]));
    fill($("#studies"), ...studies.map((s) => {
      const trials = s.trials || [];
      // Every CSV column, in first-seen order; params get one column each.
      const keys = [], params = [];
      for (const t of trials) {
        for (const k of Object.keys(t)) if (k !== "params" && k !== "run" && !keys.includes(k)) keys.push(k);
        for (const k of Object.keys(t.params || {})) if (!params.includes(k)) params.push(k);
      }
      const runIds = trials.map((t) => t.run).filter(Boolean);
      return h("section", {class: "card study", "data-id": s.id},
        h("div", {class: "card-head"}, h("h2", {text: "Study " + (s.name || s.id)}),
          s.metric && h("span", {class: "muted", text: "metric: " + s.metric}),
          h("span", {class: "muted", text: `${trials.length} trials`}),
          h("button", {type: "button", disabled: runIds.length === 0, onclick: () => { this.picked = new Set(runIds); this.renderRuns(); this.refreshCompare(); $("#compare-card").scrollIntoView({behavior: "smooth"}); }}, "compare all trials")),
        s.warning && h("div", {class: "banner warn", text: s.warning}),
        h("div", {class: "scroll"}, h("table", {class: "trials"},
          h("thead", null, h("tr", null, keys.map((k) => h("th", {text: k})), params.map((k) => h("th", {class: "param", title: "parameter", text: k})), h("th", {text: "run"}))),
          h("tbody", null, trials.map((t) => h("tr", null,
            keys.map((k) => h("td", {class: isNumeric(t[k]) ? "num" : "", title: String(t[k] ?? ""), text: fmtCell(t[k])})),
            params.map((k) => h("td", {class: "num param", text: fmtCell((t.params || {})[k])})),
            h("td", null, t.run ? h("a", {href: runLink(t.run), text: names.get(t.run) || t.run}) : NA)))))));
    }));
  }

  pick(ids, on) {
    for (const id of ids) on ? this.picked.add(id) : this.picked.delete(id);
    this.refreshCompare();
  }

  // Finished runs are fetched once; running ones again on each refresh so their curves grow.
  async refreshCompare() {
    const ids = [...this.picked];
    $("#compare-card").hidden = ids.length === 0;
    if (!ids.length) return;
    const status = new Map(this.runs.map((r) => [r.id, r.status]));
    await Promise.all(ids.map(async (id) => {
      const c = this.cache.get(id);
      if (c && c.status !== "running" && status.get(id) === c.status) return;
      try {
        const d = await getJSON("/api/run/" + encodeId(id));
        this.cache.set(id, {rows: d.rows || [], status: d.summary && d.summary.status, name: d.summary && d.summary.name});
      } catch (e) {
        if (!needsToken(e)) showError(`Run "${id}": ${e.message}`);
      }
    }));
    const shown = [...this.picked].filter((id) => this.cache.has(id));
    if (!shown.length) return;
    const tables = shown.map((id) => {
      const rows = this.cache.get(id).rows;
      return [rows.map((r) => r.step), rows.map((r) => num(r.loss))];
    });
    const data = tables.length === 1 ? tables[0] : uPlot.join(tables);
    this.chart.update({
      key: shown.join("\n"), data,
      opts: {axes: [stepAxis, yAxis("loss")], series: [{label: "step"}, ...shown.map((id, i) => ({
        label: this.cache.get(id).name || id, stroke: PALETTE[i % PALETTE.length], width: 1.5, spanGaps: true, value: (u, v) => fmtLoss(v)}))]},
    });
  }
}

// ---------------------------------------------------------------- start

function start() {
  const page = document.body.dataset.page;
  if (page === "runs") return new RunsPage().poll();
  const prefix = page === "mesh" ? "/mesh/" : "/run/";
  const id = runIdFromPath(prefix);
  const other = $("#other-link");
  if (other && id) other.href = page === "mesh" ? runLink(id) : meshLink(id);
  new RunSession(id, page === "mesh" ? new MeshView() : new JobView()).load();
}

if (typeof uPlot === "undefined") {
  document.addEventListener("DOMContentLoaded", () => showError("The chart library (/static/uPlot.iife.min.js) did not load."));
} else if (document.readyState === "loading") {
  document.addEventListener("DOMContentLoaded", start);
} else {
  start();
}
