// lowvram-lora frontend extension (loaded by ComfyUI from WEB_DIRECTORY).
// Shows what our nodes report after they run: the saved LoRA path on Save LoRA,
// and the final loss / step count on Train LoRA when no preview image is sent.
import { app } from "../../scripts/app.js";

const OUR_NODES = new Set([
  "LowVRAMTrainLoRA",
  "LowVRAMSaveLoRA",
]);

function showText(node, name, lines) {
  let widget = node.widgets?.find((w) => w.name === name);
  if (!widget) {
    widget = node.addWidget("text", name, "", () => {}, { serialize: false });
    widget.disabled = true;
  }
  widget.value = lines.join("\n");
  node.setDirtyCanvas(true, true);
}

app.registerExtension({
  name: "lowvram_lora.results",
  async beforeRegisterNodeDef(nodeType, nodeData) {
    if (!OUR_NODES.has(nodeData.name)) return;
    const onExecuted = nodeType.prototype.onExecuted;
    nodeType.prototype.onExecuted = function (message) {
      onExecuted?.apply(this, arguments);
      if (message?.text) showText(this, "saved", message.text);
      if (message?.final_loss) showText(this, "final loss", message.final_loss.map(String));
    };
  },
});
