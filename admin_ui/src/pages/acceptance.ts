import { get, type Acceptance, type Engine, type List, type RecordPage } from "../api";
import { ChartBox } from "../charts";
import { fmt, fmtInt, h, pct } from "../dom";
import type { Ctx } from "../main";
import { field, kpi, pageHeader, rangeOf, windowPicker } from "../ui";

type Group = "tenant" | "model" | "tier";
const SAMPLE = 1000;

/** P(draft j+1 accepted | drafts 1..j accepted) from the per-position fractions of rounds. */
export function conditional(perPosition: number[]): (number | null)[] {
  return perPosition.map((p, j) => {
    const before = j === 0 ? 1 : perPosition[j - 1];
    return before > 0 ? p / before : null;
  });
}

/** Acceptance: position-wise conditional acceptance, τ per group, verification budgets. */
export async function renderAcceptance(ctx: Ctx): Promise<HTMLElement> {
  const win = ctx.params.get("window") ?? "24h";
  const group = (ctx.params.get("group_by") ?? "tenant") as Group;
  const r = rangeOf(win);
  const [acc, engine, recs] = await Promise.all([
    get<List<Acceptance>>("/admin/v1/stats/acceptance", { since: r.since, until: r.until, group_by: group }),
    get<Engine>("/admin/v1/engine"),
    get<RecordPage>("/admin/v1/requests", { since: r.since, until: r.until, limit: SAMPLE }),
  ]);
  const groups = acc.data.filter((a) => a.rounds > 0);
  const nameOf = (a: Acceptance) => (a[group] ?? "(none)") as string;

  const rounds = groups.reduce((s, a) => s + a.rounds, 0);
  const drafted = groups.reduce((s, a) => s + a.drafted, 0);
  const accepted = groups.reduce((s, a) => s + a.accepted, 0);
  const emitted = groups.reduce((s, a) => s + a.emitted, 0);
  const kTau = kpi("tau", "τ (tokens / round)");
  const kAcc = kpi("acceptance", "Acceptance rate");
  const kRounds = kpi("rounds", "Speculative rounds");
  const kSpec = kpi("spec", "Speculation");
  kTau.set(rounds ? fmt(emitted / rounds, 2) : "—", "emitted tokens per round, bonus included");
  kAcc.set(drafted ? pct(accepted / drafted) : "—", drafted ? `${fmtInt(accepted)} of ${fmtInt(drafted)} drafts` : "");
  kRounds.set(fmtInt(rounds), `${groups.length} ${group}${groups.length === 1 ? "" : "s"}`);
  kSpec.set(engine.spec.method, engine.spec.method === "none" ? "this server does not speculate"
    : `${engine.spec.policy ?? ""}${engine.spec.block_size ? `, γ = ${engine.spec.block_size}` : ""}`);

  const none = engine.spec.method === "none" ? " This server runs without speculation (SPARKGATE_SPEC_METHOD=none)." : "";
  const pos = new ChartBox({ name: "position-acceptance", title: "Conditional acceptance by draft position", type: "line",
    x: "category", xLabel: "draft position", yLabel: "% accepted, given the previous ones were", yMax: 100,
    description: `Line chart per ${group}: probability that draft token j is accepted given tokens before it were`,
    empty: `No speculative rounds in this window.${none}` });
  const maxLen = Math.max(0, ...groups.map((a) => a.per_position.length));
  const positions = Array.from({ length: maxLen }, (_, j) => String(j + 1));
  pos.set(groups.map((a) => {
    const c = conditional(a.per_position);
    return { label: nameOf(a), points: positions.map((p, j) => [p, c[j] === undefined || c[j] === null ? null : 100 * c[j]!]) };
  }), positions);
  pos.setNote("Position j: rounds with drafts 1..j accepted ÷ rounds with drafts 1..j−1 accepted.");

  const tau = new ChartBox({ name: "tau-by-group", title: `τ and acceptance rate by ${group}`, type: "bar", x: "category",
    yLabel: "τ (tokens / round)", y2Label: "acceptance rate %", y2Max: 100, yDigits: 2,
    description: `Bar chart of τ and acceptance rate per ${group}`, empty: `No speculative rounds in this window.${none}` });
  const cats = groups.map(nameOf);
  tau.set([
    { label: "τ", points: groups.map((a) => [nameOf(a), a.tau]) },
    { label: "acceptance rate %", points: groups.map((a) => [nameOf(a), a.acceptance_rate === null ? null : 100 * a.acceptance_rate]),
      axis: "y2" },
  ], cats);

  // grammar-constrained (JSON, tools: drafts verified against the masked target) vs free text
  const split = new ChartBox({ name: "grammar-vs-plain", title: `Acceptance rate: grammar vs plain, by ${group}`,
    type: "bar", x: "category", yLabel: "acceptance rate %", yMax: 100,
    description: `Bar chart per ${group}: accepted / drafted for requests with a JSON response format or tools, and for free text`,
    empty: `No speculative rounds in this window.${none}` });
  split.set([
    { label: "grammar (JSON, tools)", points: groups.map((a) => [nameOf(a),
      a.constrained.acceptance_rate === null ? null : 100 * a.constrained.acceptance_rate]) },
    { label: "plain", points: groups.map((a) => [nameOf(a), a.plain.acceptance_rate === null ? null : 100 * a.plain.acceptance_rate]) },
  ], cats);
  split.setNote("Grammar: requests with response_format json_object / json_schema or tools; their drafts are verified against the grammar-masked target.");

  // per-request mean verification budget ℓ (drafts sent to the target per round)
  const spec = recs.data.filter((x) => x.spec_rounds && x.spec_verified !== null);
  const budgets = spec.map((x) => x.spec_verified! / x.spec_rounds!);
  const top = Math.max(engine.spec.block_size, ...budgets.map((b) => Math.ceil(b)), 1);
  const width = top > 8 ? 1 : 0.5;
  const bins = Array.from({ length: Math.ceil(top / width) }, (_, i) => i * width);
  const counts = bins.map((b, i) => budgets.filter((v) => v >= b && (v < b + width || i === bins.length - 1)).length);
  const labels = bins.map((b) => `${fmt(b, 1)}–${fmt(b + width, 1)}`);
  const hist = new ChartBox({ name: "verify-budgets", title: "Verification budget per request", type: "bar", x: "category",
    xLabel: "drafts verified per round (mean of a request)", yLabel: "requests", yDigits: 0,
    description: "Histogram of the mean number of draft tokens each request had verified per round",
    empty: `No speculative requests in this window.${none}` });
  hist.set(budgets.length ? [{ label: "requests", points: labels.map((l, i) => [l, counts[i]]) }] : [], labels);
  hist.setNote(budgets.length ? `${budgets.length} speculative requests (of the newest ${fmtInt(recs.data.length)} in the window).` : "");

  const charts = [pos, tau, split, hist];
  for (const c of charts) c.setWindow(r.since, r.until);
  const sps = engine.spec.sps_table;
  if (sps && sps.buckets.length) {
    const spsChart = new ChartBox({ name: "sps", title: "SPS table: target rounds/s by verification budget", type: "line",
      x: "linear", xLabel: "B (tokens verified per round)", yLabel: "rounds / s",
      description: "Line chart of profiled target rounds per second by total verification tokens", empty: "No SPS table." });
    spsChart.set(sps.sps.map((row, i) => ({ label: `context ${sps.context_lens[i] ?? "?"}`,
      points: row.map((v, j) => [sps.buckets[j], v] as [number, number]) })));
    if (sps.note) spsChart.setNote(sps.note);
    charts.push(spsChart);
  }
  ctx.onLeave(() => charts.forEach((c) => c.destroy()));

  const groupPick = field({ name: "group_by", label: "Group by", value: group,
    options: [["tenant", "Tenant"], ["model", "Model"], ["tier", "Tier"]] });
  groupPick.wrap.classList.add("inline");
  groupPick.input.addEventListener("change", () => ctx.go("acceptance", { window: win, group_by: groupPick.value() }));
  return h("div", { class: "page acceptance" },
    pageHeader("Acceptance", windowPicker(win, (w) => ctx.go("acceptance", { window: w, group_by: group })), groupPick.wrap),
    h("div", { class: "kpis" }, kTau.el, kAcc.el, kRounds.el, kSpec.el),
    h("div", { class: "charts" }, charts.map((c) => c.el)));
}
