"""The pack in a real ComfyUI: install as the README says, start the server, run the shipped
workflows through comfy-cli (``comfy run --wait``), and check what a user would see.

Skipped unless ``LOWVRAM_COMFYUI_DIR`` names a ComfyUI checkout with its environment in
``venv/`` (or ``LOWVRAM_COMFYUI_PYTHON``) holding comfy-cli; ``../shared/COMFYUI.md`` says how to
build one. The server runs on the CPU with ``--base-directory`` in a fresh temporary folder,
so models, inputs, outputs and custom nodes are this test's own and no earlier finished run
can be reused by mistake.

    LOWVRAM_COMFYUI_DIR=/path/to/ComfyUI .venv/bin/python -m pytest -q tests/comfyui -s
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import zlib
from pathlib import Path

import pytest

from lowvram_lora.engine.families import families, family_fixtures
from lowvram_lora.demo import WORKFLOW as DEMO_WORKFLOW
from lowvram_lora.host.templates import shipped

COMFY_DIR = os.environ.get("LOWVRAM_COMFYUI_DIR")
pytestmark = pytest.mark.skipif(not COMFY_DIR, reason="set LOWVRAM_COMFYUI_DIR to a real ComfyUI to run these")

REPO = Path(__file__).resolve().parents[2]
OUR_NODES = {"LowVRAMLoadQuantizedSlab", "LowVRAMCacheTextEmbeds", "LowVRAMOffloadConfig", "LowVRAMDualGPUSplit",
             "LowVRAMTrainLoRA", "LowVRAMSaveLoRA", "LowVRAMDatasetOptions", "LowVRAMLossOptions",
             "LowVRAMSamplePromptConditioning", "LowVRAMImagesToDataset", "LowVRAMTrainingOptions",
             "LowVRAMPreviewOptions", "LowVRAMOffloadTuning"}


def _copy_checkout(dest: Path) -> None:
    """What a user's clone holds: the files git tracks (plus new ones it does not ignore)."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"], cwd=REPO,
                           check=True, capture_output=True, text=True).stdout.split("\0")
    for rel in filter(None, files):
        src = REPO / rel
        if src.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / rel)


def _python(comfy: Path) -> Path:
    return Path(os.environ.get("LOWVRAM_COMFYUI_PYTHON", comfy / "venv" / "bin" / "python"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(port: int, path: str, timeout: float = 30):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as r:
        return json.loads(r.read())


def _server_log(port: int) -> str:
    try:
        return _get(port, "/internal/logs")
    except Exception as exc:  # noqa: BLE001
        return f"(no log: {exc})"


class Comfy:
    def __init__(self, comfy: Path, base: Path, port: int, proc: subprocess.Popen, home: Path):
        self.dir, self.base, self.port, self.proc, self.home = comfy, base, port, proc, home

    @property
    def pack(self) -> Path:
        return self.base / "custom_nodes" / "lowvram-lora"

    def comfy_run(self, workflow: Path, timeout: int = 600) -> subprocess.CompletedProcess:
        """``comfy run --workflow FILE --wait`` exactly as a user types it (comfy-cli)."""
        cli = self.dir / "venv" / "bin" / "comfy"
        env = dict(os.environ, HOME=str(self.home), DO_NOT_TRACK="1", COMFY_NO_TELEMETRY="1",
                   COMFY_NO_UPDATE_CHECK="1")
        cmd = [str(cli), "--skip-prompt", "--workspace", str(self.dir), "run", "--workflow", str(workflow),
               "--host", "127.0.0.1", "--port", str(self.port), "--wait", "--timeout", "300"]
        print("$", " ".join(cmd))
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        print(done.stdout[-3000:], done.stderr[-3000:])
        return done


@pytest.fixture(scope="module")
def comfy(tmp_path_factory):
    comfy_dir = Path(COMFY_DIR).resolve()
    python = _python(comfy_dir)
    base = tmp_path_factory.mktemp("comfy-base")
    home = tmp_path_factory.mktemp("home")
    # 1. Install as the README says: copy into custom_nodes/lowvram-lora, pip install -e it.
    pack = base / "custom_nodes" / "lowvram-lora"
    _copy_checkout(pack)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "-e", str(pack)], check=True)
    # 2. The demo's files, with the one documented preparation command.
    subprocess.run([str(python.parent / "lowvram-lora"), "demo", "--prepare-only", "--dir", str(base)],
                   check=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    # 3. The server, on the CPU, everything under our base directory.
    port = _free_port()
    log = open(base / "server.log", "w")
    # --verbose DEBUG: ComfyUI logs its "consider renaming it to 'example_workflows'" suggestion at debug level.
    proc = subprocess.Popen([str(python), "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port),
                             "--disable-auto-launch", "--base-directory", str(base), "--verbose", "DEBUG"],
                            cwd=comfy_dir, stdout=log, stderr=subprocess.STDOUT,
                            env=dict(os.environ, PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1"))
    deadline = time.monotonic() + 240
    while True:
        try:
            _get(port, "/system_stats", timeout=5)
            break
        except Exception:  # noqa: BLE001
            if proc.poll() is not None or time.monotonic() > deadline:
                log.close()
                pytest.fail(f"ComfyUI did not start:\n{(base / 'server.log').read_text()[-4000:]}")
            time.sleep(1)
    yield Comfy(comfy_dir, base, port, proc, home)
    proc.terminate()
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.close()


def test_nodes_load_without_import_errors(comfy):
    info = _get(comfy.port, "/object_info")
    assert OUR_NODES <= set(info)
    names = {k: info[k]["display_name"] for k in OUR_NODES}
    assert names["LowVRAMTrainLoRA"] == "Train LoRA (LowVRAM)" != info.get("TrainLoraNode", {}).get("display_name")
    assert all(info[k]["category"] == "LowVRAM LoRA" for k in OUR_NODES)
    assert info["LowVRAMTrainLoRA"]["input"]["required"]["steps"][1]["tooltip"]
    log = json.dumps(_server_log(comfy.port))
    assert "IMPORT FAILED" not in log or "lowvram-lora" not in log.split("IMPORT FAILED")[1][:300]


def test_templates_are_listed(comfy):
    """Every family's shipped templates (the registry's), e.g. z_image_lora and lumina2_lora, and nothing else."""
    templates = _get(comfy.port, "/workflow_templates")
    from lowvram_lora.host.templates import TRY_TEMPLATES  # train-and-try graphs (ComfyUI's own nodes too)

    assert sorted(templates.get("lowvram-lora", [])) == sorted([*shipped(), *TRY_TEMPLATES]), templates


def test_templates_are_served_from_example_workflows_without_a_rename_suggestion(comfy):
    """ComfyUI serves the folder at /api/workflow_templates/<pack>/ (file, thumbnail, the models list the editor
    offers downloads from) and, the folder being example_workflows/, logs no suggestion to rename it."""
    ui = _get(comfy.port, "/api/workflow_templates/lowvram-lora/flux1_dev_lora.json")
    models = [m for n in ui["nodes"] for m in n.get("properties", {}).get("models", [])]
    assert {m["name"] for m in models} == set(shipped()["flux1_dev_lora"].downloads)
    with urllib.request.urlopen(f"http://127.0.0.1:{comfy.port}/api/workflow_templates/lowvram-lora/"
                                f"flux1_dev_lora.jpg", timeout=30) as r:
        assert r.headers["Content-Type"] == "image/jpeg" and len(r.read()) > 1000
    log = str(_server_log(comfy.port))  # /internal/logs: the console text (debug lines too, see the fixture)
    assert "Starting server" in log, log[-2000:]
    assert not [line for line in log.splitlines() if "consider renaming it to 'example_workflows'" in line
                and "lowvram-lora" in line]


def test_demo_workflow_trains_through_comfy_run(comfy):
    """The demo as shipped (no widget edits) trains a LoRA inside ComfyUI's inference mode."""
    loras = comfy.base / "output" / "loras"
    done = comfy.comfy_run(comfy.pack / "example_workflows" / "demo_tiny_lora.json")
    log = json.dumps(_server_log(comfy.port))
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:], log[-4000:])
    new = sorted(loras.glob("demo_tiny_lora_*_.safetensors"))
    assert len(new) == 1, (sorted(loras.iterdir()) if loras.exists() else "no loras folder", log[-3000:])
    assert new[0].with_name(new[0].stem + "_loss.png").exists()
    # the demo samples its two prompts at step 0 and every sample_every steps: the last grid lands next to the LoRA
    from PIL import Image

    train = shipped()["demo_tiny_lora"].train
    steps, every = train["steps"], train["sample_every"]
    from lowvram_lora.engine.sampling.grid import title_height

    width = (steps // every + 1) * 256
    with Image.open(new[0].with_name(new[0].stem + "_samples.png")) as grid:
        assert grid.size == (width, title_height(width) + 2 * 256)
    assert f"sampled 2 prompt(s) at step {steps}" in log
    # the run trained (nothing to reuse in a fresh base folder) and its progress reached the console: the last step's
    # line (the first one's can have left ComfyUI's log buffer, a capped deque, on a slow machine: 2026-11-28)
    assert f"[lowvram-lora] step {steps}/{steps}" in log, log[-3000:]
    for noise in ("is an Enum subclass", "Unable to import `torchao` Tensor objects"):  # item 7: no known noise
        assert noise not in log, noise
    from lowvram_lora.engine.lora_io import load_lora

    lora = load_lora(new[0])
    assert lora.format == "comfyui" and lora.metadata["lowvram_lora.steps"] == str(steps)
    assert oct(new[0].stat().st_mode & 0o777) in ("0o644", "0o664")  # readable by other users (item 6)


def test_demo_api_twin_runs(comfy, tmp_path):
    """The API-format twin; a new filename prefix, so ComfyUI re-runs Save LoRA (an identical prompt
    would be answered from ComfyUI's cache and write nothing)."""
    graph = json.loads((comfy.pack / "example_workflows" / "api" / "demo_tiny_lora.json").read_text())
    graph["5"]["inputs"]["filename_prefix"] = "loras/demo_api"
    (tmp_path / "api.json").write_text(json.dumps(graph))
    done = comfy.comfy_run(tmp_path / "api.json")
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:])
    assert len(list((comfy.base / "output" / "loras").glob("demo_api_*_.safetensors"))) == 1


