// The queue, refreshed while open: each waiting run's place, what orders it (priority, its share's
// recent use), what it needs, why it waits and the head's reservation; and the viewer's quota.

import { api } from "./api.js";
import { every, h } from "./dom.js";

const REFRESH_MS = 2000;

function limitText(limit) {
  return limit.limit === null ? `${limit.in_use} (no limit)` : `${limit.in_use} of ${limit.limit}`;
}

function quotaFacts(quota) {
  const facts = [
    ["Highest priority you may submit", quota.priority_ceiling === null ? "any (staff)" : String(quota.priority_ceiling)],
    ["GPUs your runs hold", limitText(quota.user.gpus)],
    ["CPU slots your runs hold", limitText(quota.user.cpu_slots)],
    ["Your queued runs", limitText(quota.user.queued_runs)],
  ];
  for (const project of quota.projects) {
    const who = `Project ${project.name}`;
    facts.push([`${who}: GPUs`, limitText(project.gpus)], [`${who}: CPU slots`, limitText(project.cpu_slots)]);
    facts.push([`${who}: may be preempted`, project.preemptible ? "yes" : "no"]);
  }
  return facts.flatMap(([term, value]) => [h("dt", {}, term), h("dd", {}, value)]);
}

function runCell(entry) {
  return entry.name === null ? `run ${entry.id}` : h("a", { href: `/runs/${entry.id}` }, entry.name);
}

function reasonCell(entry) {
  const held = entry.reservation?.devices;
  const when = entry.reservation?.expected_at ? ` (expected by ${new Date(entry.reservation.expected_at).toLocaleTimeString()})` : "";
  return h(
    "td",
    { "data-label": "Why it waits" },
    entry.status_reason || "–",
    held?.length ? h("div", { class: "muted reservation" }, `Holds in reserve: ${held.join(", ")}${when}`) : null,
  );
}

async function refresh() {
  const error = document.getElementById("queue-error");
  let queue;
  let quota;
  try {
    [queue, quota] = await Promise.all([api("/api/queue/"), api("/api/quota/")]);
    error.hidden = true;
  } catch (exc) {
    error.textContent = `Could not load the queue: ${exc.message}`;
    error.hidden = false;
    return;
  }
  document.getElementById("quota").replaceChildren(...quotaFacts(quota));
  document.getElementById("queue-empty").hidden = queue.length > 0;
  document.getElementById("queue-rows").replaceChildren(
    ...queue.map((entry) =>
      h(
        "tr",
        { dataset: { run: String(entry.id) } },
        h("td", { "data-label": "#" }, String(entry.position)),
        h("td", { "data-label": "Run" }, runCell(entry)),
        h("td", { "data-label": "Owner" }, entry.owner),
        h("td", { "data-label": "Priority" }, String(entry.priority)),
        h("td", { "data-label": "Share" }, `${entry.share} (${entry.share_recent_slots.toFixed(2)} slots lately)`),
        h("td", { "data-label": "Needs" }, entry.needs),
        reasonCell(entry),
      ),
    ),
  );
}

refresh();
every(REFRESH_MS, refresh);
