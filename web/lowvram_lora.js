// lowvram-lora frontend extension (loaded by ComfyUI from WEB_DIRECTORY).
// - Train LoRA: a live chart on the node while it trains (loss, its moving average, the learning rate)
//   and a line with s/step, ETA, peak VRAM and pinned host RAM, from the "lowvram_lora.progress"
//   websocket events nodes/progress.py sends after every step. It is a <canvas> in a DOM widget (as the
//   multiline text widgets are), so the frontend gives it its own place among the widgets and the sample
//   grid preview is drawn below it, not over it (frontends 1.27 and 1.49).
// - After a run: the saved LoRA path on Save LoRA, the final loss / step count on Train LoRA.
//
// A read-only multiline STRING widget is used for text, not a disabled "text" widget: frontends 1.27
// and 1.49 draw a disabled text widget as a grey label without its value.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";
import { ComfyWidgets } from "../../scripts/widgets.js";

const OUR_NODES = new Set(["LowVRAMTrainLoRA", "LowVRAMSaveLoRA"]);
const CHART_H = 150;
const EMA = 0.9;
const progress = new Map(); // node id -> { points: [{step, loss, avg, lr}], last }
window.__lowvramProgress = progress; // for tests and the curious

function showText(node, name, lines) {
  let widget = node.widgets?.find((w) => w.name === name);
  if (!widget) {
    widget = ComfyWidgets["STRING"](node, name, ["STRING", { multiline: true }], app).widget;
    // Display only: never saved into the workflow or sent as a node input.
    widget.serialize = false;
    widget.options = { ...(widget.options || {}), serialize: false };
    if (widget.inputEl) {
      widget.inputEl.readOnly = true;
      widget.inputEl.style.opacity = 0.85;
    }
  }
  widget.value = lines.join("\n");
  if (widget.inputEl) widget.inputEl.value = widget.value;
  const size = node.computeSize();
  node.setSize([Math.max(node.size[0], size[0]), Math.max(node.size[1], size[1])]);
  node.setDirtyCanvas(true, true);
}

function clock(seconds) {
  const s = Math.max(0, Math.round(seconds));
  const h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), r = s % 60;
  return (h ? `${h}:${String(m).padStart(2, "0")}` : `${m}`) + `:${String(r).padStart(2, "0")}`;
}

function findNode(id) {
  return app.graph?.getNodeById?.(Number(id)) ?? app.graph?._nodes?.find((n) => String(n.id) === String(id));
}

function chartWidget(node) {
  let widget = node.widgets?.find((w) => w.name === "loss_chart");
  if (!widget) {
    const canvas = document.createElement("canvas");
    canvas.style.width = "100%";
    canvas.style.height = `${CHART_H}px`;
    widget = node.addDOMWidget("loss_chart", "lowvram_chart", canvas, {
      serialize: false, getMinHeight: () => CHART_H, getMaxHeight: () => CHART_H, getHeight: () => CHART_H,
    });
    widget.serialize = false; // display only: never in the workflow's widgets_values or the prompt
    widget.canvas = canvas;
    widget.computeSize = (width) => [width, CHART_H + 6];
    const size = node.computeSize();
    node.setSize([Math.max(node.size[0], 360), Math.max(node.size[1], size[1])]);
  }
  return widget;
}

api.addEventListener("lowvram_lora.progress", ({ detail }) => {
  if (!detail || detail.node == null) return;
  const id = String(detail.node);
  let entry = progress.get(id);
  if (!entry || detail.step <= (entry.last?.step ?? 0)) entry = { points: [] }; // a new run
  const prev = entry.points[entry.points.length - 1];
  const avg = prev ? EMA * prev.avg + (1 - EMA) * detail.loss : detail.loss;
  entry.points.push({ step: detail.step, loss: detail.loss, avg, lr: detail.lr });
  entry.last = detail;
  progress.set(id, entry);
  const node = findNode(id);
  if (node) {
    drawChart(chartWidget(node).canvas, entry);
    node.setDirtyCanvas(true, true);
  }
});

function drawChart(canvas, entry) {
  const scale = window.devicePixelRatio || 1;
  const cw = Math.max(canvas.clientWidth || 340, 100), ch = CHART_H;
  canvas.width = cw * scale;
  canvas.height = ch * scale;
  const ctx = canvas.getContext("2d");
  ctx.setTransform(scale, 0, 0, scale, 0, 0);
  const pad = 2, w = cw - 2 * pad, h = ch - 30;
  const x0 = pad, y0 = 0;
  ctx.fillStyle = "rgba(0,0,0,0.35)";
  ctx.fillRect(x0, y0, w, ch - 2);
  const pts = entry.points, last = entry.last;
  const losses = pts.map((p) => p.loss);
  const lo = Math.min(...losses), hi = Math.max(...losses);
  const lrMax = Math.max(...pts.map((p) => p.lr), 1e-12);
  const total = Math.max(last.total, 1);
  const X = (step) => x0 + 4 + (w - 8) * (step / total);
  const Y = (v) => y0 + 18 + (h - 4) * (1 - (v - lo) / Math.max(hi - lo, 1e-12));
  const line = (color, value, width) => {
    ctx.strokeStyle = color;
    ctx.lineWidth = width;
    ctx.beginPath();
    pts.forEach((p, i) => (i ? ctx.lineTo : ctx.moveTo).call(ctx, X(p.step), value(p)));
    ctx.stroke();
  };
  line("rgba(120,170,255,0.6)", (p) => Y(p.loss), 1);
  line("#ffb040", (p) => Y(p.avg), 2);
  line("#60d080", (p) => y0 + 18 + (h - 4) * (1 - p.lr / lrMax), 1);
  ctx.font = "11px sans-serif";
  ctx.fillStyle = "#ddd";
  ctx.fillText(`loss ${last.loss.toFixed(4)} (avg ${pts[pts.length - 1].avg.toFixed(4)})  lr ${last.lr.toExponential(1)}`,
               x0 + 6, y0 + 13);
  const vram = last.peak_vram_gb ? ` · peak ${last.peak_vram_gb.toFixed(2)} GB` : "";
  const pinned = last.pinned_host_gb ? ` · pinned ${last.pinned_host_gb.toFixed(1)} GB` : "";
  ctx.fillText(`step ${last.step}/${last.total} · ${last.seconds_per_step.toFixed(2)} s/step · ETA ` +
               `${clock(last.eta_seconds)}${vram}${pinned}`, x0 + 6, y0 + ch - 10);
  ctx.fillStyle = "#ffb040";
  ctx.fillText("avg", x0 + w - 52, y0 + 13);
  ctx.fillStyle = "#60d080";
  ctx.fillText("lr", x0 + w - 24, y0 + 13);
}

app.registerExtension({
  name: "lowvram_lora.results",
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!OUR_NODES.has(nodeData.name)) return;
    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (message) {
      onExecuted?.apply(this, arguments);
      if (message?.text) showText(this, "saved", message.text.map(String));
      if (message?.final_loss) {
        const steps = message?.steps ? ` after ${message.steps[0]} steps` : "";
        showText(this, "result", message.final_loss.map((l) => `final loss ${Number(l).toFixed(5)}${steps}`));
      }
    };
  },
});
