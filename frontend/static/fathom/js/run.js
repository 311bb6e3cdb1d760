// The run page: history then live events over the run's websocket (resuming after the last
// seq held across reconnects), curves, rank health, timeline, checkpoints, log, and actions.

import { api } from "./api.js";
import { LineChart, formatNumber } from "./chart.js";
import { every, pageData } from "./dom.js";
import { LiveEvents } from "./live.js";
import { RankGrid } from "./ranks.js";
import { Checkpoints, LogTail } from "./run_panels.js";
import { Timeline } from "./timeline.js";

// How often the log tail is read while the run is active.
const LOG_REFRESH_MS = 3000;
const ACTIVE = new Set(["queued", "starting", "running", "restarting"]);
// Events after which the run's row (status, reason, restarts) is read again.
const STATUS_KINDS = new Set([
  "queued", "status", "agent_started", "resumed", "restarting", "succeeded", "failed", "cancelled", "cancel_requested",
]);

const run = pageData("run-data");
const $ = (id) => document.getElementById(id);

const charts = {
  loss: new LineChart($("chart-loss"), { series: ["loss"] }),
  lr: new LineChart($("chart-lr"), { series: ["lr"] }),
  tps: new LineChart($("chart-tps"), { series: ["tokens/s"], yRange: (u, min, max) => [0, Math.max(max, 1) * 1.1] }),
  mfu: new LineChart($("chart-mfu"), { series: ["MFU %"], yRange: (u, min, max) => [0, Math.max(max, 0.01) * 1.1] }),
};
const grid = new RankGrid($("rank-grid"), run.layout);
const timeline = new Timeline($("timeline"));
const checkpoints = new Checkpoints(run.id, $("checkpoint-rows"), $("checkpoints-empty"), { seqLen: run.seq_len });
const logTail = new LogTail(run.id, $("log-tail"), $("log-rank"));
logTail.setWorldSize(grid.ranks.length);

let status = run.status;
let step = 0;
const markers = []; // restarts and checkpoints drawn on the loss curve

// --- Events ------------------------------------------------------------------------------------

function onEvents(events) {
  let gridChanged = false;
  let statusChanged = false;
  for (const e of events) {
    if (e.kind === "metrics") {
      step = Math.max(step, e.step);
      charts.loss.put(e.step, [e.loss]);
      charts.lr.put(e.step, [e.lr]);
      charts.tps.put(e.step, [e.tokens_per_s]);
      charts.mfu.put(e.step, [e.mfu == null ? null : e.mfu * 100]);
      showMetrics(e);
    } else if (e.kind === "checkpoint") {
      markers.push({ x: e.step, color: "#2e7d32" });
      checkpoints.refreshSoon();
    } else if (e.kind === "exported") {
      checkpoints.refreshSoon();
    } else if (e.kind === "restarting") {
      markers.push({ x: step, color: "#d1242f" });
    }
    if (e.kind === "rendezvous") logTail.setWorldSize(e.world_size ?? grid.ranks.length);
    gridChanged = grid.apply(e) || gridChanged;
    statusChanged = statusChanged || STATUS_KINDS.has(e.kind);
  }
  if (events.some((e) => e.kind === "checkpoint" || e.kind === "restarting")) charts.loss.setMarkers([...markers]);
  if (gridChanged) grid.render();
  timeline.add(events);
  if (statusChanged) refreshRunSoon();
}

function showMetrics(e) {
  $("stat-step").textContent = String(step);
  $("stat-progress").value = step;
  $("stat-loss").textContent = formatNumber(e.loss);
  $("stat-tps").textContent = formatNumber(e.tokens_per_s);
  $("stat-mfu").textContent = e.mfu == null ? "–" : `${formatNumber(e.mfu * 100)} %`;
  $("stat-step-time").textContent = e.step_time == null ? "–" : `${formatNumber(e.step_time)} s`;
  $("stat-memory").textContent = e.memory_mb == null ? "–" : `${formatNumber(e.memory_mb)} MB`;
}

// --- The run's row: status and actions -------------------------------------------------------------

let runTimer = null;
function refreshRunSoon() {
  clearTimeout(runTimer);
  runTimer = setTimeout(() => refreshRun().catch(showActionError), 250);
}

async function refreshRun() {
  showRun(await api(`/api/runs/${run.id}/`));
}

function showRun(row) {
  const wasActive = ACTIVE.has(status);
  status = row.status;
  const badge = $("run-status");
  badge.textContent = status;
  badge.className = `badge status-${status}`;
  badge.dataset.status = status;
  const reason = $("run-reason");
  reason.textContent = row.status_reason;
  reason.hidden = !row.status_reason;
  $("stat-restarts").textContent = String(row.restarts);
  if (row.step > step) {
    step = row.step;
    $("stat-step").textContent = String(step);
    $("stat-progress").value = step;
  }
  $("cancel-run").hidden = !ACTIVE.has(status) || row.cancel_requested;
  $("resume-run").hidden = !(status === "failed" || status === "cancelled");
  if (wasActive && !ACTIVE.has(status)) {
    // One last read of the log and checkpoints: the final lines land as the run stops.
    logTail.refresh().catch(() => {});
    checkpoints.refreshSoon();
  }
}

function showActionError(exc) {
  const box = $("action-error");
  box.textContent = exc ? exc.message : "";
  box.hidden = !exc;
}

function action(button, path, after) {
  button.addEventListener("click", async () => {
    button.disabled = true;
    showActionError(null);
    try {
      after(await api(`/api/runs/${run.id}/${path}/`, { method: "POST", json: {} }));
    } catch (exc) {
      showActionError(exc);
    } finally {
      button.disabled = false;
    }
  });
}

action($("cancel-run"), "cancel", showRun);
action($("resume-run"), "resume", showRun);
action($("clone-run"), "clone", (clone) => location.assign(`/runs/${clone.id}`));

// --- Start -------------------------------------------------------------------------------------

function showLiveState(state) {
  const el = $("live-state");
  el.dataset.state = state;
  el.textContent = { connecting: "connecting…", live: "live", reconnecting: "reconnecting…", closed: "not live" }[state];
}

new LiveEvents(`/ws/runs/${run.id}/`, onEvents, { onState: showLiveState }).start();
grid.render();
refreshRun().catch(showActionError);
checkpoints.refresh().catch(() => {});
logTail.refresh().catch(() => {});
every(LOG_REFRESH_MS, async () => {
  if (ACTIVE.has(status)) await logTail.refresh();
});
