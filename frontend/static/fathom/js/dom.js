// Small DOM helpers: elements built from data (never from HTML strings holding user text),
// and the formatting every page shares.

/** `h("a", {href: "/x", class: "c"}, "text", child)`; `on*` attributes become listeners. */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (key.startsWith("on") && typeof value === "function") el.addEventListener(key.slice(2), value);
    else if (key === "dataset") Object.assign(el.dataset, value);
    else el.setAttribute(key, value === true ? "" : String(value));
  }
  for (const child of children.flat()) {
    if (child === undefined || child === null || child === false) continue;
    el.append(child instanceof Node ? child : document.createTextNode(String(child)));
  }
  return el;
}

export function statusBadge(status) {
  return h("span", { class: `badge status-${status}`, dataset: { status } }, status);
}

/** "12 s ago", "5 min ago", or a date for anything older than a day. */
export function ago(value) {
  if (!value) return "–";
  const when = typeof value === "number" ? new Date(value * 1000) : new Date(value);
  const seconds = (Date.now() - when.getTime()) / 1000;
  if (seconds < 60) return `${Math.max(0, Math.round(seconds))} s ago`;
  if (seconds < 3600) return `${Math.round(seconds / 60)} min ago`;
  if (seconds < 86400) return `${Math.round(seconds / 3600)} h ago`;
  return when.toLocaleDateString();
}

export function clockTime(epochSeconds) {
  return new Date(epochSeconds * 1000).toLocaleTimeString([], { hour12: false });
}

/** Reads a `{{ value|json_script:"id" }}` block. */
export function pageData(id) {
  const el = document.getElementById(id);
  return el ? JSON.parse(el.textContent) : null;
}

/** Runs `fn` every `ms` while the tab is visible, and at once when it becomes visible again. */
export function every(ms, fn) {
  let timer = null;
  const tick = async () => {
    try {
      if (document.visibilityState === "visible") await fn();
    } catch {
      // The page shows its own error state; the next tick tries again.
    } finally {
      timer = setTimeout(tick, ms);
    }
  };
  document.addEventListener("visibilitychange", () => {
    if (document.visibilityState === "visible") {
      clearTimeout(timer);
      tick();
    }
  });
  timer = setTimeout(tick, ms);
  return () => clearTimeout(timer);
}