def test_compiled_blocks_train_inside_comfyui(comfy, tmp_path):
    """Offload Config compile='blocks' through comfy run: torch.compile (inductor, here on the CPU) under
    ComfyUI's inference mode, and the progress log says what was compiled."""
    graph = json.loads((comfy.pack / "example_workflows" / "api" / "demo_tiny_lora.json").read_text())
    graph["3"]["inputs"]["compile"] = "blocks"
    graph["4"]["inputs"].update(steps=4, sample_every=0)
    graph["5"]["inputs"]["filename_prefix"] = "loras/demo_compiled"
    (tmp_path / "compiled.json").write_text(json.dumps(graph))
    done = comfy.comfy_run(tmp_path / "compiled.json", timeout=900)
    log = json.dumps(_server_log(comfy.port))
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:], log[-4000:])
    assert "compiled blocks:" in log and "the first step took" in log, log[-3000:]
    assert len(list((comfy.base / "output" / "loras").glob("demo_compiled_*_.safetensors"))) == 1


def test_int4_slab_trains_inside_comfyui(comfy, tmp_path):
    """Load Quantized Slab with precision 'int4 slab' through comfy run: the int4 slab is built once into
    models/slabs (its manifest says 4 bits), the LoRA trains on it (resident: the CPU server does not stream) and
    is saved; Save LoRA's file loads back."""
    from safetensors.torch import load_file

    graph = json.loads((comfy.pack / "example_workflows" / "api" / "demo_tiny_lora.json").read_text())
    graph["1"]["inputs"]["precision"] = "int4 slab"
    graph["4"]["inputs"].update(steps=4, sample_every=0, sample_at_start=False)
    graph["5"]["inputs"]["filename_prefix"] = "loras/demo_int4"
    (tmp_path / "int4.json").write_text(json.dumps(graph))
    done = comfy.comfy_run(tmp_path / "int4.json", timeout=900)
    log = json.dumps(_server_log(comfy.port))
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:], log[-4000:])
    slabs = list((comfy.base / "models" / "slabs").glob("*-int4.slab.safetensors"))
    assert len(slabs) == 1, list((comfy.base / "models" / "slabs").iterdir())
    manifest = json.loads(slabs[0].with_name(slabs[0].name.replace(".safetensors", ".manifest.json")).read_text())
    assert manifest["quantization"]["bits"] == 4 and manifest["format_version"] == 2
    assert "from int4 slab" in log, log[-3000:]  # the Load node's description of what it loads
    loras = list((comfy.base / "output" / "loras").glob("demo_int4_*_.safetensors"))
    assert len(loras) == 1 and load_file(str(loras[0]))


def _dp_workers() -> list[int]:
    """Live data-parallel worker processes (started by the ComfyUI server)."""
    out = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and b"engine.runs.worker" in (d / "cmdline").read_bytes():
                out.append(int(d.name))
        except OSError:
            continue
    return out


def _demo_with_data_parallel(comfy, prefix: str, steps: int) -> dict:
    """The demo's API graph with a Dual-GPU Split node in data-parallel mode on two CPU ranks (gloo)."""
    graph = json.loads((comfy.pack / "example_workflows" / "api" / "demo_tiny_lora.json").read_text())
    graph["7"] = {"class_type": "LowVRAMDualGPUSplit",
                  "inputs": {"mode": "data_parallel", "devices": "cpu,cpu", "cut": -1, "vram_budget_gb": "0"}}
    graph["4"]["inputs"].update(split=["7", 0], steps=steps)
    graph["5"]["inputs"]["filename_prefix"] = prefix
    return graph


