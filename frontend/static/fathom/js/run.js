// The run page: history then live events over the run's websocket (resuming after the last
// seq held across reconnects), curves, rank health, timeline, checkpoints, log, and actions.

import { api, flattenErrors } from "./api.js";
import { LineChart, formatNumber } from "./chart.js";
import { every, h, pageData } from "./dom.js";
import { LiveEvents } from "./live.js";
import { RankGrid } from "./ranks.js";
import { Checkpoints, Goodput, LogTail, formatBytes } from "./run_panels.js";
import { Timeline } from "./timeline.js";

// How often the log tail is read while the run is active.
const LOG_REFRESH_MS = 3000;
const ACTIVE = new Set(["queued", "starting", "running", "restarting"]);
// Events after which the run's row (reason, restarts, cancel flag) is read again (`waiting`: the
// reason a queued run waits, the scheduler's or Slurm's, changed). The status
// itself comes from the control plane's `status` and `queued` events, which the run's row
// agrees with once they are committed.
const ROW_KINDS = new Set(["queued", "status", "restarting", "cancel_requested", "waiting"]);

const run = pageData("run-data");
const $ = (id) => document.getElementById(id);

const charts = {
  loss: new LineChart($("chart-loss"), { series: ["loss", "eval loss"], yLabel: "nats/token", smoothable: true, syncKey: `run-${run.id}` }),
  lr: new LineChart($("chart-lr"), { series: ["lr"], yLabel: "learning rate", syncKey: `run-${run.id}` }),
  tps: new LineChart($("chart-tps"), { series: ["tokens/s"], yLabel: "tokens/s", yRange: (u, min, max) => [0, Math.max(max, 1) * 1.1], syncKey: `run-${run.id}` }),
  mfu: new LineChart($("chart-mfu"), { series: ["MFU %"], yLabel: "% of peak FLOPs", yRange: (u, min, max) => [0, Math.max(max, 0.01) * 1.1], syncKey: `run-${run.id}` }),
};
$("loss-smoothing").addEventListener("input", (event) => {
  const weight = Number(event.target.value);
  $("loss-smoothing-value").textContent = weight > 0 ? weight.toFixed(2) : "off";
  charts.loss.setSmoothing(weight);
});
$("loss-log").addEventListener("change", (event) => charts.loss.setLogScale(event.target.checked));
const grid = new RankGrid($("rank-grid"), run.layout);
const timeline = new Timeline($("timeline"));
const goodput = new Goodput(run.id, { bar: $("goodput-bar"), rows: $("goodput-rows"), share: $("goodput-share") });
const checkpoints = new Checkpoints(run.id, $("checkpoint-rows"), $("checkpoints-empty"), { seqLen: run.seq_len, onDeploy: openDeploy });
const logTail = new LogTail(run.id, $("log-tail"), $("log-rank"));
logTail.setWorldSize(grid.worldSize);

let status = run.status;
let statusSeq = 0; // the seq of the event that set `status`: an older read of the row must not undo it
let cancelRequested = false;
const silent = new Map(); // node agent → seconds it had been silent when the control plane noticed
let step = 0;
const markers = []; // restarts and checkpoints drawn on the loss curve
// The loss chart's two series by step: a point holds both, and each event brings one of them.
const trainLoss = new Map();
const evalLoss = new Map();

// --- Events ------------------------------------------------------------------------------------

