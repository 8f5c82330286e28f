"""Issue 43 item 6 in the real editor (headless Chromium): Offload Config with its four widgets, and a workflow saved
before the planner's settings moved to Offload Tuning.

    python tests/comfyui/editor_offload43.py --url http://127.0.0.1:8247 --out shots --old OLD_DEMO.json [--tag fe1.58.1]

1. demo_tiny_lora as shipped: prints the widgets Offload Config shows; screenshot.
2. OLD_DEMO.json (the demo as shipped before Training Options and Offload Tuning, its Offload Config's 16 positional
   values tuned here: stream, resident_blocks 2, prefetch_depth 1, recompute_chunks 2, compile off) loaded as a
   dropped file is: prints Offload Config's values and the Offload Tuning the extension added, with its values;
   screenshot (with the extension's toast).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from editor_demo import close_session, headless_chromium, open_blank_editor, session_args  # noqa: E402
from editor_ux4 import FIT  # noqa: E402
from editor_ux43 import NODES as TRAIN_NODES, _load, load_template  # noqa: E402

NODES = TRAIN_NODES.replace("TrainLoRA|TrainingOptions|PreviewOptions", "OffloadConfig|OffloadTuning")
TOASTS = """return document.body.innerText.split('\\n').map(l => l.trim()).filter(l => /settings moved/.test(l))"""
TUNED = ["stream", 0.0, 2, 1, "auto", True, 0.8, "dequant", 2, "auto", 0, "off", 1.0, "auto", 0.0, -1]


def main(argv=None) -> int:
    a, out, tag = session_args(__doc__, argv, [("--old", {"required": True, "help": "the demo workflow as shipped before "
                                                                                     "the settings moved"})])
    d = headless_chromium()
    bad = []
    try:
        open_blank_editor(d, a.url)
        load_template(d, "demo_tiny_lora")
        d.execute_script(FIT, None)
        time.sleep(2)
        nodes = d.execute_script(NODES)
        print("1 shipped demo:", json.dumps(nodes))
        offload = next(n for n in nodes if n["type"] == "LowVRAMOffloadConfig")
        order = d.execute_script("const g = app.canvas.graph || app.graph; return (g._nodes || g.nodes).find(n => "
                                 "n.type === 'LowVRAMOffloadConfig').widgets.filter(w => !w.hidden).map(w => w.name)")
        print("1 Offload Config's widgets, in order:", order)
        if order != ["mode", "compile", "vram_budget_gb", "ram_budget_gb"]:
            bad.append(f"Offload Config shows {order}")
        d.save_screenshot(str(out / f"1_demo_offload_config{tag}.png"))
        old = json.loads(Path(a.old).read_text())
        next(n for n in old["nodes"] if n["type"] == "LowVRAMOffloadConfig")["widgets_values"] = list(TUNED)
        _load(d, old)
        time.sleep(1)
        toasts = d.execute_script(TOASTS)
        d.execute_script(FIT, None)
        time.sleep(2)
        nodes = d.execute_script(NODES)
        print("2 old demo:", json.dumps(nodes), "toasts:", json.dumps(toasts))
        by_type = {n["type"]: n for n in nodes}
        want = {"LowVRAMOffloadConfig": {"mode": "stream", "compile": "off", "vram_budget_gb": 0, "ram_budget_gb": 0},
                "LowVRAMOffloadTuning": {"resident_blocks": 2, "prefetch_depth": 1, "recompute_chunks": 2,
                                         "gradient_checkpointing": True, "max_pinned_fraction": 0.8}}
        for t, values in want.items():
            got = by_type.get(t, {}).get("shown", {})
            if any(got.get(k) != v for k, v in values.items()):
                bad.append(f"{t} after loading the old file: {got}, want {values}")
        if by_type.get("LowVRAMOffloadTuning", {}).get("linked_to") != [offload["id"]]:
            bad.append(f"Offload Tuning not plugged into Offload Config: {by_type.get('LowVRAMOffloadTuning')}")
        if not any("moved" in t for t in toasts):
            bad.append(f"no toast about the moved settings: {toasts}")
        d.save_screenshot(str(out / f"2_old_offload_config_migrated{tag}.png"))
    finally:
        code = close_session(d, bad)
    return code

if __name__ == "__main__":
    sys.exit(main())