def test_data_parallel_from_the_node_inside_comfyui(comfy, tmp_path):
    """Train LoRA + Dual-GPU Split (data parallel): ComfyUI's one process starts the workers, their
    progress reaches the console, the LoRA is saved, and no worker is left behind."""
    (tmp_path / "dp.json").write_text(json.dumps(_demo_with_data_parallel(comfy, "loras/demo_dp", 12)))
    done = comfy.comfy_run(tmp_path / "dp.json")
    log = json.dumps(_server_log(comfy.port))
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:], log[-4000:])
    assert "data parallel: starting 2 worker processes" in log and "[lowvram-lora] step 12/12" in log, log[-3000:]
    new = list((comfy.base / "output" / "loras").glob("demo_dp_*_.safetensors"))
    assert len(new) == 1
    from lowvram_lora.engine.lora_io import load_lora

    assert load_lora(new[0]).metadata["lowvram_lora.steps"] == "12"
    assert not _dp_workers()


def test_data_parallel_cancel_stops_the_workers(comfy):
    """ComfyUI's Cancel (POST /interrupt) during data-parallel training: the workers stop and exit."""
    graph = _demo_with_data_parallel(comfy, "loras/demo_dp_cancel", 100000)
    graph["4"]["inputs"]["training_seed"] = 7  # a run nobody finished: no reuse
    req = urllib.request.Request(f"http://127.0.0.1:{comfy.port}/prompt", method="POST",
                                 data=json.dumps({"prompt": graph, "client_id": "test"}).encode(),
                                 headers={"Content-Type": "application/json"})
    prompt_id = json.loads(urllib.request.urlopen(req, timeout=30).read())["prompt_id"]
    deadline = time.monotonic() + 240
    while "step 1/100000" not in json.dumps(_server_log(comfy.port)):
        assert time.monotonic() < deadline, json.dumps(_server_log(comfy.port))[-3000:]
        time.sleep(1)
    assert len(_dp_workers()) == 2
    urllib.request.urlopen(urllib.request.Request(f"http://127.0.0.1:{comfy.port}/interrupt", method="POST",
                                                  data=b""), timeout=30)
    while True:
        history = _get(comfy.port, f"/history/{prompt_id}")
        if prompt_id in history:
            break
        assert time.monotonic() < deadline + 120, "the interrupted prompt did not end"
        time.sleep(1)
    status = history[prompt_id]["status"]
    assert status["status_str"] == "error" and any(m[0] == "execution_interrupted" for m in status["messages"])
    time.sleep(2)
    assert not _dp_workers()
    assert not list((comfy.base / "output" / "loras").glob("demo_dp_cancel_*"))


#: Every shipped template except the demo, whose (tiny) files the fixture prepares: full-size models absent here.
FULL_SIZE = [pytest.param(t, id=name) for name, t in shipped().items() if name != DEMO_WORKFLOW.stem]


def _template_files(template) -> list[str]:
    """The model files a template's widgets name (checkpoint, single-file text encoders, VAE)."""
    names = [template.load["checkpoint"]] + [c["load"]["checkpoint"] for c in template.chains
                                             if "checkpoint" in c.get("load", {})]
    names += [template.cache[k] for k in ("text_encoder_1", "text_encoder_2", "vae_file")
              if template.cache.get(k, "(none)") != "(none)"]
    return names


@pytest.mark.parametrize("template", FULL_SIZE)
def test_full_size_workflow_without_its_files_fails_clearly(comfy, template):
    """The template as shipped, its model files absent: comfy run stops before running and names every one."""
    for name in _template_files(template):
        assert not list((comfy.base / "models").rglob(name)), f"{name} exists: this check needs it absent"
    done = comfy.comfy_run(comfy.pack / "example_workflows" / f"{template.name}.json", timeout=300)
    text = done.stdout + done.stderr
    assert done.returncode != 0
    missing = [name for name in _template_files(template) if name not in text]
    assert not missing, (missing, text[-2000:])


# Runs inside ComfyUI's own environment: its model detection, key map and weight patching, on our LoRA.
_COMFY_LORA_CHECK = r"""
import json, logging, sys
sys.argv = [sys.argv[0], "--cpu"]
import comfy.options
comfy.options.enable_args_parsing()  # as main.py does: --cpu is honoured
import torch
from safetensors.torch import load_file
import comfy.lora, comfy.model_base, comfy.model_detection

args = json.load(open(ARGS))
lora, base, ref = load_file(args["lora"]), load_file(args["base"]), load_file(args["ref"])
orig = dict(base)
# What ComfyUI's own detection reads from the base file must agree with the family's comfyui_model().
detected = comfy.model_detection.detect_unet_config(orig, "")
supported = comfy.model_detection.model_config_from_unet_config(detected, orig)
cls = getattr(comfy.model_base, args["model_class"])
model = cls.__new__(cls)  # the key map needs only the two attributes below
object.__setattr__(model, "model_config", type("C", (), {"unet_config": args["unet_config"]})())
object.__setattr__(model, "state_dict", lambda: {"diffusion_model." + k: v for k, v in base.items()})
warnings = []
handler = logging.Handler()
handler.emit = lambda record: warnings.append(record.getMessage())
logging.getLogger().addHandler(handler)
key_map = comfy.lora.model_lora_keys_unet(model, {})
patches = comfy.lora.load_lora(lora, key_map)
targets, worst = set(), 0.0
for target, adapter in patches.items():
    key, offset, function = (target, None, None) if isinstance(target, str) else (target[0], target[1], (target + (None,))[2])
    targets.add(key)
    name = key[len("diffusion_model."):]
    weight = comfy.lora.calculate_weight([(1.0, adapter, 1.0, offset, function)], base[name].float().clone(), key)
    base[name] = weight
for name in {t[len("diffusion_model."):] for t in targets}:
    worst = max(worst, float((base[name] - ref[name]).norm() / (ref[name] - orig[name]).norm()))
changed = sorted("diffusion_model." + n for n in ref if not torch.equal(ref[n], orig[n].to(ref[n].dtype)))
print(json.dumps({"patches": len(patches), "not_loaded": [w for w in warnings if "lora key not loaded" in w],
                  "targets": sorted(targets), "changed_by_our_merge": changed, "worst_rel_delta_error": worst,
                  "detected_unet_config": {k: v for k, v in detected.items() if k in args["unet_config"]},
                  "supported_model": type(supported).__name__}))
"""


def _comfy_has(comfy, model_class: str) -> bool:
    probe = ("import sys; sys.argv += ['--cpu']; import comfy.options; comfy.options.enable_args_parsing(); "
             f"import comfy.model_base as m; print(hasattr(m, '{model_class}'))")
    check = subprocess.run([str(_python(comfy.dir)), "-c", probe], cwd=comfy.dir, capture_output=True, text=True)
    return check.stdout.strip() == "True"


