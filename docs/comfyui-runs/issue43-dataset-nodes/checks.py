"""Real-ComfyUI checks (data4): ComfyUI's own dataset nodes into our caching and training; a wrong dataset path
refused at queue time, before any node (so the model loader) runs."""
import hashlib, json, os, subprocess, sys, time, urllib.request, urllib.error
from pathlib import Path

PORT = int(sys.argv[1])
B = Path("/work/comfy-data4/base"); R = Path("/work/comfy-data4/run")
PACK = B / "custom_nodes/lowvram-lora"
base = json.loads((PACK / "example_workflows/api/demo_tiny_lora.json").read_text())


def get(path):
    with urllib.request.urlopen(f"http://127.0.0.1:{PORT}{path}", timeout=60) as r:
        return json.loads(r.read())


def comfy_run(graph, name):
    f = R / f"{name}.json"; f.write_text(json.dumps(graph, indent=1))
    env = dict(os.environ, HOME=str(R / "home"), DO_NOT_TRACK="1", COMFY_NO_TELEMETRY="1", COMFY_NO_UPDATE_CHECK="1")
    cmd = ["/work/comfyui/venv/bin/comfy", "--skip-prompt", "--workspace", "/work/comfyui", "run", "--workflow", str(f),
           "--host", "127.0.0.1", "--port", str(PORT), "--wait", "--timeout", "900"]
    print("$", " ".join(cmd), flush=True)
    t = time.time(); done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    print(f"exit {done.returncode} in {time.time() - t:.0f} s\n", (done.stdout + done.stderr)[-1500:], flush=True)
    return done


info = get("/object_info")
print("Images to Dataset in /object_info:", "LowVRAMImagesToDataset" in info,
      "is_input_list:", info["LowVRAMImagesToDataset"]["is_input_list"],
      "LoadImageTextDataSetFromFolder:", "LoadImageTextDataSetFromFolder" in info)

# 1. ComfyUI's dataset node -> Images to Dataset -> Cache Text Embeds -> Train LoRA -> Save LoRA
g = json.loads(json.dumps(base))
g["10"] = {"class_type": "LoadImageTextDataSetFromFolder", "inputs": {"folder": "lowvram_demo/shapes"}}
g["11"] = {"class_type": "LowVRAMImagesToDataset", "inputs": {"images": ["10", 0], "texts": ["10", 1]}}
g["2"]["inputs"].update(dataset_path="", images=["11", 0])
g["4"]["inputs"].update(steps=20, sample_every=10)
g["5"]["inputs"]["filename_prefix"] = "loras/from_dataset_nodes"
cache = B / "output/lowvram_cache"
def newest():
    return json.loads(max((cache / "datasets").glob("*.json"), key=os.path.getmtime).read_text())
a = comfy_run(g, "dataset_nodes"); man_nodes = newest()
# 2. the same folder by path (the shipped demo graph), for the cache comparison
g2 = json.loads(json.dumps(base)); g2["4"]["inputs"].update(steps=20, sample_every=10)
g2["5"]["inputs"]["filename_prefix"] = "loras/from_folder"
b = comfy_run(g2, "folder_path"); man_folder = newest()
loras = sorted(p.name for p in (B / "output/loras").glob("*.safetensors"))
print("loras:", loras)
# the two caches: same captions, same latents (compared as tensors, by caption and content)
from safetensors.torch import load_file
import torch
mans = [man_nodes, man_folder]
print("manifests:", [(m["source"], len(m["items"]), m["dataset_hash"]) for m in mans])
def entries(m):
    out = []
    for it in m["items"]:
        lat = load_file(str(cache / "latents" / f"{it['latent_key']}.safetensors"))["latent"]
        text = load_file(str(cache / "text" / f"{it['text_key']}.safetensors"))
        out.append((it["caption"], hashlib.sha256(lat.numpy().tobytes()).hexdigest(),
                    hashlib.sha256(b"".join(text[k].numpy().tobytes() for k in sorted(text))).hexdigest()))
    return sorted(out)
comfy_items, folder_items = entries(mans[0]), entries(mans[1])
print("dataset-node cache == folder cache (caption, latent, text embeddings of all 6):", comfy_items == folder_items)
# 3. a wrong dataset path: refused when queued, nothing runs
g3 = json.loads(json.dumps(base)); g3["2"]["inputs"]["dataset_path"] = "no_such_folder"
log_before = len(get("/internal/logs"))
req = urllib.request.Request(f"http://127.0.0.1:{PORT}/prompt", data=json.dumps({"prompt": g3}).encode(),
                             headers={"Content-Type": "application/json"})
try:
    urllib.request.urlopen(req, timeout=60); print("queued: NOT refused")
except urllib.error.HTTPError as e:
    body = json.loads(e.read()); print("POST /prompt ->", e.code, json.dumps(body["node_errors"], indent=1)[:1200])
time.sleep(3)
print("queue after refusal:", get("/queue"))
c = comfy_run(g3, "wrong_path")
after = get("/internal/logs")
print("server log after the refusals mentions the model loading:", "[lowvram-lora] Flux" in after[log_before:] or
      "got prompt" in after[log_before:])
