// The run page's panels: the checkpoint list (with Deploy) and the polled log tail.

import { api, items } from "./api.js";
import { formatNumber } from "./chart.js";
import { ago, h } from "./dom.js";

/**
 * The run's checkpoints, one row per step, kept from the API's list and moved by the run's
 * events as they arrive: `checkpoint` adds a row, `exported` fills its export,
 * `checkpoint_pruned` marks it pruned. A row's `data-state` is "saved", "exported" or "pruned".
 */
export class Checkpoints {
  constructor(runId, body, empty, { seqLen = null, onDeploy = null } = {}) {
    this.runId = runId;
    this.seqLen = seqLen;
    this.body = body;
    this.empty = empty;
    this.onDeploy = onDeploy;
    this.timer = null;
    this.rows = new Map(); // step → {id, step, path, export_path, created_at, pruned_at}
  }

  /** Loads soon: several checkpoint events in one burst cost one request. */
  refreshSoon() {
    clearTimeout(this.timer);
    this.timer = setTimeout(() => this.refresh().catch(() => {}), 300);
  }

  async refresh() {
    const checkpoints = items(await api(`/api/runs/${this.runId}/checkpoints/`));
    for (const c of checkpoints) this.rows.set(c.step, { ...this.rows.get(c.step), ...c });
    this.render();
  }

  /** Applies one of the run's events; returns whether a row changed. */
  apply(e) {
    const iso = new Date(e.time * 1000).toISOString();
    const row = this.rows.get(e.step);
    if (e.kind === "checkpoint") {
      if (!row) this.rows.set(e.step, { id: null, step: e.step, path: e.path, export_path: "", eval_loss: e.eval_loss ?? null, created_at: iso, pruned_at: null });
      this.refreshSoon(); // the row's id, which Deploy needs
      return true;
    }
    if (e.kind === "eval" && row) {
      row.eval_loss ??= e.eval_loss;
      return true;
    }
    if (e.kind === "exported" && row) {
      row.export_path = e.path;
      return true;
    }
    if (e.kind === "checkpoint_pruned" && row) {
      row.pruned_at ??= iso;
      return true;
    }
    if (QUANTIZED_EVENTS.has(e.kind)) this.refreshSoon(); // the row's quantized exports, as stored
    return false;
  }

  render() {
    const rows = [...this.rows.values()].sort((a, b) => b.step - a.step);
    this.empty.hidden = rows.length > 0;
    this.body.replaceChildren(...rows.map((c) => this.row(c)));
  }

  row(checkpoint) {
    const state = checkpoint.export_path ? "exported" : checkpoint.pruned_at ? "pruned" : "saved";
    // A pruned checkpoint's folder is gone; only its export, if one was made, can be served.
    const deployable = checkpoint.id != null && (state !== "pruned" || checkpoint.export_path);
    const deploy = deployable
      ? h("button", { type: "button", class: "small", dataset: { checkpoint: checkpoint.id }, onclick: () => this.onDeploy?.(checkpoint) }, "Deploy…")
      : null;
    const exportCell =
      state === "exported"
        ? [
            h("span", { class: "badge status-succeeded" }, "exported"),
            " ",
            h("span", { class: "path" }, checkpoint.export_path),
            // A local export streams from the API as a tar; one on object storage is fetched from there.
            ...(checkpoint.id != null && !checkpoint.export_path.includes("://")
              ? [" ", h("a", { class: "export-download", href: `/api/runs/${this.runId}/checkpoints/${checkpoint.id}/export.tar`, download: true }, "Download (.tar)")]
              : []),
          ]
        : state === "pruned"
          ? h("span", { class: "badge status-pruned", title: "Deleted by the trainer: train.keep_checkpoints" }, "pruned")
          : h("span", { class: "muted" }, "not exported");
    const quantized = (checkpoint.quantized_exports || []).map((q) => quantizedLine(q, checkpoint.export_size_bytes));
    return h(
      "tr",
      { dataset: { step: checkpoint.step, state } },
      h("td", { class: "num", "data-label": "Step" }, String(checkpoint.step)),
      h("td", { class: "num", "data-label": "Eval loss" }, checkpoint.eval_loss == null ? "–" : formatNumber(checkpoint.eval_loss)),
      h("td", { "data-label": "Saved" }, h("time", { datetime: checkpoint.created_at, title: checkpoint.created_at }, ago(checkpoint.created_at))),
      h("td", { class: "export", "data-label": "State" }, exportCell, ...quantized),
      h("td", {}, deploy ? [h("span", { class: "visually-hidden" }, `Step ${checkpoint.step}: `), deploy] : null),
    );
  }
}

// Run events after which a checkpoint's quantized exports are read again.
const QUANTIZED_EVENTS = new Set(["quantizing", "quantized", "quantize_failed", "quality_measured", "quality_failed"]);

