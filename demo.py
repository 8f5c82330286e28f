"""The demo job: the shipped demo workflow, run headless on a tiny Flux.1 model on CPU.

Builds (once) a tiny Flux.1 pipeline folder (its VAE trained to reconstruct and its transformer pretrained on
captioned shapes: demo_models.py), its BFL single-file twin and a synthetic captioned dataset of what the sample
prompts name, under ``--dir`` in ComfyUI's layout (``models/``, ``input/``), then runs
``example_workflows/demo_tiny_lora.json`` through the same executor as ``lowvram-lora run``: cache, 300
training steps, LoRA + loss-curve and sample-grid PNGs.
"""
from __future__ import annotations

import argparse
from pathlib import Path

WORKFLOW = Path(__file__).resolve().parent / "example_workflows" / "demo_tiny_lora.json"
#: The demo dataset, relative to the input folder: the workflow names it this way, so it runs as
#: shipped in ComfyUI (input/ of its root) and headless (input/ beside --models-dir).
DEMO_DATASET = "lowvram_demo/shapes_on_ohwx"
#: The demo VAE as ComfyUI's VAE Loader takes it (models/vae/): what ComfyUI's VAE Decode previews the demo with.
PREVIEW_VAE = "flux1-tiny-taesd.safetensors"


def ensure_demo_assets(root: Path, trained: bool = True) -> dict[str, Path]:
    """Build the tiny model and dataset if absent; returns their paths. ``trained``: the demo's model (one ComfyUI's
    own loaders take, ``flux1-demo``), its VAE trained to reconstruct shapes and its transformer to draw them (a few
    minutes on a CPU, once per folder), so the sample grid shows the LoRA at work; tests of the plumbing pass False
    and get the random ``flux1-tiny`` models (cheaper steps)."""
    import json
    import shutil

    from .demo_models import (DATASET_MARKER, DEMO_VARIANT, MARKER, dataset_settings, make_demo_dataset,
                              pretrain_demo_transformer, train_demo_vae, write_comfy_preview_vae)
    from .engine.families.flux1 import FAMILY
    from .engine.testing import build_tiny_flux1_pipeline, write_bfl_single_file

    pipeline = root / "models" / "diffusers" / "flux1-tiny"
    single = root / "models" / "diffusion_models" / "flux1-tiny.safetensors"
    preview_vae = root / "models" / "vae" / PREVIEW_VAE
    data = root / "input" / DEMO_DATASET
    variant = DEMO_VARIANT if trained else FAMILY.tiny_variant
    config = pipeline / "transformer" / "config.json"
    if config.exists() and FAMILY.variant_for_config(json.loads(config.read_text())) != variant:
        # prepared by an older version (a model ComfyUI cannot load), or untrained for a test: build it again
        shutil.rmtree(pipeline)
        single.unlink(missing_ok=True)
        preview_vae.unlink(missing_ok=True)
    if not (pipeline / "model_index.json").exists():
        build_tiny_flux1_pipeline(pipeline, variant=variant)
    if trained and not (pipeline / "vae" / MARKER).exists():  # a random VAE decodes everything to texture (issue 28)
        preview_vae.unlink(missing_ok=True)
        train_demo_vae(pipeline)
    # a random transformer draws one texture for all prompts
    if trained and not (pipeline / "transformer" / MARKER).exists():
        single.unlink(missing_ok=True)  # the twin is written from the pretrained weights below
        pretrain_demo_transformer(pipeline)
    if not single.exists():
        write_bfl_single_file(pipeline, single)
    if trained and not preview_vae.exists():
        write_comfy_preview_vae(pipeline, preview_vae)
    marker = data / DATASET_MARKER
    if not marker.exists() or json.loads(marker.read_text()) != json.loads(json.dumps(dataset_settings(count=6))):
        for old in data.glob("img_*.*"):  # an older version's demo images (white backgrounds): made again
            old.unlink()
        make_demo_dataset(data, count=6)
    return {"pipeline": pipeline, "single_file": single, "dataset": data, "models": root / "models",
            "preview_vae": preview_vae}


def run_demo(root: str | Path = "demo_output", prepare_only: bool = False, progress: bool = True) -> int:
    from .host.run_command import run_workflow_command
    from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS
    from .nodes.paths import configure_standalone_dirs

    root = Path(root)
    assets = ensure_demo_assets(root)
    if prepare_only:
        print(f"demo files ready: {assets['single_file']}, {assets['pipeline']}, {assets['dataset']}")
        return 0
    args = argparse.Namespace(
        workflow=str(WORKFLOW), overrides=[],  # the workflow exactly as shipped
        models_dir=str(assets["models"]), output_dir=str(root / "output"), no_progress=not progress, traceback=False,
    )
    from .demo_models import _Threads

    # One intra-op thread, as the preparation: the tiny model's ops are too small to share, and on a loaded 2-core
    # machine two threads wait on each other. Measured 2026-11-27, the demo run with two busy processes beside it:
    # 38.4 s with 2 threads, 19.8 s with 1 (at load 1.6 both ~7-10 s). It also keeps the run's float sums in one
    # order on every machine.
    with _Threads():
        return run_workflow_command(args, NODE_CLASS_MAPPINGS, configure_dirs=configure_standalone_dirs,
                                    display_names=NODE_DISPLAY_NAME_MAPPINGS)
