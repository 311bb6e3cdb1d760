// The launch form: uploads or picks a dataset, sends only what the user filled in, and puts
// each of the API's errors next to its own input, leaving every input as the user left it.

import { ApiError, api, flattenErrors, items } from "./api.js";
import { h, pageData } from "./dom.js";
import { checkLayout, planQuery } from "./plan.js";

const form = document.getElementById("launch-form");
const recipes = pageData("recipes");
const recipeSelect = document.getElementById("f-recipe");
const datasetSelect = document.getElementById("f-dataset");
const tokenizerSelect = document.getElementById("f-tokenizer-run");
const validationSelect = document.getElementById("f-validation-dataset");
const pretrainedSelect = document.getElementById("f-pretrained");
const modelFilesInput = document.getElementById("f-model-files");
const modelFilesStatus = document.getElementById("f-model-files-status");
const fileInput = document.getElementById("f-file");
const fileStatus = document.getElementById("f-file-status");
const summary = document.getElementById("form-errors");
const planResult = document.getElementById("plan-result");
const launchButton = document.getElementById("launch");
// The spec's inputs, and the run's Slurm options where runs go to Slurm.
const specInputs = [...form.querySelectorAll('[name^="spec."], [name^="slurm."]')];

let uploadedFile = null; // the File object the dataset select currently holds an upload of
// A clone's source spec: the form's inputs are merged over it, so what the form does not show
// (and the inputs the reader leaves as they were) stays as the source run had it.
let baseSpec = null;

// --- Recipe defaults as placeholders ----------------------------------------------------------

function recipeValue(recipe, key) {
  return key.split(".").reduce((obj, part) => (obj == null ? undefined : obj[part]), recipes[recipe]);
}

function showRecipeDefaults() {
  const recipe = recipeSelect.value;
  for (const input of specInputs) {
    const key = input.dataset.recipeKey;
    if (!key) continue;
    const value = recipeValue(recipe, key);
    if (input.tagName === "SELECT") {
      input.options[0].textContent = value === undefined ? "recipe's" : `recipe's (${value})`;
    } else {
      input.placeholder = value === undefined ? "" : String(value);
    }
  }
}

// --- Datasets ----------------------------------------------------------------------------------

function datasetLabel(d) {
  return `${d.name} · ${d.records.toLocaleString()} records · ${d.format}`;
}

async function loadDatasets(select) {
  const datasets = items(await api("/api/datasets/"));
  const current = select ?? datasetSelect.value;
  datasetSelect.replaceChildren(
    h("option", { value: "" }, "Built-in demo corpus"),
    ...datasets.map((d) => h("option", { value: d.id }, datasetLabel(d))),
  );
  datasetSelect.value = String(current ?? "");
  const held = validationSelect.value;
  validationSelect.replaceChildren(
    h("option", { value: "" }, "None (or a validation split, under Evaluation)"),
    ...datasets.map((d) => h("option", { value: d.id }, datasetLabel(d))),
  );
  validationSelect.value = held;
}

async function upload() {
  const file = fileInput.files[0];
  if (!file) return;
  clearError("file");
  fileStatus.textContent = `Uploading ${file.name}…`;
  const body = new FormData();
  body.append("file", file);
  try {
    const dataset = await api("/api/datasets/", { method: "POST", form: body });
    uploadedFile = file;
    await loadDatasets(dataset.id);
    fileStatus.textContent = `Uploaded ${dataset.name}: ${dataset.records.toLocaleString()} records.`;
    fileStatus.dataset.datasetId = dataset.id;
  } catch (exc) {
    fileStatus.textContent = "";
    showErrors(exc instanceof ApiError && exc.status === 400 ? exc.data : { file: [exc.message] });
    throw exc;
  }
}

fileInput.addEventListener("change", () => upload().catch(() => {}));

// --- Pretrained models -------------------------------------------------------------------------

function modelLabel(m) {
  return `${m.name} · ${m.model.n_layers} layers · dim ${m.model.dim} · vocab ${m.model.vocab_size}`;
}

