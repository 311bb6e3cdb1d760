// Line charts on uPlot (vendored under static/vendor, MIT), fed point by point as events arrive,
// and the small SVG sparklines of the runs list.

import uPlot from "../../vendor/uplot-1.6.32/uPlot.esm.js";

// Eight colours that stay apart on white and for common colour blindness (the compare page
// draws up to eight runs); the first two are the run page's loss and eval loss.
export const PALETTE = ["#1f6feb", "#d1242f", "#2e7d32", "#8250df", "#bf8700", "#0a7d8c", "#e16f24", "#57606a"];
// Time ticks on whole seconds, minutes and hours only.
const SECOND_INCREMENTS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 14400, 43200, 86400];
const STEP_INCREMENTS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1e3, 2e3, 5e3, 1e4, 2e4, 5e4, 1e5, 2e5, 5e5, 1e6];

/**
 * A chart of one or more series over a shared x (a step, or a time in seconds).
 * `put(x, [y…])` adds or replaces the point at x; redraws are batched to one per frame.
 * The container's `data-points` says how many x values the chart holds.
 */
export class LineChart {
  constructor(container, { series, time = false, height = 200, yRange, yLabel = "", format = formatNumber, smoothable = false, syncKey = null }) {
    this.container = container;
    this.names = series;
    // With `smoothable`, each series gets a smoothed twin (an exponential moving average with
    // TensorBoard's start-up correction), drawn over the raw one, which fades; 0 turns it off.
    this.smoothable = smoothable;
    this.smoothing = 0;
    this.yRange = yRange;
    this.points = new Map(); // x → [y…]
    this.sorted = true; // whether every put so far came after the previous largest x
    this.maxX = -Infinity;
    this.markers = [];
    this.pending = false;
    this.data = [[], ...series.map(() => []), ...(smoothable ? series.map(() => []) : [])];
    const opts = {
      width: Math.max(container.clientWidth, 200),
      height,
      scales: { x: { time }, y: yRange ? { range: yRange } : {} },
      legend: { live: true },
      // Charts of one page share a sync key: hovering one shows the same step on all of them.
      cursor: { drag: { x: false, y: false }, ...(syncKey ? { sync: { key: syncKey } } : {}) },
      series: [
        { label: time ? "time" : "step", value: (u, v) => (v == null ? "–" : time ? new Date(v * 1000).toLocaleTimeString() : v) },
        ...series.map((label, i) => ({
          label,
          stroke: PALETTE[i % PALETTE.length],
          width: 2,
          spanGaps: true,
          value: (u, v) => (v == null ? "–" : format(v)),
        })),
        ...(smoothable
          ? series.map((label, i) => ({
              label: `${label} (smoothed)`,
              stroke: PALETTE[i % PALETTE.length],
              width: 2,
              spanGaps: true,
              show: false,
              value: (u, v) => (v == null ? "–" : format(v)),
            }))
          : []),
      ],
      // Steps are whole numbers: no tick at step 1.5.
      axes: [
        time ? { space: 70, incrs: SECOND_INCREMENTS, values: clockTicks, label: "time", labelSize: 20 } : { incrs: STEP_INCREMENTS, label: "step", labelSize: 20 },
        { values: (u, ticks) => ticks.map(format), size: 60, ...(yLabel ? { label: yLabel, labelSize: 20 } : {}) },
      ],
      hooks: {
        draw: [(u) => this.drawMarkers(u)],
        // Away from the cursor the legend shows the latest point, not dashes.
        setCursor: [(u) => this.showLatest(u)],
      },
    };
    this.opts = opts;
    this.plot = new uPlot(opts, this.data, container);
    this.showTwinsInLegend();
    this.container.dataset.points = "0";
    new ResizeObserver(() => {
      const width = Math.max(this.container.clientWidth, 200);
      if (width !== this.plot.width) this.plot.setSize({ width, height });
    }).observe(container);
  }

  put(x, ys) {
    if (x == null || !Number.isFinite(x)) return;
    if (x <= this.maxX) this.sorted = false;
    this.maxX = Math.max(this.maxX, x);
    this.points.set(x, ys.map((y) => (typeof y === "number" && Number.isFinite(y) ? y : null)));
    this.schedule();
  }

  /** Sets series `index` at x, keeping the other series' values there (one run of many). */
  putAt(x, index, y) {
    const ys = this.points.get(x) ?? this.names.map(() => null);
    ys[index] = y;
    this.put(x, ys);
  }

  /** Vertical lines at x values: restarts, checkpoints. `[{x, color, label}]` */
  setMarkers(markers) {
    this.markers = markers;
    this.schedule();
  }

  schedule() {
    if (this.pending) return;
    this.pending = true;
    requestAnimationFrame(() => this.flush());
  }

  flush() {
    this.pending = false;
    const xs = [...this.points.keys()];
    if (!this.sorted) xs.sort((a, b) => a - b);
    this.sorted = true;
    const raw = this.names.map((_, i) => xs.map((x) => this.points.get(x)[i]));
    this.data = [xs, ...raw, ...(this.smoothable ? raw.map((ys) => smooth(ys, this.smoothing)) : [])];
    this.plot.setData(this.data);
    this.container.dataset.points = String(xs.length);
    // How many series hold a point: the curves a reader sees.
    this.container.dataset.curves = String(raw.filter((ys) => ys.some((y) => y != null)).length);
    this.showLatest(this.plot);
  }

