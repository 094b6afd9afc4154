import { get, type Acceptance, type Engine, type List, type Live, type SlaRow, type TenancyStatus, type Tier, type UserSeries } from "../api";
import { ChartBox } from "../charts";
import { fmt, fmtInt, h, pct } from "../dom";
import type { Ctx } from "../main";
import { every, kpi, messageBox, pageHeader, rangeOf, userLabel, windowPicker } from "../ui";

const LIVE_SAMPLES = 150; // 5 minutes at one sample per 2 s

/** Overview: tokens/s per user, engine load, τ/acceptance, verification budget, SLA per tier. */
export async function renderOverview(ctx: Ctx): Promise<HTMLElement> {
  const win = ctx.params.get("window") ?? "1h";
  const msg = messageBox();
  const updated = h("span", { class: "muted", "data-updated": "" });

  const kRunning = kpi("running", "Running", "requests in the engine");
  const kWaiting = kpi("waiting", "Waiting", "engine + admission queues");
  const kBudget = kpi("verify-budget", "Verified tokens / round", "B over the last 2 s");
  const kTau = kpi("tau", "τ (tokens / round)", "");
  const kZero = kpi("zero-budget", "Rounds with ℓ = 0", "share of request-rounds, last 2 s");
  const kAcc = kpi("acceptance", "Acceptance rate", "accepted / drafted");
  const kSplit = kpi("acceptance-split", "Acceptance: grammar / plain", "JSON and tool requests / free text");
  const kSla = kpi("sla", "SLA attainment", "requests meeting their tier's tok/s");
  const kReplicas = kpi("replicas", "Gateway replicas", "live, over all replicas");

  const tps = new ChartBox({ name: "tokens-per-s", title: "Decode tokens/s per user", type: "line", x: "time",
    description: "Line chart: each user's median decode tokens per second, per minute, over the selected window",
    yLabel: "tokens/s", empty: "No finished requests in this window.", tall: true });
  tps.setNote("Per minute: the median of the user's per-request decode tok/s (from the rollups, refreshed every ~10 s).");
  const load = new ChartBox({ name: "engine-load", title: "Requests running / waiting (live)", type: "line", x: "time",
    description: "Line chart of running and waiting requests, sampled every 2 seconds since this page opened",
    yLabel: "requests", yDigits: 0, empty: "Collecting samples…", seconds: true });
  const budget = new ChartBox({ name: "verify-budget", title: "Verification budget vs load (live)", type: "line",
    x: "time", description: "Line chart: tokens verified per target forward (B) against running requests",
    yLabel: "tokens / requests", empty: "Collecting samples…", seconds: true });
  budget.setNote("B = tokens verified per decode round (Σ over requests of 1 + drafts verified); without speculation B = running. τ = tokens produced per request per round (1 without speculation).");
  const volume = new ChartBox({ name: "volume", title: "Requests and completion tokens per minute (all users)",
    type: "line", x: "time", yLabel: "requests / min", y2Label: "tokens / min", yDigits: 0,
    description: "Line chart of requests and completion tokens per minute over the selected window, all users together",
    empty: "No finished requests in this window." });
  const sla = new ChartBox({ name: "sla-attainment", title: "SLA attainment per tier", type: "bar", x: "category",
    description: "Bar chart: percentage of requests and of user-minutes meeting the tier's tokens/s target",
    yLabel: "% meeting target", yMax: 100, empty: "No requests in this window." });

  let specMethod = "";
  let windowRounds = 0;

  // ---- the selected window (rollups)
  async function refreshWindow(): Promise<void> {
    const r = rangeOf(win);
    const q = { since: r.since, until: r.until };
    const [series, acc, slaRows, tiers] = await Promise.all([
      get<List<UserSeries>>("/admin/v1/usage/tokens_per_s", q),
      get<List<Acceptance>>("/admin/v1/stats/acceptance", { ...q, group_by: "model" }),
      get<List<SlaRow>>("/admin/v1/stats/sla", q),
      get<List<Tier>>("/admin/v1/tiers"),
    ]);
    tps.setWindow(r.since, r.until);
    volume.setWindow(r.since, r.until);
    volume.setXRange(r.sinceMs, r.untilMs);
    const perMinute = new Map<number, [number, number]>();
    for (const s of series.data) {
      for (const p of s.points) {
        const t = Date.parse(p.minute);
        const [n, tok] = perMinute.get(t) ?? [0, 0];
        perMinute.set(t, [n + p.requests, tok + p.completion_tokens]);
      }
    }
    const minutes = [...perMinute.keys()].sort((a, b) => a - b);
    volume.set([
      { label: "requests", points: minutes.map((t) => [t, perMinute.get(t)![0]]) },
      { label: "completion tokens", points: minutes.map((t) => [t, perMinute.get(t)![1]]), axis: "y2" },
    ]);
    sla.setWindow(r.since, r.until);
    tps.setXRange(r.sinceMs, r.untilMs);
    tps.set(series.data.map((s) => ({
      label: userLabel(s.tenant, s.user),
      points: s.points.map((p) => [Date.parse(p.minute), p.tokens_per_s] as [number, number | null]),
    })));

    const rounds = acc.data.reduce((a, x) => a + x.rounds, 0);
    const drafted = acc.data.reduce((a, x) => a + x.drafted, 0);
    const accepted = acc.data.reduce((a, x) => a + x.accepted, 0);
    const emitted = acc.data.reduce((a, x) => a + x.emitted, 0);
    windowRounds = rounds;
    kTau.set(rounds ? fmt(emitted / rounds, 2) : "—", rounds ? `${fmtInt(rounds)} rounds in window`
      : specMethod === "none" ? "speculation off (spec method none)" : "no speculative rounds in window");
    kAcc.set(drafted ? pct(accepted / drafted) : "—", drafted ? `${fmtInt(accepted)} of ${fmtInt(drafted)} drafts` : "accepted / drafted");
    const split = (k: "constrained" | "plain") => {
      const d = acc.data.reduce((a, x) => a + x[k].drafted, 0);
      const r = acc.data.reduce((a, x) => a + x[k].rounds, 0);
      return { rate: d ? acc.data.reduce((a, x) => a + x[k].accepted, 0) / d : null,
        tau: r ? acc.data.reduce((a, x) => a + x[k].emitted, 0) / r : null, rounds: r };
    };
    const g = split("constrained"), p = split("plain");
    kSplit.set(g.rounds || p.rounds ? `${pct(g.rate)} / ${pct(p.rate)}` : "—",
      g.rounds || p.rounds ? `τ ${fmt(g.tau, 2)} / ${fmt(p.tau, 2)} · ${fmtInt(g.rounds)} grammar, ${fmtInt(p.rounds)} plain rounds`
        : "no speculative rounds in window");

    const graded = slaRows.data.reduce((a, x) => a + x.graded_requests, 0);
    const met = slaRows.data.reduce((a, x) => a + x.met_requests, 0);
    kSla.set(graded ? pct(met / graded) : "—", graded ? `${fmtInt(met)} of ${fmtInt(graded)} graded requests` : "no graded requests (no tier targets?)");
    const target = new Map(tiers.data.map((t) => [t.name, t.min_tokens_per_s]));
    const cats = slaRows.data.map((s) => {
      const name = s.tier ?? "(none)";
      const t = target.get(s.tier ?? "");
      return t ? `${name} (≥ ${fmt(t, 1)} tok/s)` : `${name} (no target)`;
    });
    sla.set([
      { label: "requests meeting target", points: slaRows.data.map((s, i) => [cats[i], s.attainment === null ? null : 100 * s.attainment]) },
      { label: "user-minutes meeting target", points: slaRows.data.map((s, i) => [cats[i], s.user_minute_attainment === null ? null : 100 * s.user_minute_attainment]) },
    ], cats);
    updated.textContent = `Updated ${new Date().toLocaleTimeString("en-GB")}`;
  }

  // ---- live engine samples
  type Sample = { t: number; running: number; waiting: number; queued: number; maxBatch: number; B: number | null;
    tau: number | null };
  const samples: Sample[] = [];
  let prev: Engine | null = null;
  async function sampleEngine(): Promise<void> {
    const [e, st, live] = await Promise.all([get<Engine>("/admin/v1/engine"), get<TenancyStatus>("/admin/v1/tenancy/status"),
      get<Live>("/admin/v1/live").catch(() => null)]);
    if (live) {
      const sla = live.sla.attainment === null ? "no SLA requests" : `SLA ${pct(live.sla.attainment)}`;
      kReplicas.set(fmtInt(live.replicas.length), `${live.running_total} running · ${live.waiting_total} waiting · ${sla} (last ${live.window_s} s)` +
        (live.degraded ? " · Redis down: this replica only" : live.shared ? "" : " · single process"));
    }
    const dSteps = prev ? e.decode_steps - prev.decode_steps : 0;
    const B = prev && dSteps > 0 ? (e.verify_tokens - prev.verify_tokens) / dSteps : null; // null: no decode round
    // Request-rounds since the last sample: the share the budget (or gate) gave no draft, and live τ.
    const dRows = prev ? e.decode_rows - prev.decode_rows : 0;
    const zero = dRows > 0 ? (e.zero_budget_rows - prev!.zero_budget_rows) / dRows : null;
    const tau = dRows > 0 ? (e.decode_tokens - prev!.decode_tokens) / dRows : null;
    prev = e;
    samples.push({ t: Date.now(), running: e.running, waiting: e.waiting, queued: st.admission.waiting, maxBatch: e.max_batch, B, tau });
    kZero.set(zero === null ? "—" : pct(zero), e.spec.method === "none" ? "speculation off: every round has ℓ = 0"
      : tau === null ? "no decode round in the last 2 s" : `live τ ${fmt(tau, 2)} tokens / request-round`);
    if (samples.length > LIVE_SAMPLES) samples.shift();
    kRunning.set(fmtInt(e.running), `of max batch ${e.max_batch}${e.ready ? "" : " (engine not ready)"}`);
    kWaiting.set(fmtInt(e.waiting + st.admission.waiting), `engine ${e.waiting} · admission ${st.admission.waiting}`);
    kBudget.set(B === null ? (prev && samples.length > 1 ? "idle" : "…") : fmt(B, 2), e.spec.method === "none" ? "no speculation: B = running"
      : `${e.spec.method}${e.spec.policy ? ` / ${e.spec.policy}` : ""}${e.spec.block_size ? `, γ ${e.spec.block_size}` : ""}`);
    specMethod = e.spec.method;
    if (specMethod === "none" && !windowRounds) kTau.set("—", "speculation off (spec method none)");
    const xs = (f: (s: Sample) => number | null) => samples.map((s) => [s.t, f(s)] as [number, number | null]);
    load.set([
      { label: "running", points: xs((s) => s.running) },
      { label: "waiting (engine)", points: xs((s) => s.waiting) },
      { label: "waiting (admission)", points: xs((s) => s.queued) },
    ]);
    budget.set([
      { label: "verified tokens per round (B)", points: xs((s) => s.B) },
      { label: "running requests", points: xs((s) => s.running) },
      { label: "τ (tokens per request-round)", points: xs((s) => s.tau) },
      { label: "max batch", points: xs((s) => s.maxBatch), dashed: true, color: "#94a3b8" },
    ]);
  }

  const page = h("div", { class: "page overview" },
    pageHeader("Overview", windowPicker(win, (w) => ctx.go("overview", { window: w })), updated),
    msg.el,
    h("div", { class: "kpis" }, kRunning.el, kWaiting.el, kBudget.el, kTau.el, kZero.el, kAcc.el, kSplit.el, kSla.el, kReplicas.el),
    h("div", { class: "charts" }, tps.el, load.el, budget.el, sla.el, volume.el));

  const guard = async (fn: () => Promise<void>) => {
    try {
      await fn();
    } catch (e) {
      msg.error(`Refresh failed: ${(e as Error).message}`);
      throw e;
    }
  };
  await Promise.all([guard(refreshWindow), guard(sampleEngine)]).catch(() => undefined);
  every(2000, () => guard(sampleEngine), ctx.onLeave);
  every(10000, () => guard(refreshWindow), ctx.onLeave);
  ctx.onLeave(() => [tps, load, budget, sla, volume].forEach((c) => c.destroy()));
  return page;
}
