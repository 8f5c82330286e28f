"""Issue 43 (fifth pass) in the real editor (headless Chromium): Train LoRA with its options nodes, a workflow saved
before the settings moved, and what the editor shows of a node's run-time error.

    python tests/comfyui/editor_ux43.py --url http://127.0.0.1:8243 --out shots --old OLD_DEMO.json [--tag fe1.49.6]

1. demo_tiny_lora as shipped: prints the widgets Train LoRA, Training Options and Preview Options show; screenshot.
2. OLD_DEMO.json (the demo as shipped before the move: Train LoRA's 20 positional values) loaded as a dropped file
   is: prints Train LoRA's values by name and the options nodes the extension added, with theirs; screenshot
   (with the extension's toast).
3. The demo with a 0-byte checkpoint (``models/diffusion_models/broken.safetensors``) run: prints the toasts' text
   and the error details' text; screenshots of the toast and of "View details".
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from editor_demo import close_session, headless_chromium, open_blank_editor, session_args  # noqa: E402
from editor_ux4 import FIT  # noqa: E402

NODES = """
const g = app.canvas.graph || app.graph;
return (g._nodes || g.nodes).filter(n => /^LowVRAM(TrainLoRA|TrainingOptions|PreviewOptions)$/.test(n.type)).map(n => ({
  id: n.id, type: n.type, pos: n.pos,
  linked_to: (n.outputs || []).flatMap(o => (o.links || []).map(l => (g.links[l] || g.links.get?.(l) || {}).target_id)),
  shown: Object.fromEntries((n.widgets || []).filter(w => !w.hidden && w.serialize !== false).map(w => [w.name, w.value])),
  hidden: (n.widgets || []).filter(w => w.hidden).map(w => w.name)}));
"""
# The toasts' text (PrimeVue's in 1.49.6, another component in 1.58.1): the page's text lines about them.
TOASTS = """return document.body.innerText.split('\\n').map(l => l.trim())
  .filter(l => /settings moved|saved before Train LoRA|\\bfailed$|threw an error during execution/.test(l))"""


def _load(d, workflow: dict) -> None:
    d.execute_async_script("const done = arguments[arguments.length - 1];"
                           "Promise.resolve(app.loadGraphData(arguments[0])).then(() => done(true))", workflow)
    time.sleep(4)


def load_template(d, name: str) -> dict:
    """The pack's template ``name`` as the server lists it, loaded into the editor; returns its workflow."""
    workflow = d.execute_script(f"return fetch('/api/workflow_templates/lowvram-lora/{name}.json')"
                                ".then(r => r.json())")
    _load(d, workflow)
    return workflow


def _idle(d, timeout=300):
    time.sleep(3)
    for _ in range(timeout // 2):
        q = d.execute_async_script("const done = arguments[arguments.length - 1];"
                                   "fetch('/queue').then(r => r.json()).then(done).catch(e => done({}))")
        if not q.get("queue_running") and not q.get("queue_pending"):
            return
        time.sleep(2)


def main(argv=None) -> int:
    a, out, tag = session_args(__doc__, argv, [("--old", {"required": True, "help": "the demo workflow as shipped before "
                                                                                     "the settings moved"})])
    d = headless_chromium()
    bad = []
    try:
        open_blank_editor(d, a.url)
        # 1. the shipped demo
        demo = load_template(d, "demo_tiny_lora")
        d.execute_script(FIT, None)
        time.sleep(2)
        nodes = d.execute_script(NODES)
        print("1 shipped demo:", json.dumps(nodes))
        train = next(n for n in nodes if n["type"] == "LowVRAMTrainLoRA")
        if len(train["shown"]) > 8:
            bad.append(f"Train LoRA shows {len(train['shown'])} widgets")
        d.save_screenshot(str(out / f"1_demo_train_lora_and_options{tag}.png"))
        # 2. the demo as saved before the move
        _load(d, json.loads(Path(a.old).read_text()))
        time.sleep(1)
        toasts = d.execute_script(TOASTS)
        d.execute_script(FIT, None)
        time.sleep(2)
        nodes = d.execute_script(NODES)
        print("2 old demo:", json.dumps(nodes), "toasts:", json.dumps(toasts))
        by_type = {n["type"]: n for n in nodes}
        want = {"LowVRAMTrainLoRA": {"steps": 300, "learning_rate": 0.005, "rank": 8, "alpha": 8, "batch_size": 1,
                                     "training_seed": 0, "sample_every": 100},
                "LowVRAMTrainingOptions": {"warmup_steps": 10, "lr_scheduler": "constant", "optimizer": "adamw"},
                "LowVRAMPreviewOptions": {"sample_steps": 8, "sample_resolution": 128, "sample_seed": 0}}
        for t, values in want.items():
            got = by_type.get(t, {}).get("shown", {})
            if any(got.get(k) != v for k, v in values.items()):
                bad.append(f"{t} after loading the old file: {got}, want {values}")
        if not any("moved" in t for t in toasts):
            bad.append(f"no toast about the moved settings: {toasts}")
        d.save_screenshot(str(out / f"2_old_workflow_migrated{tag}.png"))
        # 3. a node's run-time error: a 0-byte checkpoint
        _load(d, demo)
        d.execute_script("document.querySelectorAll('.p-toast-message').forEach(e => e.remove())")
        d.execute_script("const n = app.graph._nodes.find(n => n.type === 'LowVRAMLoadQuantizedSlab');"
                         "const w = n.widgets.find(w => w.name === 'checkpoint'); w.value = 'broken.safetensors';"
                         "w.callback?.(w.value)")
        d.execute_script("app.queuePrompt(0, 1)")
        _idle(d)
        time.sleep(2)
        d.execute_script("const c = app.canvas; c.ds.scale = 1.0; c.ds.offset = [20, 20]; c.setDirty(true, true)")
        time.sleep(1)
        print("3 toasts:", json.dumps(d.execute_script(TOASTS)))
        d.save_screenshot(str(out / f"3_runtime_error_toast{tag}.png"))
        clicked = d.execute_script("const b = [...document.querySelectorAll('.p-toast-message button, button')]"
                                   ".find(b => /view details|see error/i.test(b.innerText)); b?.click(); return !!b")
        time.sleep(3)
        details = d.execute_script("const b = document.body.innerText, i = b.indexOf('Execution failed');"
                                   "return i >= 0 ? b.slice(i, i + 900) : b.slice(0, 900)")
        print("3 details (clicked:", clicked, "):", json.dumps(details))
        d.save_screenshot(str(out / f"4_runtime_error_details{tag}.png"))
    finally:
        code = close_session(d, bad)
    return code


if __name__ == "__main__":
    sys.exit(main())
