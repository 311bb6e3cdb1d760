// The projects page: create a project, add, change and remove members, delete a project, all
// through /api/projects/; the page reloads after each change to show what the server holds.

import { api } from "./api.js";

function showError(box, exc) {
  box.textContent = exc ? exc.message : "";
  box.hidden = !exc;
}

async function change(box, call) {
  showError(box, null);
  try {
    await call();
    location.reload();
  } catch (exc) {
    showError(box, exc);
  }
}

document.getElementById("new-project").addEventListener("submit", (event) => {
  event.preventDefault();
  const name = document.getElementById("project-name").value.trim();
  change(document.querySelector('[data-error-for="new-project"]'), () => api("/api/projects/", { method: "POST", json: { name } }));
});

for (const section of document.querySelectorAll("section.project")) {
  const id = section.dataset.projectId;
  const box = section.querySelector('[data-error-for="members"]');
  section.querySelector("form.add-member")?.addEventListener("submit", (event) => {
    event.preventDefault();
    const form = event.target;
    const json = { username: form.elements.username.value.trim(), role: form.elements.role.value };
    change(box, () => api(`/api/projects/${id}/members/`, { method: "POST", json }));
  });
  for (const button of section.querySelectorAll("[data-remove]")) {
    button.addEventListener("click", () =>
      change(box, () => api(`/api/projects/${id}/members/${encodeURIComponent(button.dataset.remove)}/`, { method: "DELETE" })),
    );
  }
  section.querySelector(".delete-project")?.addEventListener("click", () => {
    const name = section.querySelector("h2").textContent;
    if (!confirm(`Delete project "${name}"? Its runs stay, shared with no one.`)) return;
    change(box, () => api(`/api/projects/${id}/`, { method: "DELETE" }));
  });
}