export function formatBytes(bytes) {
  if (bytes == null) return "–";
  if (bytes < 1024 * 1024) return `${(bytes / 1024).toFixed(1)} KiB`;
  return `${(bytes / 1024 / 1024).toFixed(1)} MiB`;
}

/** What an int8/int4 export costs and saves: its size beside the float export's, its top-1
 * next-token agreement with it and both perplexities once measured; or where it stands. */
function quantizedLine(q, floatBytes) {
  const facts =
    q.status === "ready"
      ? [
          `${formatBytes(q.size_bytes)} of ${formatBytes(q.source_size_bytes ?? floatBytes)}`,
          ...(q.top1 == null
            ? ["quality not measured yet"]
            : [
                `top-1 agreement ${(100 * q.top1).toFixed(1)}% (${q.top1_positions} positions)`,
                `held-out perplexity ${formatNumber(q.perplexity)} vs ${formatNumber(q.source_perplexity)} float`,
              ]),
        ].join(" · ")
      : q.status === "failed"
        ? q.reason
        : "being made";
  return h(
    "div",
    { class: "quantized", dataset: { scheme: q.scheme, state: q.status } },
    h("span", { class: `badge status-${q.status === "ready" ? "succeeded" : q.status === "failed" ? "failed" : "running"}` }, q.scheme),
    " ",
    h("span", { class: q.status === "failed" ? "error" : "muted" }, facts),
  );
}

// Lines of log fetched each refresh: a screenful and a half, and cheap to send every few seconds.
const LOG_LINES = 200;

export class LogTail {
  constructor(runId, pre, rankSelect) {
    this.runId = runId;
    this.pre = pre;
    this.rankSelect = rankSelect;
    rankSelect.addEventListener("change", () => this.refresh());
  }

  setWorldSize(worldSize) {
    if (this.rankSelect.options.length === worldSize) return;
    const current = this.rankSelect.value || "0";
    this.rankSelect.replaceChildren(...Array.from({ length: worldSize }, (_, r) => h("option", { value: r }, String(r))));
    this.rankSelect.value = Number(current) < worldSize ? current : "0";
  }

  async refresh() {
    const rank = this.rankSelect.value || "0";
    const { lines } = await api(`/api/runs/${this.runId}/logs/?rank=${rank}&lines=${LOG_LINES}`);
    // Follow the end only if the reader is already there; otherwise keep their place.
    const atEnd = this.pre.scrollTop + this.pre.clientHeight >= this.pre.scrollHeight - 4;
    const text = lines.length ? lines.join("\n") : "(no output yet)";
    if (this.pre.textContent !== text) {
      this.pre.textContent = text;
      if (atEnd) this.pre.scrollTop = this.pre.scrollHeight;
    }
  }
}

const GOODPUT_LABELS = {
  productive: "Productive steps",
  queued: "Queued",
  startup: "Starting",
  checkpoint: "Checkpoint saves",
  evaluation: "Evaluation",
  down: "Down after failures",
  replayed: "Replayed steps",
  rolled_back: "Rolled back",
  other: "Other",
};

/** The run's goodput ledger (`/api/runs/<id>/goodput/`): one bar and a table, read again soon
 * after the events that move time between its buckets. */
export class Goodput {
  constructor(runId, { bar, rows, share }) {
    Object.assign(this, { runId, bar, rows, share, timer: null });
  }

  refreshSoon() {
    clearTimeout(this.timer);
    this.timer = setTimeout(() => this.refresh().catch(() => {}), 2000);
  }

  async refresh() {
    this.render(await api(`/api/runs/${this.runId}/goodput/`));
  }

  render(ledger) {
    const wall = ledger.wall_s;
    this.share.textContent = ledger.goodput == null ? "" : `· goodput ${(ledger.goodput * 100).toFixed(1)} %`;
    this.share.dataset.goodput = ledger.goodput ?? "";
    const spent = Object.entries(ledger.seconds).filter(([, s]) => s > 0);
    this.bar.replaceChildren(
      ...spent.map(([bucket, s]) =>
        h("span", { class: `goodput-${bucket}`, style: `width: ${(100 * s) / wall}%`, title: `${GOODPUT_LABELS[bucket]}: ${s.toFixed(1)} s` }),
      ),
    );
    this.rows.replaceChildren(
      ...spent.map(([bucket, s]) =>
        h(
          "tr",
          { dataset: { bucket } },
          h("th", {}, h("span", { class: `goodput-key goodput-${bucket}` }), GOODPUT_LABELS[bucket] ?? bucket),
          h("td", {}, `${s.toFixed(1)} s`),
          h("td", {}, `${((100 * s) / wall).toFixed(1)} %`),
        ),
      ),
    );
  }
}
