// lowvram-lora frontend extension (loaded by ComfyUI from WEB_DIRECTORY).
// - Template browser: our templates demos first (the server lists them in the file system's order).
// - Inputs that do nothing for the loaded model (video inputs for an image model, control_folder for a model
//   without control images) are hidden (nodes/model_traits.py says which).
// - Train LoRA: a live chart on the node while it trains (loss, its moving average, the learning rate)
//   and a line with s/step, ETA, peak VRAM and pinned host RAM, from the "lowvram_lora.progress"
//   websocket events nodes/progress.py sends after every step. It is a <canvas> in a DOM widget (as the
//   multiline text widgets are), so the frontend gives it its own place among the widgets and the sample
//   grid preview is drawn below it, not over it (frontends 1.27 and 1.49).
// - A resumed run ("lowvram_lora.resumed": the losses before the saved step) continues the same chart, with
//   a lasting "resumed from step N" line; a Cancel or an error marks the chart stopped instead of leaving
//   its ETA running.
// - After a run: the saved LoRA path on Save LoRA, the final loss / step count on Train LoRA, and a video
//   model's sample clips (animated WebPs, ComfyUI's `animated` output flag) playing in <img> elements on Train
//   LoRA: the frontend keeps showing the last progress preview (the sample grid: first frames and a strip)
//   over a node's outputs until the node runs again, so the clips get a widget of their own.
//
// Only the frontend's public API is used (app, api, node.addDOMWidget): the internal scripts/widgets.js
// makes frontends 1.49+ warn that the import will break. Text is a read-only <textarea> in a DOM widget
// sized to its lines, so it is never clipped, and wraps between words.
import { app } from "../../scripts/app.js";
import { api } from "../../scripts/api.js";

// The template browser lists a pack's templates in the order ComfyUI globbed its folder (the file system's
// order: the demo came third). Ours go demos first, then by name (host/template_cards.py order()). The browser
// reads the list once, through this method of the api object.
const PACK_FOLDER = decodeURIComponent(new URL(import.meta.url).pathname.split("/").slice(-2, -1)[0] ?? "");
const listTemplates = api.getWorkflowTemplates?.bind(api);
if (listTemplates) {
  api.getWorkflowTemplates = async (...args) => {
    const all = await listTemplates(...args);
    for (const [pack, names] of Object.entries(all ?? {})) {
      if (!Array.isArray(names) || !(pack === PACK_FOLDER || names.includes("demo_tiny_lora"))) continue;
      const demo = (n) => (String(n).startsWith("demo_") ? 0 : 1);
      all[pack] = [...names].sort((a, b) => demo(a) - demo(b) || (a < b ? -1 : a > b ? 1 : 0));
    }
    return all;
  };
}

const OUR_NODES = new Set(["LowVRAMTrainLoRA", "LowVRAMSaveLoRA"]);
const CHART_H = 150;
const LINE_H = 16;
const EMA = 0.9;
const progress = new Map(); // node id -> { points: [{step, loss, avg, lr}], last, resumedFrom, stopped }
window.__lowvramProgress = progress; // for tests and the curious

function textWidget(node, name) {
  let widget = node.widgets?.find((w) => w.name === name);
  if (widget) return widget;
  const el = document.createElement("textarea");
  el.readOnly = true;
  el.spellcheck = false;
  Object.assign(el.style, {
    width: "100%", boxSizing: "border-box", resize: "none", overflow: "hidden", border: "none",
    background: "rgba(0,0,0,0.25)", color: "var(--input-text, #ddd)", opacity: 0.9, padding: "3px 6px",
    font: `12px/${LINE_H}px monospace`, whiteSpace: "pre-wrap", wordBreak: "normal", overflowWrap: "anywhere",
  });
  const height = () => Math.max(1, el.__lines || 1) * LINE_H + 8 + (el.__extra || 0);
  widget = node.addDOMWidget(name, "lowvram_text", el, {
    serialize: false, getValue: () => el.value, setValue: (v) => { el.value = v; },
    getMinHeight: height, getMaxHeight: height, getHeight: height,
  });
  widget.serialize = false; // display only: never in the workflow's widgets_values or the prompt
  // Our own name for the element: frontend 1.58 deprecates `inputEl` (its setter logs a console warning).
  widget.lowvramEl = el;
  widget.computeSize = (width) => [width, height() + 4];
  return widget;
}

