// Chart.js (tree-shaken) behind one small wrapper. Every chart also publishes exactly
// what it plots: as JSON in the figure's data-chart attribute and as a data table
// (a <details> under the chart, for screen readers and for anyone who wants numbers).

import {
  BarController,
  BarElement,
  CategoryScale,
  Chart,
  Filler,
  Legend,
  LinearScale,
  LineController,
  LineElement,
  PointElement,
  Tooltip,
  type ChartConfiguration,
  type ChartDataset,
} from "chart.js";
import { clear, dayTime, fmt, h, hhmm, newId, svg } from "./dom";

Chart.register(BarController, BarElement, CategoryScale, Filler, Legend, LinearScale, LineController, LineElement,
  PointElement, Tooltip);
Chart.defaults.animation = false;
Chart.defaults.font.family = "system-ui, -apple-system, 'Segoe UI', Roboto, sans-serif";
Chart.defaults.font.size = 12;
Chart.defaults.color = "#475569";
Chart.defaults.borderColor = "#e2e8f0";

export const PALETTE = ["#2563eb", "#dc2626", "#16a34a", "#9333ea", "#ea580c", "#0891b2", "#ca8a04", "#db2777",
  "#4b5563", "#65a30d"];

export type X = number | string;
export interface Series {
  label: string;
  points: [X, number | null][];
  color?: string;
  dashed?: boolean;
  axis?: "y" | "y2";
  type?: "line" | "bar";
}

export interface ChartOptions {
  name: string; // data-chart-name, a stable handle for tests and links
  title: string;
  description: string; // aria-label of the canvas
  type: "line" | "bar";
  x: "time" | "category" | "linear";
  xLabel?: string;
  yLabel: string;
  y2Label?: string;
  yMax?: number;
  y2Max?: number;
  yDigits?: number;
  seconds?: boolean; // time axis labels with seconds (live charts)
  empty: string; // shown instead of the chart when there is nothing to plot
  tall?: boolean;
}

export class ChartBox {
  readonly el: HTMLElement;
  private chart: Chart | null = null;
  private canvas: HTMLCanvasElement;
  private emptyEl: HTMLElement;
  private table: HTMLTableElement;
  private note: HTMLElement;

  constructor(private o: ChartOptions) {
    const titleId = newId("chart-title");
    this.canvas = h("canvas", { role: "img", "aria-label": o.description });
    this.emptyEl = h("p", { class: "empty", hidden: true }, o.empty);
    this.table = h("table", { class: "data" });
    this.note = h("p", { class: "chart-note" });
    this.el = h("figure", { class: `chart${o.tall ? " tall" : ""}`, "data-chart-name": o.name, "aria-labelledby": titleId },
      h("figcaption", { id: titleId }, o.title),
      h("div", { class: "canvas-wrap" }, this.canvas),
      this.emptyEl,
      this.note,
      h("details", {}, h("summary", {}, "Data"), this.table));
  }

  private xMin: number | undefined;
  private xMax: number | undefined;

  /** Fix the x axis of a time/linear chart (e.g. to the selected window). */
  setXRange(min: number | undefined, max: number | undefined): void {
    this.xMin = min;
    this.xMax = max;
    if (this.chart) Object.assign(this.chart.options.scales!.x as any, this.xAxisRange());
  }

  /** min/max of the x axis (the window, when one was set). */
  private xAxisRange(): Record<string, unknown> {
    return { min: this.xMin, max: this.xMax };
  }

  /** Labels of time ticks: seconds on short spans, the day on spans over a day. */
  private timeTicks(): Record<string, unknown> {
    return {
      callback: (v: number) => {
        const span = this.span();
        return span > 86400000 ? dayTime(v) : hhmm(v, this.o.seconds || span < 300000);
      },
      maxRotation: 0,
    };
  }

  private span(): number {
    const c = this.chart;
    if (!c) return 0;
    const x = c.scales.x;
    return x ? x.max - x.min : 0;
  }

