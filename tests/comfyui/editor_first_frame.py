"""Loss & Validation Options' ``first_frame_p`` in the real editor (headless Chromium): shown only where the model a
graph trains holds its first frame (LTX-2), hidden for any other model, though the options node has no model input
(it follows the Train LoRA it feeds; nodes/model_traits.py, web/lowvram_lora.js).

    python tests/comfyui/editor_first_frame.py --url http://127.0.0.1:8247 --out shots --other flux1-tiny.safetensors

Needs a server whose models hold the ``ltx23_i2v_lora`` template's checkpoint (tests/comfyui/ltx2_comfy_run.py writes
the tiny one) and ``--other``, a checkpoint of another family.

1. The shipped ``ltx23_i2v_lora`` with a Loss & Validation Options node linked to Train LoRA's ``loss_options``: prints
   the widgets the options node and Cache Text Embeds show and hide; screenshot.
2. The Load node switched to ``--other`` (its family to auto): the same; screenshot. ``first_frame_p`` (and ``image_to_video``) hidden.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from editor_demo import close_session, headless_chromium, open_blank_editor, session_args  # noqa: E402
from editor_ux4 import FIT  # noqa: E402
from editor_ux43 import load_template  # noqa: E402

NODES = """
const g = app.canvas.graph || app.graph;
return (g._nodes || g.nodes).filter(n => /^LowVRAM(LossOptions|CacheTextEmbeds)$/.test(n.type)).map(n => ({
  type: n.type,
  shown: (n.widgets || []).filter(w => !w.hidden && w.serialize !== false).map(w => w.name),
  hidden: (n.widgets || []).filter(w => w.hidden).map(w => w.name)}));
"""
ADD = """
const g = app.canvas.graph || app.graph;
const train = (g._nodes || g.nodes).find(n => n.type === 'LowVRAMTrainLoRA');
const n = LiteGraph.createNode('LowVRAMLossOptions');
n.pos = [train.pos[0] + 420, train.pos[1] + 160];
g.add(n);
n.connect(0, train, train.findInputSlot('loss_options'));
return train.inputs.find(i => i.name === 'loss_options').link !== null;
"""


def _shown(d) -> dict:
    d.execute_script("app.canvas.setDirty(true, true)")
    time.sleep(4)  # the traits request, then a redraw
    return {n["type"]: n for n in d.execute_script(NODES)}


def main(argv=None) -> int:
    a, out, tag = session_args(__doc__, argv, [("--other", {"required": True, "help": "a checkpoint of another "
                                                                                       "family in the server's models"})])
    d = headless_chromium()
    bad = []
    try:
        open_blank_editor(d, a.url)
        load_template(d, "ltx23_i2v_lora")
        print("linked:", d.execute_script(ADD))
        d.execute_script(FIT, None)
        nodes = _shown(d)
        print("1 LTX-2:", json.dumps(nodes))
        if "first_frame_p" not in nodes["LowVRAMLossOptions"]["shown"]:
            bad.append("first_frame_p hidden for LTX-2")
        d.save_screenshot(str(out / f"1_ltx2_loss_options_first_frame_p{tag}.png"))
        d.execute_script("const n = app.graph._nodes.find(n => n.type === 'LowVRAMLoadQuantizedSlab');"
                         "for (const [k, v] of [['family', 'auto'], ['checkpoint', arguments[0]]]) {"
                         "const w = n.widgets.find(w => w.name === k); w.value = v; w.callback?.(w.value); }", a.other)
        nodes = _shown(d)
        print("2", a.other, json.dumps(nodes))
        if "first_frame_p" not in nodes["LowVRAMLossOptions"]["hidden"]:
            bad.append(f"first_frame_p shown for {a.other}")
        if "image_to_video" not in nodes["LowVRAMCacheTextEmbeds"]["hidden"]:
            bad.append(f"image_to_video shown for {a.other}")
        d.save_screenshot(str(out / f"2_other_model_first_frame_p_hidden{tag}.png"))
    finally:
        code = close_session(d, bad)
    return code


if __name__ == "__main__":
    sys.exit(main())
