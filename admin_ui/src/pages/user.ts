import { get, type List, type RecordPage, type Record_, type UserSeries, type UserSummary } from "../api";
import { ChartBox, PALETTE } from "../charts";
import { fmt, fmtInt, h, pct, svg, when } from "../dom";
import type { Ctx } from "../main";
import { kpi, messageBox, pageHeader, rangeOf, section, table, userLabel, windowPicker } from "../ui";

const PAGE = 50;

/** Accepted draft tokens per position as tiny bars (fraction of rounds). */
function positionBars(r: Record_): SVGElement | string {
  const pos = r.accepted_per_position ?? [];
  if (!r.spec_rounds || !pos.length) return "—";
  const w = 8, gap = 2, hgt = 22;
  const el = svg("svg", { width: pos.length * (w + gap), height: hgt, class: "bars", role: "img",
    "aria-label": `accepted at positions 1..${pos.length}: ${pos.map((n) => pct(n / r.spec_rounds!, 0)).join(", ")}` });
  pos.forEach((n, j) => {
    const f = n / r.spec_rounds!;
    el.appendChild(svg("rect", { x: j * (w + gap), y: hgt - 1 - f * (hgt - 2), width: w, height: Math.max(1, f * (hgt - 2)),
      fill: PALETTE[0] }));
  });
  return el;
}

/** The constraint of a request's output (JSON response format or tools) and its grammar-mask time. */
export function constraintText(r: Record_): string {
  if (!r.constraint) return "—";
  return r.mask_ms_per_token === null ? r.constraint : `${r.constraint} · ${fmt(r.mask_ms_per_token, 2)} ms/token`;
}

function requestRow(r: Record_): HTMLTableRowElement {
  const spec = r.spec_rounds ? [
    fmtInt(r.spec_rounds), fmtInt(r.spec_drafted), fmtInt(r.spec_verified), fmtInt(r.spec_accepted),
    fmt(r.spec_tau, 2), r.spec_drafted ? pct((r.spec_accepted ?? 0) / r.spec_drafted, 0) : "—",
  ] : ["—", "—", "—", "—", "—", "—"];
  const outcome = r.status === "finished" ? (r.finish_reason ?? "finished") : `${r.status}${r.error_code ? `: ${r.error_code}` : ""}`;
  return h("tr", { "data-request": r.id },
    h("td", {}, when(r.finished_at)),
    h("td", { title: r.error_message ?? "" }, outcome),
    h("td", {}, r.model),
    h("td", { class: "num" }, `${fmtInt(r.prompt_tokens)} → ${fmtInt(r.completion_tokens)}`),
    h("td", { class: "num" }, r.ttft_s === null ? "—" : `${fmt(r.ttft_s, 2)} s`),
    h("td", { class: "num" }, fmt(r.decode_tokens_per_s, 1),
      r.predicted_tokens_per_s !== null ? h("span", { class: "muted small" }, ` (pred. ${fmt(r.predicted_tokens_per_s, 1)})`) : null),
    h("td", { "data-col": "constraint", title: r.constraint ? "grammar-mask time per generated token" : "free text" },
      constraintText(r)),
    h("td", {}, r.sla_met === null ? "—" : `${r.sla_met ? "met" : "missed"} (≥ ${fmt(r.sla_target_tokens_per_s, 1)})`),
    spec.map((v) => h("td", { class: "num" }, v)),
    h("td", {}, positionBars(r)));
}

/** One user's recent requests with their speculative stats. */
export async function renderUser(ctx: Ctx): Promise<HTMLElement> {
  const tenant = ctx.params.get("tenant") ?? "";
  const user = ctx.params.get("user");
  const win = ctx.params.get("window") ?? "1h";
  const r = rangeOf(win);
  const q = { since: r.since, until: r.until, tenant, user };
  const [summary, series] = await Promise.all([
    get<List<UserSummary>>("/admin/v1/usage/users", { since: r.since, until: r.until, tenant }),
    get<List<UserSeries>>("/admin/v1/usage/tokens_per_s", q),
  ]);
  const mine = summary.data.find((u) => u.user === user);
  const pts = series.data.find((s) => s.user === user)?.points ?? [];
  const name = userLabel(tenant, user);

  const kReq = kpi("requests", "Requests");
  const kTps = kpi("p50", "p50 tok/s");
  const kSla = kpi("sla", "SLA met");
  const kTau = kpi("tau", "τ (loaded requests)");
  kReq.set(fmtInt(mine?.requests ?? 0), mine ? `${mine.rejected} rejected, ${mine.failed} failed` : "none in window");
  kTps.set(fmt(mine?.tokens_per_s_p50 ?? null, 1), "decode tokens/s");
  kSla.set(mine?.sla_requests ? pct(mine.sla_attainment) : "—", mine?.sla_requests ? `of ${mine.sla_requests} graded` : "no target");

  const chart = new ChartBox({ name: "user-tokens-per-s", title: `Decode tokens/s of ${name}`, type: "line", x: "time",
    description: `Line chart of ${name}'s median decode tokens per second per minute`, yLabel: "tokens/s",
    empty: "No finished requests in this window." });
  chart.setXRange(r.sinceMs, r.untilMs);
  chart.setWindow(r.since, r.until);
  chart.set([{ label: name, points: pts.map((p) => [Date.parse(p.minute), p.tokens_per_s]) }]);
  ctx.onLeave(() => chart.destroy());

  const t = table(["Finished", "Outcome", "Model", "Tokens", "TTFT", "tok/s", "Constraint", "SLA", "Rounds", "Drafted", "Verified",
    "Accepted", "τ", "Accept rate", "Accepted by position"], "requests");
  const msg = messageBox();
  const more = h("button", { type: "button", hidden: true }, "Load more");
  const loaded: Record_[] = [];
  let cursor: string | null = null;
  async function load(): Promise<void> {
    const page = await get<RecordPage>("/admin/v1/requests", { ...q, limit: PAGE, cursor });
    // a user-less record can only be found by tenant: keep those without a user
    const rows = user === null ? page.data.filter((x) => x.user === null) : page.data;
    for (const x of rows) t.body.appendChild(requestRow(x));
    loaded.push(...rows);
    cursor = page.next_cursor;
    more.hidden = !page.has_more;
    const spec = loaded.filter((x) => x.spec_rounds);
    const rounds = spec.reduce((a, x) => a + (x.spec_rounds ?? 0), 0);
    const emitted = spec.reduce((a, x) => a + (x.spec_emitted ?? 0), 0);
    kTau.set(rounds ? fmt(emitted / rounds, 2) : "—", rounds ? `${spec.length} speculative requests` : "no speculative requests");
  }
  more.addEventListener("click", () => load().catch((e) => msg.error((e as Error).message)));
  await load();

  return h("div", { class: "page user" },
    h("p", { class: "crumbs" }, h("a", { href: `#/users?window=${encodeURIComponent(win)}` }, "← Users")),
    pageHeader(`User ${user ?? "(no user)"}`, windowPicker(win, (w) => ctx.go("user", { tenant, user, window: w }))),
    h("p", { class: "muted" }, `Tenant ${tenant} · tier ${mine?.tier ?? "—"}`),
    msg.el,
    h("div", { class: "kpis" }, kReq.el, kTps.el, kSla.el, kTau.el),
    h("div", { class: "charts one" }, chart.el),
    section("Recent requests", h("div", { class: "table-wrap" }, t.el), more));
}
