// Shared page pieces: KPI tiles, labelled form fields, the time-window picker, messages.

import { clear, h, newId } from "./dom";

export interface Kpi {
  el: HTMLElement;
  set(value: string, sub?: string): void;
}

export function kpi(name: string, label: string, hint = ""): Kpi {
  const value = h("div", { class: "kpi-value" }, "…");
  const sub = h("div", { class: "kpi-sub" }, hint);
  const el = h("div", { class: "kpi", "data-kpi": name }, h("div", { class: "kpi-label" }, label), value, sub);
  return {
    el,
    set(v: string, s?: string) {
      value.textContent = v;
      if (s !== undefined) sub.textContent = s;
    },
  };
}

export interface Field {
  wrap: HTMLElement;
  input: HTMLInputElement | HTMLSelectElement;
  setError(message: string | null): void;
  value(): string;
}

export function field(o: {
  name: string;
  label: string;
  hint?: string;
  type?: string;
  value?: string;
  placeholder?: string;
  required?: boolean;
  options?: [string, string][]; // a <select>: [value, text]
  autocomplete?: string;
  list?: string;
}): Field {
  const id = newId(`f-${o.name}`);
  const hintId = `${id}-hint`;
  const errId = `${id}-error`;
  let input: HTMLInputElement | HTMLSelectElement;
  if (o.options) {
    input = h("select", { id, name: o.name });
    for (const [v, t] of o.options) input.appendChild(h("option", { value: v }, t));
    if (o.value !== undefined) input.value = o.value;
  } else {
    input = h("input", { id, name: o.name, type: o.type ?? "text", placeholder: o.placeholder,
      autocomplete: o.autocomplete ?? "off", required: o.required, list: o.list, spellcheck: "false" });
    if (o.value !== undefined) input.value = o.value;
  }
  input.setAttribute("aria-describedby", `${o.hint ? hintId + " " : ""}${errId}`);
  const err = h("div", { class: "field-error", id: errId });
  const wrap = h("div", { class: "field", "data-field": o.name },
    h("label", { for: id }, o.label),
    input,
    o.hint ? h("div", { class: "field-hint", id: hintId }, o.hint) : null,
    err);
  return {
    wrap,
    input,
    setError(message) {
      err.textContent = message ?? "";
      if (message) input.setAttribute("aria-invalid", "true");
      else input.removeAttribute("aria-invalid");
    },
    value: () => input.value.trim(),
  };
}

/** A message area: role=alert for errors, role=status for the rest. */
export function messageBox(): { el: HTMLElement; error(text: string): void; ok(text: string): void; clear(): void } {
  const el = h("div", { class: "message", role: "status" });
  return {
    el,
    error(text) {
      el.setAttribute("role", "alert");
      el.className = "message error";
      el.textContent = text;
    },
    ok(text) {
      el.setAttribute("role", "status");
      el.className = "message ok";
      el.textContent = text;
    },
    clear() {
      el.className = "message";
      clear(el);
    },
  };
}

// ---------------------------------------------------------------- time window
export const WINDOWS: [string, string, number][] = [
  ["15m", "Last 15 minutes", 15],
  ["1h", "Last hour", 60],
  ["6h", "Last 6 hours", 360],
  ["24h", "Last 24 hours", 1440],
  ["7d", "Last 7 days", 10080],
];

export interface Range {
  since: string;
  until: string;
  sinceMs: number;
  untilMs: number;
}

/** ``[since, until)``: until is the start of the next minute, so the current minute counts. */
export function rangeOf(win: string, now = Date.now()): Range {
  const minutes = (WINDOWS.find(([k]) => k === win) ?? WINDOWS[1])[2];
  const untilMs = Math.floor(now / 60000) * 60000 + 60000;
  const sinceMs = untilMs - minutes * 60000;
  return { since: new Date(sinceMs).toISOString(), until: new Date(untilMs).toISOString(), sinceMs, untilMs };
}

export function windowPicker(value: string, onChange: (w: string) => void): HTMLElement {
  const f = field({ name: "window", label: "Time window", options: WINDOWS.map(([k, t]) => [k, t]), value });
  f.input.addEventListener("change", () => onChange(f.value()));
  f.wrap.classList.add("inline");
  return f.wrap;
}

export function pageHeader(title: string, ...controls: (HTMLElement | null)[]): HTMLElement {
  return h("div", { class: "page-header" }, h("h1", {}, title), h("div", { class: "controls" }, controls));
}

export function section(title: string, ...children: (Node | null)[]): HTMLElement {
  const id = newId("sec");
  return h("section", { class: "card", "aria-labelledby": id }, h("h2", { id }, title), children);
}

export function table(headers: string[], cls = ""): { el: HTMLTableElement; body: HTMLTableSectionElement } {
  const body = h("tbody");
  const el = h("table", { class: `grid ${cls}` },
    h("thead", {}, h("tr", {}, headers.map((t) => h("th", { scope: "col" }, t)))), body);
  return { el, body };
}

/** How a (tenant, user) pair is named everywhere (chart legends, tables). */
/** The API's rule for a new tenant or tier name (gateway/core/text.py NAME_PATTERN): null when valid. */
const NAME_RE = /^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$/;
export function nameError(n: string): string | null {
  if (!n) return "Required.";
  if (n.length > 64) return "At most 64 characters.";
  return NAME_RE.test(n) ? null : "Letters, digits, . _ @ and -, starting with a letter or digit.";
}

export function userLabel(tenant: string, user: string | null): string {
  return `${user ?? "(no user)"} · ${tenant}`;
}

/** Repeat ``fn`` every ``ms`` while the page is shown (stopped by ``onLeave``). */
export function every(ms: number, fn: () => Promise<void> | void, onLeave: (f: () => void) => void): void {
  let busy = false;
  const tick = async () => {
    if (busy || document.hidden) return;
    busy = true;
    try {
      await fn();
    } catch {
      /* the page shows its own error state */
    } finally {
      busy = false;
    }
  };
  const id = window.setInterval(tick, ms);
  onLeave(() => window.clearInterval(id));
}