  /** 0 (off) to 0.99: the weight of the past in the moving average. */
  setSmoothing(weight) {
    if (!this.smoothable) return;
    this.smoothing = weight;
    const n = this.names.length;
    this.names.forEach((_, i) => {
      this.plot.setSeries(1 + n + i, { show: weight > 0 });
      // The raw curve stays, faded, as W&B and TensorBoard draw it.
      this.plot.series[1 + i].alpha = weight > 0 ? 0.25 : 1;
    });
    this.showTwinsInLegend();
    this.container.dataset.smoothing = String(weight);
    this.schedule();
  }

  /** The smoothed twins' legend rows only while smoothing is on: off, they would list dashes. */
  showTwinsInLegend() {
    if (!this.smoothable) return;
    const rows = this.plot.root.querySelectorAll(".u-legend .u-series");
    const n = this.names.length;
    for (let i = 0; i < n; i++) {
      const row = rows[1 + n + i];
      if (row) row.hidden = !(this.smoothing > 0);
    }
  }

  /** A logarithmic y axis (positive values only), or back to linear. */
  setLogScale(on) {
    this.opts.scales.y = on ? { distr: 3, log: 10 } : this.yRange ? { range: this.yRange } : {};
    this.opts.width = this.plot.width;
    this.plot.destroy();
    this.plot = new uPlot(this.opts, this.data, this.container);
    this.showTwinsInLegend();
    if (this.smoothing > 0) this.setSmoothing(this.smoothing);
    this.container.dataset.scale = on ? "log" : "linear";
    this.schedule();
  }

  showLatest(u) {
    if (u.cursor.idx == null && u.data[0].length) u.setLegend({ idx: u.data[0].length - 1 });
  }

  drawMarkers(u) {
    if (!this.markers.length) return;
    const { ctx } = u;
    const { top, height } = u.bbox;
    ctx.save();
    ctx.lineWidth = Math.max(1, devicePixelRatio);
    ctx.setLineDash([4 * devicePixelRatio, 4 * devicePixelRatio]);
    for (const marker of this.markers) {
      const x = Math.round(u.valToPos(marker.x, "x", true));
      if (!Number.isFinite(x) || x < u.bbox.left || x > u.bbox.left + u.bbox.width) continue;
      ctx.strokeStyle = marker.color;
      ctx.beginPath();
      ctx.moveTo(x, top);
      ctx.lineTo(x, top + height);
      ctx.stroke();
    }
    ctx.restore();
  }
}

/** Debiased exponential moving average of `ys` (nulls kept), as TensorBoard's smoothing slider. */
export function smooth(ys, weight) {
  if (!(weight > 0)) return ys.map(() => null);
  let last = 0;
  let n = 0;
  return ys.map((y) => {
    if (y == null) return null;
    last = last * weight + (1 - weight) * y;
    n += 1;
    return last / (1 - weight ** n);
  });
}

/** Time ticks as a 24-hour clock, with seconds when the chart spans only a few minutes. */
function clockTicks(u, ticks) {
  const span = (u.scales.x.max ?? 0) - (u.scales.x.min ?? 0);
  const options = { hour: "2-digit", minute: "2-digit", hour12: false, ...(span < 600 ? { second: "2-digit" } : {}) };
  return ticks.map((t) => new Date(t * 1000).toLocaleTimeString([], options));
}

/** An inline SVG line of `[[x, y], …]`, scaled to its box; empty points give an empty string. */
export function sparkline(points, { width = 120, height = 28, label = "loss" } = {}) {
  if (!points || points.length < 2) return "";
  const xs = points.map((p) => p[0]);
  const ys = points.map((p) => p[1]);
  const [x0, x1] = [Math.min(...xs), Math.max(...xs)];
  const [y0, y1] = [Math.min(...ys), Math.max(...ys)];
  const sx = (x) => (x1 === x0 ? 0 : ((x - x0) / (x1 - x0)) * (width - 2) + 1);
  const sy = (y) => (y1 === y0 ? height / 2 : height - 1 - ((y - y0) / (y1 - y0)) * (height - 2));
  const path = points.map((p) => `${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(" ");
  const title = `${label} from ${formatNumber(ys[0])} to ${formatNumber(ys[ys.length - 1])}`;
  return (
    `<svg class="spark" viewBox="0 0 ${width} ${height}" width="${width}" height="${height}" role="img" aria-label="${title}">` +
    `<title>${title}</title><polyline fill="none" stroke="currentColor" stroke-width="1.5" points="${path}"/></svg>`
  );
}

/** Three significant digits, exponent notation for very small or large values. */
export function formatNumber(v) {
  if (v == null || !Number.isFinite(v)) return "–";
  const a = Math.abs(v);
  if (a !== 0 && (a < 1e-3 || a >= 1e6)) return v.toExponential(2);
  if (a >= 100) return Math.round(v).toLocaleString("en-US");
  return Number(v.toPrecision(3)).toString();
}
