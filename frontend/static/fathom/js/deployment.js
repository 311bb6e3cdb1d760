// The deployment page: replicas and their health, live serving metrics over the deployment's
// websocket, API keys, and a chat playground that streams the model's answer.

import { api, items } from "./api.js";
import { streamChat } from "./chat.js";
import { LineChart } from "./chart.js";
import { ago, clockTime, every, h, pageData } from "./dom.js";
import { LiveEvents } from "./live.js";

const deployment = pageData("deployment-data");
const $ = (id) => document.getElementById(id);
const ACTIVE = new Set(["pending", "starting", "ready", "degraded"]);
const SERVING = new Set(["ready", "degraded"]);
const STARTING = new Set(["pending", "starting"]);
// How often a starting replica's log is read for the start-up panel.
const STARTUP_LOG_MS = 2000;

// --- Status and replicas: from the deployment's row, then moved by its events -----------------

let status = deployment.status;
let statusSeq = 0; // the seq of the last event that set `status`
let createdAt = null;
let replicaCount = 0;
const replicas = new Map(); // index → {index, status, url, restarts, updated_at}
// Each ready replica's prefix-cache hit rate since it started, by its url (the sync's scrape).
const cacheHitRate = new Map();
const lostWith = new Map(); // index → the host a replica was lost with, until it is placed again
// A supervisor event → the replica state it leaves behind (as the control plane mirrors it).
const REPLICA_STATE = {
  replica_starting: "starting",
  replica_restarting: "dead",
  replica_died: "dead",
  replica_ready: "ready",
  replica_stopped: "stopped",
};

function showStatus(next) {
  status = next;
  const badge = $("deployment-status");
  badge.textContent = status;
  badge.className = `badge status-${status}`;
  badge.dataset.status = status;
  $("stop-deployment").hidden = !ACTIVE.has(status);
  // The playground talks to the replicas: only while some serve.
  $("chat-send").disabled = !SERVING.has(status) || controller !== null;
  $("chat-input").disabled = !SERVING.has(status);
  $("chat-closed").hidden = SERVING.has(status) || STARTING.has(status);
  $("startup").hidden = !STARTING.has(status);
  $("live-state").dataset.finished = String(!ACTIVE.has(status) && status !== "stopping");
  showLiveState($("live-state").dataset.state);
}

function showDeployment(row) {
  createdAt = Date.parse(row.created_at);
  replicaCount = row.replicas;
  if (row.last_seq == null || row.last_seq >= statusSeq) showStatus(row.status);
  $("deployment-reason").textContent = row.status_reason;
  $("deployment-reason").hidden = !row.status_reason;
  for (const r of row.replica_set ?? []) replicas.set(r.index, { ...r });
  renderReplicas();
}

function renderReplicas() {
  const shown = replicas.size ? [...replicas.values()] : Array.from({ length: replicaCount }, (_, index) => ({ index, status: "pending" }));
  $("replica-grid").replaceChildren(
    ...shown.sort((a, b) => a.index - b.index).map((r) =>
      h(
        "li",
        { class: `rank replica-${r.status}`, dataset: { replica: r.index, state: r.status } },
        h("div", { class: "rank-head" }, h("strong", {}, `Replica ${r.index}`), h("span", { class: "rank-state" }, r.status)),
        lostWith.has(r.index) && r.status === "dead"
          ? h("div", { class: "rank-failures" }, `lost with host ${lostWith.get(r.index)}; waiting for a host with room`)
          : h("div", { class: "muted path" }, r.status === "stopped" ? "" : r.url || "no address yet"),
        h("div", {}, `${r.restarts ?? 0} restart${r.restarts === 1 ? "" : "s"}`),
        r.url && cacheHitRate.get(r.url) != null
          ? h("div", { class: "cache-hits" }, `prefix cache hits ${Math.round(100 * cacheHitRate.get(r.url))} %`)
          : null,
        r.updated_at ? h("div", { class: "muted" }, `${r.status} since `, h("time", { datetime: r.updated_at, dataset: { ago: "" } }, ago(r.updated_at))) : null,
      ),
    ),
  );
}

