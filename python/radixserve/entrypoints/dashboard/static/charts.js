// A small time-series line chart on a canvas: no library, no build step.
// chart.draw(series, now) with series = [{name, color, points: [[t_seconds, value|null], ...]}];
// a null value breaks the line. The x axis spans the last `spanS` seconds. Only
// window.RadixCharts is global.
(() => {
"use strict";

const PALETTE = ["#2f6fde", "#e8743b", "#19a979", "#945ecf", "#ed4a7b", "#13a4b4", "#6f7d8c", "#bf9a00"];

class LineChart {
  constructor(canvas, legend, opts = {}) {
    this.canvas = canvas;
    this.legend = legend;
    this.spanS = opts.spanS || 120;
    this.unit = opts.unit || "";
    this.minMax = opts.minMax || 1; // the y axis reaches at least this value
    this.fixedMax = opts.fixedMax || null;
    this.message = ""; // drawn over an empty chart
    this.lastLegend = "";
  }

  draw(series, now) {
    const canvas = this.canvas;
    const ratio = window.devicePixelRatio || 1;
    const width = canvas.clientWidth, height = canvas.clientHeight;
    if (canvas.width !== Math.round(width * ratio) || canvas.height !== Math.round(height * ratio)) {
      canvas.width = Math.round(width * ratio);
      canvas.height = Math.round(height * ratio);
    }
    const ctx = canvas.getContext("2d");
    ctx.setTransform(ratio, 0, 0, ratio, 0, 0);
    ctx.clearRect(0, 0, width, height);
    const pad = {left: 52, right: 8, top: 8, bottom: 20};
    const plotW = width - pad.left - pad.right, plotH = height - pad.top - pad.bottom;
    const t0 = now - this.spanS;
    let max = this.minMax;
    for (const s of series) {
      for (const [t, v] of s.points) {
        if (t >= t0 && v !== null && v > max) max = v;
      }
    }
    if (this.fixedMax !== null) max = this.fixedMax;
    max = niceCeil(max);
    const x = (t) => pad.left + ((t - t0) / this.spanS) * plotW;
    const y = (v) => pad.top + plotH - (v / max) * plotH;
    this.drawAxes(ctx, pad, plotW, plotH, max, y);
    let drawn = 0;
    for (const s of series) {
      ctx.strokeStyle = s.color;
      ctx.lineWidth = 1.6;
      ctx.beginPath();
      let open = false;
      for (const [t, v] of s.points) {
        if (t < t0 || v === null) { open = false; continue; }
        if (open) ctx.lineTo(x(t), y(v)); else ctx.moveTo(x(t), y(v));
        open = true;
        drawn++;
      }
      ctx.stroke();
    }
    if (drawn === 0 && this.message) {
      ctx.fillStyle = "#667085";
      ctx.font = "13px system-ui, sans-serif";
      ctx.textAlign = "center";
      ctx.fillText(this.message, pad.left + plotW / 2, pad.top + plotH / 2);
    }
    this.drawLegend(series);
  }

  drawAxes(ctx, pad, plotW, plotH, max, y) {
    ctx.strokeStyle = "#e3e6eb";
    ctx.fillStyle = "#667085";
    ctx.font = "11px system-ui, sans-serif";
    ctx.lineWidth = 1;
    ctx.textAlign = "right";
    ctx.textBaseline = "middle";
    for (let i = 0; i <= 4; i++) {
      const v = (max * i) / 4;
      ctx.beginPath();
      ctx.moveTo(pad.left, y(v));
      ctx.lineTo(pad.left + plotW, y(v));
      ctx.stroke();
      ctx.fillText(formatNumber(v) + this.unit, pad.left - 6, y(v));
    }
    ctx.textBaseline = "top";
    for (let i = 0; i <= 4; i++) {
      ctx.textAlign = i === 4 ? "right" : "center"; // "now" stays inside the canvas
      const ago = this.spanS - (this.spanS * i) / 4;
      ctx.fillText(ago === 0 ? "now" : `-${Math.round(ago)}s`, pad.left + (plotW * i) / 4, pad.top + plotH + 4);
    }
  }

  drawLegend(series) {
    const key = series.map((s) => s.name + s.color).join("|");
    if (key === this.lastLegend) return;
    this.lastLegend = key;
    this.legend.replaceChildren(...series.map((s) => {
      const item = document.createElement("span");
      const swatch = document.createElement("span");
      swatch.className = "swatch";
      swatch.style.background = s.color;
      item.append(swatch, document.createTextNode(s.name));
      return item;
    }));
  }
}

function niceCeil(v) {
  if (v <= 0) return 1;
  const exp = Math.pow(10, Math.floor(Math.log10(v)));
  for (const m of [1, 2, 2.5, 5, 10]) {
    if (v <= m * exp) return m * exp;
  }
  return 10 * exp;
}

function formatNumber(v) {
  if (v >= 1e6) return (v / 1e6).toFixed(1) + "M";
  if (v >= 1e4) return (v / 1e3).toFixed(0) + "k";
  if (v >= 100 || Number.isInteger(v)) return v.toFixed(0);
  return v.toFixed(v >= 10 ? 1 : 2);
}

window.RadixCharts = {LineChart, PALETTE, formatNumber};
})();
