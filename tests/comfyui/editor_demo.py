"""Drive the real ComfyUI editor in headless Chromium: open the template browser, pick this pack's
demo, press Run, wait for the queue to empty, and save screenshots (look at them).

Needs a running ComfyUI with the pack installed and the demo prepared (tests/comfyui/README.md),
Debian's chromium + chromium-driver, and selenium::

    python tests/comfyui/editor_demo.py --url http://127.0.0.1:8188 --out /tmp/shots

Prints the node widgets after the run (the saved path and final loss must be there) and exits 1
if they are missing.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8188")
    p.add_argument("--out", default="editor_shots")
    p.add_argument("--template", default="demo_tiny_lora")
    p.add_argument("--steps", type=int, default=0,
                   help="set Train LoRA's steps before Run (long enough to catch the live chart mid-run)")
    args = p.parse_args(argv)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    opts = webdriver.ChromeOptions()
    opts.binary_location = "/usr/bin/chromium"
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
              "--disable-background-networking", "--disable-component-update", "--disable-sync",
              "--window-size=1600,1000", f"--user-data-dir={tempfile.mkdtemp(prefix='chrome-')}"):
        opts.add_argument(a)
    d = webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)
    try:
        d.get(args.url)
        for _ in range(90):
            if d.execute_script("return !!(window.app && window.app.graph)"):
                break
            time.sleep(1)
        time.sleep(4)

        def leaves(pattern):
            # The deepest visible elements whose text matches (a label may sit beside an icon).
            return d.execute_script(
                "const re = new RegExp(arguments[0], 'i');"
                "const hit = e => e.offsetParent !== null && re.test((e.textContent || '').trim());"
                "return Array.from(document.querySelectorAll('body *')).filter("
                "e => hit(e) && !Array.from(e.children).some(hit))", pattern)

        def click(pattern):
            found = leaves(pattern)
            if not found:
                raise SystemExit(f"nothing on the page matches {pattern!r}")
            d.execute_script("arguments[0].scrollIntoView({block: 'center'}); arguments[0].click()", found[0])
            time.sleep(2)

        if not leaves("^All Templates$"):  # frontend 1.27 opens the browser on first load; else open it
            # The frontend's own command (what the sidebar's Templates button runs), else the button.
            opened = d.execute_script(
                "try { return !!app.extensionManager.command.execute('Comfy.BrowseTemplates') || true }"
                " catch (e) { return false }")
            time.sleep(3)
            if not opened or not leaves("^All Templates$"):
                click("^Templates$")
        click("^lowvram-lora$")
        d.save_screenshot(str(out / "1_template_browser.png"))
        click(f"^{args.template}$")
        time.sleep(3)
        view = "app.canvas.ds.scale = 0.75; app.canvas.ds.offset = [20, 40]; app.canvas.setDirty(true, true)"
        d.execute_script(view)
        time.sleep(1)
        d.save_screenshot(str(out / "2_loaded.png"))
        if args.steps:
            d.execute_script(
                "const n = app.graph._nodes.find(n => n.type == 'LowVRAMTrainLoRA');"
                "for (const [k, v] of Object.entries(arguments[0])) n.widgets.find(w => w.name == k).value = v;",
                {"steps": args.steps, "sample_every": max(1, args.steps // 3), "training_seed": int(time.time()) % 1000})
        run = d.execute_script(  # the Run button (frontend 1.27: a leaf "Run"; 1.49: text beside an icon)
            "return Array.from(document.querySelectorAll('button')).find(b => (b.textContent || '').trim() == 'Run')")
        if run is not None:
            d.execute_script("arguments[0].click()", run)
        else:
            click("^Run$")
        mid_run = False
        for i in range(600):
            time.sleep(1)
            points = d.execute_script("const e = [...(window.__lowvramProgress || new Map()).values()][0];"
                                      "return e ? e.points.length : 0")
            if args.steps and not mid_run and points >= args.steps // 2:
                d.execute_script(view)
                time.sleep(0.5)
                d.save_screenshot(str(out / "2b_training.png"))  # the live chart, mid-run
                mid_run = True
                print(f"mid-run screenshot at {points} chart points")
            q = d.execute_script("return fetch('/queue').then(r => r.json())")
            if i > 3 and not q["queue_running"] and not q["queue_pending"]:
                break
        time.sleep(3)
        d.execute_script(view)
        time.sleep(1)
        d.save_screenshot(str(out / "3_after_run.png"))
        widgets = d.execute_script(
            "return Object.fromEntries(app.graph._nodes.filter(n => n.type.startsWith('LowVRAM'))"
            ".map(n => [n.type, Object.fromEntries((n.widgets || []).map(w => [w.name, String(w.value)]))]))")
        print(json.dumps(widgets, indent=1))
        saved = widgets.get("LowVRAMSaveLoRA", {}).get("saved", "")
        result = widgets.get("LowVRAMTrainLoRA", {}).get("result", "")
        print(f"screenshots in {out}")
        return 0 if saved.endswith(".safetensors") and result.startswith("final loss") else 1
    finally:
        d.quit()


if __name__ == "__main__":
    sys.exit(main())