function onEvents(events) {
  let gridChanged = false;
  let rowChanged = false;
  let checkpointsChanged = false;
  let silenceChanged = false;
  for (const e of events) {
    if (e.kind === "metrics") {
      step = Math.max(step, e.step);
      trainLoss.set(e.step, e.loss);
      charts.loss.put(e.step, [e.loss, evalLoss.get(e.step)]);
      charts.lr.put(e.step, [e.lr]);
      charts.tps.put(e.step, [e.tokens_per_s]);
      charts.mfu.put(e.step, [e.mfu == null ? null : e.mfu * 100]);
      showMetrics(e);
    } else if (e.kind === "eval") {
      evalLoss.set(e.step, e.eval_loss);
      charts.loss.put(e.step, [trainLoss.get(e.step), e.eval_loss]);
      $("stat-eval-loss").textContent = formatNumber(e.eval_loss);
      $("chart-loss").dataset.evalPoints = String(evalLoss.size);
    } else if (e.kind === "checkpoint") {
      markers.push({ x: e.step, color: "#2e7d32" });
    } else if (e.kind === "restarting") {
      markers.push({ x: step, color: "#d1242f" });
    } else if ((e.kind === "status" || e.kind === "queued") && e.seq > statusSeq) {
      statusSeq = e.seq;
      showStatus(e.status ?? "queued");
    } else if (e.kind === "node_silent") {
      silent.set(e.node, e.silent_s);
      silenceChanged = true;
    } else if (e.kind === "node_reporting") {
      silenceChanged = silent.delete(e.node) || silenceChanged;
    }
    checkpointsChanged = checkpoints.apply(e) || checkpointsChanged;
    gridChanged = grid.apply(e) || gridChanged;
    if (e.kind === "rendezvous") {
      logTail.setWorldSize(e.world_size ?? grid.worldSize);
      $("stat-layout").textContent = grid.layoutLabel();
    }
    rowChanged = rowChanged || ROW_KINDS.has(e.kind);
  }
  if (events.some((e) => e.kind === "checkpoint" || e.kind === "restarting")) charts.loss.setMarkers([...markers]);
  if (gridChanged) grid.render();
  if (checkpointsChanged) checkpoints.render();
  if (silenceChanged) showSilence();
  timeline.add(events);
  if (rowChanged) refreshRunSoon();
  if (events.some((e) => e.kind !== "metrics")) goodput.refreshSoon(); // a phase began or ended
}

