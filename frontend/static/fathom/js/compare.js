// The compare page: 2 to 8 runs' curves overlaid (one chart per metric, a colour per run), their
// final and best figures, and the spec fields that differ. Runs still training keep updating
// over their own run websockets, from the last seq the comparison was read at.

import { api } from "./api.js";
import { LineChart, PALETTE, formatNumber } from "./chart.js";
import { h, pageData, statusBadge } from "./dom.js";
import { LiveEvents } from "./live.js";

const ACTIVE = new Set(["queued", "starting", "running", "restarting"]);
// Which event kind carries each metric (as runs.compare.METRICS), and whether more is better.
const METRICS = { loss: "metrics", eval_loss: "eval", tokens_per_s: "metrics", mfu: "metrics" };
const HIGHER_IS_BETTER = new Set(["tokens_per_s", "mfu"]);
const LABELS = { loss: "loss", eval_loss: "eval loss", tokens_per_s: "tokens/s", mfu: "MFU" };

const $ = (id) => document.getElementById(id);
const ids = pageData("compare-ids");
const params = new URLSearchParams(location.search);
const specAll = $("spec-all");
specAll.checked = ["1", "true"].includes(params.get("all") || "");

let runs = []; // as the API answered, in the order asked
let curves = []; // per run: metric → Map(step → value)
let charts = {};
const sockets = [];

function label(run) {
  return `${run.name} #${run.id}`;
}

/** MFU is a fraction in events and the API; the chart and table show percent. */
function shown(metric, value) {
  return metric === "mfu" && value != null ? value * 100 : value;
}

function showError(exc) {
  const box = $("compare-error");
  box.textContent = exc ? `Could not load the comparison: ${exc.message}` : "";
  box.hidden = !exc;
}

// --- Legend ----------------------------------------------------------------------------------------

function renderLegend() {
  $("compare-legend").replaceChildren(
    ...runs.map((run, i) =>
      h(
        "li",
        { dataset: { runId: run.id }, style: `--run-colour: ${PALETTE[i % PALETTE.length]}` },
        h("span", { class: "swatch", "aria-hidden": "true" }),
        h("a", { href: `/runs/${run.id}` }, run.name),
        h("span", { class: "muted id" }, ` #${run.id}`),
        statusBadge(run.status),
        h("span", { class: "muted" }, `${run.layout}${run.recipe ? ` · ${run.recipe}` : ""}`),
        run.tags.length ? h("span", { class: "tags" }, run.tags.map((t) => h("span", { class: "tag" }, t))) : null,
      ),
    ),
  );
}

// --- Charts -----------------------------------------------------------------------------------------

function buildCharts() {
  const names = runs.map(label);
  const fromZero = (u, min, max) => [0, Math.max(max, 1e-6) * 1.1];
  charts = {
    loss: new LineChart($("chart-loss"), { series: names, yLabel: "nats/token", smoothable: true, syncKey: "compare" }),
    eval_loss: new LineChart($("chart-eval_loss"), { series: names, yLabel: "nats/token", smoothable: true, syncKey: "compare" }),
    tokens_per_s: new LineChart($("chart-tokens_per_s"), { series: names, yLabel: "tokens/s", yRange: fromZero, smoothable: true, syncKey: "compare" }),
    mfu: new LineChart($("chart-mfu"), { series: names, yLabel: "% of peak FLOPs", yRange: fromZero, smoothable: true, syncKey: "compare" }),
  };
  runs.forEach((run, i) => {
    for (const metric of Object.keys(METRICS)) {
      for (const [step, value] of run.series[metric]) charts[metric].putAt(step, i, shown(metric, value));
    }
  });
}

$("smoothing").addEventListener("input", (event) => {
  const weight = Number(event.target.value);
  $("smoothing-value").textContent = weight > 0 ? weight.toFixed(2) : "off";
  for (const chart of Object.values(charts)) chart.setSmoothing(weight);
});
$("log-scale").addEventListener("change", (event) => {
  for (const chart of Object.values(charts)) chart.setLogScale(event.target.checked);
});

// --- Final and best -----------------------------------------------------------------------------------

/** The value at the last step, and the best with the first step that reached it (as the API). */
function figures(points, metric) {
  if (!points.size) return { final: null, best: null };
  const steps = [...points.keys()].sort((a, b) => a - b);
  const last = steps[steps.length - 1];
  let best = steps[0];
  for (const step of steps) {
    const better = HIGHER_IS_BETTER.has(metric) ? points.get(step) > points.get(best) : points.get(step) < points.get(best);
    if (better) best = step;
  }
  return { final: { step: last, value: points.get(last) }, best: { step: best, value: points.get(best) } };
}

function figureCell(metric, figure) {
  if (!figure) return h("td", { class: "num muted" }, "–");
  const unit = metric === "mfu" ? " %" : "";
  return h("td", { class: "num" }, `${formatNumber(shown(metric, figure.value))}${unit}`, h("span", { class: "muted step" }, ` @ ${figure.step}`));
}

