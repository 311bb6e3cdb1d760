// "Check layout" on the launch form: asks the planner (`GET /api/plan/`) to rank every layout
// of the chosen model on the cluster the form describes, shows where the form's own layout
// stands, and offers the best ones to fill in. Degrades to a notice where there is no planner.

import { ApiError, api } from "./api.js";
import { formatNumber } from "./chart.js";
import { h } from "./dom.js";

// How many ranked layouts to ask for: enough to find the form's own among them.
const RANKED = 50;
const SHOWN = 5;

// The planner's query names → the form's inputs, so its 400s land next to the right input.
export const PLAN_FIELDS = {
  model: "recipe",
  global_batch: "spec.train.global_batch",
  nodes: "spec.nodes.max",
  gpus_per_node: "spec.layout.dp",
  seq_len: "spec.model.seq_len",
  precision: "spec.layout.precision",
  gpu: "plan-gpu",
};

/** The planner query for what the form holds; `value(path)` reads an input or the recipe's value. */
export function planQuery(value, gpu) {
  const nodes = Number(value("spec.nodes.max")) || 1;
  const world = ["dp", "tp", "pp"].reduce((n, dim) => n * (Number(value(`spec.layout.${dim}`)) || 1), 1);
  const query = {
    model: value("recipe"),
    nodes: String(nodes),
    gpus_per_node: String(Math.max(1, Math.round(world / nodes))),
    gpu,
    global_batch: String(value("spec.train.global_batch")),
    top: String(RANKED),
  };
  const seqLen = value("spec.model.seq_len");
  if (seqLen) query.seq_len = String(seqLen);
  const precision = value("spec.layout.precision");
  if (precision) query.precision = precision;
  return new URLSearchParams(query);
}

/**
 * Renders the planner's answer into `box`. `layout` is the form's {dp, tp, pp, zero, recompute};
 * `use(candidate)` fills the form with a ranked candidate.
 */
export function renderPlan(box, plan, layout, use) {
  const ranked = plan.ranked ?? [];
  const mine = ranked.findIndex((e) =>
    ["dp", "tp", "pp"].every((dim) => e.candidate[dim] === layout[dim]) &&
    (layout.zero == null || e.candidate.zero === layout.zero) &&
    (layout.recompute == null || e.candidate.recompute === layout.recompute),
  );
  const own = `dp${layout.dp} tp${layout.tp} pp${layout.pp} zero${layout.zero ?? 0} ${layout.recompute ?? "none"}`;
  const ranks = tiedRanks(ranked);
  const fit = plan.counts?.fit ?? ranked.length;
  let verdict;
  if (mine >= 0) {
    const ties = ranks.filter((r) => r === ranks[mine]).length - 1;
    verdict =
      `Your layout (${own}) ranks #${ranks[mine]} of ${fit} that fit` +
      `${ties ? `, tied with ${ties} other${ties === 1 ? "" : "s"} at the same step time` : ""}: ` +
      `${formatNumber(ranked[mine].step_seconds)} s a step, ${formatNumber(ranked[mine].mfu * 100)} % MFU.`;
  } else {
    verdict = `Your layout (${own}) is not among the ${ranked.length} best that fit this cluster.`;
  }
  const shown = ranked.slice(0, SHOWN).map((e, i) => [e, i]);
  if (mine >= SHOWN) shown.push([ranked[mine], mine]); // the reader's own row, wherever it ranks
  const rows = shown.map(([e, i]) =>
    h(
      "tr",
      { class: i === mine ? "plan-mine" : "", dataset: { rank: ranks[i] } },
      h("td", { class: "num", "data-label": "Rank" }, `#${ranks[i]}`),
      h("td", { "data-label": "Layout" }, h("code", {}, e.label)),
      h("td", { class: "num", "data-label": "Step" }, `${formatNumber(e.step_seconds)} s`),
      h("td", { class: "num", "data-label": "Tokens/s" }, formatNumber(e.tokens_per_second)),
      h("td", { class: "num", "data-label": "MFU" }, `${formatNumber(e.mfu * 100)} %`),
      h("td", { class: "num", "data-label": "Memory / device" }, `${formatNumber(e.memory.total / 2 ** 30)} GiB`),
      h("td", {}, h("button", { type: "button", class: "small secondary", onclick: () => use(e.candidate) }, "Use", h("span", { class: "visually-hidden" }, ` ${e.label}`))),
    ),
  );
  box.replaceChildren(
    h("h2", {}, "Layout check"),
    h("p", { class: mine >= 0 ? "" : "notice", dataset: { rank: mine >= 0 ? ranks[mine] : 0 } }, verdict),
    h(
      "div",
      { class: "table-scroll" },
      h(
        "table",
        { class: "plan-table stack" },
        h("thead", {}, h("tr", {}, ...["Rank", "Layout", "Step", "Tokens/s", "MFU", "Memory / device", ""].map((t) => h("th", { scope: "col" }, t)))),
        h("tbody", {}, rows),
      ),
    ),
    h("details", {}, h("summary", {}, "Why"), h("pre", { class: "plan-why" }, plan.explanation ?? "")),
  );
}

/**
 * Standard competition ranks ("1, 1, 3") by step time, as the planner orders them: layouts whose
 * step times agree to the shown precision share the rank of the first of them.
 */
export function tiedRanks(ranked) {
  const ranks = [];
  ranked.forEach((e, i) => {
    const same = i > 0 && formatNumber(e.step_seconds) === formatNumber(ranked[i - 1].step_seconds);
    ranks.push(same ? ranks[i - 1] : i + 1);
  });
  return ranks;
}

/** Runs the check; returns field errors (`[{path, message}]`) for the form to show, if any. */
export async function checkLayout(box, query, layout, use) {
  box.replaceChildren(h("p", { class: "muted" }, "Checking the layout…"));
  try {
    renderPlan(box, await api(`/api/plan/?${query}`), layout, use);
    return [];
  } catch (exc) {
    if (exc instanceof ApiError && exc.status === 404) {
      box.replaceChildren(
        h("p", { class: "notice", dataset: { planner: "missing" } },
          "The layout planner is not available on this server. Launching still checks the layout: " +
          "any problem with it shows next to its input."),
      );
      return [];
    }
    if (exc instanceof ApiError && exc.status === 400 && exc.data && typeof exc.data === "object") {
      box.replaceChildren();
      return Object.entries(exc.data).flatMap(([field, messages]) =>
        [].concat(messages).map((message) => ({ path: PLAN_FIELDS[field] ?? field, message: String(message) })),
      );
    }
    box.replaceChildren(h("p", { class: "error" }, `The planner failed: ${exc.message}`));
    return [];
  }
}
