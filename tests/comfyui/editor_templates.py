"""Open shipped templates in the real ComfyUI editor (headless Chromium) and screenshot each graph.

Each template is fetched from the server as the template browser does
(``/api/workflow_templates/lowvram-lora/<name>.json``) and opened with ``app.loadGraphData``, which is what
dropping the file on the canvas does. For each one it saves ``<out>/<name>.png`` and prints what a user
would check by eye, read from the live nodes: every widget's value against the file's, the Load node's
family choices, and which widgets have a tooltip. Look at the PNGs too.

    python tests/comfyui/editor_templates.py --url http://127.0.0.1:8188 --out /tmp/shots z_image_lora lumina2_lora

Exits 1 when a widget value differs from the file, a node did not load (a red "missing" node), or the
family dropdown lacks the template's family.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

_READ = """
const g = (app.canvas && app.canvas.graph) || app.graph;
const spec = (n, name) => {
  const d = n.constructor.nodeData;
  return d && d.input ? ((d.input.required || {})[name] || (d.input.optional || {})[name] || null) : null;
};
return g._nodes.map(n => ({
  id: n.id, type: n.type, title: n.title, missing: window.LiteGraph ? !LiteGraph.registered_node_types[n.type] : n.constructor.nodeData === undefined, size: n.size,
  widgets: (n.widgets || []).map(w => {
    const s = spec(n, w.name);
    return {name: w.name, value: w.value, type: w.type,
            options: (w.options && Array.isArray(w.options.values)) ? w.options.values : null,
            tooltip: !!(w.tooltip || (s && s[1] && s[1].tooltip))};
  })}));
"""


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8188")
    p.add_argument("--out", default="editor_shots")
    p.add_argument("--suffix", default="", help="added to each screenshot's name (e.g. _with_files)")
    p.add_argument("templates", nargs="+")
    args = p.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from editor_demo import headless_chromium

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    d = headless_chromium()
    problems = []
    try:
        d.get(args.url)
        for _ in range(120):
            if d.execute_script("return !!(window.app && window.app.canvas && window.app.canvas.graph)"):
                break
            time.sleep(1)
        time.sleep(5)
        d.find_element("tag name", "body").send_keys("\ue00c")  # Escape: close the template browser it opens
        time.sleep(1)
        print("frontend", d.execute_script("return window.__COMFYUI_FRONTEND_VERSION__ || null"))
        report = {}
        for name in args.templates:
            d.set_script_timeout(60)
            ui = d.execute_async_script(
                "const done = arguments[arguments.length - 1];"
                f"fetch('/api/workflow_templates/lowvram-lora/{name}.json').then(r => r.json())"
                ".then(j => Promise.resolve(app.loadGraphData(j)).then(() => done(j)))"
                ".catch(e => done({error: String(e)}))")
            if "error" in ui:
                problems.append(f"{name}: could not load ({ui['error']})")
                continue
            time.sleep(3)
            d.execute_script("document.querySelectorAll('.p-dialog-mask, .p-dialog').forEach(e => e.remove());"
                             "const c = app.canvas; c.ds.scale = 0.62; c.ds.offset = [120, 115]; c.setDirty(true, true)")
            time.sleep(2)
            d.save_screenshot(str(out / f"{name}{args.suffix}.png"))
            nodes = d.execute_script(_READ)
            report[name] = nodes
            by_id = {str(n["id"]): n for n in ui["nodes"]}
            for node in nodes:
                if node["missing"]:
                    problems.append(f"{name}: node {node['id']} ({node['type']}) did not load")
                stored = by_id.get(str(node["id"]), {}).get("widgets_values")
                if isinstance(stored, list):
                    shown = [w["value"] for w in node["widgets"]]
                    for i, v in enumerate(stored):
                        if v in ("fixed", "increment", "decrement", "randomize"):
                            continue  # control_after_generate slots: the frontend keeps them in the widget too
                        if v not in shown:
                            problems.append(f"{name}: node {node['id']} ({node['type']}) shows no widget with "
                                            f"the file's value {v!r}")
                if node["type"] == "LowVRAMLoadQuantizedSlab":
                    family = next((w for w in node["widgets"] if w["name"] == "family"), None)
                    family_wanted = by_id[str(node["id"])]["widgets_values"][1]
                    print(name, "family choices:", family and family["options"], "value:", family and family["value"])
                    if not family or family_wanted not in (family["options"] or []):
                        problems.append(f"{name}: family dropdown lacks {family_wanted!r}")
                untipped = [w["name"] for w in node["widgets"] if not w["tooltip"]]
                print(f"{name} node {node['id']} {node['type']}: {len(node['widgets'])} widgets;"
                      f" without tooltip: {untipped}")
        (out / f"editor_report{args.suffix}.json").write_text(json.dumps(report, indent=1, default=str))
        console = [e["message"][:300] for e in d.get_log("browser") if e["level"] == "SEVERE"]
        print(json.dumps({"problems": problems, "console_errors": console}, indent=1))
        return 1 if problems else 0
    finally:
        d.quit()


if __name__ == "__main__":
    sys.exit(main())
