import { get, type List, type Tenant, type UserSeries, type UserSummary } from "../api";
import { sparkline } from "../charts";
import { fmt, fmtInt, h, pct } from "../dom";
import type { Ctx } from "../main";
import { field, messageBox, pageHeader, rangeOf, section, table, userLabel, windowPicker } from "../ui";

export function userHref(tenant: string, user: string | null, win: string): string {
  const q = new URLSearchParams({ tenant, window: win });
  if (user !== null) q.set("user", user);
  return `#/user?${q.toString()}`;
}

/** Users: one row per (tenant, user) in the window, with a tok/s sparkline; click to drill down. */
export async function renderUsers(ctx: Ctx): Promise<HTMLElement> {
  const win = ctx.params.get("window") ?? "1h";
  const tenant = ctx.params.get("tenant") ?? "";
  const r = rangeOf(win);
  const q = { since: r.since, until: r.until, tenant: tenant || null };
  const [users, series, tenants] = await Promise.all([
    get<List<UserSummary>>("/admin/v1/usage/users", q),
    get<List<UserSeries>>("/admin/v1/usage/tokens_per_s", q),
    get<List<Tenant>>("/admin/v1/tenants"),
  ]);
  const pointsOf = new Map(series.data.map((s) => [`${s.tenant}\u0000${s.user ?? ""}`, s.points]));
  // every sparkline spans the same range: from the first minute with data (any user) to the window's end
  const first = series.data.reduce((m, s) => s.points.reduce((m2, p) => Math.min(m2, Date.parse(p.minute)), m),
    r.untilMs - 60000);

  const tenantPick = field({ name: "tenant", label: "Tenant", value: tenant,
    options: [["", "All tenants"], ...tenants.data.map((t) => [t.name, t.name] as [string, string])] });
  tenantPick.wrap.classList.add("inline");
  tenantPick.input.addEventListener("change", () => ctx.go("users", { window: win, tenant: tenantPick.value() }));

  const t = table(["User", "Tenant", "Tier", "Requests", "Tokens (prompt / completion)", "p50 tok/s", "SLA met",
    "tok/s per minute"], "users");
  for (const u of users.data) {
    const pts = pointsOf.get(`${u.tenant}\u0000${u.user ?? ""}`) ?? [];
    const spark = sparkline(pts.map((p) => [Date.parse(p.minute), p.tokens_per_s]), first, r.untilMs - 60000,
      `tok/s of ${userLabel(u.tenant, u.user)}: ${pts.length} minutes with requests`);
    const bad = u.failed + u.rejected + u.cancelled;
    t.body.appendChild(h("tr", { "data-user": u.user ?? "", "data-tenant": u.tenant },
      h("th", { scope: "row", class: "name" }, h("a", { href: userHref(u.tenant, u.user, win) }, u.user ?? "(no user)")),
      h("td", { class: "name" }, u.tenant),
      h("td", { class: "name" }, u.tier ?? "—"),
      h("td", { class: "num" }, fmtInt(u.requests),
        bad ? h("span", { class: "muted small" }, ` (${[u.failed && `${u.failed} failed`, u.rejected && `${u.rejected} rejected`,
          u.cancelled && `${u.cancelled} cancelled`].filter(Boolean).join(", ")})`) : null),
      h("td", { class: "num" }, `${fmtInt(u.prompt_tokens)} / ${fmtInt(u.completion_tokens)}`),
      h("td", { class: "num", "data-col": "p50" }, fmt(u.tokens_per_s_p50, 1)),
      h("td", { class: "num", "data-col": "sla" }, u.sla_requests ? `${pct(u.sla_attainment, 0)} of ${u.sla_requests}` : "no target"),
      h("td", {}, spark)));
  }
  const msg = messageBox();
  return h("div", { class: "page users" },
    pageHeader("Users", windowPicker(win, (w) => ctx.go("users", { window: w, tenant })), tenantPick.wrap),
    msg.el,
    section(`Users with requests in the window (${users.data.length})`,
      users.data.length ? h("div", { class: "table-wrap" }, t.el) : h("p", { class: "empty" }, "No requests in this window."),
      h("p", { class: "muted small" }, "p50 tok/s: median of the per-minute medians of per-request decode tok/s, ",
        "each minute weighted by its measured requests. SLA met: requests with a tier target that reached it.")));
}
