// lowvram-lora: workflows saved before a node's rarely changed settings moved to small options nodes plugged into
// it (Train LoRA's to Training Options and Preview Options, Offload Config's to Offload Tuning; 2026-11-28) load
// with every value where it was.
//
// The frontend restores a node's widgets_values by position (LGraphNode.configure; restoring by name is an
// experimental setting, off by default, in frontend 1.49). The node now has fewer widgets than such a file stores,
// so positions would shift: Train LoRA's training_seed would get gradient_accumulation's value. Here the node reads
// such a file by the old names instead (MOVED: each node's LEGACY_WIDGETS and is_legacy_layout, the same as in
// nodes/train_lora.py and nodes/offload_config.py; nodes/moved_settings.py says how the rest fits), and once the
// graph is configured adds each options node whose settings the file holds at other than its defaults beside it,
// with the file's values, plugged in. A toast says so; saving the workflow then stores the new layout.
import { app } from "../../scripts/app.js";

const MOVED = {
  LowVRAMTrainLoRA: {
    title: "Train LoRA",
    LEGACY_WIDGETS: [
      "steps", "learning_rate", "rank", "alpha", "batch_size", "gradient_accumulation", "lr_scheduler",
      "warmup_steps", "training_seed", "guidance", "max_grad_norm", "optimizer", "save_every",
      "sample_every", "sample_steps", "sample_resolution", "sample_seed", "sample_at_start",
      "sample_guidance", "sample_frames",
    ],
    isLegacyLayout: (values) => values.length >= 7 && typeof values[6] === "string",
    // [options node, the socket it plugs into]
    options: [["LowVRAMTrainingOptions", "training_options"], ["LowVRAMPreviewOptions", "preview_options"]],
  },
  LowVRAMOffloadConfig: {
    title: "Offload Config",
    LEGACY_WIDGETS: [
      "mode", "vram_budget_gb", "resident_blocks", "prefetch_depth", "activation_offload",
      "gradient_checkpointing", "max_pinned_fraction", "int8_compute", "recompute_chunks",
      "optimizer_on_host", "micro_batch_size", "compile", "activation_memory_budget", "outer_on_host",
      "ram_budget_gb", "disk_blocks",
    ],
    isLegacyLayout: (values) => values.length >= 2 && typeof values[1] !== "string",
    options: [["LowVRAMOffloadTuning", "tuning"]],
  },
};

const pending = []; // [node, its MOVED entry, {name: value}] read while the graph configures

// The first y at or below `y` where a w x h box at x overlaps no node of the graph (title bars included): the
// options node goes below its node without covering what the file has there (the demo's Note).
function freeY(graph, x, y, w, h) {
  const nodes = graph._nodes ?? graph.nodes ?? [];
  for (let i = 0; i < 100; i++) {
    const hit = nodes.find((n) => n.pos[0] < x + w && x < n.pos[0] + n.size[0]
      && n.pos[1] - 40 < y + h && y - 40 < n.pos[1] + n.size[1]);
    if (!hit) break;
    y = hit.pos[1] + hit.size[1] + 60;
  }
  return y;
}

function migrate(node, moved, byName) {
  const graph = node.graph;
  if (!graph) return [];
  const added = [];
  // The file's size was for its many widgets: fit the node to the ones it has now.
  const fit = node.computeSize?.();
  if (fit && fit[1] < node.size[1]) node.setSize([Math.max(node.size[0], fit[0]), fit[1]]);
  let y = node.pos[1] + node.size[1] + 60;
  for (const [type, socket] of moved.options) {
    const slot = node.inputs?.findIndex((i) => i.name === socket) ?? -1;
    if (slot < 0 || node.inputs[slot].link != null) continue; // plugged already: its values stand
    const options = LiteGraph.createNode(type);
    if (!options) continue; // a server without the node (an older pack): nothing to plug
    const held = (options.widgets ?? []).filter((w) => w.name in byName);
    if (!held.some((w) => w.value !== byName[w.name])) continue; // the defaults: unplugged means the same
    for (const w of held) w.value = byName[w.name];
    y = freeY(graph, node.pos[0], y, options.size[0], options.size[1]);
    options.pos = [node.pos[0], y];
    graph.add(options);
    options.connect(0, node, slot);
    y += options.size[1] + 60;
    added.push(options.title);
  }
  return added;
}

app.registerExtension({
  name: "lowvram_lora.moved_settings",
  async beforeRegisterNodeDef(nodeType, nodeData) {
    const moved = MOVED[nodeData.name];
    if (!moved) return;
    const onConfigure = nodeType.prototype.onConfigure;
    nodeType.prototype.onConfigure = function (info) {
      const r = onConfigure?.apply(this, arguments);
      const values = info?.widgets_values;
      if (Array.isArray(values) && moved.isLegacyLayout(values)) {
        const byName = {};
        moved.LEGACY_WIDGETS.forEach((name, i) => { if (i < values.length) byName[name] = values[i]; });
        for (const w of this.widgets ?? []) if (w.name in byName) w.value = byName[w.name];
        pending.push([this, moved, byName]);
      }
      return r;
    };
  },
  async afterConfigureGraph() {
    const notes = [];
    while (pending.length) {
      const [node, moved, byName] = pending.shift();
      const added = migrate(node, moved, byName);
      if (added.length) notes.push(`${moved.title}: ${added.join(", ")}`);
    }
    if (!notes.length) return;
    app.graph?.setDirtyCanvas?.(true, true);
    app.extensionManager?.toast?.add?.({
      severity: "info", life: 10000, summary: "lowvram-lora: settings moved",
      detail: "This workflow was saved before some settings moved to small options nodes. They were added with "
        + `this workflow's values, plugged in (${[...new Set(notes)].join("; ")}); save the workflow to keep the `
        + "new layout.",
    });
  },
});
