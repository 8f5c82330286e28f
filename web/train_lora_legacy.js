// lowvram-lora: workflows saved before Train LoRA's rarely changed settings moved to the Training Options and
// Preview Options nodes (2026-11-28) load with every value where it was.
//
// The frontend restores a node's widgets_values by position (LGraphNode.configure; restoring by name is an
// experimental setting, off by default, in frontend 1.49). Train LoRA then has 8 widgets where such a file stores
// 20, so positions would shift: training_seed would get gradient_accumulation's value. Here the node reads such a
// file by the old names instead (nodes/train_lora.py LEGACY_WIDGETS, the same list; is_legacy_layout, the same
// test), and once the graph is configured adds a Training Options and a Preview Options node beside it holding the
// file's values for them, plugged in. A toast says so; saving the workflow then stores the new layout.
import { app } from "../../scripts/app.js";

const LEGACY_WIDGETS = [
  "steps", "learning_rate", "rank", "alpha", "batch_size", "gradient_accumulation", "lr_scheduler",
  "warmup_steps", "training_seed", "guidance", "max_grad_norm", "optimizer", "save_every",
  "sample_every", "sample_steps", "sample_resolution", "sample_seed", "sample_at_start",
  "sample_guidance", "sample_frames",
];
// The options node for each of Train LoRA's option sockets.
const OPTION_NODES = [["LowVRAMTrainingOptions", "training_options"], ["LowVRAMPreviewOptions", "preview_options"]];
const isLegacyLayout = (values) => Array.isArray(values) && values.length >= 7 && typeof values[6] === "string";

const pending = []; // [Train LoRA node, {name: value}] read while the graph configures

function migrate(node, byName) {
  const graph = node.graph;
  if (!graph) return 0;
  let added = 0;
  let y = node.pos[1] + node.size[1] + 60;
  for (const [type, socket] of OPTION_NODES) {
    const slot = node.inputs?.findIndex((i) => i.name === socket) ?? -1;
    if (slot < 0 || node.inputs[slot].link != null) continue; // plugged already: its values stand
    const options = LiteGraph.createNode(type);
    if (!options) continue; // a server without the node (an older pack): nothing to plug
    options.pos = [node.pos[0], y];
    graph.add(options);
    for (const w of options.widgets ?? []) if (w.name in byName) w.value = byName[w.name];
    options.connect(0, node, slot);
    y += options.size[1] + 60;
    added += 1;
  }
  return added;
}

app.registerExtension({
  name: "lowvram_lora.train_lora_legacy",
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (nodeData.name !== "LowVRAMTrainLoRA") return;
    const onConfigure = nodeType.prototype.onConfigure;
    nodeType.prototype.onConfigure = function (info) {
      const r = onConfigure?.apply(this, arguments);
      const values = info?.widgets_values;
      if (isLegacyLayout(values)) {
        const byName = {};
        LEGACY_WIDGETS.forEach((name, i) => { if (i < values.length) byName[name] = values[i]; });
        for (const w of this.widgets ?? []) if (w.name in byName) w.value = byName[w.name];
        pending.push([this, byName]);
      }
      return r;
    };
  },
  async afterConfigureGraph() {
    let added = 0;
    while (pending.length) {
      const [node, byName] = pending.shift();
      added += migrate(node, byName);
    }
    if (!added) return;
    app.graph?.setDirtyCanvas?.(true, true);
    app.extensionManager?.toast?.add?.({
      severity: "info", life: 10000, summary: "Train LoRA: settings moved",
      detail: "This workflow was saved before Train LoRA's optimizer and preview settings moved to the Training "
        + "Options and Preview Options nodes. They were added next to Train LoRA with this workflow's values; "
        + "save the workflow to keep the new layout.",
    });
  },
});
