// The run page's polled panels: the checkpoint list (with Deploy) and the log tail.

import { api } from "./api.js";
import { ago, h } from "./dom.js";

export class Checkpoints {
  constructor(runId, body, empty, { seqLen = null } = {}) {
    this.runId = runId;
    this.seqLen = seqLen;
    this.body = body;
    this.empty = empty;
    this.timer = null;
  }

  /** Loads soon: several checkpoint and export events in one burst cost one request. */
  refreshSoon() {
    clearTimeout(this.timer);
    this.timer = setTimeout(() => this.refresh(), 300);
  }

  async refresh() {
    const checkpoints = await api(`/api/runs/${this.runId}/checkpoints/`);
    this.empty.hidden = checkpoints.length > 0;
    this.body.replaceChildren(...[...checkpoints].reverse().map((c) => this.row(c)));
  }

  row(checkpoint) {
    const error = h("span", { class: "error", role: "alert" });
    const button = h("button", { type: "button", class: "small", dataset: { checkpoint: checkpoint.id } }, "Deploy");
    button.addEventListener("click", async () => {
      button.disabled = true;
      error.textContent = "";
      try {
        const body = { checkpoint: checkpoint.id, replicas: 1 };
        if (this.seqLen) body.options = { max_model_len: this.seqLen };
        const deployment = await api("/api/deployments/", { method: "POST", json: body });
        location.assign(`/deployments/${deployment.id}`);
      } catch (exc) {
        error.textContent = exc.message;
        button.disabled = false;
      }
    });
    return h(
      "tr",
      { dataset: { step: checkpoint.step } },
      h("td", { class: "num" }, String(checkpoint.step)),
      h("td", {}, h("time", { datetime: checkpoint.created_at, title: checkpoint.created_at }, ago(checkpoint.created_at))),
      h("td", { class: "path" }, checkpoint.export_path || h("span", { class: "muted" }, "not exported")),
      h("td", {}, h("span", { class: "visually-hidden" }, `Step ${checkpoint.step}: `), button, " ", error),
    );
  }
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