/** Applies one deployment event to the status and the replica cards; returns whether any changed. */
function applyEvent(e) {
  if (e.kind === "status" && e.status && e.seq > statusSeq) {
    statusSeq = e.seq;
    showStatus(e.status);
  } else if (["stopping", "stopped", "failed", "asleep"].includes(e.kind) && e.seq > statusSeq) {
    statusSeq = e.seq;
    showStatus(e.kind);
    if (e.kind === "stopped" || e.kind === "asleep") for (const r of replicas.values()) Object.assign(r, { status: "stopped", updated_at: new Date(e.time * 1000).toISOString() });
    return true;
  }
  if (e.kind === "host_lost") {
    for (const index of e.replicas ?? []) {
      lostWith.set(index, (e.hosts ?? []).join(", "));
      const r = replicas.get(index) ?? { index, restarts: 0 };
      replicas.set(index, { ...r, status: "dead", url: "", updated_at: new Date(e.time * 1000).toISOString() });
    }
    return true;
  }
  if (e.kind === "placed") for (const index of e.again ?? []) lostWith.delete(index);
  const state = REPLICA_STATE[e.kind];
  if (state && e.replica != null) {
    const r = replicas.get(e.replica) ?? { index: e.replica, restarts: 0, url: "" };
    if (e.kind === "replica_restarting") r.restarts = (r.restarts ?? 0) + 1;
    replicas.set(e.replica, { ...r, status: state, updated_at: new Date(e.time * 1000).toISOString() });
    return true;
  }
  return false;
}

let refreshTimer = null;
function refreshSoon() {
  clearTimeout(refreshTimer);
  refreshTimer = setTimeout(refresh, 300);
}

async function refresh() {
  try {
    showDeployment(await api(`/api/deployments/${deployment.id}/`));
  } catch (exc) {
    showError($("action-error"), exc);
  }
}

$("stop-deployment").addEventListener("click", async (event) => {
  if (!confirm(`Stop deployment "${$("served-model").textContent}"? Its replicas stop and its /v1 model goes away.`)) return;
  event.target.disabled = true;
  try {
    showDeployment(await api(`/api/deployments/${deployment.id}/stop/`, { method: "POST", json: {} }));
  } catch (exc) {
    showError($("action-error"), exc);
  } finally {
    event.target.disabled = false;
  }
});

function showError(box, exc) {
  box.textContent = exc ? exc.message : "";
  box.hidden = !exc;
}

// --- Live metrics and events -------------------------------------------------------------------

const charts = {
  tps: new LineChart($("chart-dtps"), { series: ["tokens/s"], time: true, yLabel: "tokens/s", syncKey: `deployment-${deployment.id}` }),
  requests: new LineChart($("chart-requests"), { series: ["running", "waiting"], time: true, yLabel: "requests", syncKey: `deployment-${deployment.id}` }),
  kv: new LineChart($("chart-kv"), { series: ["KV cache %"], time: true, yRange: [0, 100], yLabel: "% in use", syncKey: `deployment-${deployment.id}` }),
  ttft: new LineChart($("chart-ttft"), { series: ["TTFT p50 (s)"], time: true, yLabel: "seconds", syncKey: `deployment-${deployment.id}` }),
};
// A metrics event may describe one replica (`replica` set) or the whole deployment; per-replica
// samples are combined with the latest sample of every other replica.
const latestByReplica = new Map();

function first(e, ...names) {
  for (const name of names) if (typeof e[name] === "number") return e[name];
  return null;
}

