"""Drive the real ComfyUI editor in headless Chromium on a video workflow: open a UI-format workflow file with
``app.loadGraphData`` (what opening a file does), press Run, wait for the queue to empty, and screenshot the
Train LoRA node with its preview (the animated sample clip, ComfyUI's ``animated`` output flag) and the whole
graph. Look at the screenshots: the node must show the clip, not a blank or a still of the loss curve only.

Needs a running server with the pack installed and the workflow's files present (the tiny Wan model under the
template's names and clips, as ``test_video_template_trains_on_clips_and_shows_the_animated_preview`` writes
them), Debian's chromium + chromium-driver and selenium::

    python tests/comfyui/editor_video.py --url http://127.0.0.1:8188 --workflow tiny_video.json --out /tmp/shots

Prints the Train LoRA node's outputs as the frontend holds them (``app.nodeOutputs``) and the preview element's
source. Exits 1 when the node got no animated WebP.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from editor_demo import headless_chromium  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://127.0.0.1:8188")
    p.add_argument("--workflow", required=True, help="a UI-format workflow file")
    p.add_argument("--out", default="editor_shots")
    args = p.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    graph = json.loads(Path(args.workflow).read_text())
    d = headless_chromium()
    try:
        d.get(args.url)
        for _ in range(90):
            if d.execute_script("return !!(window.app && window.app.canvas && window.app.canvas.graph)"):
                break
            time.sleep(1)
        time.sleep(4)
        # Some frontends open the template browser on the first visit: close it, it would cover the graph.
        d.execute_script("document.dispatchEvent(new KeyboardEvent('keydown', {key: 'Escape', bubbles: true}));"
                         "document.querySelectorAll('.p-dialog-close-button, [aria-label=\"Close\"]')"
                         ".forEach(b => b.click())")
        time.sleep(1)
        d.execute_script("return app.loadGraphData(arguments[0])", graph)
        time.sleep(3)
        train_id = next(n["id"] for n in graph["nodes"] if n["type"] == "LowVRAMTrainLoRA")
        view = ("app.canvas.ds.scale = 0.7; app.canvas.ds.offset = [20, 40]; app.canvas.setDirty(true, true)")
        d.execute_script(view)
        # A fresh seed: an identical prompt would be answered from ComfyUI's cache, with no outputs sent.
        d.execute_script("const n = app.graph.getNodeById(arguments[0]);"
                         "n.widgets.find(w => w.name == 'training_seed').value = arguments[1]",
                         train_id, int(time.time()) % 100_000)
        d.execute_script("return app.queuePrompt(0, 1)")
        for i in range(600):
            time.sleep(1)
            q = d.execute_script("return fetch('/queue').then(r => r.json())")
            if i > 3 and not q["queue_running"] and not q["queue_pending"]:
                break
        time.sleep(4)
        d.execute_script(view)
        time.sleep(1)
        d.save_screenshot(str(out / "video_1_graph_after_run.png"))
        # The Train LoRA node alone, large: centred and zoomed so its preview fills the screen.
        d.execute_script(
            "const n = app.graph.getNodeById(arguments[0]); const s = 1.4;"
            "app.canvas.ds.scale = s; app.canvas.ds.offset = [-n.pos[0] + 40 / s, -n.pos[1] + 60 / s];"
            "app.canvas.setDirty(true, true)", train_id)
        time.sleep(2)
        d.save_screenshot(str(out / "video_2_train_node.png"))
        # Its bottom, where the frontend puts the node's output images (the preview), at 1:1.
        d.execute_script(
            "const n = app.graph.getNodeById(arguments[0]); const s = 1.0;"
            "app.canvas.ds.scale = s; app.canvas.ds.offset = [-n.pos[0] + 300, -(n.pos[1] + n.size[1]) + 760];"
            "app.canvas.setDirty(true, true)", train_id)
        time.sleep(2)
        d.save_screenshot(str(out / "video_3_train_node_preview.png"))
        outputs = d.execute_script(
            "const o = app.nodeOutputs || {}; return o[String(arguments[0])] || o[arguments[0]] || null", train_id)
        imgs = d.execute_script(
            "return Array.from(document.querySelectorAll('img')).map(i => i.src).filter(s => s.includes('view'))")
        print(json.dumps({"train_node_outputs": outputs, "preview_img_sources": imgs}, indent=1))
        print(f"screenshots in {out}")
        ok = bool(outputs) and any(str(im.get("filename", "")).endswith(".webp") for im in outputs.get("images", []))
        return 0 if ok else 1
    finally:
        d.quit()


if __name__ == "__main__":
    sys.exit(main())