function showText(node, name, lines) {
  const widget = textWidget(node, name);
  const el = widget.lowvramEl ?? widget.element;
  el.value = lines.join("\n");
  // Lines as drawn: a long path wraps, so count the wrapped lines at the node's width (7.2 px per character).
  const perLine = Math.max(20, Math.floor((node.size[0] - 40) / 7.2));
  el.__lines = lines.reduce((n, l) => n + Math.max(1, Math.ceil(String(l).length / perLine)), 0);
  el.__extra = 0;
  el.__fixes = 0;
  const size = node.computeSize();
  node.setSize([Math.max(node.size[0], size[0]), Math.max(node.size[1], size[1])]);
  node.setDirtyCanvas(true, true);
  fit(node, el);
}

// Once drawn, grow the node until the text shows whole: the frontends lay DOM widgets out with margins and
// fonts of their own, so the estimate above may fall a line short (then the text was clipped).
function fit(node, el) {
  requestAnimationFrame(() => {
    const over = el.scrollHeight - el.clientHeight;
    if (over > 1 && el.clientHeight > 0 && el.__fixes++ < 4) {
      el.__extra += over;
      node.setSize([node.size[0], node.size[1] + over]);
      node.setDirtyCanvas(true, true);
      setTimeout(() => fit(node, el), 50);
    }
  });
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

function redraw(id, entry) {
  const node = findNode(id);
  if (node) {
    drawChart(chartWidget(node).canvas, entry);
    node.setDirtyCanvas(true, true);
  }
}

function addPoint(entry, step, loss, lr, val = null) {
  const prev = entry.points[entry.points.length - 1];
  const avg = prev ? EMA * prev.avg + (1 - EMA) * loss : loss;
  entry.points.push({ step, loss, avg, lr, val }); // val: the held-out split's loss, on steps it was measured
}

api.addEventListener("lowvram_lora.progress", ({ detail }) => {
  if (!detail || detail.node == null) return;
  const id = String(detail.node);
  let entry = progress.get(id);
  // A new run starts over; a resumed one was set up by "lowvram_lora.resumed" and goes on after its step.
  if (!entry || entry.stopped != null || detail.step <= (entry.last?.step ?? 0)) {
    if (!(entry && entry.resumedFrom != null && entry.stopped == null && detail.step === entry.resumedFrom + 1)) {
      entry = { points: [] };
    }
  }
  addPoint(entry, detail.step, detail.loss, detail.lr, detail.validation_loss ?? null);
  entry.last = detail;
  entry.running = detail.step < detail.total;
  progress.set(id, entry);
  redraw(id, entry);
});

// Training goes on from a saved state: the chart is the run's, from step 1, not a new one from step N.
api.addEventListener("lowvram_lora.resumed", ({ detail }) => {
  if (!detail || detail.node == null) return;
  const id = String(detail.node);
  const entry = { points: [], resumedFrom: detail.step, running: true };
  detail.loss.forEach((loss, i) => addPoint(entry, i + 1, loss, detail.lr[i] ?? 0));
  entry.last = { step: detail.step, total: detail.total, loss: detail.loss[detail.loss.length - 1] ?? 0,
                 lr: detail.lr[detail.lr.length - 1] ?? 0, seconds_per_step: 0, eta_seconds: null };
  progress.set(id, entry);
  redraw(id, entry);
});

// Cancel or a failure: the chart says where it stopped instead of a frozen ETA.
function markStopped(how) {
  for (const [id, entry] of progress) {
    if (!entry.running || !entry.last) continue;
    entry.running = false;
    entry.stopped = entry.last.step;
    entry.how = how;
    redraw(id, entry);
  }
}
api.addEventListener("execution_interrupted", () => markStopped("cancelled"));
api.addEventListener("execution_error", ({ detail }) => {
  markStopped("failed");
  showError(detail);
});

// A node of ours that failed says why on itself, whole: the toast names only the node, and the message sat
// below the fold of the error log. Cleared when the next run starts.
const PACK_PREFIX = "LowVRAM";
function showError(detail) {
  const node = detail ? findNode(detail.node_id) : null;
  if (!node || !String(node.comfyClass ?? node.type ?? "").startsWith(PACK_PREFIX)) return;
  const message = String(detail.exception_message ?? "").trim();
  if (!message) return;
  showText(node, "error", message.split("\n").filter((l) => l.trim()));
  const el = textWidget(node, "error").lowvramEl;
  el.style.color = "#ffb4a0";
  el.title = detail.exception_type ?? "";
}
function clearErrors() {
  for (const node of app.graph?._nodes ?? []) {
    node.__lowvramInputErrors = "";
    clearError(node);
  }
}
api.addEventListener("execution_start", clearErrors);

// An input our node refused when the graph was queued (validate_inputs): the editor outlines the node and its toast
// says only "Invalid input"; ComfyUI files the message once per input the check read ("dataset_path - ...",
// "control_folder - ..."). The node shows it once, whole, until the errors change.
function syncInputErrors(node) {
  const errors = app.lastNodeErrors?.[node.id]?.errors ?? [];
  const lines = [...new Set(errors.map((e) => String(e.details || e.message || "").replace(/^[\w.]+ - /, "")))];
  const key = lines.join("\n");
  if (key === (node.__lowvramInputErrors ?? "")) return;
  node.__lowvramInputErrors = key;
  if (lines.length) showError({ node_id: node.id, exception_message: key, exception_type: "invalid input" });
  else clearError(node);
}
function clearError(node) {
  const i = node.widgets?.findIndex((w) => w.name === "error") ?? -1;
  if (i < 0) return;
  const [widget] = node.widgets.splice(i, 1);
  widget.onRemove?.();
  widget.lowvramEl?.remove?.();
  node.setSize([node.size[0], node.computeSize()[1]]);
  node.setDirtyCanvas(true, true);
}

// The frontend's own progress-text box ($$node-text-preview) is two lines high with a scroll bar, so our status
// lines were cut; on our nodes it grows to its text.
const PROGRESS_TEXT = "$$node-text-preview";
api.addEventListener("progress_text", ({ detail }) => {
  const node = detail ? findNode(detail.nodeId) : null;
  if (!node || !String(node.comfyClass ?? node.type ?? "").startsWith(PACK_PREFIX)) return;
  requestAnimationFrame(() => {
    const widget = node.widgets?.find((w) => w.name === PROGRESS_TEXT);
    if (!widget?.options) return;
    const perLine = Math.max(20, Math.floor((node.size[0] - 40) / 7.2));
    const lines = String(detail.text ?? "").split("\n")
      .reduce((n, l) => n + Math.max(1, Math.ceil(l.length / perLine)), 0);
    const height = Math.max(58, lines * LINE_H + 12);
    widget.options.getMinHeight = () => height;
    widget.options.getMaxHeight = () => height;
    node.setSize([node.size[0], Math.max(node.size[1], node.computeSize()[1])]);
    node.setDirtyCanvas(true, true);
  });
});

// Inputs that do nothing for the loaded model are hidden: the video inputs for an image model, control_folder for a
// model that takes no control images, first_frame_p for a model that holds no first frame. nodes/model_traits.py
// answers for the Load Quantized Slab's choice (its file header, as the node reads it). Hidden widgets stay in the
// node, so saved workflows keep their positional values; a model the server cannot identify (or a server without the
// route) shows every input. An options node without a model input follows the Train LoRA it feeds.
const FAMILY_NODES = new Set(["LowVRAMCacheTextEmbeds", "LowVRAMTrainLoRA", "LowVRAMLossOptions"]);
const traitsCache = new Map(); // "checkpoint|family" -> Promise<traits or null>
function traitsFor(checkpoint, family) {
  const key = `${checkpoint}|${family}`;
  if (!traitsCache.has(key)) {
    const q = new URLSearchParams({ checkpoint, family });
    traitsCache.set(key, api.fetchApi(`/lowvram_lora/model_traits?${q}`)
      .then((r) => (r.ok ? r.json() : null)).catch(() => null));
  }
  return traitsCache.get(key);
}
const widgetValue = (node, name) => node?.widgets?.find((w) => w.name === name)?.value;
// The node whose `model` input names the model: the node itself, or the Train LoRA an options node's output feeds.
function modelOwner(node) {
  if (node.inputs?.some((i) => i.name === "model")) return node;
  for (const id of node.outputs?.[0]?.links ?? []) {
    const link = node.graph?.links?.get?.(id) ?? node.graph?.links?.[id];
    const target = link ? node.graph.getNodeById(link.target_id) : null;
    if (target && String(target.comfyClass ?? target.type) === "LowVRAMTrainLoRA") return target;
  }
  return null;
}
function syncFamilyInputs(node) {
  const cls = String(node.comfyClass ?? node.type ?? "");
  if (!FAMILY_NODES.has(cls)) return;
  const owner = modelOwner(node);
  const slot = owner?.inputs?.findIndex((i) => i.name === "model") ?? -1;
  let load = slot >= 0 ? owner.getInputNode?.(slot) : null;
  for (let hops = 0; load && load.type === "Reroute" && hops < 16; hops++) load = load.getInputNode?.(0);
  const ok = load && String(load.comfyClass ?? load.type) === "LowVRAMLoadQuantizedSlab";
  const key = ok ? `${widgetValue(load, "checkpoint")}|${widgetValue(load, "family")}` : "";
  if (key === node.__lowvramTraitsKey) return;
  node.__lowvramTraitsKey = key;
  if (!ok) return applyTraits(node, null);
  traitsFor(widgetValue(load, "checkpoint"), widgetValue(load, "family") ?? "auto").then((t) => {
    if (node.__lowvramTraitsKey === key) applyTraits(node, t);
  });
}
function applyTraits(node, traits) {
  const cls = String(node.comfyClass ?? node.type ?? "");
  const managed = new Set(traits?.inputs?.[cls] ?? node.__lowvramManaged ?? []);
  node.__lowvramManaged = [...managed];
  const hide = new Set(traits?.hide?.[cls] ?? []);
  let changed = false;
  for (const w of node.widgets ?? []) {
    if (!managed.has(w.name)) continue;
    const hidden = hide.has(w.name);
    if (!!w.hidden === hidden) continue;
    w.hidden = hidden; // what the frontends (1.49, 1.58) test before drawing a widget
    if (w.options) w.options.hidden = hidden;
    changed = true;
  }
  if (!changed) return;
  node.setSize([node.size[0], node.computeSize()[1]]);
  node.setDirtyCanvas(true, true);
}

function drawChart(canvas, entry) {
  const scale = window.devicePixelRatio || 1;
  const cw = Math.max(canvas.clientWidth || 340, 100), ch = CHART_H;
  canvas.width = cw * scale;
  canvas.height = ch * scale;
  const ctx = canvas.getContext("2d");
  ctx.setTransform(scale, 0, 0, scale, 0, 0);
  // Layout, top to bottom: the numbers line, the plot (loss values on a y axis at its left), the status line(s).
  // Nothing is drawn over the curve.
  const pad = 2, w = cw - 2 * pad;
  const x0 = pad, y0 = 0, top = y0 + 22, bottom = ch - (entry.resumedFrom != null ? 40 : 24);
  ctx.fillStyle = "rgba(0,0,0,0.35)";
  ctx.fillRect(x0, y0, w, ch - 2);
  const pts = entry.points, last = entry.last;
  const vals = pts.filter((p) => p.val != null);
  const losses = pts.map((p) => p.loss).concat(vals.map((p) => p.val));
  const lo = Math.min(...losses), hi = Math.max(...losses);
  const lrMax = Math.max(...pts.map((p) => p.lr), 1e-12);
  const total = Math.max(last.total, 1);
  const axis = (v) => (Math.abs(v) >= 1e-3 && Math.abs(v) < 1e4 ? v.toPrecision(3) : v.toExponential(1));
  ctx.font = "10px sans-serif";
  const left = x0 + 6 + Math.max(...[hi, lo].map((v) => ctx.measureText(axis(v)).width)) + 4;
  const X = (step) => left + 2 + (x0 + w - 6 - left) * (step / total);
  const span = (f) => top + (bottom - top) * (1 - f);
  const Y = (v) => span((v - lo) / Math.max(hi - lo, 1e-12));
  ctx.fillStyle = "#aaa";
  ctx.textBaseline = "middle";
  for (const v of hi > lo ? [hi, (hi + lo) / 2, lo] : [lo]) ctx.fillText(axis(v), x0 + 4, Y(v));
  ctx.textBaseline = "alphabetic";
  ctx.strokeStyle = "rgba(255,255,255,0.25)";
  ctx.lineWidth = 1;
  ctx.beginPath();
  ctx.moveTo(left, top - 2);
  ctx.lineTo(left, bottom + 2);
  ctx.lineTo(x0 + w - 4, bottom + 2);
  ctx.stroke();
  const line = (color, value, width) => {
    ctx.strokeStyle = color;
    ctx.lineWidth = width;
    ctx.beginPath();
    pts.forEach((p, i) => (i ? ctx.lineTo : ctx.moveTo).call(ctx, X(p.step), value(p)));
    ctx.stroke();
  };
  if (entry.resumedFrom != null) { // where the saved state took over: a dashed mark
    ctx.strokeStyle = "rgba(255,255,255,0.45)";
    ctx.setLineDash([3, 3]);
    ctx.beginPath();
    ctx.moveTo(X(entry.resumedFrom), top);
    ctx.lineTo(X(entry.resumedFrom), bottom);
    ctx.stroke();
    ctx.setLineDash([]);
  }
  line("rgba(120,170,255,0.6)", (p) => Y(p.loss), 1);
  line("#ffb040", (p) => Y(p.avg), 2);
  line("#60d080", (p) => span(p.lr / lrMax), 1);
  if (vals.length) { // the validation loss: a magenta line through its measured steps, a dot at each
    ctx.strokeStyle = ctx.fillStyle = "#ff60d0";
    ctx.lineWidth = 2;
    ctx.beginPath();
    vals.forEach((p, i) => (i ? ctx.lineTo : ctx.moveTo).call(ctx, X(p.step), Y(p.val)));
    ctx.stroke();
    vals.forEach((p) => { ctx.beginPath(); ctx.arc(X(p.step), Y(p.val), 2.5, 0, 2 * Math.PI); ctx.fill(); });
  }
  ctx.font = "11px sans-serif";
  ctx.fillStyle = "#ddd";
  const valText = vals.length ? `  val ${vals[vals.length - 1].val.toFixed(4)}` : "";
  ctx.fillText(`loss ${last.loss.toFixed(4)} (avg ${pts[pts.length - 1].avg.toFixed(4)})${valText}  lr ${last.lr.toExponential(1)}`,
               x0 + 6, y0 + 13);
  const vram = last.peak_vram_gb ? ` · peak ${last.peak_vram_gb.toFixed(2)} GB` : "";
  const pinned = (last.host_ram_gb ? ` · RAM ${last.host_ram_gb.toFixed(1)} GB` +
                  (last.predicted_host_gb ? ` (plan ${last.predicted_host_gb.toFixed(1)})` : "") : "") +
                 (last.pinned_host_gb ? ` · pinned ${last.pinned_host_gb.toFixed(1)} GB` : "");
  let status;
  if (entry.stopped != null) {
    status = entry.how === "cancelled" ? `stopped at step ${entry.stopped}/${last.total} · Run again to resume`
                                       : `failed after step ${entry.stopped}/${last.total}`;
  } else if (last.eta_seconds == null) {
    status = `step ${last.step}/${last.total} · loading`;
  } else {
    status = `step ${last.step}/${last.total} · ${last.seconds_per_step.toFixed(2)} s/step · ETA ` +
             `${clock(last.eta_seconds)}${vram}${pinned}`;
  }
  if (entry.resumedFrom != null) {
    ctx.fillStyle = "#bbb";
    ctx.fillText(`resumed from step ${entry.resumedFrom} (saved state)`, x0 + 6, y0 + ch - 22);
    ctx.fillStyle = "#ddd";
  }
  ctx.fillStyle = entry.stopped != null ? "#ffb040" : "#ddd";
  ctx.fillText(status, x0 + 6, y0 + ch - 8);
  ctx.fillStyle = "#ffb040";
  ctx.fillText("avg", x0 + w - 52, y0 + 13);
  ctx.fillStyle = "#60d080";
  ctx.fillText("lr", x0 + w - 24, y0 + 13);
}

const CLIP_H = 160;

function clipsWidget(node) {
  let widget = node.widgets?.find((w) => w.name === "sample_clips");
  if (widget) return widget;
  const box = document.createElement("div");
  Object.assign(box.style, { display: "flex", gap: "4px", overflowX: "auto", height: `${CLIP_H}px`,
                             background: "rgba(0,0,0,0.25)", padding: "2px" });
  widget = node.addDOMWidget("sample_clips", "lowvram_clips", box, {
    serialize: false, getMinHeight: () => CLIP_H + 4, getMaxHeight: () => CLIP_H + 4, getHeight: () => CLIP_H + 4,
  });
  widget.serialize = false; // display only
  widget.box = box;
  widget.computeSize = (width) => [width, CLIP_H + 8];
  return widget;
}

// The last checkpoint's clips, one per prompt, animated (an <img> plays an animated WebP by itself).
function showClips(node, message) {
  const clips = (message?.images || []).filter((im) => String(im.filename).endsWith(".webp"));
  if (!message?.animated?.some(Boolean) || !clips.length) return;
  const box = clipsWidget(node).box;
  box.replaceChildren(...clips.map((im) => {
    const img = document.createElement("img");
    const q = new URLSearchParams({ filename: im.filename, subfolder: im.subfolder || "", type: im.type || "output" });
    img.src = api.apiURL(`/view?${q}`);
    img.title = `${im.filename}: the sample clip of prompt ${clips.indexOf(im) + 1} at the last checkpoint`;
    Object.assign(img.style, { height: "100%", imageRendering: "auto", objectFit: "contain" });
    return img;
  }));
  const size = node.computeSize();
  node.setSize([Math.max(node.size[0], size[0]), Math.max(node.size[1], size[1])]);
  node.setDirtyCanvas(true, true);
}

app.registerExtension({
  name: "lowvram_lora.results",
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (String(nodeData.name).startsWith(PACK_PREFIX)) {
      const onDrawForeground = nodeType.prototype.onDrawForeground;
      nodeType.prototype.onDrawForeground = function () {
        onDrawForeground?.apply(this, arguments);
        syncInputErrors(this);
        syncFamilyInputs(this);
      };
    }
    if (!OUR_NODES.has(nodeData.name)) return;
    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (message) {
      onExecuted?.apply(this, arguments);
      if (message?.text) showText(this, "saved", message.text.map(String));
      if (message?.final_loss) {
        const steps = message?.steps ? ` after ${message.steps[0]} steps` : "";
        showText(this, "result", message.final_loss.map((l) => `final loss ${Number(l).toFixed(5)}${steps}`));
      }
      showClips(this, message);
    };
  },
});
