"""What a user meets in the editor when a run is cancelled and queued again (issue 28), in headless Chromium:
open the demo, train long enough to Cancel while a sample is being drawn, screenshot the node; queue again,
screenshot the resumed chart mid-run and the finished node (one chart, one grid of every checkpoint); then set
``dataset_path`` to a folder that is not there and screenshot the error. Look at the PNGs.

Needs a running server with the demo prepared (tests/comfyui/README.md), ComfyUI or ``lowvram-lora serve``::

    python tests/comfyui/editor_resume.py --url http://127.0.0.1:8188 --out /tmp/shots

Prints what the Train LoRA node's chart held at each point (steps, "resumed from", stopped) and the server's
lines about saved and resumed states when it can read them (ComfyUI's /internal/logs).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

_TRAIN = "((app.canvas && app.canvas.graph) || app.graph)._nodes.find(n => n.type == 'LowVRAMTrainLoRA')"
_CHART = ("const e = [...(window.__lowvramProgress || new Map()).values()][0];"
          "return e ? {points: e.points.length, first: e.points.length ? e.points[0].step : null,"
          " last: e.last ? e.last.step : null, resumed_from: e.resumedFrom ?? null, stopped: e.stopped ?? null} : null")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8188")
    p.add_argument("--out", default="editor_shots")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--cancel-after", type=int, default=10, help="Cancel while the samples of this step are drawn")
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from editor_demo import headless_chromium

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    d = headless_chromium()
    d.set_script_timeout(60)
    try:
        d.get(args.url)
        for _ in range(120):
            if d.execute_script("return !!(window.app && window.app.canvas && window.app.canvas.graph)"):
                break
            time.sleep(1)
        time.sleep(5)
        d.find_element("tag name", "body").send_keys("\ue00c")  # Escape: close the template browser
        time.sleep(1)
        print("frontend", d.execute_script("return window.__COMFYUI_FRONTEND_VERSION__ || null"))
        d.execute_async_script(
            "const done = arguments[arguments.length - 1];"
            "fetch('/api/workflow_templates/lowvram-lora/demo_tiny_lora.json').then(r => r.json())"
            ".then(j => Promise.resolve(app.loadGraphData(j)).then(() => done(true)))")
        time.sleep(3)
        view = ("document.querySelectorAll('.p-dialog-mask').forEach(e => e.remove());"
                "const c = app.canvas; c.ds.scale = 0.75; c.ds.offset = [-380, 20]; c.setDirty(true, true)")
        d.execute_script(view)
        seed = int(time.time()) % 100000
        # Train LoRA's widgets, or its Preview / Training Options' (sample_steps, save_every).
        d.execute_script("const g = app.graph, ns = g._nodes.filter(n => /^LowVRAM(TrainLoRA|TrainingOptions|"
                         "PreviewOptions)$/.test(n.type));"
                         "for (const [k, v] of Object.entries(arguments[0])) ns.flatMap(n => n.widgets || [])"
                         ".find(w => w.name == k).value = v;",
                         {"steps": args.steps, "sample_every": args.cancel_after, "sample_steps": 30,
                          "sample_resolution": 256, "training_seed": seed, "save_every": 0})
        queue = "return app.queuePrompt(0, 1).then(() => true)"

        def wait_idle(limit=600):
            for _ in range(limit):
                time.sleep(1)
                q = d.execute_script("return fetch('/queue').then(r => r.json())")
                if not q["queue_running"] and not q["queue_pending"]:
                    return

        def shot(name):
            d.execute_script(view)
            time.sleep(1)
            d.save_screenshot(str(out / name))
            print(name, json.dumps(d.execute_script(_CHART)))

        d.execute_script(queue)
        for _ in range(600):  # the step of the samples reported: they are being drawn now
            time.sleep(0.5)
            chart = d.execute_script(_CHART)
            if chart and chart["last"] and chart["last"] >= args.cancel_after:
                break
        time.sleep(2)
        shot("1_sampling_before_cancel.png")
        d.execute_script("return fetch('/interrupt', {method: 'POST'})")
        t0 = time.monotonic()
        wait_idle()
        print(f"the run ended {time.monotonic() - t0:.1f} s after Cancel")
        time.sleep(2)
        shot("2_after_cancel.png")
        d.execute_script(queue)
        for _ in range(600):
            time.sleep(0.5)
            chart = d.execute_script(_CHART)
            if chart and chart["last"] and chart["last"] >= args.cancel_after + 5:
                break
        shot("3_resumed_mid_run.png")
        wait_idle()
        time.sleep(3)
        shot("4_resumed_done.png")
        try:
            logs = d.execute_script("return fetch('/internal/logs').then(r => r.json())")
            print("\n".join(line for line in str(logs).splitlines()
                            if "state at step" in line or "resuming from" in line or "goes on from" in line))
        except Exception:  # noqa: BLE001  (serve has no /internal/logs)
            pass
        d.execute_script("const n = ((app.canvas && app.canvas.graph) || app.graph)._nodes.find("
                         "n => n.type == 'LowVRAMCacheTextEmbeds'); n.widgets.find(w => w.name == 'dataset_path')"
                         ".value = 'my_subject'")
        d.execute_script(queue)
        wait_idle()
        time.sleep(3)
        d.save_screenshot(str(out / "5_missing_dataset.png"))
        history = d.execute_script("return fetch('/history?max_items=1').then(r => r.json())")
        for item in history.values():
            for kind, data in item.get("status", {}).get("messages", []):
                if kind == "execution_error":
                    print("error shown:", data.get("exception_type"), "|", data.get("exception_message"))
        details = d.execute_script("return Array.from(document.querySelectorAll('button'))"
                                   ".find(b => (b.textContent || '').trim() == 'View details') || null")
        if details is not None:
            d.execute_script("arguments[0].click()", details)
            time.sleep(2)
            d.save_screenshot(str(out / "6_missing_dataset_details.png"))
        return 0
    finally:
        d.quit()


if __name__ == "__main__":
    sys.exit(main())