async function loadPretrained(select) {
  const models = items(await api("/api/pretrained-models/"));
  const current = select ?? pretrainedSelect.value;
  pretrainedSelect.replaceChildren(
    h("option", { value: "" }, "A new model (the recipe's sizes)"),
    ...models.map((m) => h("option", { value: m.id }, modelLabel(m))),
  );
  pretrainedSelect.value = String(current ?? "");
}

async function uploadModel() {
  const files = [...modelFilesInput.files];
  if (!files.length) return;
  clearError("files");
  modelFilesStatus.textContent = `Uploading ${files.length} files…`;
  const body = new FormData();
  for (const file of files) body.append("files", file);
  await pretrainedLoaded; // the first listing must not land after this upload's and unselect it
  try {
    const model = await api("/api/pretrained-models/", { method: "POST", form: body });
    await loadPretrained(model.id);
    modelFilesStatus.textContent = `Uploaded ${modelLabel(model)}.`;
  } catch (exc) {
    modelFilesStatus.textContent = "";
    showErrors(exc instanceof ApiError && exc.status === 400 ? exc.data : { files: [exc.message] });
  }
}

modelFilesInput.addEventListener("change", () => uploadModel());

// A run has a tokenizer once its ranks prepared the data, so runs still waiting are not offered.
async function loadTokenizerRuns() {
  const runs = items(await api("/api/runs/?status=running,restarting,succeeded,failed,cancelled&limit=100"));
  tokenizerSelect.append(...runs.map((r) => h("option", { value: r.id }, `run ${r.id} · ${r.name}`)));
}

// --- The body sent to the API -------------------------------------------------------------------

function setPath(target, path, value) {
  const parts = path.split(".");
  let obj = target;
  for (const [i, part] of parts.slice(0, -1).entries()) {
    const nextIsIndex = /^\d+$/.test(parts[i + 1]);
    obj[part] ??= nextIsIndex ? [] : {};
    obj = obj[part];
  }
  obj[parts[parts.length - 1]] = value;
}

/** The run body, or `{errors}` for inputs the browser could not read as numbers. */
function readForm() {
  const body = { recipe: recipeSelect.value };
  if (baseSpec) body.spec = structuredClone(baseSpec);
  const errors = [];
  const name = form.elements.namedItem("name").value.trim();
  if (name) body.name = name;
  body.dataset = datasetSelect.value ? Number(datasetSelect.value) : null;
  if (tokenizerSelect.value) body.tokenizer_run = Number(tokenizerSelect.value);
  if (validationSelect.value) body.validation_dataset = Number(validationSelect.value);
  if (pretrainedSelect.value) body.pretrained = Number(pretrainedSelect.value);
  const faultChosen = form.elements.namedItem("spec.faults.0.kind").value !== "";
  for (const input of specInputs) {
    if (input.name.startsWith("spec.faults.") && !faultChosen) continue;
    if (input.validity?.badInput) {
      errors.push({ path: input.name, message: "must be a number" });
      continue;
    }
    const raw = input.value.trim();
    if (raw === "") continue;
    const kind = input.dataset.kind;
    // Numbers go as numbers, even malformed ones (2.5 for a degree): the API says what is wrong.
    const value = kind === "text" ? raw : kind === "choice" ? (/^-?\d+$/.test(raw) ? Number(raw) : raw) : Number(raw);
    setPath(body, input.name, value);
  }
  return { body, errors };
}

// --- Errors next to their inputs ----------------------------------------------------------------

function errorSlot(path) {
  // An error on "spec.faults.0" (the whole item) or on a section lands on its first input.
  let probe = path;
  while (probe) {
    const slot = form.querySelector(`[data-error-for="${CSS.escape(probe)}"]`);
    if (slot) return slot;
    const prefix = form.querySelector(`[data-error-for^="${CSS.escape(probe)}."]`);
    if (prefix) return prefix;
    probe = probe.includes(".") ? probe.slice(0, probe.lastIndexOf(".")) : "";
  }
  return null;
}

