"""Issue 43/41 in the real editor (headless Chromium): the template browser's cards, inputs hidden for the loaded
model, and the validation-loss curve on Train LoRA's chart after a tiny run.

    python tests/comfyui/editor_ux4.py --url http://127.0.0.1:8241 --out shots [--run] [--tag fe1.49.6]

1. The template browser on our pack's category: prints the cards' order (thumbnail file names); screenshot.
2. demo_tiny_lora (an image model) loaded: prints which of Cache Text Embeds' / Train LoRA's widgets are hidden
   (the video inputs and control_folder must be) and how many Train LoRA shows; screenshot.
3. With --run: Dataset Options (validation_fraction 0.34) and Loss & Validation Options (validation_every 5) plugged
   into the demo, 40 steps, Run; waits for the end and screenshots Train LoRA's chart with its validation curve.
Needs the demo's files in the server's base directory (lowvram-lora demo --prepare-only --dir BASE).
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from editor_demo import close_session, headless_chromium, open_editor, session_args  # noqa: E402

FIT = """
const [title] = arguments; const c = app.canvas, g = c.graph || app.graph;
const ns = (g._nodes || g.nodes).filter(n => !title || n.title === title || n.type === title);
let x0=1e9,y0=1e9,x1=-1e9,y1=-1e9;
for (const n of ns) { x0=Math.min(x0,n.pos[0]); y0=Math.min(y0,n.pos[1]-30); x1=Math.max(x1,n.pos[0]+n.size[0]); y1=Math.max(y1,n.pos[1]+n.size[1]); }
const r = c.canvas.getBoundingClientRect(); const bw = r.width-120, bh = r.height-120;
const s = Math.min(1.0, bw/(x1-x0), bh/(y1-y0)); c.ds.scale = s;
c.ds.offset = [(60+bw/2)/s-(x0+x1)/2, (60+bh/2)/s-(y0+y1)/2]; c.setDirty(true,true); return s;
"""

WIDGETS = """
const g = app.canvas.graph || app.graph;
return (g._nodes || g.nodes).filter(n => ['LowVRAMCacheTextEmbeds','LowVRAMTrainLoRA'].includes(n.type)).map(n => ({
  type: n.type, size: n.size, shown: (n.widgets||[]).filter(w => !w.hidden && !w.advanced && !(w.options||{}).advanced).map(w => w.name),
  hidden: (n.widgets||[]).filter(w => w.hidden).map(w => w.name),
  advanced: (n.widgets||[]).filter(w => w.advanced || (w.options||{}).advanced).map(w => w.name),
  values: (n.widgets||[]).filter(w => w.serialize !== false).length}));
"""


def main(argv=None) -> int:
    a, out, tag = session_args(__doc__, argv, [("--run", {"action": "store_true"})])
    d = headless_chromium()
    bad = []
    try:
        open_editor(d, a.url)
        # 1. the template browser (frontend 1.49+ opens it on first load; else open it)
        if not d.execute_script("return document.querySelectorAll('[role=dialog]').length"):
            d.execute_script("app.extensionManager.command.execute('Comfy.BrowseTemplates')")
            time.sleep(4)
        d.execute_script("""const els=[...document.querySelectorAll('[role=dialog] *')].filter(e=>e.children.length<=2
            && /^\\s*lowvram-lora\\s*$/i.test(e.textContent||'')); if (els.length) els[els.length-1].click();""")
        time.sleep(5)
        d.save_screenshot(str(out / f"1_template_browser{tag}.png"))
        # the cards' text lines (the file names), in the order drawn
        cards = d.execute_script("""return [...document.querySelectorAll('[role=dialog] *')].filter(e =>
            e.children.length === 0 && /^(demo_[a-z_]+|[a-z0-9_]+_(lora|gpu))$/.test((e.textContent || '').trim()))
            .map(e => e.textContent.trim())""")
        print("cards in order:", cards)
        if cards[:2] != ["demo_tiny_lora", "demo_train_and_try"]:
            bad.append(f"the demos are not first: {cards[:3]}")
        d.find_element("tag name", "body").send_keys("\ue00c")
        d.execute_script("document.querySelectorAll('[role=dialog]').forEach(e => e.remove())")
        # 2. the demo: an image model, its video inputs and control_folder hidden
        wf = d.execute_script("return fetch('/api/workflow_templates/lowvram-lora/demo_tiny_lora.json').then(r=>r.json())")
        d.execute_script("app.loadGraphData(arguments[0]); return true", wf)
        time.sleep(5)
        d.execute_script(FIT, None)
        time.sleep(2)
        nodes = d.execute_script(WIDGETS)
        print(json.dumps(nodes, indent=1))
        hidden = {w for n in nodes for w in n["hidden"]}
        for w in ("video_frames", "video_fps", "video_window", "windows_per_clip", "control_folder", "sample_frames"):
            if w not in hidden:
                bad.append(f"{w} shown for an image model")
        d.save_screenshot(str(out / f"2_demo_inputs_for_an_image_model{tag}.png"))
        if a.run:
            _validation_run(d, out, tag, bad)
    finally:
        code = close_session(d, bad)
    return code


def _validation_run(d, out: Path, tag: str, bad: list) -> None:
    d.execute_script("""
      const g = app.graph, by = t => g._nodes.find(n => n.type === t);
      const cache = by('LowVRAMCacheTextEmbeds'), train = by('LowVRAMTrainLoRA');
      const ds = LiteGraph.createNode('LowVRAMDatasetOptions'); ds.pos = [40, 1050]; g.add(ds);
      ds.widgets.find(w => w.name === 'validation_fraction').value = 0.34;
      const lo = LiteGraph.createNode('LowVRAMLossOptions'); lo.pos = [420, 1050]; g.add(lo);
      lo.widgets.find(w => w.name === 'validation_every').value = 5;
      ds.connect(0, cache, cache.inputs.findIndex(i => i.name === 'options'));
      lo.connect(0, train, train.inputs.findIndex(i => i.name === 'loss_options'));
      train.widgets.find(w => w.name === 'steps').value = 40;
      g.setDirtyCanvas(true, true);""")
    time.sleep(1)
    d.execute_script("app.queuePrompt(0, 1)")
    t0 = time.time()
    done = None
    while time.time() - t0 < 900:
        time.sleep(5)
        done = d.execute_script("""const e = [...(window.__lowvramProgress || new Map()).values()][0];
          return e && e.last ? {step: e.last.step, total: e.last.total, running: e.running,
                                vals: e.points.filter(p => p.val != null).length} : null""")
        if done and done["step"] >= done["total"] and not done["running"]:
            break
    print("run:", done, f"{time.time() - t0:.0f} s")
    time.sleep(6)
    d.execute_script(FIT, "Train LoRA (LowVRAM)")
    time.sleep(2)
    d.save_screenshot(str(out / f"3_validation_curve{tag}.png"))
    if not done or done["vals"] < 2:
        bad.append(f"no validation curve on the chart: {done}")


if __name__ == "__main__":
    sys.exit(main())
