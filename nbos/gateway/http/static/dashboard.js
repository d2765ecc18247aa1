// The nbos dashboard: plain JavaScript, no library, no build step.
//
// The token lives in this tab's sessionStorage and goes out only as an Authorization
// header to this gateway. The feed (/dashboard/api/feed) is read as a stream of
// server-sent events through fetch, so that the header can be sent (EventSource
// cannot); it is opened again after a break. Every value from the gateway is put
// into the page as text (textContent), never as HTML.
"use strict";

const TOKEN_KEY = "nbos-dashboard-token";
const RETRY_MS = 2000;
const SVG = "http://www.w3.org/2000/svg";

const state = { samples: [], events: [], board: null, user: null, abort: null };

const $ = (id) => document.getElementById(id);

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attrs || {})) {
    if (name === "class") node.className = value;
    else node.setAttribute(name, value);
  }
  for (const child of children) {
    node.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return node;
}

function duration(seconds) {
  if (seconds == null) return "-";
  if (seconds < 1) return `${Math.round(seconds * 1000)} ms`;
  if (seconds < 60) return `${seconds.toFixed(1)} s`;
  if (seconds < 3600) return `${Math.floor(seconds / 60)} min ${Math.round(seconds % 60)} s`;
  return `${Math.floor(seconds / 3600)} h ${Math.round((seconds % 3600) / 60)} min`;
}

function clock(t) {
  return new Date(t * 1000).toLocaleTimeString();
}

// --- signing in -------------------------------------------------------------------

function showLogin(message) {
  $("board").hidden = true;
  $("signout").hidden = true;
  $("who").textContent = "";
  $("login").hidden = false;
  $("login-error").textContent = message || "";
  $("token").focus();
}

$("login").addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(TOKEN_KEY, $("token").value.trim());
  $("token").value = "";
  connect();
});

$("signout").addEventListener("click", () => {
  sessionStorage.removeItem(TOKEN_KEY);
  if (state.abort) state.abort.abort();
  showLogin("");
});

// --- the feed ---------------------------------------------------------------------

function setLive(live) {
  $("live").textContent = live ? "live" : "reconnecting";
  $("live").classList.toggle("off", !live);
}

async function connect() {
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (!token) return showLogin("");
  if (state.abort) state.abort.abort();
  const abort = (state.abort = new AbortController());
  let response;
  try {
    response = await fetch("api/feed", {
      headers: { Authorization: `token ${token}` },
      cache: "no-store",
      signal: abort.signal,
    });
  } catch (error) {
    return retry(abort);
  }
  if (response.status === 401 || response.status === 403) {
    sessionStorage.removeItem(TOKEN_KEY);
    return showLogin(response.status === 403 ? "That token is not known here." : "A token is required.");
  }
  if (!response.ok || !response.body) return retry(abort);
  $("login").hidden = true;
  $("board").hidden = false;
  $("signout").hidden = false;
  setLive(true);
  try {
    await read(response.body.getReader());
  } catch (error) {
    // the connection broke: open it again below
  }
  retry(abort);
}

function retry(abort) {
  if (abort.signal.aborted) return;
  setLive(false);
  setTimeout(() => { if (state.abort === abort) connect(); }, RETRY_MS);
}

async function read(reader) {
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let end;
    while ((end = buffer.indexOf("\n\n")) >= 0) {
      const block = buffer.slice(0, end);
      buffer = buffer.slice(end + 2);
      let kind = "message", data = "";
      for (const line of block.split("\n")) {
        if (line.startsWith("event: ")) kind = line.slice(7);
        else if (line.startsWith("data: ")) data += line.slice(6);
      }
      if (data) receive(kind, JSON.parse(data));
    }
  }
}

const MAX_SAMPLES = 4320;
const MAX_EVENTS = 1000;

function receive(kind, data) {
  if (kind === "hello") {
    state.user = data.user;
    state.samples = data.samples;
    state.events = data.events;
    $("who").textContent = `${data.user.name} (${data.user.role})`;
    drawBoard(data.board);
    drawEvents();
    drawCharts();
  } else if (kind === "board") {
    drawBoard(data);
  } else if (kind === "events") {
    state.events = state.events.concat(data).slice(-MAX_EVENTS);
    drawEvents();
  } else if (kind === "samples") {
    state.samples = state.samples.concat(data).slice(-MAX_SAMPLES);
    drawCharts();
  }
}

// --- hosts and kernels ------------------------------------------------------------

function drawBoard(board) {
  state.board = board;
  const hosts = board.hosts.map(drawHost);
  $("hosts").replaceChildren(...(hosts.length ? hosts : [el("p", { class: "empty" }, "no host yet")]));
  const up = board.hosts.filter((h) => h.state === "up").length;
  const gpus = board.hosts.reduce((n, h) => n + h.gpus.length, 0);
  $("hosts-summary").textContent = `${up} up of ${board.hosts.length}, ${gpus} GPUs`;
  const rows = board.kernels.map(drawKernel);
  $("kernels").tBodies[0].replaceChildren(
    ...(rows.length ? rows : [el("tr", {}, el("td", { colspan: 7, class: "empty" }, "no kernel"))]));
  $("kernels-summary").textContent = `${board.kernels.length} kernels, ${board.waiting} cells waiting`;
}

