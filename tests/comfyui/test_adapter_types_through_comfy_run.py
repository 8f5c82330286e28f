"""Each adapter type trained inside a real ComfyUI through ``comfy run``, and its files read back by ComfyUI's own loader.

For LoHa, LoKr and DoRA: the demo's API graph with a LoRA Adapter node of that type (EMA on) plugged into Train LoRA,
Save LoRA in fp32, run through ``comfy run --wait`` against the real server (the ``comfy`` fixture of
``test_real_comfyui.py``). Save LoRA writes the plain file and the EMA's own file beside it. Each is then read by
ComfyUI 0.33's ``model_lora_keys_unet`` + ``load_lora`` + ``calculate_weight`` (the script of ``test_real_comfyui.py``)
on the demo's checkpoint, against an independent reference: peft's own merge (``helpers.peft_merged``) of the run's
fp32 adapter weights (the run's finished-run entry in ComfyUI's output folder, its weights and EMA) into the same
checkpoint, in ComfyUI's native names. Every key mapped, exactly the weights peft's merge changes patched, relative
delta error <= 1e-6.

    flock /work/comfyui/.lock env LOWVRAM_COMFYUI_DIR=/work/comfyui /work/wt/pt -q tests/comfyui -k comfy_run_per_type
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
from test_real_comfyui import _COMFY_LORA_CHECK, COMFY_DIR, _python, _server_log, comfy  # noqa: E402,F401

pytestmark = pytest.mark.skipif(not COMFY_DIR, reason="set LOWVRAM_COMFYUI_DIR to a real ComfyUI to run these")

#: EMA on: both files. The average spans few steps, so its delta stays large beside fp32 rounding (DoRA's rescale of
#: the whole weight: a delta near its init would show ComfyUI's and peft's fp32 roundings, ~1e-6 of it, not an error).
DECAY = 0.5


def _graph(comfy, kind: str) -> dict:
    graph = json.loads((comfy.pack / "example_workflows" / "api" / "demo_tiny_lora.json").read_text())
    adapter = str(max(int(k) for k in graph) + 1)  # a free id: the demo's options nodes hold the next ones
    graph[adapter] = {"class_type": "LowVRAMLoraAdapter",
                      "inputs": {"type": kind, "lokr_factor": -1, "lokr_decompose_both": False, "continue_from": "",
                                 "ema_decay": DECAY, "snapshot_every": 0, "snapshot_keep": 3, "ema_previews": True}}
    graph["4"]["inputs"].update(adapter=[adapter, 0], steps=6, learning_rate=0.03, rank=4, alpha=8.0, sample_every=0)
    options = {v["class_type"]: v["inputs"] for v in graph.values()}  # the demo plugs both options nodes
    options["LowVRAMTrainingOptions"].update(warmup_steps=0)
    options["LowVRAMPreviewOptions"].update(sample_at_start=False)
    graph["5"]["inputs"].update(filename_prefix=f"loras/demo_{kind}", dtype="fp32")
    return graph


def _finished_run(comfy, kind: str):
    """The run's entry in the finished-run cache (the fp32 peft weights and their EMA, as trained)."""
    from lowvram_lora.engine.lora_io.trained import read_trained

    folder = comfy.base / "output" / "lowvram_cache" / "trained"
    found = []
    for info in folder.glob("*.json"):
        run = read_trained(folder, info.stem)
        adapter = ((run.settings.get("lora") or {}).get("adapter") or {}) if run is not None else {}
        if run is not None and run.adapter == kind and adapter.get("ema_decay") == DECAY:
            found.append(run)
    assert len(found) == 1, (kind, sorted(p.name for p in folder.iterdir()))
    return found[0]


def _comfy_check(comfy, tmp_path, lora_file: Path, ref_state: dict, model_config: dict) -> dict:
    """ComfyUI's own loader on ``lora_file`` over the demo checkpoint, against the native tensors of ``ref_state``."""
    from safetensors.torch import save_file

    from lowvram_lora.engine.families import families, family_fixtures
    from lowvram_lora.engine.families.names import join_diffusers_tensors

    family = families()["flux1"]
    model_class, unet_config = family_fixtures(family).comfyui_model(model_config)
    ref = tmp_path / f"ref_{lora_file.stem}.safetensors"
    save_file({p.name: join_diffusers_tensors(p, ref_state).contiguous() for p in family.param_table(model_config)},
              str(ref))
    args = tmp_path / f"args_{lora_file.stem}.json"
    args.write_text(json.dumps({"lora": str(lora_file), "ref": str(ref), "model_class": model_class,
                                "unet_config": unet_config,
                                "base": str(comfy.base / "models" / "diffusion_models" / "flux1-tiny.safetensors")}))
    done = subprocess.run([str(_python(comfy.dir)), "-c", _COMFY_LORA_CHECK.replace("ARGS", repr(str(args)))],
                          cwd=comfy.dir, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("kind", ("loha", "lokr", "dora"))
def test_comfy_run_per_type_saves_files_comfyui_loads_exactly(comfy, tmp_path, kind):
    import torch
    from safetensors.torch import load_file

    from lowvram_lora.engine.config import AdapterConfig, LoraSettings
    from lowvram_lora.engine.models import load_transformer
    from helpers import peft_merged

    (tmp_path / "graph.json").write_text(json.dumps(_graph(comfy, kind)))
    done = comfy.comfy_run(tmp_path / "graph.json", timeout=900)
    log = json.dumps(_server_log(comfy.port))
    assert done.returncode == 0, (done.stdout[-2000:], done.stderr[-2000:], log[-4000:])
    loras = comfy.base / "output" / "loras"
    plain = sorted(loras.glob(f"demo_{kind}_*_.safetensors"))
    assert len(plain) == 1, sorted(p.name for p in loras.iterdir())
    ema = plain[0].with_name(plain[0].stem + "_ema.safetensors")
    assert ema.exists(), sorted(p.name for p in loras.iterdir())  # the EMA's own file, beside the plain one
    assert f"saved its EMA: {ema}" in log, log[-3000:]

    run = _finished_run(comfy, kind)
    assert run.steps == 6 and run.ema_state_dict.keys() == run.state_dict.keys()
    settings = LoraSettings(rank=4, alpha=8.0, adapter=AdapterConfig(type=kind))
    base, family, _, _ = load_transformer(comfy.base / "models" / "diffusion_models" / "flux1-tiny.safetensors",
                                          dtype=torch.float32)
    for file, state, weights in ((plain[0], run.state_dict, "last"), (ema, run.ema_state_dict, "ema")):
        from safetensors import safe_open

        with safe_open(str(file), "pt") as f:
            assert f.metadata()["lowvram_lora.adapter"] == kind and f.metadata()["lowvram_lora.weights"] == weights
        ref = peft_merged(base, family, settings, state).state_dict()
        result = _comfy_check(comfy, tmp_path, file, ref, run.model_config)
        print(kind, weights, {k: v for k, v in result.items() if k not in ("targets", "changed_by_our_merge")})
        keys = load_file(str(file))
        prefixes = {k.rsplit(".", 2)[0] if k.endswith(".weight") else k.rsplit(".", 1)[0] for k in keys}
        assert result["patches"] == len(prefixes) and not result["not_loaded"], result
        assert result["targets"] == result["changed_by_our_merge"], "ComfyUI patches other weights than peft's merge"
        assert result["worst_rel_delta_error"] <= 1e-6, result
