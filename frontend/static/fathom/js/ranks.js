// The per-rank health grid, derived from a run's events alone: `rendezvous` says which ranks
// run where, `metrics` how far the group got, `rank_failed` which rank went down and why,
// `host_lost` which ranks went with a host, `straggler` which one the others wait for (until
// `straggler_cleared` or the next rendezvous: new processes). Ranks train in lockstep, so the group's step is each
// running rank's last step. A rendezvous with fewer ranks (a node was lost and `nodes.min` let
// the rest go on) fits the mesh to the world it formed, as the ranks do (data parallelism
// shrinks); the ranks past it stay on the grid, marked as having left the run.

import { h } from "./dom.js";

const STATE_TEXT = {
  waiting: "waiting",
  running: "running",
  failed: "down",
  restarting: "restarting",
  done: "finished",
  stopped: "stopped",
  left: "left the run",
  lost: "host lost",
};

export class RankGrid {
  constructor(list, { dp, tp, pp }) {
    this.list = list;
    this.planned = { dp, tp, pp };
    this.dims = { dp, tp, pp };
    this.ranks = [];
    this.resize(dp * tp * pp);
  }

  resize(worldSize) {
    while (this.ranks.length < worldSize) {
      this.ranks.push({ rank: this.ranks.length, state: "waiting", host: "", step: null, failures: 0, lastFailure: "", straggling: null });
    }
    for (const rank of this.ranks.slice(worldSize)) if (rank.state !== "lost") rank.state = "left";
    const { tp, pp } = this.dims;
    if (worldSize % (tp * pp) === 0) this.dims.dp = worldSize / (tp * pp);
    this.worldSize = worldSize;
  }

  /** The layout the run has now, dp×tp×pp, and the planned one where it shrank. */
  layoutLabel() {
    const label = ({ dp, tp, pp }) => `${dp}×${tp}×${pp}`;
    const now = label(this.dims);
    return this.dims.dp === this.planned.dp ? now : `${now} (planned ${label(this.planned)})`;
  }

  /** Where a rank sits in the (pp, dp, tp) mesh; tp is innermost, as the trainer builds it. */
  coords(rank) {
    const { dp, tp } = this.dims;
    return { tp: rank % tp, dp: Math.floor(rank / tp) % dp, pp: Math.floor(rank / (tp * dp)) };
  }

  apply(event) {
    switch (event.kind) {
      case "rendezvous":
        if (event.world_size) this.resize(event.world_size);
        for (const r of event.ranks ?? []) {
          const rank = this.ranks[r];
          if (rank) Object.assign(rank, { state: "running", host: event.host ?? rank.host, straggling: null });
        }
        return true;
      case "metrics":
        for (const rank of this.ranks) if (rank.state === "running") rank.step = event.step;
        return true;
      case "rank_failed": {
        const rank = this.ranks[event.rank];
        if (!rank) return false;
        rank.state = "failed";
        rank.failures += 1;
        rank.host = event.host ?? rank.host;
        if (event.last_step != null) rank.step = event.last_step;
        rank.lastFailure = failureText(event);
        return true;
      }
      case "straggler":
      case "straggler_cleared": {
        const rank = this.ranks[event.rank];
        if (!rank) return false;
        rank.straggling = event.kind === "straggler" ? event : null;
        return true;
      }
      case "host_lost":
        for (const rank of this.ranks) {
          if (rank.host !== event.host || rank.state === "lost") continue;
          rank.state = "lost";
          rank.failures += 1;
          rank.lastFailure = `host ${event.host} lost`;
        }
        return true;
      case "restarting":
        for (const rank of this.ranks) if (rank.state === "running") rank.state = "restarting";
        return true;
      case "succeeded":
        for (const rank of this.ranks.slice(0, this.worldSize)) if (rank.state !== "failed") rank.state = "done";
        return true;
      case "failed":
      case "cancelled":
        for (const rank of this.ranks.slice(0, this.worldSize)) if (rank.state !== "failed") rank.state = "stopped";
        return true;
      default:
        return false;
    }
  }

  render() {
    this.list.replaceChildren(
      ...this.ranks.map((r) => {
        const { dp, tp, pp } = this.coords(r.rank);
        const inMesh = r.rank < this.worldSize;
        return h(
          "li",
          {
            class: `rank rank-${r.state}${r.straggling ? " rank-straggling" : ""}`,
            dataset: { rank: r.rank, state: r.state, failures: r.failures, straggling: Boolean(r.straggling) },
          },
          h("div", { class: "rank-head" }, h("strong", {}, `Rank ${r.rank}`), h("span", { class: "rank-state" }, STATE_TEXT[r.state])),
          h("div", { class: "muted" }, inMesh ? `dp ${dp} · tp ${tp} · pp ${pp}` : `not in the ${this.worldSize}-rank world`),
          h("div", {}, r.host || "host unknown"),
          h("div", {}, r.step == null ? "no step yet" : `step ${r.step}`),
          r.straggling ? h("div", { class: "rank-straggling-note" }, stragglerText(r.straggling)) : null,
          r.failures
            ? h("div", { class: "rank-failures" }, `${r.failures} failure${r.failures > 1 ? "s" : ""}: ${r.lastFailure}`)
            : null,
        );
      }),
    );
  }
}

export function failureText(event) {
  const details = [];
  if (event.signal) details.push(event.signal);
  else if (event.exit_code != null) details.push(`exit ${event.exit_code}`);
  if (event.silent_for != null) details.push(`silent ${Number(event.silent_for).toFixed(1)} s`);
  return `${event.reason ?? "failed"}${details.length ? ` (${details.join(", ")})` : ""}`;
}

export function stragglerText(event) {
  const own = Math.round(Number(event.own_s) * 1000);
  const others = Math.round(Number(event.others_s) * 1000);
  return `straggling: ${own} ms of its own a step against its peers' ${others} ms, ${event.steps} steps in a row`;
}