function drawHost(host) {
  const ratio = host.ratio == null ? "-" : `${host.ratio.toFixed(2)}×`;
  const gpus = host.gpus.map((gpu) => {
    const owner = gpu.kernel ? ` for kernel ${gpu.kernel}${gpu.user ? ` (${gpu.user})` : ""}` : "";
    return el("span", {
      class: `gpu ${gpu.state}`,
      title: `GPU ${gpu.device}: ${gpu.state}${owner}`,
      "data-state": gpu.state,
      "data-kernel": gpu.kernel,
    }, gpu.kernel ? gpu.kernel.slice(0, 4) : String(gpu.device));
  });
  return el("div", { class: `host ${host.state}`, "data-host": host.id },
    el("div", {}, el("span", { class: "name" }, host.id), " ",
      el("span", { class: `badge ${host.state}` }, host.state)),
    el("div", { class: "meta" }, host.address),
    el("div", { class: "meta" },
      `subscribed ${host.subscribed} GPUs on ${host.gpus.length} (${ratio}), ${host.replicas} replicas`),
    el("div", { class: "gpus" }, ...gpus));
}

function drawKernel(kernel) {
  const replicas = kernel.replicas.map((r) =>
    el("span", { class: `replica ${r.role}${r.alive ? "" : " dead"}`, "data-role": r.role },
      `${r.node}@${r.host} ${r.role}`));
  let cell = "-";
  const last = kernel.last_cell;
  if (last) {
    cell = last.waiting
      ? `#${last.index} waiting ${duration(last.wait_s)}`
      : `#${last.index} waited ${duration(last.wait_s)}`;
  }
  return el("tr", { "data-kernel": kernel.id, "data-state": kernel.state },
    el("td", { class: "id", title: `nbos kernel ${kernel.nbos_id}` }, kernel.id),
    el("td", { class: "user" }, kernel.user || "-"),
    el("td", { class: "state" }, el("span", { class: `badge ${kernel.state}` }, kernel.state)),
    el("td", {}, kernel.gpus),
    el("td", {}, duration(kernel.age_s)),
    el("td", {}, ...(kernel.waiting ? [el("span", { class: "waiting" }, kernel.waiting)] : replicas)),
    el("td", { class: "cell" }, cell));
}

// --- events -----------------------------------------------------------------------

function drawEvents() {
  const items = state.events.slice().reverse().map((e) =>
    el("li", { "data-kind": e.kind, "data-kernel": e.kernel, "data-host": e.host },
      el("time", {}, clock(e.time)),
      el("span", { class: `badge kind ${e.kind}` }, e.kind),
      e.text));
  $("events").replaceChildren(...(items.length ? items : [el("li", { class: "empty" }, "nothing yet")]));
}

// --- time series ------------------------------------------------------------------

function drawCharts() {
  const s = state.samples;
  chart($("chart-gpus"), s, [(x) => x.gpus_provisioned, (x) => x.gpus_committed, (x) => x.gpus_busy]);
  chart($("chart-hosts"), s, [(x) => x.hosts]);
  chart($("chart-waiting"), s, [(x) => x.cells_waiting]);
  chart($("chart-wait"), s, [(x) => x.wait_p50, (x) => x.wait_p95, (x) => x.wait_p99]);
}

function chart(svg, samples, series) {
  const width = svg.clientWidth || 400, height = svg.clientHeight || 120;
  const left = 34, bottom = 16, top = 6;
  svg.setAttribute("viewBox", `0 0 ${width} ${height}`);
  const nodes = [];
  const line = (x1, y1, x2, y2) => svgEl("line", { x1, y1, x2, y2, class: "axis" });
  nodes.push(line(left, top, left, height - bottom), line(left, height - bottom, width, height - bottom));
  if (samples.length) {
    const t0 = samples[0].t, t1 = Math.max(samples[samples.length - 1].t, t0 + 1);
    let top_value = 1;
    for (const value of series) for (const x of samples) top_value = Math.max(top_value, value(x) || 0);
    const px = (t) => left + ((t - t0) / (t1 - t0)) * (width - left - 2);
    const py = (v) => height - bottom - (v / top_value) * (height - bottom - top);
    series.forEach((value, i) => {
      const points = samples.filter((x) => value(x) != null).map((x) => `${px(x.t).toFixed(1)},${py(value(x)).toFixed(1)}`);
      if (points.length) nodes.push(svgEl("polyline", { points: points.join(" "), class: `s${i}` }));
    });
    nodes.push(svgText(2, top + 8, fmt(top_value)), svgText(2, height - bottom, "0"),
      svgText(left, height - 3, clock(t0)), svgText(width - 60, height - 3, clock(t1)));
  } else {
    nodes.push(svgText(left + 8, height / 2, "no sample yet"));
  }
  svg.replaceChildren(...nodes);
}

function fmt(v) {
  return Number.isInteger(v) ? String(v) : v.toFixed(2);
}

function svgEl(tag, attrs) {
  const node = document.createElementNS(SVG, tag);
  for (const [name, value] of Object.entries(attrs)) node.setAttribute(name, value);
  return node;
}

function svgText(x, y, text) {
  const node = svgEl("text", { x, y });
  node.textContent = text;
  return node;
}

window.addEventListener("resize", drawCharts);
connect();