function clearError(path) {
  const slot = form.querySelector(`[data-error-for="${CSS.escape(path)}"]`);
  if (!slot) return;
  slot.hidden = true;
  slot.textContent = "";
  form.elements.namedItem(path)?.removeAttribute("aria-invalid");
}

function clearErrors() {
  for (const slot of form.querySelectorAll("[data-error-for]")) clearError(slot.dataset.errorFor);
  summary.hidden = true;
  summary.querySelector("ul").replaceChildren();
}

/** Shows every error next to its input (and in the summary); returns the first input to fix. */
function showErrors(data) {
  const errors = Array.isArray(data) && data.every((e) => e && typeof e === "object" && "path" in e) ? data : flattenErrors(data);
  const list = summary.querySelector("ul");
  let first = null;
  for (const { path, message } of errors) {
    const slot = errorSlot(path);
    const input = slot ? form.elements.namedItem(slot.dataset.errorFor) : null;
    if (slot) {
      slot.textContent = slot.hidden ? message : `${slot.textContent} ${message}`;
      slot.hidden = false;
      input?.setAttribute("aria-invalid", "true");
      const details = slot.closest("details");
      if (details) details.open = true;
      first ??= input;
    }
    const label = input ? form.querySelector(`label[for="${input.id}"]`)?.textContent : path;
    const text = `${label || "Run"}: ${message}`;
    list.append(h("li", {}, input ? h("a", { href: `#${input.id}` }, text) : text));
  }
  summary.hidden = errors.length === 0;
  return first;
}

// --- Launch -------------------------------------------------------------------------------------

form.addEventListener("submit", async (event) => {
  event.preventDefault();
  clearErrors();
  launchButton.disabled = true;
  launchButton.textContent = "Launching…";
  try {
    if (fileInput.files[0] && fileInput.files[0] !== uploadedFile) await upload();
    const { body, errors } = readForm();
    if (errors.length) {
      (showErrors(errors) ?? summary).focus();
      return;
    }
    const run = await api("/api/runs/", { method: "POST", json: body });
    location.assign(`/runs/${run.id}`);
  } catch (exc) {
    const data = exc instanceof ApiError && exc.status === 400 ? exc.data : [{ path: "", message: exc.message }];
    const first = showErrors(data);
    (first ?? summary).focus();
  } finally {
    launchButton.disabled = false;
    launchButton.textContent = "Launch run";
  }
});

// --- Check layout (the planner) -----------------------------------------------------------------

/** What an input holds, or the recipe's value for it when it is empty. */
function effectiveValue(path) {
  if (path === "recipe") return recipeSelect.value;
  const input = form.elements.namedItem(path);
  const raw = input?.value?.trim() ?? "";
  if (raw !== "") return /^-?[\d.e]+$/i.test(raw) ? Number(raw) : raw;
  return input?.dataset.recipeKey ? recipeValue(recipeSelect.value, input.dataset.recipeKey) : undefined;
}

function useCandidate(candidate) {
  const set = (path, value) => {
    const input = form.elements.namedItem(path);
    input.value = String(value);
    clearError(path);
  };
  for (const dim of ["dp", "tp", "pp", "zero", "recompute", "schedule", "stages_per_rank"]) set(`spec.layout.${dim}`, candidate[dim]);
  // The planner counts micro-batch size; the spec counts micro-batches per local batch.
  const local = Number(effectiveValue("spec.train.global_batch")) / candidate.dp;
  set("spec.layout.microbatches", candidate.pp > 1 ? Math.max(1, Math.floor(local / candidate.micro_batch)) : 1);
  form.elements.namedItem("spec.layout.dp").focus();
}

