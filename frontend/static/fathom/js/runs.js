// The runs list: search, tag, recipe, layout and status filters (kept in the URL, so a link
// reproduces the view), progress, loss sparkline, selection for the compare page; refreshed while open.

import { api, items } from "./api.js";
import { sparkline, formatNumber } from "./chart.js";
import { ago, every, h, pageData, statusBadge } from "./dom.js";

// The list is polled: runs change a few times a second at most and a list has no websocket.
const REFRESH_MS = 3000;
const FINISHED = new Set(["succeeded", "failed", "cancelled"]);

const body = document.getElementById("runs-body");
const empty = document.getElementById("runs-empty");
const error = document.getElementById("runs-error");
const boxes = [...document.querySelectorAll('#status-filter input[name="status"]')];
// The text filters, by their query parameter (the API's and the page URL's).
// (Project is offered only to someone with a project.)
const fields = Object.fromEntries(
  ["search", "tag", "recipe", "project", "layout"].map((name) => [name, document.querySelector(`#run-filters [name="${name}"]`)]).filter(([, input]) => input),
);
const compareButton = document.getElementById("compare-runs");
const compareHint = document.getElementById("compare-hint");
const curves = new Map(); // run id → [[step, loss], …]; finished runs' curves are fetched once
// Runs chosen for the compare page, in the order chosen; kept while the list refreshes or filters.
const selected = [];
const MAX_COMPARED = 8;
const me = pageData("me"); // runs of a project one is a member of name who launched them
// Typing in a filter waits this long for the next key before asking the API.
const TYPING_MS = 300;

function chosenStatuses() {
  return boxes.filter((b) => b.checked).map((b) => b.value);
}

/** The filters as query parameters, the same for the page's URL and the API. */
function filterParams() {
  const params = new URLSearchParams();
  for (const [name, input] of Object.entries(fields)) if (input.value.trim()) params.set(name, input.value.trim());
  const chosen = chosenStatuses();
  if (chosen.length) params.set("status", chosen.join(","));
  return params;
}

function readFilterFromUrl() {
  const params = new URLSearchParams(location.search);
  const wanted = new Set((params.get("status") || "").split(",").filter(Boolean));
  for (const box of boxes) box.checked = wanted.has(box.value);
  for (const [name, input] of Object.entries(fields)) input.value = params.get(name) || "";
}

function writeFilterToUrl() {
  const query = filterParams().toString();
  history.replaceState(null, "", `${location.pathname}${query ? `?${query}` : ""}`);
}

async function refresh() {
  const query = filterParams().toString();
  let runs;
  try {
    runs = items(await api(`/api/runs/${query ? `?${query}` : ""}`));
    error.hidden = true;
  } catch (exc) {
    error.textContent = exc.status === 400 ? `Filter not understood: ${exc.message}` : `Could not load runs: ${exc.message}`;
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
  const pick = h("input", {
    type: "checkbox",
    name: "compare",
    value: run.id,
    checked: selected.includes(run.id),
    "aria-label": `Select run #${run.id} to compare`,
    onchange: (event) => choose(run.id, event.target.checked),
  });
  const tags = run.tags.length
    ? h("span", { class: "tags run-tags" }, run.tags.map((tag) => h("button", { type: "button", class: "tag", title: `Show runs tagged ${tag}`, onclick: () => filterByTag(tag) }, tag)))
    : null;
  return h(
    "tr",
    { dataset: { runId: run.id, status: run.status } },
    h("td", { "data-label": "Compare", class: "select-cell" }, pick),
    h("td", { "data-label": "Run" }, h("a", { href: `/runs/${run.id}` }, run.name), h("span", { class: "muted id" }, ` #${run.id}`), run.owner !== me ? h("span", { class: "muted id" }, ` · ${run.owner}`) : null, tags),
    h("td", { "data-label": "Status" }, statusBadge(run.status)),
    h("td", { "data-label": "Layout", class: "num" }, run.layout),
    h("td", { "data-label": "Progress" }, progress),
    h("td", { "data-label": "Loss" }, h("div", { class: "loss-cell" }, spark, h("span", { class: "num" }, formatNumber(run.last_loss)))),
    h("td", { "data-label": "Tokens/s", class: "num" }, formatNumber(run.tokens_per_s)),
    h("td", { "data-label": "Restarts", class: run.restarts ? "num warn" : "num" }, String(run.restarts)),
    h("td", { "data-label": "Created" }, h("time", { datetime: run.created_at, title: run.created_at }, ago(run.created_at))),
  );
}

// --- Selection for the compare page -------------------------------------------------------------------

function choose(id, on) {
  const at = selected.indexOf(id);
  if (on && at < 0) selected.push(id);
  if (!on && at >= 0) selected.splice(at, 1);
  showSelection();
}

function showSelection() {
  const n = selected.length;
  compareButton.disabled = n < 2 || n > MAX_COMPARED;
  compareButton.textContent = n ? `Compare ${n}` : "Compare";
  compareHint.textContent =
    n > MAX_COMPARED ? `At most ${MAX_COMPARED} runs at once; ${n} are selected.` : n < 2 ? "Select 2 to 8 runs to compare them." : `Runs ${selected.map((id) => `#${id}`).join(", ")}.`;
}

compareButton.addEventListener("click", () => {
  location.assign(`/runs/compare/?ids=${selected.join(",")}`);
});

// --- Filters --------------------------------------------------------------------------------------------

function applyFilters() {
  writeFilterToUrl();
  refresh();
}

function filterByTag(tag) {
  fields.tag.value = tag;
  applyFilters();
}

let typing = null;
for (const input of Object.values(fields)) {
  input.addEventListener(input.tagName === "SELECT" ? "change" : "input", () => {
    clearTimeout(typing);
    typing = setTimeout(applyFilters, input.tagName === "SELECT" ? 0 : TYPING_MS);
  });
}
document.getElementById("run-filters").addEventListener("submit", (event) => {
  event.preventDefault();
  clearTimeout(typing);
  applyFilters();
});
for (const box of boxes) box.addEventListener("change", applyFilters);
document.getElementById("filter-clear").addEventListener("click", () => {
  for (const box of boxes) box.checked = false;
  for (const input of Object.values(fields)) input.value = "";
  applyFilters();
});

readFilterFromUrl();
showSelection();
refresh();
every(REFRESH_MS, refresh);
