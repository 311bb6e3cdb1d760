// The runs list: status filter (kept in the URL), progress, loss sparkline, refreshed while open.

import { api, items } from "./api.js";
import { sparkline, formatNumber } from "./chart.js";
import { ago, every, h, statusBadge } from "./dom.js";

// The list is polled: runs change a few times a second at most and a list has no websocket.
const REFRESH_MS = 3000;
const FINISHED = new Set(["succeeded", "failed", "cancelled"]);

const body = document.getElementById("runs-body");
const empty = document.getElementById("runs-empty");
const error = document.getElementById("runs-error");
const boxes = [...document.querySelectorAll('#status-filter input[name="status"]')];
const curves = new Map(); // run id → [[step, loss], …]; finished runs' curves are fetched once

function chosenStatuses() {
  return boxes.filter((b) => b.checked).map((b) => b.value);
}

function readFilterFromUrl() {
  const wanted = new Set((new URLSearchParams(location.search).get("status") || "").split(",").filter(Boolean));
  for (const box of boxes) box.checked = wanted.has(box.value);
}

function writeFilterToUrl() {
  const chosen = chosenStatuses();
  const url = new URL(location.href);
  if (chosen.length) url.searchParams.set("status", chosen.join(","));
  else url.searchParams.delete("status");
  history.replaceState(null, "", url);
}

async function refresh() {
  const chosen = chosenStatuses();
  const query = chosen.length ? `?status=${encodeURIComponent(chosen.join(","))}` : "";
  let runs;
  try {
    runs = items(await api(`/api/runs/${query}`));
    error.hidden = true;
  } catch (exc) {
    error.textContent = `Could not load runs: ${exc.message}`;
    error.hidden = false;
    return;
  }
  const stale = runs.filter((r) => !FINISHED.has(r.status) || !curves.has(r.id)).map((r) => r.id);
  if (stale.length) {
    try {
      const fresh = await api(`/dashboard/sparklines/?runs=${stale.join(",")}`);
      for (const [id, points] of Object.entries(fresh)) curves.set(Number(id), points);
    } catch {
      // Sparklines are decoration; the table is still right without them.
    }
  }
  render(runs);
}

function render(runs) {
  body.replaceChildren(...runs.map(row));
  empty.hidden = runs.length > 0;
}

function row(run) {
  const total = run.total_steps || 0;
  const progress = h(
    "div",
    { class: "progress-cell" },
    h("progress", { max: total || 1, value: Math.min(run.step, total || 1), "aria-label": `${run.name} progress` }),
    h("span", { class: "num" }, `${run.step}/${total}`),
  );
  const spark = h("span", { class: "spark-wrap" });
  spark.innerHTML = sparkline(curves.get(run.id)); // built from numbers only
  return h(
    "tr",
    { dataset: { runId: run.id, status: run.status } },
    h("td", { "data-label": "Run" }, h("a", { href: `/runs/${run.id}` }, run.name), h("span", { class: "muted id" }, ` #${run.id}`)),
    h("td", { "data-label": "Status" }, statusBadge(run.status)),
    h("td", { "data-label": "Layout", class: "num" }, run.layout),
    h("td", { "data-label": "Progress" }, progress),
    h("td", { "data-label": "Loss" }, h("div", { class: "loss-cell" }, spark, h("span", { class: "num" }, formatNumber(run.last_loss)))),
    h("td", { "data-label": "Tokens/s", class: "num" }, formatNumber(run.tokens_per_s)),
    h("td", { "data-label": "Restarts", class: run.restarts ? "num warn" : "num" }, String(run.restarts)),
    h("td", { "data-label": "Created" }, h("time", { datetime: run.created_at, title: run.created_at }, ago(run.created_at))),
  );
}

for (const box of boxes) {
  box.addEventListener("change", () => {
    writeFilterToUrl();
    refresh();
  });
}
document.getElementById("filter-clear").addEventListener("click", () => {
  for (const box of boxes) box.checked = false;
  writeFilterToUrl();
  refresh();
});

readFilterFromUrl();
refresh();
every(REFRESH_MS, refresh);