function onMetrics(e) {
  const sample = {
    running: first(e, "running", "requests_running"),
    waiting: first(e, "waiting", "requests_waiting"),
    kv: first(e, "kv_cache_usage"),
    tps: first(e, "tokens_per_s", "generation_tokens_per_s"),
    ttft: first(e, "ttft_p50", "ttft_p50_s"),
  };
  latestByReplica.set(e.replica ?? "all", sample);
  if (e.prefix_cache_hit_rate) {
    for (const [url, rate] of Object.entries(e.prefix_cache_hit_rate)) cacheHitRate.set(url, rate);
    renderReplicas();
  }
  const all = [...latestByReplica.values()];
  const sum = (key) => (all.some((s) => s[key] != null) ? all.reduce((t, s) => t + (s[key] ?? 0), 0) : null);
  const known = (key) => all.map((s) => s[key]).filter((v) => v != null);
  const kv = known("kv");
  const ttft = known("ttft");
  charts.tps.put(e.time, [sum("tps")]);
  charts.requests.put(e.time, [sum("running"), sum("waiting")]);
  charts.kv.put(e.time, [kv.length ? (100 * kv.reduce((a, b) => a + b, 0)) / kv.length : null]);
  charts.ttft.put(e.time, [ttft.length ? Math.max(...ttft) : null]);
}

function describe(e) {
  const replica = e.replica != null ? `Replica ${e.replica}` : "";
  switch (e.kind) {
    case "created":
      return `Created with ${e.replicas} replica${e.replicas === 1 ? "" : "s"}${e.quantization && e.quantization !== "none" ? `, ${e.quantization}` : ""}`;
    case "waiting_for_quantization":
      return `Waiting for the checkpoint's ${e.scheme} export to be made (llmcompressor)`;
    case "quantized":
      return `The ${e.scheme ?? "quantized"} export is ready${e.bytes ? ` (${e.bytes} bytes)` : ""}`;
    case "replica_starting":
      return `${replica} starting`;
    case "replica_ready":
      return `${replica} ready`;
    case "replica_died":
      return `${replica} died${e.reason ? `: ${e.reason}` : e.exit_code != null ? ` (exit ${e.exit_code})` : ""}`;
    case "replica_restarting":
      return `${replica} restarting${e.backoff ? ` in ${Number(e.backoff).toFixed(1)} s` : ""}`;
    case "replica_stopped":
      return `${replica} stopped`;
    case "host_lost": {
      const lost = e.replicas ?? [];
      return `Host ${(e.hosts ?? []).join(", ")} lost with replica${lost.length === 1 ? "" : "s"} ${lost.join(", ")}; the others serve on`;
    }
    case "placed":
      return (e.hosts ?? [])
        .map((p) => `${e.again ? "Replica placed again" : "Placed"}: ${p.replicas.length === 1 ? "replica" : "replicas"} ${p.replicas.join(", ")} on ${p.host}`)
        .join("; ") || "Placed";
    case "scaled":
      return `Autoscaler: ${e.from} → ${e.to} replica${e.to === 1 ? "" : "s"}: ${e.reason}`;
    case "asleep":
      return "Asleep: no replica runs; the next request wakes it";
    case "waking":
      return `Waking on ${e.replicas} replica${e.replicas === 1 ? "" : "s"}: ${e.reason}`;
    case "status":
      return `Status: ${e.status}${e.replicas ? ` (${e.ready ?? 0} of ${e.replicas} replicas ready)` : ""}`;
    default:
      return [e.kind.replaceAll("_", " "), e.reason].filter(Boolean).join(": ");
  }
}

function onEvents(events) {
  const timeline = $("timeline");
  let changed = false;
  let replicasChanged = false;
  for (const e of events) {
    if (e.kind === "metrics") {
      onMetrics(e);
      continue;
    }
    changed = true;
    replicasChanged = applyEvent(e) || replicasChanged;
    const bad = e.kind === "replica_died" || e.kind === "failed" || e.kind === "host_lost";
    timeline.prepend(
      h(
        "li",
        { class: `tl ${bad ? "tl-bad" : e.kind === "replica_ready" ? "tl-ok" : "tl-plain"}`, dataset: { kind: e.kind } },
        h("time", {}, clockTime(e.time)),
        h("strong", {}, describe(e)),
      ),
    );
  }
  if (replicasChanged) renderReplicas();
  if (changed) refreshSoon();
}

