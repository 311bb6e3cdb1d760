// The hosts list, refreshed while open: devices (free of all), who holds them, the processes the
// host worker reports, last heartbeat; for staff, drain, undrain and remove.

import { api, items } from "./api.js";
import { ago, every, h, statusBadge } from "./dom.js";

const REFRESH_MS = 2000;

function devicesText(host) {
  const word = host.kind === "gpu" ? "GPU" : "CPU slot";
  const total = host.devices.length;
  const model = host.kind === "gpu" && total ? ` (${host.devices[0].model})` : "";
  return `${host.free} of ${total} ${word}${total === 1 ? "" : "s"} free${model}`;
}

function runsCell(host) {
  // Claims name the run and node each device is given to.
  const nodes = new Map();
  for (const claim of host.claims) {
    const key = claim.run ? `run ${claim.run} node ${claim.node}` : `deployment ${claim.deployment} replica ${claim.node}`;
    nodes.set(key, [...(nodes.get(key) ?? []), claim.device]);
  }
  if (!nodes.size) return "–";
  return h(
    "ul",
    { class: "plain" },
    ...[...nodes].map(([key, devices]) => h("li", {}, `${key}: device ${devices.join(", ")}`)),
  );
}

const staff = document.getElementById("host-rows").dataset.staff === "true";

async function act(host, action) {
  if (action === "remove" && !confirm(`Remove host ${host.name}? A machine may then join under its name again.`)) return;
  // Its own line: the list's refresh clears only the list's error.
  const error = document.getElementById("host-action-error");
  try {
    await api(`/api/hosts/${host.id}/${action}/`, { method: "POST" });
    error.hidden = true;
  } catch (exc) {
    error.textContent = `Could not ${action} ${host.name}: ${exc.message}`;
    error.hidden = false;
  }
  await refresh();
}

function actionsCell(host) {
  const button = (action, label, kind) =>
    h("button", { type: "button", class: `small ${kind}`, onclick: () => act(host, action) }, label);
  return h(
    "td",
    { "data-label": "Actions" },
    host.status === "ready" ? button("drain", "Drain", "secondary") : null,
    host.status === "draining" ? button("undrain", "Undrain", "secondary") : null,
    " ",
    button("remove", "Remove", "danger"),
  );
}

async function refresh() {
  const error = document.getElementById("hosts-error");
  let hosts;
  try {
    hosts = items(await api("/api/hosts/"));
    error.hidden = true;
  } catch (exc) {
    error.textContent = `Could not load hosts: ${exc.message}`;
    error.hidden = false;
    return;
  }
  document.getElementById("hosts-empty").hidden = hosts.length > 0;
  document.getElementById("host-rows").replaceChildren(
    ...hosts.map((host) =>
      h(
        "tr",
        { dataset: { host: host.name } },
        h("td", { "data-label": "Host" }, host.name),
        h("td", { "data-label": "Status" }, statusBadge(host.status)),
        h("td", { "data-label": "Address" }, h("code", {}, host.address)),
        h("td", { "data-label": "Devices" }, devicesText(host)),
        h("td", { "data-label": "Runs" }, runsCell(host)),
        h("td", { "data-label": "Processes" }, host.running.map((p) => p.key).join(", ") || "–"),
        h("td", { "data-label": "Last heartbeat" }, ago(host.last_seen)),
        staff ? actionsCell(host) : null,
      ),
    ),
  );
}

refresh();
every(REFRESH_MS, refresh);
