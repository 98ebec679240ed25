// The dashboard page: polls /api/state at the sampler's interval and places what it says.
// Host text (names, errors, log lines) is only ever set as text (textContent), never parsed
// as markup; the plots come drawn and escaped by the server.
"use strict";

// ?window=7d picks the plots' window (a link keeps it); the select changes it.
const state = {
  window: new URLSearchParams(location.search).get("window"),
  log: null, interval: 2, timer: null, busy: false,
};

function el(tag, text, cls) {
  const node = document.createElement(tag);
  if (text !== undefined && text !== null) node.textContent = String(text);
  if (cls) node.className = cls;
  return node;
}

function stateCell(word, style) {
  const td = el("td");
  td.appendChild(el("span", word, "state s-" + (style || "red")));
  return td;
}

function unitCell(host, unit) {
  const td = el("td");
  const a = el("a", unit, "unit");
  a.href = "#log";
  a.dataset.host = host;
  a.dataset.unit = unit;
  a.addEventListener("click", (ev) => {
    ev.preventDefault();
    state.log = { host: host, unit: unit };
    document.getElementById("log-name").textContent = host + "/" + unit + " (loading…)";
    poll();
  });
  td.appendChild(a);
  return td;
}

function fill(id, rows, build) {
  const body = document.querySelector("#" + id + " tbody");
  const fresh = document.createElement("tbody");
  for (const row of rows) fresh.appendChild(build(row));
  if (!rows.length) {
    const tr = el("tr");
    const td = el("td", "none", "dim");
    td.colSpan = document.querySelectorAll("#" + id + " thead th").length;
    tr.appendChild(td);
    fresh.appendChild(tr);
  }
  body.replaceWith(fresh);
}

function hostRow(h) {
  const tr = el("tr");
  tr.dataset.host = h.host;
  tr.appendChild(el("td", h.host));
  tr.appendChild(stateCell(h.state, h.style));
  tr.appendChild(el("td", h.identity || "-"));
  tr.appendChild(el("td", h.up + "/" + h.units));
  tr.appendChild(el("td", h.error || "", "why"));
  return tr;
}

function serverRow(u) {
  const tr = el("tr");
  tr.dataset.host = u.host;
  tr.dataset.unit = u.unit;
  tr.appendChild(el("td", u.host));
  tr.appendChild(unitCell(u.host, u.unit));
  tr.appendChild(stateCell(u.state, u.style));
  for (const k of ["tok_s", "requests", "kv", "gpu", "gpu_mem"]) tr.appendChild(el("td", u[k], "num"));
  tr.appendChild(el("td", u.restarts, "num restarts"));
  tr.appendChild(el("td", u.last_exit, "why"));
  return tr;
}

function jobRow(j) {
  const tr = el("tr");
  tr.dataset.host = j.host;
  tr.dataset.unit = j.unit;
  tr.appendChild(el("td", j.host));
  tr.appendChild(unitCell(j.host, j.unit));
  tr.appendChild(stateCell(j.state, j.style));
  const td = el("td");
  const bar = el("progress");
  bar.max = 1;
  if (j.ratio !== null) bar.value = j.ratio;
  td.appendChild(bar);
  td.appendChild(el("span", " " + j.progress));
  tr.appendChild(td);
  for (const k of ["done", "rate", "eta", "failed"]) tr.appendChild(el("td", j[k], "num"));
  tr.appendChild(el("td", j.restarts, "num restarts"));
  tr.appendChild(el("td", j.last_exit, "why"));
  return tr;
}

function eventItem(e) {
  const li = el("li");
  const when = new Date(e.time * 1000).toISOString().slice(11, 19) + "Z";
  li.appendChild(el("time", when));
  li.appendChild(el("span", " " + e.host + (e.unit ? "/" + e.unit : "") + " ", "who"));
  li.appendChild(el("span", e.text, "what w-" + e.what));
  return li;
}

function place(doc) {
  state.interval = doc.interval;
  const select = document.getElementById("window");
  if (!select.options.length) {
    for (const w of doc.windows) select.appendChild(el("option", w));
    select.value = doc.window;
    select.addEventListener("change", () => { state.window = select.value; poll(); });
  }
  const f = doc.fleet;
  document.getElementById("summary").textContent =
    f.reached + "/" + f.hosts + " host(s) answering · " + f.ready + "/" + f.servers +
    " server(s) up · fleet " + f.tok_s + " tok/s";
  document.getElementById("updated").textContent =
    "updated " + new Date(doc.time * 1000).toISOString().slice(11, 19) + "Z, every " + doc.interval + "s";
  fill("hosts", doc.hosts, hostRow);
  fill("servers", doc.servers, serverRow);
  fill("jobs", doc.jobs, jobRow);
  const events = el("ol");
  events.id = "events";
  for (const e of doc.events) events.appendChild(eventItem(e));
  if (!doc.events.length) events.appendChild(el("li", "nothing happened yet", "dim"));
  document.getElementById("events").replaceWith(events);
  for (const name of ["fleet", "servers", "jobs", "gpu", "job-metrics"]) {
    // Drawn and escaped by the server (dashboard/plots.py).
    document.getElementById("plot-" + name + "-slot").innerHTML = doc.plots[name];
  }
  if (doc.log) {
    const log = doc.log;
    document.getElementById("log-name").textContent =
      log.host + "/" + log.unit + (log.text === null ? " (" + (log.error || "loading…") + ")" : "");
    document.getElementById("log").textContent = log.text === null ? "" : log.text;
  }
  document.body.dataset.samples = String(doc.samples);
  // When the page was first whole (ms after navigation): bench/bench_dashboard.py reads it.
  if (!document.body.dataset.placedAt) document.body.dataset.placedAt = String(performance.now());
}

async function poll() {
  if (state.busy) return;
  state.busy = true;
  clearTimeout(state.timer);
  try {
    const params = new URLSearchParams();
    if (state.window) params.set("window", state.window);
    if (state.log) { params.set("host", state.log.host); params.set("unit", state.log.unit); }
    const resp = await fetch("/api/state?" + params.toString(), { credentials: "same-origin", cache: "no-store" });
    if (!resp.ok) throw new Error("HTTP " + resp.status);
    place(await resp.json());
    document.body.classList.remove("stale");
  } catch (err) {
    document.body.classList.add("stale");
    document.getElementById("updated").textContent = "not updated: " + err.message;
  } finally {
    state.busy = false;
    state.timer = setTimeout(poll, Math.max(0.5, state.interval) * 1000);
  }
}

document.addEventListener("DOMContentLoaded", poll);