// --- Start-up: elapsed time, the replica's phase as vLLM logs it, and its log's last lines ---------

// vLLM's start-up, in the order it logs it; the latest line that matches names the phase.
const PHASES = [
  ["serving", /Application startup complete|Uvicorn running|Starting vLLM API server|Available routes/i, "starting the HTTP server"],
  ["compiling", /torch\.compile|Compiling a graph|compil|graph captur|Capturing (CUDA )?graphs|warm(ing)? ?up/i, "compiling and capturing graphs"],
  ["kv-cache", /KV cache|num_gpu_blocks|# (CPU|GPU) blocks|Maximum concurrency/i, "sizing the KV cache"],
  ["weights", /Loading (model )?weights|safetensors|Model loading took|load_model/i, "loading weights"],
  ["engine", /Initializing|init engine|detected platform|Resolved architecture|non-default args/i, "initialising the engine"],
];

export function startupPhase(lines) {
  for (let i = lines.length - 1; i >= 0; i--) {
    for (const [key, pattern, text] of PHASES) if (pattern.test(lines[i])) return [key, text];
  }
  return ["launching", "launching vllm serve"];
}

function formatElapsed(seconds) {
  const s = Math.max(0, Math.floor(seconds));
  return s < 60 ? `${s} s` : `${Math.floor(s / 60)} min ${s % 60} s`;
}

async function refreshStartup() {
  if (!STARTING.has(status)) return;
  // The first replica not yet ready is the one to watch.
  const waiting = [...replicas.values()].sort((a, b) => a.index - b.index).find((r) => r.status !== "ready");
  const index = waiting?.index ?? 0;
  const { lines } = await api(`/api/deployments/${deployment.id}/logs/?replica=${index}&lines=40`);
  const [key, text] = startupPhase(lines);
  $("startup-replica").textContent = String(index);
  $("startup-phase").textContent = text;
  $("startup-phase").dataset.phase = key;
  const log = $("startup-log");
  const body = lines.length ? lines.slice(-12).join("\n") : "(no output yet)";
  if (log.textContent !== body) {
    log.textContent = body;
    log.scrollTop = log.scrollHeight;
  }
}

setInterval(() => {
  if (createdAt && STARTING.has(status)) $("startup-elapsed").textContent = formatElapsed((Date.now() - createdAt) / 1000);
  for (const el of document.querySelectorAll("time[data-ago]")) el.textContent = ago(el.getAttribute("datetime"));
}, 1000);
every(STARTUP_LOG_MS, refreshStartup);

// --- API keys ----------------------------------------------------------------------------------

// How often the key list is read again: use is written in batches every couple of seconds.
const KEYS_REFRESH_MS = 5000;
const count = (n, one, many) => `${n.toLocaleString()} ${n === 1 ? one : many}`;

function keyRow(k) {
  const limit = k.rate_limit_per_minute ? `${k.rate_limit_per_minute.toLocaleString()} requests/min` : "no limit";
  return h(
    "li",
    { class: `key-row${k.revoked ? " key-revoked" : ""}`, dataset: { key: k.id, prefix: k.prefix, revoked: String(k.revoked) } },
    h(
      "div",
      { class: "key-head" },
      h("code", {}, `${k.prefix}…`),
      h("strong", {}, k.name || "unnamed"),
      k.revoked
        ? h("span", { class: "badge status-stopped" }, "revoked")
        : h("button", { type: "button", class: "small secondary", "aria-label": `Revoke ${k.prefix}…`, onclick: () => revokeKey(k) }, "Revoke"),
    ),
    h(
      "div",
      { class: "muted key-use" },
      h("span", { dataset: { use: "requests" } }, count(k.requests, "request", "requests")),
      " · ",
      h("span", { dataset: { use: "tokens" }, title: `${k.prompt_tokens} in, ${k.completion_tokens} out` }, count(k.tokens, "token", "tokens")),
      " · ",
      h("span", { dataset: { use: "limit" } }, limit),
    ),
    h(
      "div",
      { class: "muted key-use" },
      "created ",
      h("time", { datetime: k.created_at, dataset: { ago: "" } }, ago(k.created_at)),
      " · last used ",
      k.last_used_at ? h("time", { datetime: k.last_used_at, dataset: { ago: "", use: "last-used" } }, ago(k.last_used_at)) : h("span", { dataset: { use: "last-used" } }, "never"),
      k.revoked_at ? [" · revoked ", h("time", { datetime: k.revoked_at, dataset: { ago: "" } }, ago(k.revoked_at))] : null,
    ),
  );
}

async function loadKeys() {
  // Keys come in pages of 100 (newest first); a deployment rarely has more.
  const page = await api(`/api/deployments/${deployment.id}/keys/?limit=100`);
  const keys = items(page);
  $("key-list").replaceChildren(...keys.map(keyRow));
  $("key-none").hidden = keys.length > 0;
  showError($("key-error"), null);
}

async function revokeKey(k) {
  if (!confirm(`Revoke the key ${k.prefix}…${k.name ? ` (${k.name})` : ""}? Calls with it are refused within 5 s; this cannot be undone.`)) return;
  try {
    await api(`/api/deployments/${deployment.id}/keys/${k.id}/revoke/`, { method: "POST", json: {} });
  } catch (exc) {
    showError($("key-error"), exc);
  }
  await loadKeys();
}

$("key-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  showError($("key-error"), null);
  const body = { name: $("key-name").value.trim() };
  const limit = $("key-rate-limit").value.trim();
  if (limit) body.rate_limit_per_minute = Number(limit);
  $("key-create").disabled = true;
  try {
    const created = await api(`/api/deployments/${deployment.id}/keys/`, { method: "POST", json: body });
    $("new-key-value").textContent = created.key;
    $("new-key").hidden = false;
    $("copy-key").textContent = "Copy";
    $("key-name").value = "";
    $("key-rate-limit").value = "";
    showCallExample(created.key);
    await loadKeys();
  } catch (exc) {
    showError($("key-error"), exc);
  } finally {
    $("key-create").disabled = false;
  }
});

