"""The ltx23_lora template (or another LTX-2 template named by a third argument: ltx23_i2v_lora) on the tiny LTX-2 model through a real ComfyUI's ``comfy run`` (a script, not collected by
pytest: the template reads its VAE and text connectors from the all-in-one checkpoint, which test_real_comfyui's
single-file template test does not write; this script writes it, with 9-frame clips).

Installs this checkout as the README says (a copy in <base>/custom_nodes/lowvram-lora, ``pip install -e`` into
ComfyUI's environment), writes the tiny model under the template's names (the all-in-one checkpoint in
models/checkpoints with the connectors and the VAE, ComfyUI's Gemma file models/text_encoders/gemma_3_12B_it.safetensors
with the tiny tokenizer and config in its companion folder, 9-frame clips in input/my_clips), starts the
server with ``--base-directory <base>``, runs the UI workflow with sizes and steps reduced, and checks the saved LoRA
lowers the flow loss of diffusers' own model on the cached clip. Hold the ComfyUI lock while it runs:

    flock <comfyui>/.lock python tests/comfyui/ltx2_comfy_run.py <comfyui> <base folder> [template name] [first_frame_p]

With a fourth argument a Loss & Validation Options node with that ``first_frame_p`` (and TensorBoard off) is added to
the graph and linked to Train LoRA's ``loss_options`` (a mixed image- / text-to-video batch).

The flow loss is the one training takes: an image-to-video template's held first frame is given clean and left out.
"""
import json, os, shutil, socket, subprocess, sys, time, urllib.request
from pathlib import Path
import torch
sys.path.insert(0, str(Path(__file__).resolve().parents[1])); sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_real_comfyui import _with_widgets
from helpers import eval_flow_loss, merged
from lowvram_lora.engine.families import get_family, family_templates
from lowvram_lora.engine.families.ltx2.fixtures import build_tiny_pipeline, write_comfy_gemma, write_single_file
from lowvram_lora.engine.testing import make_tiny_video_dataset

WT = Path(__file__).resolve().parents[2]
COMFY, BASE = Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve()
py = COMFY / "venv" / "bin" / "python"
NAME = sys.argv[3] if len(sys.argv) > 3 else "ltx23_lora"
t = next(x for x in family_templates(get_family("ltx2")) if x.name == NAME)
pack = BASE / "custom_nodes" / "lowvram-lora"
shutil.rmtree(pack, ignore_errors=True)
shutil.copytree(WT, pack, ignore=shutil.ignore_patterns(".git", "__pycache__", "*.pyc", ".carry"))
subprocess.run([str(py), "-m", "pip", "install", "-q", "-e", str(pack)], check=True)
pipe = build_tiny_pipeline(BASE / "scratch" / "pipe", seed=5)
write_single_file(pipe, BASE / "models" / "checkpoints" / t.load["checkpoint"], prefix="model.diffusion_model.", bundle=True)
write_comfy_gemma(pipe, BASE / "models" / "text_encoders" / t.cache["text_encoder_1"], dtype=torch.bfloat16)
shutil.rmtree(BASE / "input" / "my_clips", ignore_errors=True)
make_tiny_video_dataset(BASE / "input" / "my_clips", count=1, frames=9)


def _add_loss_options(ui: dict, values: dict) -> None:
    """A Loss & Validation Options node (its defaults, ``values`` by name) linked to Train LoRA's loss_options."""
    from lowvram_lora.host.workflow import input_specs
    from lowvram_lora.nodes import NODE_CLASS_MAPPINGS

    specs = [x for x in input_specs(NODE_CLASS_MAPPINGS["LowVRAMLossOptions"]) if x.is_widget]
    node_id, link_id = ui["last_node_id"] + 1, ui["last_link_id"] + 1
    train = next(n for n in ui["nodes"] if n["type"] == "LowVRAMTrainLoRA")
    ui["nodes"].append({"id": node_id, "type": "LowVRAMLossOptions",
                        "pos": [train["pos"][0] + 420, train["pos"][1] + 160],
                        "size": [340, 400], "flags": {}, "order": 0, "mode": 0, "inputs": [],
                        "outputs": [{"name": "loss_options", "type": "LOWVRAM_LOSS_OPTIONS", "links": [link_id]}],
                        "properties": {"Node name for S&R": "LowVRAMLossOptions"},
                        "widgets_values": [values.get(x.name, x.options.get("default")) for x in specs]})
    train["inputs"].append({"name": "loss_options", "type": "LOWVRAM_LOSS_OPTIONS", "link": link_id})
    ui["links"].append([link_id, node_id, 0, train["id"], len(train["inputs"]) - 1, "LOWVRAM_LOSS_OPTIONS"])
    ui["last_node_id"], ui["last_link_id"] = node_id, link_id


