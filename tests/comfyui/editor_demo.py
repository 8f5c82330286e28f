"""Drive the real ComfyUI editor in headless Chromium: open the template browser, pick this pack's
demo, press Run, wait for the queue to empty, open the queue panel, and save screenshots (look at them).

Needs a running server with the demo prepared: ComfyUI with the pack installed (tests/comfyui/README.md)
or ``lowvram-lora serve --models-dir <dir>/models`` after ``lowvram-lora demo --prepare-only --dir <dir>``;
Debian's chromium + chromium-driver, and selenium::

    python tests/comfyui/editor_demo.py --url http://127.0.0.1:8188 --out /tmp/shots

Prints the node widgets after the run (the saved path and final loss must be there). Also writes what the
browser saw go wrong -- console errors, HTTP answers >= 400 (a 403 from the origin check), websocket
failures -- to ``<out>/browser_problems.json`` and prints it. Exits 1 if the widgets are missing or the
page got a 403 or a broken websocket.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


def headless_chromium(logs: tuple[str, ...] = ("browser",)):
    """Debian's chromium through chromedriver, headless, a fresh profile, ``logs`` kept (``browser``: the console;
    ``performance``: the network log, where a refused request or websocket shows). Used by editor_templates.py too."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = "/usr/bin/chromium"
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
              "--disable-background-networking", "--disable-component-update", "--disable-sync",
              "--window-size=1600,1000", f"--user-data-dir={tempfile.mkdtemp(prefix='chrome-')}"):
        opts.add_argument(a)
    opts.set_capability("goog:loggingPrefs", {kind: "ALL" for kind in logs})
    return webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8188")
    p.add_argument("--out", default="editor_shots")
    p.add_argument("--template", default="demo_tiny_lora")
    p.add_argument("--steps", type=int, default=0,
                   help="set Train LoRA's steps before Run (long enough to catch the live chart mid-run)")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    d = headless_chromium(("browser", "performance"))
    try:
        d.get(args.url)
        for _ in range(90):
            if d.execute_script("return !!(window.app && window.app.canvas && window.app.canvas.graph)"):
                break
            time.sleep(1)
        time.sleep(4)
        d.save_screenshot(str(out / "0_page.png"))
        print("frontend", d.execute_script("return window.__COMFYUI_FRONTEND_VERSION__ || null"))

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
        # The graph on screen: frontend 1.58 opens a template in a new tab, and app.graph may still be the first.
        nodes_js = "((app.canvas && app.canvas.graph) || app.graph)._nodes"
        view = "app.canvas.ds.scale = 0.75; app.canvas.ds.offset = [20, 40]; app.canvas.setDirty(true, true)"
        d.execute_script(view)
        time.sleep(1)
        d.save_screenshot(str(out / "2_loaded.png"))
        if args.steps:
            d.execute_script(
                f"const n = {nodes_js}.find("
                "n => n.type == 'LowVRAMTrainLoRA');"
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
        # The queue / job-history panel (1.27: the sidebar's Queue tab; 1.37+: this command's overlay).
        d.execute_script("try { app.extensionManager.command.execute('Comfy.Queue.ToggleOverlay') } catch (e) {"
                         " try { app.extensionManager.command.execute('Workspace.ToggleSidebarTab.queue') }"
                         " catch (e2) {} }")
        time.sleep(3)
        d.save_screenshot(str(out / "4_queue_panel.png"))
        widgets = d.execute_script(
            f"return Object.fromEntries({nodes_js}.filter("
            "n => n.type.startsWith('LowVRAM'))"
            ".map(n => [n.type, Object.fromEntries((n.widgets || []).map(w => [w.name, String(w.value)]))]))")
        print(json.dumps(widgets, indent=1))
        saved = widgets.get("LowVRAMSaveLoRA", {}).get("saved", "")
        result = widgets.get("LowVRAMTrainLoRA", {}).get("result", "")
        print(f"screenshots in {out}")
        console, network = _browser_problems(d)
        (out / "browser_problems.json").write_text(json.dumps({"console": console, "network": network}, indent=1))
        print(json.dumps({"console": console, "network": network}, indent=1))
        refused = [n for n in network if n.get("status") == 403 or n.get("websocket")]
        ran = saved.endswith(".safetensors") and result.startswith("final loss")
        return 0 if ran and not refused else 1
    finally:
        d.quit()


def _browser_problems(d) -> tuple[list[dict], list[dict]]:
    """(console messages of level WARNING or worse, failed HTTP answers and websocket trouble) seen so far."""
    console = [{"level": e["level"], "message": e["message"][:500]} for e in d.get_log("browser")
               if e["level"] in ("SEVERE", "WARNING")]
    network, sockets = [], {}
    for entry in d.get_log("performance"):
        msg = json.loads(entry["message"])["message"]
        method, params = msg.get("method", ""), msg.get("params", {})
        if method == "Network.responseReceived" and params["response"]["status"] >= 400:
            network.append({"status": params["response"]["status"], "url": params["response"]["url"]})
        elif method == "Network.loadingFailed" and not params.get("canceled"):
            network.append({"failed": params.get("errorText"), "type": params.get("type")})
        elif method == "Network.webSocketCreated":
            sockets[params["requestId"]] = params["url"]
        elif method == "Network.webSocketHandshakeResponseReceived" and params["response"]["status"] != 101:
            network.append({"websocket": sockets.get(params["requestId"]), "status": params["response"]["status"]})
        elif method == "Network.webSocketFrameError":
            network.append({"websocket": sockets.get(params["requestId"]), "error": params.get("errorMessage")})
    if len(sockets) > 1:  # the editor reopens its socket only after losing one
        network.append({"websocket": sorted(set(sockets.values())), "opened": len(sockets)})
    return console, network


if __name__ == "__main__":
    sys.exit(main())


def open_editor(d, url: str) -> None:
    """Load the editor at ``url`` and wait until its graph canvas exists (up to 2 min), then for its extensions (6 s);
    print the frontend's version."""
    import time

    d.get(url)
    for _ in range(120):
        if d.execute_script("return !!(window.app && window.app.canvas && window.app.canvas.graph)"):
            break
        time.sleep(1)
    time.sleep(6)
    print("frontend", d.execute_script("return window.__COMFYUI_FRONTEND_VERSION__ || null"))



def session_args(doc: str, argv=None, extra=()):
    """The editor scripts' common arguments (``--url``, ``--out``, ``--tag``) plus ``extra`` ((flag, kwargs) pairs):
    (the parsed arguments, the screenshot folder, created, and the tag as a file-name suffix)."""
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8188")
    p.add_argument("--out", default="editor_shots")
    p.add_argument("--tag", default="")
    for flag, kwargs in extra:
        p.add_argument(flag, **kwargs)
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    return a, out, f"_{a.tag}" if a.tag else ""


def open_blank_editor(d, url: str) -> None:
    """``open_editor`` at 1600 x 1100 with the first-load dialogs (the template browser) closed."""
    d.set_window_size(1600, 1100)
    d.set_script_timeout(120)
    open_editor(d, url)
    d.find_element("tag name", "body").send_keys("\ue00c")
    d.execute_script("document.querySelectorAll('.p-dialog-mask, [role=dialog]').forEach(e => e.remove())")


def close_session(d, bad: list) -> int:
    """Print the browser's severe console lines, close it, print the problems found; the exit code."""
    for e in d.get_log("browser"):
        if e.get("level") == "SEVERE":
            print("console:", e.get("message", "")[:300])
    d.quit()
    print("problems:", bad or "none")
    return 1 if bad else 0
