import { ApiError, get, patch, post, type Key, type KeyCreated, type List, type Tenant, type Tier } from "../api";
import { clear, fmtInt, h, newId, when } from "../dom";
import type { Ctx } from "../main";
import { field, messageBox, nameError, pageHeader, section, table } from "../ui";


function optInt(raw: string, label: string): [number | null, string | null] {
  if (raw === "") return [null, null];
  const n = Number(raw);
  if (!Number.isInteger(n) || n <= 0) return [null, `${label} must be a whole number greater than 0 (or blank).`];
  return [n, null];
}

async function copyText(input: HTMLInputElement): Promise<boolean> {
  try {
    await navigator.clipboard.writeText(input.value);
    return true;
  } catch {
    input.select(); // not a secure context: fall back to the selection
    return document.execCommand("copy");
  }
}

/** Tenants & keys: create tenant, set its tier, create key (shown once), revoke key. */
export async function renderTenants(ctx: Ctx): Promise<HTMLElement> {
  const status = messageBox();
  const tenantsBox = h("div");
  const keysBox = h("div");
  const created = h("div", { class: "created-key", "aria-live": "polite" });
  let tiers: Tier[] = [];
  let tenants: Tenant[] = [];
  const filter = ctx.params.get("tenant") ?? "";
  const tenantList = newId("tenants");
  const datalist = h("datalist", { id: tenantList });

  async function reload(): Promise<void> {
    const [t, ts, ks] = await Promise.all([
      get<List<Tier>>("/admin/v1/tiers"),
      get<List<Tenant>>("/admin/v1/tenants"),
      get<List<Key>>("/admin/v1/keys", { tenant: filter || null }),
    ]);
    tiers = t.data;
    tenants = ts.data;
    clear(datalist);
    for (const x of tenants) datalist.appendChild(h("option", { value: x.name }));
    const counts = new Map<string, [number, number]>();
    const all = filter ? (await get<List<Key>>("/admin/v1/keys")).data : ks.data;
    for (const k of all) {
      const c = counts.get(k.tenant) ?? [0, 0];
      counts.set(k.tenant, [c[0] + (k.status === "active" ? 1 : 0), c[1] + 1]);
    }

    const tt = table(["Tenant", "Tier", "Keys (active / all)", "Created"], "tenants");
    for (const x of tenants) {
      const pick = h("select", { "aria-label": `Tier of tenant ${x.name}` },
        h("option", { value: "" }, "(default tier)"),
        tiers.map((tier) => h("option", { value: tier.name }, tier.name)));
      pick.value = x.tier ?? "";
      pick.addEventListener("change", async () => {
        try {
          await patch(`/admin/v1/tenants/${encodeURIComponent(x.name)}`, { tier: pick.value || null });
          status.ok(`Tenant ${x.name} is now in tier ${pick.value || "(default)"}.`);
          await reload();
        } catch (e) {
          status.error(`Tier not changed: ${(e as Error).message}`);
        }
      });
      const [active, total] = counts.get(x.name) ?? [0, 0];
      tt.body.appendChild(h("tr", { "data-tenant": x.name },
        h("th", { scope: "row" }, h("a", { href: `#/tenants?tenant=${encodeURIComponent(x.name)}` }, x.name)),
        h("td", {}, pick),
        h("td", { class: "num" }, `${active} / ${total}`),
        h("td", {}, when(x.created_at))));
    }
    clear(tenantsBox);
    tenantsBox.append(tenants.length ? h("div", { class: "table-wrap" }, tt.el) : h("p", { class: "empty" }, "No tenants yet."));

    const kt = table(["ID", "Key", "Tenant", "User", "Status", "Tokens used / budget", "Limits", "Last used", "Created", ""], "keys");
    for (const k of ks.data) {
      const cell = h("td");
      if (k.status === "active") {
        const revoke = h("button", { type: "button", class: "danger", "aria-label": `Revoke key ${k.prefix}…` }, "Revoke");
        revoke.addEventListener("click", () => {
          const confirm = h("button", { type: "button", class: "danger", "aria-label": `Confirm revoking key ${k.prefix}…` }, "Confirm revoke");
          const cancel = h("button", { type: "button" }, "Cancel");
          cancel.addEventListener("click", () => {
            clear(cell);
            cell.append(revoke);
            revoke.focus();
          });
          confirm.addEventListener("click", async () => {
            try {
              await post(`/admin/v1/keys/${k.id}/revoke`);
              status.ok(`Key ${k.prefix}… revoked.`);
              await reload();
            } catch (e) {
              status.error(`Not revoked: ${(e as Error).message}`);
            }
          });
          clear(cell);
          cell.append(confirm, " ", cancel);
          confirm.focus();
        });
        cell.append(revoke);
      }
      const limits = [k.rpm_limit && `${fmtInt(k.rpm_limit)} rpm`, k.tpm_limit && `${fmtInt(k.tpm_limit)} tpm`,
        k.expires_at && `expires ${when(k.expires_at)}`].filter(Boolean).join(", ");
      kt.body.appendChild(h("tr", { "data-key-id": String(k.id), "data-status": k.status },
        h("td", { class: "num" }, String(k.id)),
        h("td", {}, h("code", {}, `${k.prefix}…`)),
        h("td", {}, k.tenant),
        h("td", {}, k.user ?? "—"),
        h("td", {}, h("span", { class: `badge ${k.status}` }, k.status)),
        h("td", { class: "num" }, `${fmtInt(k.tokens_used)} / ${k.token_budget === null ? "∞" : fmtInt(k.token_budget)}`),
        h("td", {}, limits || "—"),
        h("td", {}, when(k.last_used_at)),
        h("td", {}, when(k.created_at)),
        cell));
    }
    clear(keysBox);
    keysBox.append(ks.data.length ? h("div", { class: "table-wrap" }, kt.el) : h("p", { class: "empty" }, "No keys."));
  }
  await reload();

  // ---- create tenant
  const tMsg = messageBox();
  const tName = field({ name: "tenant-name", label: "Tenant name", hint: "letters, digits, _ . @ -", required: true });
  const tTier = field({ name: "tenant-tier", label: "Tier", options: [["", "(default tier)"], ...tiers.map((t) => [t.name, t.name] as [string, string])] });
  const tForm = h("form", { class: "inline-form", novalidate: true }, tName.wrap, tTier.wrap,
    h("button", { type: "submit", class: "primary" }, "Create tenant"), tMsg.el);
  tForm.addEventListener("submit", async (e) => {
    e.preventDefault();
    tMsg.clear();
    const n = tName.value();
    const err = nameError(n);
    tName.setError(err);
    if (err) return void tName.input.focus();
    try {
      await post("/admin/v1/tenants", { name: n, tier: tTier.value() || null });
      tName.input.value = "";
      status.ok(`Tenant ${n} created.`);
      await reload();
    } catch (e2) {
      tName.setError((e2 as ApiError).message);
      tMsg.error(`Not created: ${(e2 as ApiError).message}`);
    }
  });

  // ---- create key
  const kMsg = messageBox();
  const kTenant = field({ name: "key-tenant", label: "Tenant", hint: "created if it does not exist", required: true,
    list: tenantList, value: filter });
  const kUser = field({ name: "key-user", label: "User label", hint: "optional, stored with the key" });
  const kBudget = field({ name: "key-budget", label: "Token budget", hint: "total tokens; blank = unlimited" });
  const kRpm = field({ name: "key-rpm", label: "Requests per minute", hint: "blank = tier only" });
  const kTpm = field({ name: "key-tpm", label: "Tokens per minute", hint: "blank = tier only" });
  const kForm = h("form", { class: "key-form", novalidate: true },
    h("div", { class: "form-grid" }, kTenant.wrap, kUser.wrap, kBudget.wrap, kRpm.wrap, kTpm.wrap),
    kMsg.el, h("div", { class: "buttons" }, h("button", { type: "submit", class: "primary" }, "Create key")), datalist);
  kForm.addEventListener("submit", async (e) => {
    e.preventDefault();
    kMsg.clear();
    const tenant = kTenant.value();
    kTenant.setError(tenant ? null : "Required.");
    const parsed = ([[kBudget, "Token budget"], [kRpm, "Requests per minute"], [kTpm, "Tokens per minute"]] as const)
      .map(([f, label]) => {
        const [v, err] = optInt(f.value(), label);
        f.setError(err);
        return [v, err] as const;
      });
    const bad = !tenant || parsed.some(([, err]) => err);
    if (bad) {
      kMsg.error("Please fix the highlighted fields.");
      return;
    }
    try {
      const k = await post<KeyCreated>("/admin/v1/keys", { tenant, user: kUser.value() || null, token_budget: parsed[0][0],
        rpm_limit: parsed[1][0], tpm_limit: parsed[2][0] });
      showKey(k);
      kUser.input.value = "";
      await reload();
    } catch (e2) {
      kMsg.error(`Not created: ${(e2 as ApiError).message}`);
    }
  });

  function showKey(k: KeyCreated): void {
    clear(created);
    const id = newId("new-key");
    const input = h("input", { id, type: "text", readonly: true, class: "key-value", value: k.key, spellcheck: "false",
      autocomplete: "off" });
    const copied = h("span", { class: "muted", role: "status" });
    const copy = h("button", { type: "button", class: "primary" }, "Copy");
    copy.addEventListener("click", async () => {
      copied.textContent = (await copyText(input)) ? "Copied to the clipboard." : "Select the key and copy it by hand.";
    });
    const dismiss = h("button", { type: "button" }, "Done");
    dismiss.addEventListener("click", () => clear(created));
    created.append(h("div", { class: "notice", "data-key-id": String(k.id) },
      h("h3", {}, `New key for ${k.tenant}${k.user ? ` / ${k.user}` : ""}`),
      h("p", {}, "Copy it now: the gateway stores only its digest and will not show it again."),
      h("label", { for: id }, "New API key"),
      h("div", { class: "key-row" }, input, copy, dismiss), copied));
    input.focus();
    input.select();
  }

  const filterNote = filter ? h("p", {}, `Keys of tenant ${filter} · `, h("a", { href: "#/tenants" }, "show all keys")) : null;
  return h("div", { class: "page tenants" },
    pageHeader("Tenants & keys"),
    status.el,
    section("Tenants", tenantsBox, h("h3", {}, "Create a tenant"), tForm),
    section("API keys", created, h("h3", {}, "Create a key"), kForm, h("h3", {}, "Keys"), filterNote, keysBox));
}