s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
log = open(BASE / "server.log", "w")
proc = subprocess.Popen([str(py), "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port), "--disable-auto-launch",
                         "--base-directory", str(BASE)], cwd=COMFY, stdout=log, stderr=subprocess.STDOUT,
                        env=dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1"))
try:
    for _ in range(240):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/system_stats", timeout=5); break
        except Exception:
            time.sleep(1)
    ui = json.loads((pack / "example_workflows" / f"{NAME}.json").read_text())
    _with_widgets(ui, {"LowVRAMCacheTextEmbeds": {"resolution": 64, "sample_prompts": "ohwx, a red circle", "video_frames": "9"},
                       "LowVRAMTrainLoRA": {"steps": 8, "learning_rate": 0.01, "warmup_steps": 0, "sample_every": 4,
                                            "sample_resolution": 64, "sample_steps": 2, "sample_frames": 9,
                                            "training_seed": int(time.time()) % 100000}})
    if len(sys.argv) > 4:
        _add_loss_options(ui, {"first_frame_p": float(sys.argv[4]), "tensorboard": False})
    (BASE / "tiny.json").write_text(json.dumps(ui))
    home = BASE / "home"; home.mkdir(exist_ok=True)
    cmd = [str(COMFY / "venv" / "bin" / "comfy"), "--skip-prompt", "--workspace", str(COMFY), "run", "--workflow",
           str(BASE / "tiny.json"), "--host", "127.0.0.1", "--port", str(port), "--wait", "--timeout", "500"]
    print("$", " ".join(cmd))
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, HOME=str(home), DO_NOT_TRACK="1", COMFY_NO_TELEMETRY="1", COMFY_NO_UPDATE_CHECK="1"))
    print("comfy run exit", done.returncode, done.stdout[-1500:], done.stderr[-1500:])
    server = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{port}/internal/logs", timeout=30).read())
    print("traceback in log:", "Traceback" in server)
    print("\n".join(l for l in server.splitlines() if "lowvram" in l.lower())[-2500:])
finally:
    proc.terminate(); proc.wait(30); log.close()
from lowvram_lora.engine.lora_io import load_lora
from lowvram_lora.engine.caching.cache import open_dataset_cache
saved = sorted((BASE / "output" / "loras").glob(f"{NAME}_*_.safetensors"), key=lambda p: p.stat().st_mtime)
lora = load_lora(saved[-1]); print("saved", saved[-1].name, lora.format, lora.metadata.get("lowvram_lora.family"), lora.metadata.get("lowvram_lora.steps"))
fam = get_family("ltx2")
ref = fam.transformer_class().from_pretrained(pipe / "transformer", use_safetensors=True, torch_dtype=torch.float32)
man = sorted((BASE / "output" / "lowvram_cache").rglob("datasets/*.json"), key=lambda p: p.stat().st_mtime)[-1]
cache = open_dataset_cache(man)
if NAME == "ltx23_lora":
    b, a = eval_flow_loss(ref, fam, cache), eval_flow_loss(merged(ref, lora.state_dict, 1.0), fam, cache)
else:  # the held first frame clean and out of the loss, as training takes it
    from lowvram_lora.engine.families import predict_velocity
    from lowvram_lora.engine.families.specs import held_weights
    from lowvram_lora.engine.train.flow_matching import noisy_latents_and_target, sample_sigmas, weighted_mse

    def loss(model, n=16):
        g = torch.Generator().manual_seed(123)
        lat, emb = cache.load_item(cache.items[0])
        x0, emb = lat[None].float(), {k: v.float() for k, v in cache.collate_text([emb]).items()}
        total = 0.0
        with torch.no_grad():
            for _ in range(n):
                sigma = sample_sigmas(1, g)
                noisy, target = noisy_latents_and_target(x0, torch.randn(x0.shape, generator=g), sigma)
                total += weighted_mse(predict_velocity(fam, model, noisy, emb, sigma, 1.0), target,
                                      held_weights(emb, x0, None)).item()
        return total / n

    print("cache variant", cache.variant)
    b, a = loss(ref), loss(merged(ref, lora.state_dict, 1.0))
print(f"reference flow loss {b:.5f} -> with the LoRA {a:.5f}", "LOWER" if a < b else "NOT LOWER")
assert done.returncode == 0 and a < b
print("samples:", sorted(p.name for p in saved[-1].parent.glob(saved[-1].stem + "_samples*")))
