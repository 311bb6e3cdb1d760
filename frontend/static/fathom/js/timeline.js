// The run's timeline: everything but the metrics and evaluation streams (the charts show those), newest first, each item saying what
// happened in words. Items carry `data-kind` so a reader (or a test) can find restarts.

import { clockTime, h } from "./dom.js";
import { failureText, stragglerText } from "./ranks.js";

// The newest items kept on the page; a long run's older history stays in the API.
const MAX_ITEMS = 300;

const IMPORTANCE = {
  rank_failed: "bad",
  failed: "bad",
  export_failed: "bad",
  quantize_failed: "bad",
  quality_failed: "warn",
  quantized: "info",
  quality_measured: "info",
  quantizing: "plain",
  node_lost: "bad",
  host_lost: "bad",
  waiting: "warn",
  restarting: "warn",
  step_skipped: "warn",
  rolled_back: "warn",
  straggler: "warn",
  straggler_cleared: "ok",
  cancel_requested: "warn",
  cancelled: "warn",
  stopped: "warn",
  preempt_requested: "warn",
  preempted: "warn",
  checkpoint: "info",
  exported: "info",
  checkpoint_pruned: "plain",
  node_silent: "warn",
  node_reporting: "ok",
  resumed: "ok",
  succeeded: "ok",
};

