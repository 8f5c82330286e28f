"""The demo job: train a LoRA on a tiny Flux.1-architecture model, on CPU, in about a minute.

Builds (once) a tiny random Flux.1 pipeline folder, its BFL single-file twin and a
synthetic captioned dataset under ``demo_output/``, then caches, trains ~30 steps,
writes the LoRA and a loss-curve PNG, and prints both paths.
"""
from __future__ import annotations

from pathlib import Path


def ensure_demo_assets(root: Path) -> dict[str, Path]:
    """Build the tiny model and dataset if absent; returns their paths."""
    from .engine.testing import build_tiny_flux1_pipeline, make_tiny_dataset, write_bfl_single_file

    pipeline = root / "models" / "diffusers" / "flux1-tiny"
    single = root / "models" / "diffusion_models" / "flux1-tiny.safetensors"
    data = root / "datasets" / "shapes"
    if not (pipeline / "model_index.json").exists():
        build_tiny_flux1_pipeline(pipeline)
    if not single.exists():
        write_bfl_single_file(pipeline, single)
    if not any(data.glob("*.png")):
        make_tiny_dataset(data, count=6)
    return {"pipeline": pipeline, "single_file": single, "dataset": data}


def run_demo(root: str | Path = "demo_output", steps: int = 30) -> dict[str, Path]:
    from .engine.caching import build_dataset_cache
    from .engine.callbacks import ConsoleCallback
    from .engine.config import DataConfig, LoraSettings, ModelConfig, TrainConfig
    from .engine.lora_io import save_lora
    from .engine.plotting import save_loss_curve
    from .engine.train import train_lora

    root = Path(root)
    assets = ensure_demo_assets(root)
    cb = ConsoleCallback()
    # The transformer comes from the ComfyUI-style single file; encoders and VAE from the folder.
    model = ModelConfig(transformer_path=str(assets["single_file"]), pipeline_path=str(assets["pipeline"]))
    data = DataConfig(path=str(assets["dataset"]), resolution=128, bucket_step=32, trigger_word="ohwx")
    dataset = build_dataset_cache(model, data, root / "cache", callback=cb)
    lora = train_lora(model, dataset, LoraSettings(rank=8, alpha=8),
                      TrainConfig(steps=steps, learning_rate=2e-3, warmup_steps=3, seed=0), cb)
    out = root / "output"
    n = 1
    while (out / f"demo_lora_{n:05d}.safetensors").exists():
        n += 1
    lora_path = save_lora(lora, out / f"demo_lora_{n:05d}.safetensors", fmt="comfyui")
    curve = save_loss_curve(lora.loss_history, out / f"demo_lora_{n:05d}_loss.png")
    first, last = lora.loss_history[0], sum(lora.loss_history[-5:]) / min(5, len(lora.loss_history))
    print(f"trained {lora.steps} steps in {lora.seconds:.1f}s; loss {first:.4f} -> {last:.4f} (mean of last 5)")
    print(f"LoRA:       {lora_path}")
    print(f"loss curve: {curve}")
    return {"lora": lora_path, "loss_curve": curve}
