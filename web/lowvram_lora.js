// lowvram-lora frontend extension (loaded by ComfyUI from WEB_DIRECTORY).
// Shows what our nodes report after they run: the saved LoRA path on Save LoRA, and the
// final loss / step count on Train LoRA (beside the loss-curve preview image).
//
// A read-only multiline STRING widget is used, not a disabled "text" widget: frontends 1.27
// and 1.49 draw a disabled text widget as a grey label without its value.
import { app } from "../../scripts/app.js";
import { ComfyWidgets } from "../../scripts/widgets.js";

const OUR_NODES = new Set(["LowVRAMTrainLoRA", "LowVRAMSaveLoRA"]);

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