$("copy-key").addEventListener("click", async () => {
  try {
    await navigator.clipboard.writeText($("new-key-value").textContent);
    $("copy-key").textContent = "Copied";
  } catch {
    // Clipboard access denied: select the key so the reader can copy it by hand.
    getSelection().selectAllChildren($("new-key-value"));
  }
});

/** How to call the deployment from outside: this server's /v1, the model, and a key (the one
 * just created, while the page still holds it). */
function showCallExample(key = "fth-…") {
  const baseUrl = `${location.origin}/v1`;
  $("call-base-url").textContent = baseUrl;
  $("call-example").textContent = [
    "from openai import OpenAI",
    `client = OpenAI(base_url="${baseUrl}", api_key="${key}")`,
    `reply = client.chat.completions.create(model="${deployment.model}", messages=[{"role": "user", "content": "Hello"}])`,
    "print(reply.choices[0].message.content)",
  ].join("\n");
  $("call-example-curl").textContent = [
    `curl ${baseUrl}/chat/completions \\`,
    `  -H "Authorization: Bearer ${key}" -H "Content-Type: application/json" \\`,
    `  -d '{"model": "${deployment.model}", "messages": [{"role": "user", "content": "Hello"}]}'`,
  ].join("\n");
}

// --- Playground --------------------------------------------------------------------------------

const messages = [];
let controller = null;

function bubble(role, text) {
  const el = h("div", { class: `msg msg-${role}`, dataset: { role } }, h("span", { class: "visually-hidden" }, `${role}: `), h("span", { class: "msg-text" }, text));
  $("chat-log").append(el);
  el.scrollIntoView({ block: "nearest" });
  return el.querySelector(".msg-text");
}

function setBusy(busy) {
  $("chat-send").disabled = busy || !SERVING.has(status);
  $("chat-stop").hidden = !busy;
}