#: Variants beside each family's tiny one whose LoRA has other modules: Wan 2.1 I2V's image cross-attention
#: (native ``cross_attn.k_img`` / ``v_img``).
_MORE_VARIANTS = [("wan", "wan-i2v-tiny")]


@pytest.mark.parametrize("family_id, variant", [(f, None) for f in sorted(families())] + _MORE_VARIANTS)
def test_lora_maps_completely_in_comfyuis_own_loader(comfy, tmp_path, family_id, variant):
    """Our ComfyUI-format LoRA through ComfyUI's own model_lora_keys_unet + load_lora + calculate_weight, run in
    ComfyUI's environment, for every family: every key mapped, nothing left over, exactly the weights our merge
    changes are patched, and the patched weights equal ours. The model class and ``unet_config`` come from the
    family's ``fixtures.comfyui_model`` and are checked against ComfyUI's own detection on the base file."""
    from lowvram_lora.engine.caching import build_dataset_cache
    from lowvram_lora.engine.config import DataConfig, LoraSettings, ModelConfig, TrainConfig
    from lowvram_lora.engine.lora_io import save_lora
    from lowvram_lora.engine.testing import make_tiny_dataset
    from lowvram_lora.engine.train import train_lora

    family = families()[family_id]
    fixtures = family_fixtures(family)
    variant = variant or family.tiny_variant
    model_class, unet_config = fixtures.comfyui_model(family.load_config(variant))
    if not _comfy_has(comfy, model_class):
        pytest.skip(f"this ComfyUI has no comfy.model_base.{model_class} (0.3.64 predates Flux.2)")
    pipe = fixtures.build_tiny_pipeline(tmp_path / "pipe", **({"variant": variant} if variant != family.tiny_variant
                                                             else {}))
    data = make_tiny_dataset(tmp_path / "data", count=1)
    cache = build_dataset_cache(ModelConfig(transformer_path=str(pipe)),
                                DataConfig(path=str(data), resolution=128, bucket_step=32), tmp_path / "cache")
    lora = train_lora(ModelConfig(transformer_path=str(pipe)), cache, LoraSettings(rank=4, alpha=8),
                      TrainConfig(steps=5, learning_rate=2e-2, device="cpu"))
    assert lora.family == family_id
    assert fixtures.comfyui_model(lora.model_config) == (model_class, unet_config)
    save_lora(lora, tmp_path / "lora.safetensors", fmt="comfyui", dtype="fp32")
    _check_in_comfyuis_loader(comfy, tmp_path, family, pipe, tmp_path / "lora.safetensors", lora.state_dict,
                              lora.scale)


