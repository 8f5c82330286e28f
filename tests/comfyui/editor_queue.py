"""The queue panel while the demo trains, in headless Chromium: load the demo, queue it with more steps, open the
queue overlay mid-run, screenshot it, and read what the frontend's own jobs request returns.

Frontends >= 1.5x read the queue only from ``/api/jobs``; before ``lowvram-lora serve`` had it, the panel said
"0 active" while a prompt trained and the console logged a 404 ``JobsApiError`` every few seconds. Needs a
server with the demo prepared (as editor_demo.py), Debian's chromium + chromium-driver and selenium::

    python tests/comfyui/editor_queue.py --url http://127.0.0.1:8188 --out /tmp/shots

Writes ``queue_running.png`` (mid-run, the overlay open), ``queue_done.png`` (after) and ``browser_problems.json``
(console warnings and errors, HTTP answers >= 400). Exits 1 if the jobs list never showed the running job, or
the browser saw a console error or an HTTP error from this server, a JobsApiError, or a deprecation warning our
extension caused.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from editor_demo import _browser_problems, headless_chromium  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8188")
    p.add_argument("--out", default="queue_shots")
    p.add_argument("--steps", type=int, default=150)
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    d = headless_chromium(("browser", "performance"))
    try:
        # Where each deprecation warning comes from (the console log has no stack): ours or the frontend's.
        d.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument", {"source": """
            window.__warnStacks = [];
            const warn = console.warn;
            console.warn = function (...a) {
              if (String(a[0]).includes("deprecated")) window.__warnStacks.push([String(a[0]), new Error().stack]);
              return warn.apply(this, a);
            };
            const error = console.error;
            console.error = function (...a) {
              window.__warnStacks.push([String(a[0]), new Error().stack]);
              return error.apply(this, a);
            };"""})
        d.get(args.url)
        for _ in range(90):
            # Not app.graph: frontend 1.49 logs "ComfyApp graph accessed before initialization" (a console error)
            # when its getter is read before the graph exists.
            if d.execute_script("return !!(window.app && window.app.canvas && window.app.canvas.graph)"):
                break
            time.sleep(1)
        time.sleep(4)
        version = d.execute_script("return window.__COMFYUI_FRONTEND_VERSION__ || null")
        print("frontend", version)
        d.execute_script("document.querySelectorAll('.p-dialog-mask').forEach(m => m.remove())")  # template browser
        ui = d.execute_script("return fetch('/api/workflow_templates/lowvram-lora/demo_tiny_lora.json')"
                              ".then(r => r.json())")
        for node in ui["nodes"]:
            if node["type"] == "LowVRAMTrainLoRA":
                node["widgets_values"][0] = args.steps  # steps, the first widget
        d.execute_script("app.loadGraphData(arguments[0])", ui)
        time.sleep(2)
        d.execute_script("app.extensionManager.command.execute('Comfy.QueuePrompt')")
        running_seen = None
        for _ in range(120):
            time.sleep(1)
            page = d.execute_script("return fetch('/api/jobs?status=in_progress,pending&limit=200&offset=0')"
                                    ".then(r => r.json())")
            if any(j["status"] == "in_progress" for j in page.get("jobs", [])):
                running_seen = page
                break
        print("jobs while running:", json.dumps(running_seen)[:600])
        time.sleep(8)  # a few steps in: the chart has points
        from selenium.webdriver.common.action_chains import ActionChains
        from selenium.webdriver.common.keys import Keys

        ActionChains(d).send_keys(Keys.ESCAPE).perform()  # the template browser a fresh profile opens on first load
        time.sleep(1)
        d.execute_script("app.extensionManager.command.execute('Comfy.Queue.ToggleOverlay')")
        time.sleep(4)
        d.save_screenshot(str(out / "queue_running.png"))
        panel = d.execute_script("return document.body.innerText")
        (out / "page_text_running.txt").write_text(panel)
        for _ in range(900):
            time.sleep(1)
            q = d.execute_script("return fetch('/api/jobs?status=in_progress,pending&limit=1').then(r => r.json())")
            if not q["jobs"]:
                break
        time.sleep(4)
        d.save_screenshot(str(out / "queue_done.png"))
        history = d.execute_script("return fetch('/api/jobs?status=completed,failed,cancelled&limit=5')"
                                   ".then(r => r.json())")
        print("history:", json.dumps(history)[:800])
        console, network = _browser_problems(d)
        stacks = d.execute_script("return window.__warnStacks || []")
        ours = [m for m, stack in stacks if "/extensions/lowvram-lora" in stack]
        (out / "browser_problems.json").write_text(json.dumps({"frontend": version, "console": console,
                                                               "network": network, "deprecation_stacks": stacks},
                                                              indent=1))
        print(json.dumps({"console": console, "network": network}, indent=1))
        # Every console error and every answer >= 400 of this server counts (serve answers what the editor loads on
        # start); warnings count when our extension caused them (the stack names it); pages outside (api.comfy.org)
        # are not ours.
        origin = args.url.rstrip("/")
        bad = [n for n in network if n.get("status", 0) >= 400 and n.get("url", "").startswith(origin)]
        bad += [c for c in console if c["level"] == "SEVERE" and origin in c["message"]]
        bad += [c for c in console if "JobsApiError" in c["message"] or "Jobs API" in c["message"]]
        bad += [{"from our extension": m} for m in ours]
        print("problems of ours:", bad)
        return 0 if running_seen and not bad else 1
    finally:
        d.quit()


if __name__ == "__main__":
    sys.exit(main())