export function describe(e) {
  switch (e.kind) {
    case "queued":
      return ["Queued", e.resume ? "to resume from the latest checkpoint" : ""];
    case "status":
      return [`Status: ${e.status}`, e.reason ?? ""];
    case "agent_started":
      return ["Node agent started", `node ${e.node ?? 0} on ${e.host ?? "?"}, ${e.nproc ?? "?"} ranks`];
    case "rendezvous":
      return ["Ranks joined", `round ${e.round ?? 0}: node ${e.node ?? 0} on ${e.host ?? "?"}, ranks ${(e.ranks ?? []).join(", ")} of ${e.world_size ?? "?"}`];
    case "rank_failed":
      return [`Rank ${e.rank} failed`, `${failureText(e)} on ${e.host ?? "?"}${e.last_step != null ? `, last step ${e.last_step}` : ""}`];
    case "restarting":
      return [
        "Restarting",
        `from checkpoint step ${e.from_step ?? 0}${e.reason ? ` (${e.reason})` : ""}` +
          `${e.restarts_left != null ? `, ${e.restarts_left} restarts left` : ""}` +
          `${e.backoff ? `, after ${Number(e.backoff).toFixed(1)} s` : ""}`,
      ];
    case "resumed":
      return ["Resumed", e.source === "memory" ? `from the in-memory snapshot of step ${e.step}` : `from the checkpoint of step ${e.step}`];
    case "checkpoint":
      return ["Checkpoint", `step ${e.step}`];
    case "step_skipped":
      return [`Step ${e.step} skipped`, `${e.reason}; its optimizer step was left out on every rank (${e.skipped} so far, ${e.in_a_row} in a row)`];
    case "rolled_back":
      return [
        `Rolled back from step ${e.step} to ${e.to_step}`,
        `${e.reason}; resumed from the ${e.source === "memory" ? "in-memory snapshot" : "checkpoint"} of step ${e.to_step} ` +
          `and skipped ${e.skipped_batches} batch${e.skipped_batches === 1 ? "" : "es"} (rollback ${e.rollbacks})`,
      ];
    case "straggler":
      return [`Rank ${e.rank} straggles`, `${e.host ? `on ${e.host}: ` : ""}${stragglerText(e)}${e.slower_by ? ` (${e.slower_by}×)` : ""}`];
    case "straggler_cleared":
      return [`Rank ${e.rank} back in line`, `${e.host ? `on ${e.host}: ` : ""}as fast as its peers for ${e.steps} steps`];
    case "node_lost":
      return ["Node lost", `${e.nodes_before} → ${e.nodes} nodes`];
    case "placed":
      return ["Placed", (e.nodes ?? []).map((n) => `node ${n.node} on ${n.host} (${n.address}), devices ${n.devices.join(", ")}`).join("; ")];
    case "waiting":
      return ["Waiting", (e.reason ?? "").replace(/^waiting: /, "")];
    case "host_lost":
      return [
        `Host ${e.host} lost`,
        `${(e.nodes ?? []).join(", ")} gone; ${e.nodes_left} node${e.nodes_left === 1 ? "" : "s"} left` +
          (e.continues ? ", the run goes on" : ", fewer than nodes.min: resumes from its last checkpoint when the cluster has room"),
      ];
    case "cancel_requested":
      return ["Cancel requested", ""];
    case "preempt_requested":
      return ["Preemption asked", `run ${e.by} (priority ${e.priority}) needs its devices: checkpointing the step its ranks agree on`];
    case "preempted":
      return ["Preempted", `by run ${e.by}${e.step != null ? `; resumes from step ${e.step}` : ""}`];
    case "stopped":
      return ["Job stopped", `${e.reason ?? ""}${e.step != null ? `, last checkpoint step ${e.step}` : ""}`];
    case "cancelled":
      return ["Cancelled", e.reason ?? (e.step != null ? `last checkpoint step ${e.step}` : "")];
    case "succeeded":
      return ["Succeeded", e.step != null ? `final checkpoint step ${e.step}` : ""];
    case "failed":
      return ["Failed", e.reason ?? ""];
    case "exported":
      return ["Exported", `step ${e.step} to Hugging Face format`];
    case "export_failed":
      return ["Export failed", `step ${e.step}: ${e.reason ?? ""}`];
    case "quantizing":
      return [`Quantizing to ${e.scheme}`, `step ${e.step}: ${e.stage}${e.samples ? ` (${e.samples} calibration documents, ${e.tokens} tokens)` : ""}`];
    case "quantized":
      return [`Quantized to ${e.scheme}`, `step ${e.step}: ${e.bytes} bytes of ${e.source_bytes} in ${e.seconds} s`];
    case "quantize_failed":
      return [`Quantizing to ${e.scheme} failed`, `step ${e.step}: ${e.reason ?? ""}`];
    case "quality_measured":
      return [
        `${e.scheme} quality measured`,
        `step ${e.step}: top-1 agreement ${(100 * e.top1).toFixed(1)}% over ${e.positions} positions; perplexity ${e.perplexity?.toFixed(3)} vs ${e.source_perplexity?.toFixed(3)} float`,
      ];
    case "quality_failed":
      return [`${e.scheme} quality not measured`, `step ${e.step}: ${e.reason ?? ""}`];
    case "checkpoint_pruned":
      return ["Checkpoint pruned", `step ${e.step}: deleted by the trainer (train.keep_checkpoints)${e.exported ? "; its export stays" : ""}`];
    case "node_silent":
      return [`${e.node} silent`, `no report for ${Math.round(e.silent_s ?? 0)} s (threshold ${Math.round(e.threshold_s ?? 0)} s)`];
    case "node_reporting":
      return [`${e.node} reporting again`, `after ${Math.round(e.silent_s ?? 0)} s without a report`];
    case "finished":
      return ["Training finished", `step ${e.step}`];
    default:
      return [e.kind.replaceAll("_", " "), ""];
  }
}

export class Timeline {
  constructor(list) {
    this.list = list;
  }

  add(events) {
    const items = events
      .filter((e) => e.kind !== "metrics" && e.kind !== "eval")
      .map((e) => {
        const [title, detail] = describe(e);
        return h(
          "li",
          { class: `tl tl-${IMPORTANCE[e.kind] ?? "plain"}`, dataset: { kind: e.kind, seq: e.seq } },
          h("time", { datetime: new Date(e.time * 1000).toISOString() }, clockTime(e.time)),
          h("strong", {}, title),
          detail ? h("span", { class: "tl-detail" }, detail) : null,
        );
      })
      .reverse();
    if (!items.length) return;
    this.list.prepend(...items);
    while (this.list.children.length > MAX_ITEMS) this.list.lastElementChild.remove();
  }
}