def _check_in_comfyuis_loader(comfy, tmp_path, family, pipe, lora_file, lora_state, scale) -> None:
    """The ComfyUI-format ``lora_file`` (``lora_state``: its modules in diffusers names, ``scale`` its alpha / rank)
    through ComfyUI's own model_lora_keys_unet + load_lora + calculate_weight, run in ComfyUI's environment against
    the tiny pipeline's base file: ComfyUI's detection agrees with ``fixtures.comfyui_model``, every key is mapped
    and nothing is left over, exactly the weights our merge changes are patched, and equal to ours (1e-4). Skipped
    where this ComfyUI has no class for the model."""
    import torch
    from safetensors.torch import load_file, save_file

    from lowvram_lora.engine.families.names import join_diffusers_tensors
    from lowvram_lora.engine.models import load_transformer

    sys.path.insert(0, str(REPO / "tests"))
    from helpers import merged

    fixtures = family_fixtures(family)
    model = load_transformer(pipe, dtype=torch.float32)[0]
    config = {k: v for k, v in dict(model.config).items() if not k.startswith("_")}  # as training records it
    model_class, unet_config = fixtures.comfyui_model(config)
    if not _comfy_has(comfy, model_class):
        pytest.skip(f"this ComfyUI has no comfy.model_base.{model_class}")
    base_file = fixtures.write_single_file(pipe, tmp_path / "base.safetensors")
    state = merged(model, lora_state, scale).state_dict()
    save_file({p.name: join_diffusers_tensors(p, state).contiguous() for p in family.param_table(config)},
              str(tmp_path / "ref.safetensors"))
    args = {"lora": str(lora_file), "base": str(base_file), "ref": str(tmp_path / "ref.safetensors"),
            "model_class": model_class, "unet_config": unet_config}
    (tmp_path / "args.json").write_text(json.dumps(args))
    code = _COMFY_LORA_CHECK.replace("ARGS", repr(str(tmp_path / "args.json")))
    done = subprocess.run([str(_python(comfy.dir)), "-c", code], cwd=comfy.dir, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(family.id, {k: v for k, v in result.items() if k not in ("targets", "changed_by_our_merge")},
          len(result["targets"]), "targets")
    assert result["detected_unet_config"] == unet_config, "fixtures.comfyui_model disagrees with ComfyUI's detection"
    file_keys = load_file(str(lora_file))
    groups = {k.rsplit(".", 1)[0] for k in file_keys if k.endswith(".alpha")}
    assert len(file_keys) == 3 * len(groups)  # down/A, up/B, alpha per module: nothing else in the file
    assert result["patches"] == len(groups) and not result["not_loaded"], result
    assert result["targets"] == result["changed_by_our_merge"], "ComfyUI patches other weights than our merge changes"
    assert result["worst_rel_delta_error"] < 1e-4, result


def test_single_file_text_encoders_find_comfyuis_bundled_tokenizers(comfy):
    """Inside ComfyUI, clip_l / t5xxl single files and Qwen-Image's Qwen2.5-VL file use ComfyUI's own tokenizer
    folders (none is downloaded)."""
    code = ("import sys, json; sys.argv += ['--cpu']; import comfy.options; comfy.options.enable_args_parsing(); "
            "import folder_paths; from lowvram_lora.nodes.paths import comfy_tokenizer_dirs; "
            "from transformers import AutoTokenizer; d = comfy_tokenizer_dirs(); "
            "print(json.dumps({k: [v, AutoTokenizer.from_pretrained(v, local_files_only=True)('a photo').input_ids] "
            "for k, v in d.items() if k in ('clip_l', 't5xxl', 'qwen25_tokenizer')}))")
    done = subprocess.run([str(_python(comfy.dir)), "-c", code], cwd=comfy.dir, capture_output=True, text=True,
                          timeout=120, env=dict(os.environ, HF_HUB_OFFLINE="1"))
    assert done.returncode == 0, done.stderr[-2000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert set(found) == {"clip_l", "t5xxl", "qwen25_tokenizer"}
    assert found["clip_l"][1][0] == 49406 and found["t5xxl"][1][-1] == 1  # CLIP's BOS, T5's EOS
    assert found["qwen25_tokenizer"][1] == [64, 6548]  # Qwen2.5's BPE: no BOS, no EOS


def _one_text_file(t) -> bool:
    """One text-encoder file, or a second that is an image encoder ComfyUI keeps in clip_vision (Wan 2.1 I2V's
    clip_vision_h, which the family fixtures write beside umT5)."""
    second = t.cache.get("text_encoder_2")
    return second is None or t.download_folders.get(second) == "clip_vision"


#: Templates whose Cache Text Embeds reads one text-encoder single file: the family fixtures write every file
#: they name (as tests/test_family_workflows.py does), so each runs end to end on its tiny model.
#: LTX-2.3's (no VAE file: the all-in-one checkpoint bundles it) run through tests/comfyui/ltx2_comfy_run.py.
SINGLE_FILE = [pytest.param(t, id=name) for name, t in shipped().items()
               if t.cache.get("text_encoders") == "(single files below)" and _one_text_file(t)
               and "vae_file" in t.cache and t.split is None]
#: Flux.1 Kontext (two text-encoder files, clip_l and t5xxl, each with its tiny tokenizer in its companion folder,
#: which wins over ComfyUI's bundled one), as tests/test_family_workflows.py runs it too.
SINGLE_FILE += [pytest.param(t, id=name) for name, t in shipped().items() if name == "flux1_kontext_lora"]


def _with_widgets(ui: dict, values: dict[str, dict]) -> dict:
    """A UI-format workflow with widget values replaced by name ({node type: {input: value}}), positions
    from the node classes' declared inputs (control-after-generate slots included, as the file stores them). A
    setting that moved from the node to an options node it takes (Train LoRA's sample_steps: Preview Options) is
    set on the options node linked to it."""
    from lowvram_lora.host.workflow import input_specs
    from lowvram_lora.nodes import NODE_CLASS_MAPPINGS

    def widget_positions(node: dict) -> dict[str, int]:
        widgets = [s for s in input_specs(NODE_CLASS_MAPPINGS[node["type"]]) if s.is_widget]
        stored = len(node["widgets_values"])
        with_controls = stored == len(widgets) + sum(s.control_slots for s in widgets)
        assert with_controls or stored == len(widgets), (node["type"], stored)
        position, cursor = {}, 0
        for spec in widgets:
            position[spec.name] = cursor
            cursor += 1 + (spec.control_slots if with_controls else 0)
        return position

    by_id = {n["id"]: n for n in ui["nodes"]}
    for node in ui["nodes"]:
        if node["type"] not in values:
            continue
        position = widget_positions(node)
        links = {e["link"] for e in node.get("inputs") or [] if e.get("link") is not None}
        feeders = [by_id[l[1]] for l in ui["links"] if l[0] in links and by_id[l[1]]["type"] in NODE_CLASS_MAPPINGS]
        for name, value in values[node["type"]].items():
            target = node if name in position else next(
                f for f in feeders if name in widget_positions(f))  # StopIteration: no such widget anywhere
            target["widgets_values"][widget_positions(target)[name]] = value
    return ui


def _log_since(port: int, start: str) -> str:
    entries = _get(port, "/internal/logs/raw")["entries"]
    return "".join(e["m"] for e in entries if e["t"] >= start)


@pytest.mark.parametrize("template", SINGLE_FILE)
def test_template_trains_its_tiny_model_through_comfy_run(comfy, tmp_path, template):
    """The shipped UI workflow, sizes and steps reduced, on its family's tiny model under the template's file
    names, through comfy run against the real server: exit 0, samples taken, no traceback in the server log, and
    the LoRA written lowers the flow-matching loss of diffusers' own model (the reference) on the training image."""
    from datetime import datetime

    from lowvram_lora.engine.lora_io import load_lora

    from helpers import write_template_files

    _, written = write_template_files(template, comfy.base, tmp_path)
    try:
        ui = json.loads((comfy.pack / "example_workflows" / f"{template.name}.json").read_text())
        _with_widgets(ui, {
            "LowVRAMCacheTextEmbeds": {"resolution": 128, "sample_prompts": "ohwx, a red circle"},
            # A seed of its own: templates of one family share the tiny model's bytes, so the server would reuse
            # another template's finished run instead of training.
            "LowVRAMTrainLoRA": {"steps": 8, "learning_rate": 0.01, "warmup_steps": 0, "sample_every": 4,
                                 "sample_resolution": 64, "sample_steps": 2,
                                 "training_seed": zlib.crc32(template.name.encode()) % 100_000},
        })
        (tmp_path / "tiny.json").write_text(json.dumps(ui))
        start = datetime.now().isoformat()
        done = comfy.comfy_run(tmp_path / "tiny.json")
        log = _log_since(comfy.port, start)
        assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:], log[-4000:])
        assert "Traceback" not in log and "!!! Exception" not in log, log[-4000:]
        assert "[lowvram-lora] step 8/8" in log and "sampled 1 prompt(s) at step 8" in log, log[-3000:]
        if template.chain_links:  # Wan 2.2 A14B: each expert previews with the other chain's model at the boundary
            assert log.count("previews switch to") == len(template.chains) + 1, log[-3000:]
            assert "sampling is off" not in log, log[-3000:]
        prefix = template.save["filename_prefix"]
        saved = sorted((comfy.base / "output").glob(f"{prefix}_*_.safetensors"))
        assert len(saved) == 1, (sorted((comfy.base / "output" / "loras").iterdir()), log[-3000:])
        lora = load_lora(saved[0])
        assert lora.format == "comfyui" and lora.metadata["lowvram_lora.family"] == template.load["family"]
        assert lora.metadata["lowvram_lora.steps"] == "8"
        # What ComfyUI trained (inside its inference mode), against diffusers' own model from the tiny pipeline.
        _check_lora_lowers_the_reference_loss(comfy, template, tmp_path / "pipe", lora)
        if template.cache.get("control_folder"):  # an edit LoRA: the base family's keys, in ComfyUI's own loader
            _check_in_comfyuis_loader(comfy, tmp_path, families()[template.load["family"]], tmp_path / "pipe",
                                      saved[0], lora.state_dict, 1.0)  # the file's B holds alpha / rank
    finally:
        for path in written:
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)


def _check_lora_lowers_the_reference_loss(comfy, template, pipe, lora) -> None:
    """Merged into diffusers' own model from the tiny pipeline folder (the reference), the LoRA ComfyUI trained
    lowers the flow-matching loss on the newest cached training item (an image, or a clip window)."""
    import torch
    from helpers import eval_flow_loss, merged

    from lowvram_lora.engine.caching.cache import open_dataset_cache
    from lowvram_lora.engine.families import get_family

    family = get_family(template.load["family"])
    ref = family.transformer_class().from_pretrained(pipe / "transformer", use_safetensors=True,
                                                     torch_dtype=torch.float32, local_files_only=True)
    manifests = sorted((comfy.base / "output" / "lowvram_cache").rglob("datasets/*.json"),
                       key=lambda p: p.stat().st_mtime)
    cache = open_dataset_cache(manifests[-1])
    assert cache.family == family.id
    before, after = eval_flow_loss(ref, family, cache), eval_flow_loss(merged(ref, lora.state_dict, 1.0), family, cache)
    print(f"{template.name}: flow loss of the reference {before:.5f}, with the LoRA trained in ComfyUI {after:.5f}")
    assert after < before, f"the LoRA trained in ComfyUI did not lower the loss: {before:.5f} -> {after:.5f}"