/** "node-1 silent" while a node agent has not posted past the control plane's threshold. */
function showSilence() {
  const badge = $("silent-nodes");
  const nodes = ACTIVE.has(status) ? [...silent.keys()].sort() : [];
  badge.textContent = nodes.map((n) => `${n} silent`).join(", ");
  badge.title = nodes.map((n) => `${n}: no report for ${Math.round(silent.get(n))} s or more`).join("\n");
  badge.dataset.nodes = nodes.join(",");
  badge.hidden = nodes.length === 0;
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

/** The status badge, the buttons it allows, and the live dot: the one place the status shows. */
function showStatus(next) {
  const wasActive = ACTIVE.has(status);
  status = next;
  const badge = $("run-status");
  badge.textContent = status;
  badge.className = `badge status-${status}`;
  badge.dataset.status = status;
  $("cancel-run").hidden = !run.can_change || !ACTIVE.has(status) || cancelRequested;
  $("resume-run").hidden = !run.can_change || !(status === "failed" || status === "cancelled");
  showLiveState($("live-state").dataset.state);
  showSilence();
  if (wasActive && !ACTIVE.has(status)) {
    // One last read of the log and checkpoints: the final lines land as the run stops.
    logTail.refresh().catch(() => {});
    checkpoints.refreshSoon();
  }
}

function showRun(row) {
  cancelRequested = row.cancel_requested;
  // The row is newer than the last status event seen, or the page has seen none: it decides.
  if (row.last_seq >= statusSeq) showStatus(row.status);
  else showStatus(status);
  const reason = $("run-reason");
  reason.textContent = row.status_reason;
  reason.hidden = !row.status_reason;
  $("stat-restarts").textContent = String(row.restarts);
  if (row.step > step) {
    step = row.step;
    $("stat-step").textContent = String(step);
    $("stat-progress").value = step;
  }
}

function showActionError(exc) {
  const box = $("action-error");
  box.textContent = exc ? exc.message : "";
  box.hidden = !exc;
}

function action(button, path, after, question = null) {
  button.addEventListener("click", async () => {
    if (question && !confirm(question)) return;
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

action($("cancel-run"), "cancel", showRun, `Cancel run "${run.name}"? Its ranks stop; it can be resumed from its latest checkpoint.`);
action($("resume-run"), "resume", showRun);

// --- Tags and note ---------------------------------------------------------------------------------

function showOrganiseErrors(errors) {
  for (const name of ["tags", "note", "project"]) {
    if (!$(`run-${name}`)) continue;
    const messages = errors.filter((e) => e.path.split(".")[0] === name).map((e) => e.message);
    const box = document.querySelector(`[data-error-for="${name}"]`);
    box.textContent = messages.join(" ");
    box.hidden = messages.length === 0;
    $(`run-${name}`).setAttribute("aria-invalid", String(messages.length > 0));
  }
}

// A read-only member of the run's project gets no form (the page leaves it out).
$("organise-form")?.addEventListener("submit", async (event) => {
  event.preventDefault();
  const button = $("organise-save");
  button.disabled = true;
  $("organise-saved").textContent = "";
  const tags = $("run-tags").value.split(/[\s,]+/).filter(Boolean);
  try {
    const body = { tags, note: $("run-note").value };
    if ($("run-project")) body.project = $("run-project").value ? Number($("run-project").value) : null;
    const row = await api(`/api/runs/${run.id}/`, { method: "PATCH", json: body });
    showOrganiseErrors([]);
    $("run-tags").value = row.tags.join(", ");
    $("run-tag-list").replaceChildren(...row.tags.map((tag) => h("a", { class: "tag", href: `/?tag=${encodeURIComponent(tag)}` }, tag)));
    $("organise-saved").textContent = "Saved.";
    if ($("run-project")) {
      $("run-project-name").textContent = row.project ? $("run-project").selectedOptions[0].textContent : "";
      $("run-project-label").hidden = !row.project;
    }
  } catch (exc) {
    showOrganiseErrors(exc.status === 400 ? flattenErrors(exc.data) : [{ path: "note", message: exc.message }]);
  } finally {
    button.disabled = false;
  }
});

// --- Deploy: a checkpoint to replicas, with a name, replica count and options --------------------

const deployDialog = $("deploy-dialog");
let deploying = null; // the checkpoint row the dialog is for

function openDeploy(checkpoint) {
  deploying = checkpoint;
  $("deploy-step").textContent = String(checkpoint.step);
  $("deploy-name").value = `${run.name} step ${checkpoint.step}`;
  $("deploy-max-len").placeholder = run.seq_len ? String(run.seq_len) : "the checkpoint's";
  $("deploy-quantization").replaceChildren(
    ...(run.lora_rank ? [h("option", { value: "none" }, "none (merged export)")] : quantizationChoices(checkpoint)),
  );
  // A LoRA run's checkpoint: merged into its base, or attached to a deployment of that base.
  $("deploy-how-field").hidden = !run.lora_rank;
  $("deploy-how").replaceChildren(
    h("option", { value: "merged" }, "merged into its base, as a deployment of its own"),
    ...(run.attach_to || []).map((d) => h("option", { value: `attach:${d.id}` }, `as an adapter on ${d.served_model_name}`)),
  );
  showHow();
  $("deploy-error").hidden = true;
  deployDialog.showModal();
}

/** An adapter shares its deployment's replicas: only its name (a model name) is asked for. */
function showHow() {
  const attaching = $("deploy-how").value.startsWith("attach:");
  for (const own of deployDialog.querySelectorAll("[data-own-deployment]")) own.hidden = attaching;
  $("deploy-name").value = attaching
    ? `${run.name}-step${deploying.step}`.replace(/\s+/g, "-")
    : `${run.name} step ${deploying.step}`;
}
$("deploy-how").addEventListener("change", showHow);

/** The deploy form's quantization choices, each with the size of the export it serves and, once
 * measured, its top-1 agreement with the float export. fp8 is vLLM's own, applied at load. */
function quantizationChoices(checkpoint) {
  const made = new Map((checkpoint.quantized_exports || []).map((q) => [q.scheme, q]));
  const floatBytes = checkpoint.export_size_bytes;
  const describe = (scheme, label) => {
    const q = made.get(scheme);
    if (!q || q.status === "failed") return `${label} — made first (${q ? "last try failed" : "takes minutes"})`;
    if (q.status !== "ready") return `${label} — being made`;
    const quality =
      q.top1 == null
        ? "quality not measured yet"
        : `top-1 ${(100 * q.top1).toFixed(1)}%, perplexity ×${(q.perplexity / q.source_perplexity).toFixed(3)}`;
    return `${label} — ${formatBytes(q.size_bytes)}, ${quality}`;
  };
  return [
    h("option", { value: "none" }, floatBytes == null ? "none (float export)" : `none (float export) — ${formatBytes(floatBytes)}`),
    h("option", { value: "int8" }, describe("int8", "int8 (W8A8)")),
    h("option", { value: "int4" }, describe("int4", "int4 (W4A16, bfloat16 on CPU)")),
    h("option", { value: "fp8" }, "fp8 (vLLM at load; CUDA or AMX CPUs)"),
  ];
}

$("deploy-cancel").addEventListener("click", () => deployDialog.close());
$("deploy-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const button = $("deploy-confirm");
  button.disabled = true;
  $("deploy-error").hidden = true;
  const options = { dtype: $("deploy-dtype").value };
  const quantization = $("deploy-quantization").value;
  if (quantization === "fp8") options.quantization = "fp8";
  // A deployment's context defaults to what the model was trained on; vLLM's own may exceed it.
  const maxLen = Number($("deploy-max-len").value) || run.seq_len;
  if (maxLen) options.max_model_len = maxLen;
  if ($("deploy-eager").checked) options.enforce_eager = true;
  const how = run.lora_rank ? $("deploy-how").value : "";
  try {
    if (how.startsWith("attach:")) {
      const target = how.slice("attach:".length);
      await api(`/api/deployments/${target}/adapters/`, {
        method: "POST",
        json: { checkpoint: deploying.id, name: $("deploy-name").value.trim() },
      });
      location.assign(`/deployments/${target}`);
      return;
    }
    const deployment = await api("/api/deployments/", {
      method: "POST",
      json: {
        checkpoint: deploying.id,
        merged: how === "merged",
        name: $("deploy-name").value.trim(),
        replicas: Number($("deploy-replicas").value) || 1,
        quantization: quantization === "fp8" ? "none" : quantization,
        options,
      },
    });
    location.assign(`/deployments/${deployment.id}`);
  } catch (exc) {
    $("deploy-error").textContent = exc.message;
    $("deploy-error").hidden = false;
    button.disabled = false;
  }
});

// --- Start -------------------------------------------------------------------------------------

function showLiveState(state) {
  const el = $("live-state");
  el.dataset.state = state;
  // A finished run sends nothing more unless resumed: its socket stays open, but "live" would
  // promise updates that will not come.
  el.dataset.finished = String(!ACTIVE.has(status));
  el.textContent = ACTIVE.has(status)
    ? { connecting: "connecting…", live: "live", reconnecting: "reconnecting…", closed: "not live" }[state]
    : { connecting: "connecting…", live: "final", reconnecting: "reconnecting…", closed: "final" }[state];
}

new LiveEvents(`/ws/runs/${run.id}/`, onEvents, { onState: showLiveState }).start();
grid.render();
refreshRun().catch(showActionError);
checkpoints.refresh().catch(() => {});
goodput.refresh().catch(() => {});
logTail.refresh().catch(() => {});
every(LOG_REFRESH_MS, async () => {
  if (ACTIVE.has(status)) await logTail.refresh();
});
