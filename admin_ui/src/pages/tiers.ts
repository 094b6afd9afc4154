import { ApiError, get, patch, post, type List, type Tier } from "../api";
import { clear, fmt, fmtInt, h } from "../dom";
import type { Ctx } from "../main";
import { field, messageBox, nameError, pageHeader, section, table, type Field } from "../ui";

type Kind = "positive" | "positiveInt" | "int" | "nonNegative";
interface Spec {
  key: keyof Tier;
  label: string;
  hint: string;
  kind: Kind;
  optional: boolean; // blank = unlimited (null)
}

const FIELDS: Spec[] = [
  { key: "min_tokens_per_s", label: "Min tokens/s per user", hint: "SLA target; blank = none", kind: "positive", optional: true },
  { key: "max_concurrent", label: "Max concurrent requests", hint: "per tenant; blank = unlimited", kind: "positiveInt", optional: true },
  { key: "rpm", label: "Requests per minute", hint: "per tenant; blank = unlimited", kind: "positiveInt", optional: true },
  { key: "tpm", label: "Tokens per minute", hint: "prompt + max_tokens, per tenant; blank = unlimited", kind: "positiveInt", optional: true },
  { key: "priority", label: "Priority", hint: "larger is admitted first", kind: "int", optional: false },
  { key: "max_queue_wait_s", label: "Max queue wait (s)", hint: "before a queued request gets 429", kind: "nonNegative", optional: false },
];

/** Parse one field; returns [value, error]. */
export function parseField(spec: Spec, raw: string): [number | null, string | null] {
  if (raw === "") return spec.optional ? [null, null] : [null, "Required."];
  const n = Number(raw);
  if (!Number.isFinite(n)) return [null, "Enter a number."];
  const int = spec.kind === "positiveInt" || spec.kind === "int";
  if (int && !Number.isInteger(n)) return [null, "Enter a whole number."];
  if ((spec.kind === "positive" || spec.kind === "positiveInt") && n <= 0) {
    return [null, `Must be greater than 0${spec.optional ? " (leave blank for unlimited)" : ""}.`];
  }
  if (spec.kind === "nonNegative" && n < 0) return [null, "Must be 0 or more."];
  return [n, null];
}

function limit(v: number | null, digits = 0): string {
  return v === null ? "unlimited" : digits ? fmt(v, digits) : fmtInt(v);
}

/** A tier form (create when ``tier`` is null, else edit). */
function tierForm(tier: Tier | null, done: (t: Tier) => void, cancel: (() => void) | null): HTMLElement {
  const msg = messageBox();
  const name = tier ? null : field({ name: "name", label: "Name", hint: "letters, digits, _ . -", required: true });
  const fields: [Spec, Field][] = FIELDS.map((s) => {
    const v = tier ? tier[s.key] : s.key === "priority" ? 0 : s.key === "max_queue_wait_s" ? 10 : null;
    return [s, field({ name: s.key, label: s.label, hint: s.hint, value: v === null ? "" : String(v), type: "text" })];
  });
  for (const [, f] of fields) (f.input as HTMLInputElement).inputMode = "decimal";
  const submit = h("button", { type: "submit", class: "primary" }, tier ? "Save" : "Create tier");
  const form = h("form", { class: "tier-form", novalidate: true, "data-tier": tier?.name ?? "" },
    h("div", { class: "form-grid" }, name?.wrap ?? null, fields.map(([, f]) => f.wrap)),
    msg.el,
    h("div", { class: "buttons" }, submit,
      cancel ? h("button", { type: "button", onclick: cancel }, "Cancel") : null));
  form.addEventListener("submit", async (e) => {
    e.preventDefault();
    msg.clear();
    const body: Record<string, unknown> = {};
    let firstBad: Field | null = null;
    if (name) {
      name.setError(null);
      const n = name.value();
      const err = nameError(n);
      name.setError(err);
      if (err) firstBad = name;
      body.name = n;
    }
    for (const [s, f] of fields) {
      const [v, err] = parseField(s, f.value());
      f.setError(err);
      if (err && !firstBad) firstBad = f;
      if (!err) body[s.key] = v;
    }
    if (firstBad) {
      msg.error("Please fix the highlighted fields.");
      firstBad.input.focus();
      return;
    }
    submit.setAttribute("disabled", "");
    try {
      const saved = tier ? await patch<Tier>(`/admin/v1/tiers/${encodeURIComponent(tier.name)}`, body)
        : await post<Tier>("/admin/v1/tiers", body);
      done(saved);
    } catch (err) {
      const e2 = err as ApiError;
      const target = e2.param ? fields.find(([s]) => s.key === e2.param)?.[1] ?? (e2.param === "name" ? name : null) : null;
      target?.setError(e2.message);
      msg.error(`Not saved: ${e2.message}`);
    } finally {
      submit.removeAttribute("disabled");
    }
  });
  return form;
}

/** SLA tiers: list, edit, create. */
export async function renderTiers(_ctx: Ctx): Promise<HTMLElement> {
  const status = messageBox();
  const list = h("div");
  const editor = h("div", { class: "editor" });

  async function reload(): Promise<void> {
    const tiers = (await get<List<Tier>>("/admin/v1/tiers")).data;
    const t = table(["Name", "Priority", "Min tok/s per user", "Max concurrent", "RPM", "TPM", "Max queue wait", ""], "tiers");
    for (const tier of tiers) {
      const edit = h("button", { type: "button", "aria-label": `Edit tier ${tier.name}` }, "Edit");
      edit.addEventListener("click", () => {
        clear(editor);
        editor.append(h("h3", {}, `Edit tier ${tier.name}`), tierForm(tier, async (saved) => {
          clear(editor);
          await reload();
          status.ok(`Tier ${saved.name} saved.`);
        }, () => {
          clear(editor);
          edit.focus();
        }));
        (editor.querySelector("input") as HTMLInputElement | null)?.focus();
      });
      t.body.appendChild(h("tr", { "data-tier": tier.name },
        h("th", { scope: "row" }, tier.name),
        h("td", { class: "num" }, String(tier.priority)),
        h("td", { class: "num", "data-col": "min_tokens_per_s" }, tier.min_tokens_per_s === null ? "none" : fmt(tier.min_tokens_per_s, 1)),
        h("td", { class: "num", "data-col": "max_concurrent" }, limit(tier.max_concurrent)),
        h("td", { class: "num", "data-col": "rpm" }, limit(tier.rpm)),
        h("td", { class: "num", "data-col": "tpm" }, limit(tier.tpm)),
        h("td", { class: "num", "data-col": "max_queue_wait_s" }, `${fmt(tier.max_queue_wait_s, 1)} s`),
        h("td", {}, edit)));
    }
    clear(list);
    list.append(h("div", { class: "table-wrap" }, t.el));
  }
  await reload();

  const create = h("div");
  const resetCreate = () => {
    clear(create);
    create.append(tierForm(null, async (saved) => {
      resetCreate();
      await reload();
      status.ok(`Tier ${saved.name} created.`);
    }, null));
  };
  resetCreate();
  return h("div", { class: "page tiers" },
    pageHeader("SLA tiers"),
    status.el,
    section("Tiers", list, h("p", { class: "muted small" },
      "Changes apply at once on this replica and within the auth cache TTL (5 s by default) on the others."), editor),
    section("Create a tier", create));
}