function renderFigures() {
  const head = h("thead", {}, h("tr", {}, h("th", { scope: "col" }, "Figure"), runs.map((run, i) => runHeader(run, i))));
  const rows = [];
  const computed = curves.map((byMetric) => Object.fromEntries(Object.keys(METRICS).map((m) => [m, figures(byMetric[m], m)])));
  for (const metric of Object.keys(METRICS)) {
    for (const which of ["final", "best"]) {
      rows.push(
        h(
          "tr",
          { dataset: { figure: `${which}.${metric}` } },
          h("th", { scope: "row" }, `${which === "final" ? "Final" : "Best"} ${LABELS[metric]}`),
          computed.map((c) => figureCell(metric, c[metric][which])),
        ),
      );
    }
  }
  // The run's row counts steps as its agents report them; the curves may hold a later one.
  const lastStep = (i) => Math.max(runs[i].step, ...curves[i].loss.keys());
  rows.push(h("tr", { dataset: { figure: "steps" } }, h("th", { scope: "row" }, "Steps"), runs.map((run, i) => h("td", { class: "num" }, `${lastStep(i)}/${run.total_steps}`))));
  // Where each run's time went, as the API read it (the run page keeps it current).
  const share = (g) => (g?.goodput == null ? "–" : `${(g.goodput * 100).toFixed(1)} % of ${g.wall_s.toFixed(0)} s`);
  rows.push(h("tr", { dataset: { figure: "goodput" } }, h("th", { scope: "row" }, "Goodput"), runs.map((run) => h("td", { class: "num" }, share(run.goodput)))));
  $("figures").replaceChildren(head, h("tbody", {}, rows));
}

function runHeader(run, i) {
  return h("th", { scope: "col", style: `--run-colour: ${PALETTE[i % PALETTE.length]}` }, h("span", { class: "swatch", "aria-hidden": "true" }), label(run));
}

// --- Spec diff ------------------------------------------------------------------------------------------

function specValue(value) {
  if (value === null || value === undefined) return h("span", { class: "muted" }, "–");
  return typeof value === "string" ? value : JSON.stringify(value);
}

function renderSpec(fields, allFields) {
  const head = h("thead", {}, h("tr", {}, h("th", { scope: "col" }, "Field"), runs.map((run, i) => runHeader(run, i))));
  const rows = fields.map((row) =>
    h(
      "tr",
      { dataset: { field: row.field, differs: String(row.differs) }, class: row.differs && allFields ? "differs" : null },
      h("th", { scope: "row" }, h("code", {}, row.field)),
      row.values.map((v) => h("td", { class: "spec-value" }, specValue(v))),
    ),
  );
  const differing = fields.filter((row) => row.differs).length;
  $("spec-summary").textContent = allFields
    ? `All ${fields.length} fields; the ${differing} that differ are highlighted.`
    : differing
      ? `The ${differing} field${differing === 1 ? "" : "s"} whose values differ across these runs.`
      : "These runs' specs are the same.";
  $("spec-diff").replaceChildren(head, h("tbody", {}, rows));
}

specAll.addEventListener("change", async () => {
  const url = new URL(location.href);
  if (specAll.checked) url.searchParams.set("all", "1");
  else url.searchParams.delete("all");
  history.replaceState(null, "", url);
  try {
    const body = await api(`/api/runs/compare/?ids=${ids.join(",")}&all=${specAll.checked ? 1 : 0}`);
    renderSpec(body.spec, body.all_fields);
    showError(null);
  } catch (exc) {
    showError(exc);
  }
});

// --- Live -------------------------------------------------------------------------------------------------

let figuresTimer = null;
function renderFiguresSoon() {
  clearTimeout(figuresTimer);
  figuresTimer = setTimeout(renderFigures, 250);
}

function onRunEvents(index, events) {
  const run = runs[index];
  for (const e of events) {
    for (const [metric, kind] of Object.entries(METRICS)) {
      if (e.kind === kind && typeof e.step === "number" && typeof e[metric] === "number") {
        curves[index][metric].set(e.step, e[metric]);
        charts[metric].putAt(e.step, index, shown(metric, e[metric]));
      }
    }
    if (e.kind === "metrics" && typeof e.step === "number") run.step = Math.max(run.step, e.step);
    if (e.kind === "status" || e.kind === "queued") {
      run.status = e.status ?? "queued";
      renderLegend();
    }
  }
  renderFiguresSoon();
}

function showLiveState() {
  const el = $("live-state");
  const states = sockets.map((s) => s.state);
  el.hidden = sockets.length === 0;
  const state = states.includes("reconnecting") ? "reconnecting" : states.every((s) => s === "live") ? "live" : "connecting";
  el.dataset.state = state;
  el.textContent = { live: `live (${sockets.length} running)`, connecting: "connecting…", reconnecting: "reconnecting…" }[state];
}

function startLive() {
  runs.forEach((run, index) => {
    if (!ACTIVE.has(run.status)) return;
    const entry = { state: "connecting" };
    const live = new LiveEvents(`/ws/runs/${run.id}/`, (events) => onRunEvents(index, events), {
      onState: (state) => {
        // LiveEvents says "reconnecting" for any connect after a seq it holds; the first one
        // (from the comparison's last_seq) is a first connection.
        entry.opened ||= state === "live";
        entry.state = state === "reconnecting" && !entry.opened ? "connecting" : state;
        showLiveState();
      },
    });
    live.lastSeq = run.last_seq; // the comparison holds every event up to here
    entry.live = live;
    sockets.push(entry);
    live.start();
  });
  showLiveState();
}

// --- Start ---------------------------------------------------------------------------------------------------

async function start() {
  let body;
  try {
    body = await api(`/api/runs/compare/?ids=${ids.join(",")}&all=${specAll.checked ? 1 : 0}`);
  } catch (exc) {
    showError(exc);
    return;
  }
  runs = body.runs;
  curves = runs.map((run) => Object.fromEntries(Object.keys(METRICS).map((m) => [m, new Map(run.series[m])])));
  renderLegend();
  buildCharts();
  renderFigures();
  renderSpec(body.spec, body.all_fields);
  startLive();
}

start();