def test_video_template_trains_on_clips_and_shows_the_animated_preview(comfy, tmp_path):
    """Wan 2.2 TI2V-5B's shipped UI workflow on the tiny Wan model (its file names), on clips of
    ``make_tiny_video_dataset``, sizes reduced, through comfy run: exit 0, 5-frame sample clips drawn, the Train LoRA
    node's outputs in ComfyUI's history carry the animated WebP with ComfyUI's ``animated`` flag (as its
    SaveAnimatedWEBP returns them), ComfyUI's /view serves it with all its frames, and Save LoRA put it next to the
    LoRA."""
    import io
    import urllib.parse
    from datetime import datetime

    from PIL import Image

    from helpers import write_template_files
    from lowvram_lora.engine.testing import make_tiny_video_dataset

    template = shipped()["wan22_ti2v_5b_lora"]
    _, written = write_template_files(template, comfy.base, tmp_path)
    clips = comfy.base / "input" / template.cache["dataset_path"]
    for f in clips.iterdir():  # clips only: the template's dataset folder as a user fills it
        f.unlink()
    make_tiny_video_dataset(clips, count=2, frames=9, size=(64, 48), fps=16)
    try:
        ui = json.loads((comfy.pack / "example_workflows" / f"{template.name}.json").read_text())
        _with_widgets(ui, {
            "LowVRAMCacheTextEmbeds": {"resolution": 64, "sample_prompts": "ohwx, a red circle", "video_frames": "5",
                                       "video_fps": 16.0},
            "LowVRAMTrainLoRA": {"steps": 8, "learning_rate": 0.01, "warmup_steps": 0, "sample_every": 4,
                                 "sample_resolution": 64, "sample_steps": 2, "sample_frames": 5,
                                 "training_seed": 7},
            "LowVRAMSaveLoRA": {"filename_prefix": "loras/tiny_video_lora"},
        })
        (tmp_path / "tiny_video.json").write_text(json.dumps(ui))
        start = datetime.now().isoformat()
        done = comfy.comfy_run(tmp_path / "tiny_video.json")
        log = _log_since(comfy.port, start)
        assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:], log[-4000:])
        assert "Traceback" not in log and "!!! Exception" not in log, log[-4000:]
        assert "clip windows" in log and "sampled 1 prompt(s) at step 8" in log, log[-3000:]
        history = _get(comfy.port, "/history?max_items=1")
        (entry,) = history.values()
        train_id = next(i for i, n in enumerate(ui["nodes"]) if n["type"] == "LowVRAMTrainLoRA")
        outputs = entry["outputs"][str(ui["nodes"][train_id]["id"])]
        assert outputs.get("animated") == [True], outputs
        webps = [im for im in outputs["images"] if im["filename"].endswith(".webp")]
        assert len(webps) == 1 and webps[0]["type"] == "output", outputs
        query = urllib.parse.urlencode(webps[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{comfy.port}/view?{query}", timeout=30) as r:
            served = r.read()
        saved = sorted((comfy.base / "output" / "loras").glob("tiny_video_lora_*_samples_p00.webp"))
        assert len(saved) == 1, sorted((comfy.base / "output" / "loras").iterdir())
        import numpy as np

        with Image.open(io.BytesIO(served)) as clip, Image.open(saved[0]) as copy:
            assert clip.format == "WEBP" and clip.n_frames == 5 and clip.size == (64, 64)
            for i in range(5):  # what ComfyUI shows is, frame for frame, the clip kept next to the LoRA
                clip.seek(i)
                copy.seek(i)
                assert np.array_equal(np.asarray(clip.convert("RGB")), np.asarray(copy.convert("RGB"))), i
        from lowvram_lora.engine.lora_io import load_lora

        lora_files = sorted((comfy.base / "output" / "loras").glob("tiny_video_lora_*_.safetensors"))
        assert len(lora_files) == 1, lora_files
        _check_lora_lowers_the_reference_loss(comfy, template, tmp_path / "pipe", load_lora(lora_files[0]))
        print("animated preview:", webps[0], "next to the LoRA:", saved[0])
    finally:
        for path in written:
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)


def test_both_wan_experts_train_at_once_through_comfy_run(comfy, tmp_path):
    """Issue 42: wan22_t2v_lora's API graph on its tiny experts, with a Dual-GPU Split node in mode 'experts' on
    cpu,cpu joined to the top Train LoRA and the bottom chain's Save LoRA left out (the Note's two steps): one
    comfy run trains both experts at once in two worker processes, Save LoRA writes ..._high_noise_ and
    ..._low_noise_, each lowers the flow loss of diffusers' reference model, and no worker is left behind."""
    from datetime import datetime

    from helpers import write_template_files
    from lowvram_lora.engine.lora_io import load_lora

    template = shipped()["wan22_t2v_lora"]
    _, written = write_template_files(template, comfy.base, tmp_path)
    try:
        graph = json.loads((comfy.pack / "example_workflows" / "api" / f"{template.name}.json").read_text())
        graph["2"]["inputs"].update(resolution=64, sample_prompts="ohwx, a red circle", video_frames="1")
        graph["4"]["inputs"].update(steps=6, learning_rate=0.01, warmup_steps=0, sample_every=0, training_seed=4242,
                                    split=["7", 0])
        graph["5"]["inputs"]["filename_prefix"] = "loras/wan22_both_experts"
        graph["7"] = {"class_type": "LowVRAMDualGPUSplit",
                      "inputs": {"mode": "experts", "devices": "cpu,cpu", "cut": -1, "vram_budget_gb": "0"}}
        del graph[str(5 + 10)]  # the bottom chain's Save LoRA (the Note: bypass it)
        (tmp_path / "experts.json").write_text(json.dumps(graph))
        start = datetime.now().isoformat()
        done = comfy.comfy_run(tmp_path / "experts.json")
        log = _log_since(comfy.port, start)
        assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:], log[-4000:])
        assert "Traceback" not in log, log[-4000:]
        assert "experts: training the high-noise expert on cpu and the low-noise expert on cpu" in log, log[-3000:]
        assert "[lowvram-lora] step 6/6" in log and "[low-noise expert (cpu)] step 6/6" in log, log[-3000:]
        for role in ("high_noise", "low_noise"):
            saved = sorted((comfy.base / "output" / "loras").glob(f"wan22_both_experts_{role}_*_.safetensors"))
            assert len(saved) == 1, sorted((comfy.base / "output" / "loras").iterdir())
            lora = load_lora(saved[0])
            assert lora.metadata["lowvram_lora.steps"] == "6"
            assert lora.metadata["lowvram_lora.variant"].endswith(role.replace("_", "-")), lora.metadata
            pipe = tmp_path / ("pipe" if role == "high_noise" else "pipe1")
            _check_lora_lowers_the_reference_loss(comfy, template, pipe, lora)
        assert not _dp_workers()
    finally:
        for path in written:
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)


