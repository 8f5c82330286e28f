"""Issue 43 in the real editor (headless Chromium): an input error found at queue time, a run-time error shown on
the node, and a finished run's chart (y axis) with Train LoRA's new outputs. Saves screenshots; look at them.

Needs a running server with the demo's files (random tiny models are enough: ``ensure_demo_assets(trained=False)``)
and a 0-byte ``models/diffusion_models/broken.safetensors``::

    python tests/comfyui/editor_errors.py --url http://127.0.0.1:8188 --out /tmp/shots

Prints what each step left on the nodes (error widgets, the editor's node errors) as JSON lines.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

_SET = """
const [type, name, value] = arguments;
const g = app.graph;
const node = g._nodes.find(n => n.type === type);
const w = node.widgets.find(w => w.name === name);
w.value = value; w.callback?.(value);
app.canvas.setDirty(true, true);
return true;
"""
_READ = """
return app.graph._nodes.map(n => ({id: n.id, type: n.type,
  error: (n.widgets || []).filter(w => w.name === 'error').map(w => (w.lowvramEl || w.element).value),
  outputs: (n.outputs || []).map(o => o.name + ':' + o.type),
  node_errors: (app.lastNodeErrors && app.lastNodeErrors[n.id]) ? app.lastNodeErrors[n.id].errors : null}));
"""


def _idle(d, timeout=600):
    """Wait until the queue is empty (the run finished or failed)."""
    deadline = time.time() + timeout
    time.sleep(3)
    while time.time() < deadline:
        q = d.execute_async_script("const done = arguments[arguments.length - 1];"
                                   "fetch('/queue').then(r => r.json()).then(done).catch(e => done({}))")
        if not q.get("queue_running") and not q.get("queue_pending"):
            return
        time.sleep(2)


def _shot(d, out, name):
    d.execute_script("const c = app.canvas; c.ds.scale = 1.0; c.ds.offset = [20, 20]; c.setDirty(true, true)")
    time.sleep(2)
    d.save_screenshot(str(out / name))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8188")
    p.add_argument("--out", default="editor_shots")
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from editor_demo import headless_chromium

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    d = headless_chromium()
    d.set_window_size(1600, 1250)  # the whole Train LoRA node with its chart, at 100% zoom
    d.set_script_timeout(120)
    try:
        d.get(args.url)
        for _ in range(120):
            if d.execute_script("return !!(window.app && window.app.canvas && window.app.canvas.graph)"):
                break
            time.sleep(1)
        time.sleep(5)
        d.find_element("tag name", "body").send_keys("\ue00c")  # Escape: close the template browser
        print(json.dumps({"frontend": d.execute_script("return window.__COMFYUI_FRONTEND_VERSION__ || null")}))
        d.execute_async_script(
            "const done = arguments[arguments.length - 1];"
            "fetch('/api/workflow_templates/lowvram-lora/demo_tiny_lora.json').then(r => r.json())"
            ".then(j => Promise.resolve(app.loadGraphData(j)).then(() => done(true)))")
        time.sleep(3)
        d.execute_script(_SET, "LowVRAMTrainLoRA", "steps", 12)
        d.execute_script(_SET, "LowVRAMTrainLoRA", "sample_every", 0)
        # 1. A dataset folder that is not there: refused when queued, before any node runs.
        d.execute_script(_SET, "LowVRAMCacheTextEmbeds", "dataset_path", "no_such_folder")
        d.execute_script("app.queuePrompt(0, 1)")
        time.sleep(4)
        _shot(d, out, "1_dataset_missing_at_queue.png")
        print(json.dumps({"step": "dataset missing", "nodes": d.execute_script(_READ)}))
        d.execute_script("document.querySelectorAll('.p-dialog-mask, .p-dialog').forEach(e => e.remove())")
        # 2. A 0-byte checkpoint: fails when the Load node runs; the node says why, whole.
        d.execute_script(_SET, "LowVRAMCacheTextEmbeds", "dataset_path", "lowvram_demo/shapes_on_ohwx")
        d.execute_script(_SET, "LowVRAMLoadQuantizedSlab", "checkpoint", "broken.safetensors")
        d.execute_script("app.queuePrompt(0, 1)")
        _idle(d)
        time.sleep(2)
        _shot(d, out, "2_broken_checkpoint_on_node.png")
        print(json.dumps({"step": "broken checkpoint", "nodes": d.execute_script(_READ)}))
        d.execute_script("document.querySelectorAll('.p-dialog-mask, .p-dialog').forEach(e => e.remove())")
        # 3. A good run: the error goes, the chart has its y axis, Train LoRA shows lora_model and loss_map.
        d.execute_script(_SET, "LowVRAMLoadQuantizedSlab", "checkpoint", "flux1-tiny.safetensors")
        d.execute_script("app.queuePrompt(0, 1)")
        _idle(d)
        time.sleep(3)
        _shot(d, out, "3_good_run.png")
        print(json.dumps({"step": "good run", "nodes": d.execute_script(_READ)}))
        logs = [e["message"] for e in d.get_log("browser") if e.get("level") == "SEVERE"]
        print(json.dumps({"console_errors": logs[:10]}))
    finally:
        d.quit()
    return 0


if __name__ == "__main__":
    sys.exit(main())