$("chat-form").addEventListener("submit", async (event) => {
  event.preventDefault();
  const input = $("chat-input");
  const content = input.value.trim();
  if (!content || controller || !SERVING.has(status)) return;
  showError($("chat-error"), null);
  $("chat-stats").textContent = "Waiting for the first token…";
  messages.push({ role: "user", content });
  const question = bubble("user", content);
  input.value = "";
  const answer = bubble("assistant", "");
  answer.parentElement.dataset.streaming = "true";
  controller = new AbortController();
  setBusy(true);
  const started = performance.now();
  let firstTokenMs = null;
  let pieces = 0;
  try {
    const result = await streamChat(
      `/api/deployments/${deployment.id}/chat/`,
      {
        model: deployment.model,
        messages,
        temperature: Number($("chat-temperature").value),
        // Empty: the engine generates until the answer ends or the context is full.
        ...(Number($("chat-max-tokens").value) > 0 ? { max_tokens: Number($("chat-max-tokens").value) } : {}),
      },
      {
        signal: controller.signal,
        onDelta: (piece) => {
          firstTokenMs ??= performance.now() - started;
          pieces += 1;
          answer.textContent += piece;
          answer.parentElement.dataset.pieces = String(pieces);
        },
      },
    );
    messages.push({ role: "assistant", content: result.text });
    const seconds = (performance.now() - started) / 1000;
    $("chat-stats").textContent =
      `${pieces} chunks in ${seconds.toFixed(2)} s; first after ${((firstTokenMs ?? 0) / 1000).toFixed(2)} s` +
      (result.finishReason ? `; finished: ${result.finishReason}` : "");
  } catch (exc) {
    if (exc.name === "AbortError") {
      messages.push({ role: "assistant", content: answer.textContent });
      $("chat-stats").textContent = "Stopped.";
    } else {
      // The question was not answered: it leaves the conversation and goes back into the input,
      // so the reader can shorten it or clear the conversation and send it again.
      messages.pop();
      if (!answer.textContent) answer.parentElement.remove();
      question.parentElement.remove();
      input.value = content;
      $("chat-stats").textContent = "";
      const tooLong = exc?.data?.code === "context_length_exceeded";
      showError($("chat-error"), tooLong ? new Error(`${exc.message} Clear the conversation or shorten the message.`) : exc);
    }
  } finally {
    answer.parentElement.dataset.streaming = "false";
    controller = null;
    setBusy(false);
  }
});

$("chat-stop").addEventListener("click", () => controller?.abort());
$("chat-clear").addEventListener("click", () => {
  messages.length = 0;
  $("chat-log").replaceChildren();
  $("chat-stats").textContent = "";
});
$("chat-input").addEventListener("keydown", (event) => {
  // Enter sends, Shift+Enter adds a line, as in most chat boxes.
  if (event.key === "Enter" && !event.shiftKey && !event.isComposing) {
    event.preventDefault();
    $("chat-form").requestSubmit();
  }
});

// --- Start -------------------------------------------------------------------------------------

function showLiveState(state) {
  const el = $("live-state");
  el.dataset.state = state;
  const over = el.dataset.finished === "true";
  el.textContent = { connecting: "connecting…", live: over ? "final" : "live", reconnecting: "reconnecting…", closed: over ? "final" : "not live" }[state];
}

// The deployment socket replays recent history on every connect and takes no `after`;
// LiveEvents drops what it already holds by seq.
// The REST history (`{seq, kind, time: ISO, data}`) in the socket's shape (`{seq, kind, time: s, ...data}`).
async function eventsAfter(after) {
  const events = items(await api(`/api/deployments/${deployment.id}/events/?after=${after}`));
  return events.map((e) => ({ ...e.data, seq: e.seq, kind: e.kind, time: Date.parse(e.time) / 1000 }));
}

new LiveEvents(`/ws/deployments/${deployment.id}/`, onEvents, {
  resume: false,
  onState: showLiveState,
  catchUp: eventsAfter,
}).start();
showCallExample();
refresh();
loadKeys().catch((exc) => showError($("key-error"), exc));
every(KEYS_REFRESH_MS, loadKeys);
