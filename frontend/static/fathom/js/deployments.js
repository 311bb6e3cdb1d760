// The deployments list, refreshed while open.

import { api, items } from "./api.js";
import { ago, every, h, statusBadge } from "./dom.js";

const REFRESH_MS = 5000;

async function refresh() {
  const error = document.getElementById("deployments-error");
  let deployments;
  try {
    deployments = items(await api("/api/deployments/"));
    error.hidden = true;
  } catch (exc) {
    error.textContent = `Could not load deployments: ${exc.message}`;
    error.hidden = false;
    return;
  }
  document.getElementById("deployments-empty").hidden = deployments.length > 0;
  document.getElementById("deployment-rows").replaceChildren(
    ...deployments.map((d) => {
      const ready = (d.replica_set ?? []).filter((r) => r.status === "ready").length;
      return h(
        "tr",
        { dataset: { deploymentId: d.id } },
        h("td", { "data-label": "Deployment" }, h("a", { href: `/deployments/${d.id}` }, d.name)),
        h("td", { "data-label": "Status" }, statusBadge(d.status)),
        h("td", { "data-label": "Model" }, h("code", {}, d.served_model_name)),
        h("td", { "data-label": "Replicas", class: "num" }, `${ready}/${d.replicas} ready`),
        h("td", { "data-label": "Created" }, ago(d.created_at)),
      );
    }),
  );
}

refresh();
every(REFRESH_MS, refresh);
