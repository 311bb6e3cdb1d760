// Calls to Fathom's REST API from the browser: session cookie + CSRF header, JSON in and out,
// and the API's nested validation errors flattened to dotted field paths.

/** The CSRF token Django set in its cookie (the page's meta tag when the cookie is absent). */
export function csrfToken() {
  const cookie = document.cookie.split("; ").find((part) => part.startsWith("csrftoken="));
  if (cookie) return decodeURIComponent(cookie.slice("csrftoken=".length));
  return document.querySelector('meta[name="csrf-token"]')?.content ?? "";
}

/** An answer that was not 2xx; `data` holds the parsed body (nested field errors for a 400). */
export class ApiError extends Error {
  constructor(status, data) {
    super(describe(status, data));
    this.status = status;
    this.data = data;
  }
}

function describe(status, data) {
  if (data && typeof data === "object") {
    if (typeof data.detail === "string") return data.detail;
    const first = flattenErrors(data)[0];
    if (first) return first.path ? `${first.path}: ${first.message}` : first.message;
  }
  if (typeof data === "string" && data && !data.trimStart().startsWith("<")) return data;
  return `The server answered ${status}.`;
}

/**
 * `api("/api/runs/", {method: "POST", json: {...}})` → the parsed body; throws ApiError.
 * `form` sends a FormData (multipart) instead of JSON.
 */
export async function api(path, { method = "GET", json, form, signal } = {}) {
  const headers = { Accept: "application/json" };
  let body;
  if (json !== undefined) {
    headers["Content-Type"] = "application/json";
    body = JSON.stringify(json);
  } else if (form !== undefined) {
    body = form;
  }
  if (method !== "GET" && method !== "HEAD") headers["X-CSRFToken"] = csrfToken();
  const response = await fetch(path, { method, headers, body, signal, credentials: "same-origin" });
  const text = await response.text();
  let data = text;
  if ((response.headers.get("Content-Type") || "").includes("json") && text) {
    data = JSON.parse(text);
  }
  if (!response.ok) throw new ApiError(response.status, data);
  return data;
}

/** A list endpoint's items, whether it answered a page (`{results: [...]}`) or a bare list. */
export function items(data) {
  return Array.isArray(data) ? data : data?.results ?? [];
}

/**
 * `{"spec": {"layout": {"tp": ["msg"]}}, "name": ["msg"]}` →
 * `[{path: "spec.layout.tp", message: "msg"}, {path: "name", message: "msg"}]`.
 * Errors that belong to no field (`non_field_errors`, `detail`) get the path of their parent.
 */
export function flattenErrors(errors, prefix = "") {
  const out = [];
  if (Array.isArray(errors)) {
    for (const item of errors) {
      if (item && typeof item === "object") out.push(...flattenErrors(item, prefix));
      else out.push({ path: prefix, message: String(item) });
    }
  } else if (errors && typeof errors === "object") {
    for (const [key, value] of Object.entries(errors)) {
      const own = key === "non_field_errors" || key === "detail";
      out.push(...flattenErrors(value, own ? prefix : prefix ? `${prefix}.${key}` : key));
    }
  } else if (errors !== undefined && errors !== null) {
    out.push({ path: prefix, message: String(errors) });
  }
  return out;
}