document.getElementById("check-layout").addEventListener("click", async () => {
  clearErrors();
  const { body, errors } = readForm();
  if (errors.length) {
    showErrors(errors)?.focus();
    return;
  }
  // The spec is checked first, as Launch would check it: a layout the trainer refuses (tp that
  // does not divide the heads) is an error next to its input, not a rank among layouts.
  planResult.replaceChildren(h("p", { class: "muted" }, "Checking the run…"));
  let spec;
  try {
    ({ spec } = await api("/api/runs/check/", { method: "POST", json: body }));
  } catch (exc) {
    const data = exc instanceof ApiError && exc.status === 400 ? exc.data : [{ path: "", message: exc.message }];
    planResult.replaceChildren(
      h("p", { class: "notice", dataset: { check: "invalid" } }, "This run would not launch: fix the errors shown above, then check the layout again."),
    );
    (showErrors(data) ?? summary).focus();
    return;
  }
  const layout = {
    dp: spec.layout.dp,
    tp: spec.layout.tp,
    pp: spec.layout.pp,
    zero: spec.layout.zero ?? 0,
    recompute: spec.layout.recompute ?? "none",
  };
  const resolved = (path) => (path === "recipe" ? recipeSelect.value : path.split(".").slice(1).reduce((o, k) => o?.[k], spec));
  const query = planQuery(resolved, document.getElementById("plan-gpu").value);
  const planErrors = await checkLayout(planResult, query, layout, useCandidate);
  if (planErrors.length) showErrors(planErrors)?.focus();
});

recipeSelect.addEventListener("change", showRecipeDefaults);
for (const input of form.querySelectorAll("input, select")) {
  input.addEventListener("input", () => input.name && clearError(input.name));
}
// --- Clone: the form filled in from an earlier run ----------------------------------------------

/** Puts every value of the source run's spec that the form has an input for into that input. */
async function prefillFrom(runId) {
  const source = await api(`/api/runs/${runId}/`);
  const { data: _data, ...spec } = source.spec; // data is named through the dataset and tokenizer fields
  baseSpec = spec;
  // A run from a pretrained model takes its sizes from it again; only the context length is its own.
  const fromPretrained = source.pretrained != null;
  if (fromPretrained) baseSpec.model = { seq_len: source.spec.model.seq_len };
  form.elements.namedItem("name").value = `${source.name} (clone)`;
  for (const input of specInputs) {
    if (fromPretrained && input.name.startsWith("spec.model.") && input.name !== "spec.model.seq_len") continue;
    const root = input.name.startsWith("slurm.") ? source.slurm : source.spec;
    const value = input.name.split(".").slice(1).reduce((o, k) => o?.[k], root);
    if (value === undefined || value === null || typeof value === "object") continue;
    input.value = String(value);
  }
  await Promise.all([datasetsLoaded, tokenizersLoaded, pretrainedLoaded]);
  pretrainedSelect.value = fromPretrained ? String(source.pretrained) : "";
  datasetSelect.value = source.dataset == null ? "" : String(source.dataset);
  tokenizerSelect.value = source.tokenizer_run == null ? "" : String(source.tokenizer_run);
  validationSelect.value = source.validation_dataset == null ? "" : String(source.validation_dataset);
  document.getElementById("form-title").textContent = `Clone run #${source.id}`;
  form.dataset.cloneOf = String(source.id);
}

showRecipeDefaults();
const datasetsLoaded = loadDatasets().catch((exc) => showErrors({ dataset: [`could not list datasets: ${exc.message}`] }));
const pretrainedLoaded = loadPretrained().catch((exc) => showErrors({ pretrained: [`could not list models: ${exc.message}`] }));
const tokenizersLoaded = loadTokenizerRuns().catch((exc) => showErrors({ tokenizer_run: [`could not list runs: ${exc.message}`] }));
const cloneOf = new URLSearchParams(location.search).get("from");
if (cloneOf) {
  // Until the source run's values are in, Launch would start a run from the recipe's defaults.
  launchButton.disabled = true;
  form.setAttribute("aria-busy", "true");
  prefillFrom(cloneOf)
    .catch((exc) => showErrors([{ path: "", message: `could not read run ${cloneOf}: ${exc.message}` }]))
    .finally(() => {
      launchButton.disabled = false;
      form.removeAttribute("aria-busy");
    });
}