@pytest.mark.parametrize("virtual_stages,micro_batches,processes", [(1, 2, False), (2, 2, False), (1, 0, False),
                                                                      (1, 2, True)])
def test_pipelined_dual_gpu_template_trains_through_comfy_run(comfy, tmp_path, virtual_stages, micro_batches,
                                                              processes):
    """Issue 42: the shipped flux2_dev_dual_gpu UI workflow on the tiny Flux.2 under its file names, with Dual-GPU
    Split on cpu,cpu and micro_batches 2 (Train LoRA batch_size 2, four same-size images), one part per device or
    interleaved (virtual_stages 2: the tiny model's 4 blocks in 4 chunks, two per device), or micro_batches 0 (auto:
    the batch of two in a piece each), or one_process_per_gpu (each part in a worker process of its own): comfy run
    exits 0, the log says each batch was pipelined in 2 micro-batches, and the LoRA lowers diffusers' reference
    model's loss."""
    from datetime import datetime

    from helpers import write_template_files
    from lowvram_lora.engine.lora_io import load_lora
    from lowvram_lora.engine.testing import make_tiny_dataset

    template = shipped()["flux2_dev_dual_gpu"]
    _, written = write_template_files(template, comfy.base, tmp_path)
    try:  # four images of one size: batches of two, so each step's batch is pipelined
        make_tiny_dataset(comfy.base / "input" / template.cache["dataset_path"], count=4, sizes=((128, 128),))
        ui = json.loads((comfy.pack / "example_workflows" / f"{template.name}.json").read_text())
        _with_widgets(ui, {
            "LowVRAMCacheTextEmbeds": {"resolution": 128, "sample_prompts": "ohwx, a red circle"},
            "LowVRAMTrainLoRA": {"steps": 6, "learning_rate": 0.01, "warmup_steps": 0, "sample_every": 0,
                                 # a seed of its own: how a run is split does not change the run, so the other
                                 # parameter's finished run would be reused
                                 "batch_size": 2,
                                 "training_seed": 4242 + virtual_stages + 10 * micro_batches + 100 * processes},
            "LowVRAMDualGPUSplit": {"devices": "cpu,cpu", "micro_batches": micro_batches,
                                    "virtual_stages": virtual_stages, "one_process_per_gpu": processes},
        })
        (tmp_path / "pipelined.json").write_text(json.dumps(ui))
        pattern = f"{template.save['filename_prefix']}_*_.safetensors"
        before = set((comfy.base / "output").glob(pattern))  # the other parameter's LoRA, in the same ComfyUI
        start = datetime.now().isoformat()
        done = comfy.comfy_run(tmp_path / "pipelined.json")
        log = _log_since(comfy.port, start)
        assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:], log[-4000:])
        assert "Traceback" not in log and "!!! Exception" not in log, log[-4000:]
        kind = "interleaved 1F1B" if virtual_stages > 1 else "1F1B"
        assert f"each batch pipelined through both in 2 micro-batches ({kind})" in log, log[-3000:]
        if virtual_stages > 1:
            assert "split interleaved, virtual_stages 2: 4 blocks in 4 chunks" in log, log[-3000:]
        if micro_batches == 0:
            assert "micro_batches auto: 2, one image each" in log, log[-3000:]
        if processes:
            assert "the split's processes: starting 2 worker processes on cpu, cpu" in log, log[-3000:]
            assert "process split: this process (stage 0) runs blocks 0-" in log, log[-3000:]
        assert "[lowvram-lora] step 6/6" in log, log[-3000:]
        saved = sorted(set((comfy.base / "output").glob(pattern)) - before)
        assert len(saved) == 1, log[-3000:]
        lora = load_lora(saved[0])
        assert lora.metadata["lowvram_lora.steps"] == "6"
        _check_lora_lowers_the_reference_loss(comfy, template, tmp_path / "pipe", lora)
    finally:
        for path in written:
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)


def test_masked_loss_and_validation_through_comfy_run(comfy, tmp_path):
    """The demo with Dataset Options (masks beside the images, a quarter of them held out) and Loss & Validation
    Options (validation every 5 steps) through comfy run: the LoRA trains with masks, the validation loss is
    measured at fixed noise, and the CSV log lands beside the LoRA."""
    import csv

    from PIL import Image

    from lowvram_lora.demo import DEMO_DATASET

    data = comfy.base / "input" / DEMO_DATASET
    for img in sorted(p for p in data.glob("*.png") if not p.stem.endswith("_mask")):
        with Image.open(img) as im:
            w, h = im.size
        mask = Image.new("L", (w, h), 0)
        mask.paste(255, (w // 4, h // 4, 3 * w // 4, 3 * h // 4))  # the shape in the middle trains
        mask.save(img.with_name(img.stem + "_mask.png"))
    graph = json.loads((comfy.pack / "example_workflows" / "api" / "demo_tiny_lora.json").read_text())
    graph["6"] = {"class_type": "LowVRAMDatasetOptions",
                  "inputs": {"mask_source": "beside", "missing_mask": "error", "validation_fraction": 0.25,
                             "validation_folder": "", "caption_dropout": 0.0, "shuffle_tags": False,
                             "keep_tags": 1, "caption_variants": 4, "reg_folder": ""}}
    graph["7"] = {"class_type": "LowVRAMLossOptions",
                  "inputs": {"unmasked_weight": 0.1, "validation_every": 5, "validation_timesteps": 4,
                             "tensorboard": True, "timestep_sampling": "family", "logit_mean": 0.0,
                             "logit_std": 1.0, "sigmoid_scale": 1.0, "loss_weighting": "family", "snr_gamma": 5.0,
                             "reg_ratio": 0.5, "prior_loss_weight": 1.0}}
    graph["2"]["inputs"]["options"] = ["6", 0]
    graph["4"]["inputs"].update(steps=20, sample_every=0, loss_options=["7", 0])
    graph["5"]["inputs"]["filename_prefix"] = "loras/demo_masked"
    (tmp_path / "masked.json").write_text(json.dumps(graph))
    done = comfy.comfy_run(tmp_path / "masked.json", timeout=900)
    log = json.dumps(_server_log(comfy.port))
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:], log[-4000:])
    # 6 images, 2 held out; the six masks are one picture, and mask entries are keyed by content: one built
    assert "masks 1 built / 0 reused" in log and "2 held out for validation" in log, log[-3000:]
    assert "validation: 2 held-out item(s) x 4 fixed noise levels every 5 steps" in log, log[-3000:]
    new = sorted((comfy.base / "output" / "loras").glob("demo_masked_*_.safetensors"))
    assert len(new) == 1
    rows = list(csv.DictReader(open(new[0].with_name(new[0].stem + "_log.csv"))))
    assert [r["step"] for r in rows] == [str(s) for s in range(1, 21)]
    assert [r["step"] for r in rows if r["validation_loss"]] == ["5", "10", "15", "20"]
    print("validation loss:", [r["validation_loss"] for r in rows if r["validation_loss"]])