  /** Time ticks at round multiples (1 s … 1 day) across the visible range, at most ~8 of them. */
  private static alignedTicks(axis: any): void {
    const min: number = axis.min, max: number = axis.max;
    const range = Math.max(1, max - min) / 1000;
    const steps = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400];
    const step = (steps.find((s) => range / s <= 8) ?? 86400) * 1000;
    const offset = step >= 3600000 ? new Date(min).getTimezoneOffset() * 60000 : 0; // hours: align to local time
    const ticks = [];
    for (let v = Math.ceil((min - offset) / step) * step + offset; v <= max; v += step) ticks.push({ value: v });
    axis.ticks = ticks;
  }

  /** Publish the window the data was fetched for (data-since / data-until). */
  setWindow(since: string, until: string): void {
    this.el.dataset.since = since;
    this.el.dataset.until = until;
  }

  setNote(text: string): void {
    this.note.textContent = text;
  }

  /** Plot ``series`` (for a category x axis, ``categories`` fixes the order). */
  set(series: Series[], categories?: string[]): void {
    const o = this.o;
    this.el.dataset.chart = JSON.stringify(series.map((s) => ({ label: s.label, points: s.points })));
    const hasData = series.some((s) => s.points.some(([, y]) => y !== null));
    this.el.dataset.state = hasData ? "data" : "empty";
    this.emptyEl.hidden = hasData;
    (this.canvas.parentElement as HTMLElement).hidden = !hasData;
    this.fillTable(series, categories);
    const datasets: ChartDataset<"line" | "bar", any>[] = series.map((s, i) => {
      const color = s.color ?? PALETTE[i % PALETTE.length];
      const base = {
        label: s.label,
        type: s.type ?? o.type,
        yAxisID: s.axis ?? "y",
        borderColor: color,
        backgroundColor: (s.type ?? o.type) === "bar" ? color + "cc" : color + "22",
        borderWidth: (s.type ?? o.type) === "bar" ? 0 : 2,
        borderDash: s.dashed ? [6, 4] : undefined,
        pointRadius: s.points.length > 60 ? 0 : 2.5,
        spanGaps: false,
        minBarLength: 2,
        tension: 0,
      };
      const data = o.x === "category" ? s.points.map(([, y]) => y) : s.points.map(([x, y]) => ({ x, y }));
      return { ...base, data } as ChartDataset<"line" | "bar", any>;
    });
    if (this.chart) {
      this.chart.data.datasets = datasets;
      if (categories) this.chart.data.labels = categories;
      this.chart.update("none");
      return;
    }
    if (!hasData) return; // create lazily: Chart.js needs a laid-out canvas
    const scales: any = {
      x: {
        type: o.x === "category" ? "category" : "linear",
        title: { display: !!o.xLabel, text: o.xLabel },
        ticks: o.x === "time" ? this.timeTicks() : { autoSkip: true },
        afterBuildTicks: o.x === "time" ? ChartBox.alignedTicks : undefined,
        ...this.xAxisRange(),
        grid: { display: o.x !== "category" },
      },
      y: {
        beginAtZero: true,
        max: o.yMax,
        title: { display: true, text: o.yLabel },
      },
    };
    if (o.y2Label) {
      scales.y2 = { position: "right", beginAtZero: true, max: o.y2Max, title: { display: true, text: o.y2Label },
        grid: { drawOnChartArea: false } };
    }
    const digits = o.yDigits ?? 1;
    const config: ChartConfiguration<"line" | "bar"> = {
      type: o.type,
      data: { labels: categories, datasets },
      options: {
        responsive: true,
        maintainAspectRatio: false,
        parsing: o.x === "category" ? undefined : false,
        normalized: true,
        interaction: { mode: "nearest", intersect: false },
        scales,
        plugins: {
          legend: { display: series.length > 1 || o.type === "line", position: "bottom", labels: { boxWidth: 12 } },
          tooltip: {
            callbacks: {
              title: (items) => (o.x === "time" && items.length ? hhmm(items[0].parsed.x as number, true) : items[0]?.label ?? ""),
              label: (item) => `${item.dataset.label}: ${fmt(item.parsed.y as number, digits)}`,
            },
          },
        },
      },
    } as ChartConfiguration<"line" | "bar">;
    this.chart = new Chart(this.canvas, config);
  }

  private fillTable(series: Series[], categories?: string[]): void {
    const o = this.o;
    clear(this.table);
    const xs: X[] = categories ? [...categories] : [];
    if (!categories) {
      const seen = new Set<X>();
      for (const s of series) for (const [x] of s.points) if (!seen.has(x)) { seen.add(x); xs.push(x); }
      xs.sort((a, b) => (a < b ? -1 : a > b ? 1 : 0));
    }
    const head = h("tr", {}, h("th", { scope: "col" }, o.xLabel ?? (o.x === "time" ? "time" : "")),
      series.map((s) => h("th", { scope: "col" }, s.label)));
    const rows = xs.map((x) => h("tr", {},
      h("th", { scope: "row" }, o.x === "time" ? hhmm(x as number, o.seconds) : String(x)),
      series.map((s) => {
        const p = s.points.find(([px]) => px === x);
        return h("td", {}, p ? fmt(p[1], o.yDigits ?? 2) : "");
      })));
    this.table.append(h("thead", {}, head), h("tbody", {}, rows));
  }

  destroy(): void {
    this.chart?.destroy();
    this.chart = null;
  }
}

/** A small inline SVG line of ``points`` ([x, y], y null = gap) over ``[x0, x1]``, for table rows. */
export function sparkline(points: [number, number | null][], x0: number, x1: number, label: string, width = 120,
  height = 28): SVGElement {
  const el = svg("svg", { width, height, viewBox: `0 0 ${width} ${height}`, class: "spark", role: "img",
    "aria-label": label });
  const title = svg("title");
  title.textContent = label;
  el.appendChild(title);
  el.appendChild(svg("line", { x1: 2, x2: width - 2, y1: height - 2, y2: height - 2, stroke: "#cbd5e1", "stroke-width": 1 }));
  const nums = points.map(([, y]) => y).filter((v): v is number => v !== null);
  if (!nums.length) return el;
  const max = Math.max(...nums) || 1;
  const xAt = (x: number) => 2 + ((x - x0) / Math.max(1, x1 - x0)) * (width - 4);
  const yAt = (v: number) => height - 3 - (v / max) * (height - 6);
  let seg: string[] = [];
  const flush = () => {
    if (seg.length > 1) el.appendChild(svg("polyline", { points: seg.join(" "), fill: "none", stroke: PALETTE[0],
      "stroke-width": 1.5 }));
    seg = [];
  };
  for (const [x, y] of points) {
    if (y === null) {
      flush();
      continue;
    }
    seg.push(`${xAt(x).toFixed(1)},${yAt(y).toFixed(1)}`);
    el.appendChild(svg("circle", { cx: xAt(x).toFixed(1), cy: yAt(y).toFixed(1), r: 1.8, fill: PALETTE[0] }));
  }
  flush();
  return el;
}