def _png(path: Path):
    import numpy as np
    from PIL import Image

    with Image.open(path) as im:
        return np.asarray(im.convert("RGB"), dtype=np.int16)


def test_train_and_try_samples_as_comfyui_does_with_the_saved_file(comfy, tmp_path):
    """demo_train_and_try as shipped but for its output node and length (Preview Image -> Save Image, 40 steps,
    no grid): ComfyUI's KSampler on ComfyUI's own loader's model with Train LoRA's lora_model applied by Load LoRA
    Model. Then a second graph samples the same prompt, seed and size on the base model and with the saved LoRA
    file through LoraLoaderModelOnly: the LoRA's image differs from the base's and equals the saved file's."""
    graph = json.loads((comfy.pack / "example_workflows" / "api" / "demo_train_and_try.json").read_text())
    graph["4"]["inputs"].update(steps=40, sample_every=0)
    graph["5"]["inputs"]["filename_prefix"] = "loras/try_test"
    graph["29"] = {"class_type": "SaveImage", "inputs": {"images": ["28", 0], "filename_prefix": "try/applied"}}
    (tmp_path / "try.json").write_text(json.dumps(graph))
    done = comfy.comfy_run(tmp_path / "try.json", timeout=900)
    log = json.dumps(_server_log(comfy.port))
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:], log[-4000:])
    (lora,) = sorted((comfy.base / "output" / "loras").glob("try_test_*_.safetensors"))
    loras = comfy.base / "models" / "loras"
    loras.mkdir(parents=True, exist_ok=True)
    shutil.copy(lora, loras / "try_test.safetensors")  # where LoraLoaderModelOnly lists files
    # the same sampling twice more: on the base model, and with the saved file
    second = {k: graph[k] for k in ("1", "2", "21", "23", "24", "25", "27")}
    second["31"] = {"class_type": "LoraLoaderModelOnly",
                    "inputs": {"model": ["21", 0], "lora_name": "try_test.safetensors", "strength_model": 1.0}}
    for tag, model in (("base", ["21", 0]), ("file", ["31", 0])):
        sampler, decode = f"4{len(second)}", f"5{len(second)}"
        second[sampler] = {"class_type": "KSampler", "inputs": {**graph["26"]["inputs"], "model": model}}
        second[decode] = {"class_type": "VAEDecode", "inputs": {"samples": [sampler, 0], "vae": ["27", 0]}}
        second[f"6{len(second)}"] = {"class_type": "SaveImage",
                                     "inputs": {"images": [decode, 0], "filename_prefix": f"try/{tag}"}}
    (tmp_path / "compare.json").write_text(json.dumps(second))
    done = comfy.comfy_run(tmp_path / "compare.json", timeout=600)
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:], json.dumps(_server_log(comfy.port))[-4000:])
    out = comfy.base / "output" / "try"
    applied, base, file = (_png(next(out.glob(f"{tag}_*.png"))) for tag in ("applied", "base", "file"))
    assert applied.shape == base.shape == (128, 128, 3)
    # the same bf16 tensors patched into the same weights by ComfyUI's own code: equal to the last 8-bit level
    assert abs(applied - file).max() <= 1, abs(applied - file).max()
    # and the LoRA changed the picture (40 steps at the demo's learning rate): mean change over 2 levels of 255
    assert abs(applied - base).mean() > 2.0, abs(applied - base).mean()
    print("mean |lora - base|:", float(abs(applied - base).mean()), "max |applied - file|:",
          int(abs(applied - file).max()))


def test_comfyuis_dataset_nodes_train_and_cache_as_the_same_folder(comfy, tmp_path):
    """Issue 43 item 2: ComfyUI's own Load Image-Text (from Folder) -> Images to Dataset -> Cache Text Embeds -> Train
    LoRA -> Save LoRA through comfy run; its cache holds, for every image, the same caption, latent and text
    embeddings as the shipped demo's cache of the same folder by path (compared as tensors: ComfyUI lists the folder
    in its own order)."""
    import hashlib

    from safetensors.torch import load_file

    base = json.loads((comfy.pack / "example_workflows" / "api" / "demo_tiny_lora.json").read_text())
    cache = comfy.base / "output" / "lowvram_cache"

    def run(graph, name):
        graph["4"]["inputs"].update(steps=10, sample_every=0)
        graph["5"]["inputs"]["filename_prefix"] = f"loras/{name}"
        (tmp_path / f"{name}.json").write_text(json.dumps(graph))
        before = set((cache / "datasets").glob("*.json")) if (cache / "datasets").exists() else set()
        done = comfy.comfy_run(tmp_path / f"{name}.json", timeout=900)
        assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:], json.dumps(_server_log(comfy.port))[-4000:])
        assert len(list((comfy.base / "output" / "loras").glob(f"{name}_*_.safetensors"))) == 1
        made = set((cache / "datasets").glob("*.json")) - before
        return json.loads((made.pop() if made else _manifest_of(cache, graph)).read_text())

    nodes = json.loads(json.dumps(base))
    nodes["10"] = {"class_type": "LoadImageTextDataSetFromFolder", "inputs": {"folder": nodes["2"]["inputs"]["dataset_path"]}}
    nodes["11"] = {"class_type": "LowVRAMImagesToDataset", "inputs": {"images": ["10", 0], "texts": ["10", 1]}}
    nodes["2"]["inputs"].update(dataset_path="", images=["11", 0])
    from_nodes = run(nodes, "dataset_nodes")
    from_folder = run(json.loads(json.dumps(base)), "dataset_folder")

    def entries(manifest):
        out = []
        for it in manifest["items"]:
            latent = load_file(str(cache / "latents" / f"{it['latent_key']}.safetensors"))["latent"]
            text = load_file(str(cache / "text" / f"{it['text_key']}.safetensors"))
            out.append((it["caption"], hashlib.sha256(latent.numpy().tobytes()).hexdigest(),
                        [hashlib.sha256(text[k].numpy().tobytes()).hexdigest() for k in sorted(text)]))
        return sorted(out)

    assert "lowvram_cache/images/" in from_nodes["source"] and len(from_nodes["items"]) == 6
    assert entries(from_nodes) == entries(from_folder)


def _manifest_of(cache, graph):
    """The newest manifest (a rerun of a cached dataset writes none)."""
    return max((cache / "datasets").glob("*.json"), key=lambda p: p.stat().st_mtime)
