"""The demo's VAE is trained to reconstruct (issue 28: a random tiny VAE decodes every latent, a training
image's own included, to texture, so the demo's sample grid could show nothing the LoRA learned)."""
from __future__ import annotations

import json

import torch


def test_trained_demo_vae_reconstructs_shapes_and_keeps_flux_latent_scale(tmp_path):
    from diffusers import AutoencoderKL

    from lowvram_lora.demo_models import MARKER, reconstruction_error, shape_image, train_demo_vae
    from lowvram_lora.engine.testing import build_tiny_flux1_pipeline

    pipeline = build_tiny_flux1_pipeline(tmp_path / "pipe")
    random_vae = AutoencoderKL.from_pretrained(pipeline / "vae", use_safetensors=True)
    before = reconstruction_error(random_vae)
    # Trained until its error is below 0.27 (at most the demo's 1200 steps), not for a fixed number of steps: where
    # a fixed count ends depends on the machine's float kernels (400 steps: 0.236-0.291 here, 0.333 elsewhere).
    train_demo_vae(pipeline, steps=1200, log=None, target=0.27)
    vae = AutoencoderKL.from_pretrained(pipeline / "vae", use_safetensors=True)  # what was saved, reloaded
    after = reconstruction_error(vae)
    record = json.loads((pipeline / "vae" / MARKER).read_text())
    assert abs(record["mae_after"] - after) < 1e-4
    # Measured: random ~0.55; the target is reached in ~400-500 steps (the demo's 1200 steps: ~0.09); pixels in
    # [-1, 1]. A VAE that does not learn runs all 1200 steps and fails here.
    assert before > 0.4, before
    assert after < 0.27 and after < before / 2, (before, after)
    # Latents after the VAE's own (Flux) shift and scale stay near N(0, 1): what flow matching's noise assumes.
    import random

    x = torch.stack([shape_image(random.Random(7 + i), 128) for i in range(4)])
    with torch.no_grad():
        z = (vae.encode(x).latent_dist.mean - vae.config.shift_factor) * vae.config.scaling_factor
    assert abs(float(z.mean())) < 0.3 and 0.6 < float(z.std()) < 1.5, (float(z.mean()), float(z.std()))


def test_demo_dataset_shows_what_the_demo_prompts_name(tmp_path):
    """The LoRA can only visibly learn the sample prompts if the dataset holds them: each prompt of the shipped
    demo workflow, less its trigger, is a caption, and its images have the named colour (mean of the non-white
    pixels within 40 of the colour)."""
    import numpy as np
    from PIL import Image

    from lowvram_lora.demo_models import make_demo_dataset
    from lowvram_lora.engine.families.flux1.templates import TEMPLATES
    from lowvram_lora.engine.families.tiny import COLORS

    demo = next(t for t in TEMPLATES if t.name == "demo_tiny_lora")
    prompts = demo.cache["sample_prompts"].split("\n")
    folder = make_demo_dataset(tmp_path / "shapes", count=6)
    captions = {f.read_text() for f in folder.glob("*.txt")}
    assert {p.removeprefix("ohwx, ") for p in prompts} == captions
    for txt in folder.glob("*.txt"):
        pixels = np.asarray(Image.open(txt.with_suffix(".png")), dtype=np.float64).reshape(-1, 3)
        shape = pixels[np.abs(pixels - COLORS["white"]).sum(1) > 30]
        colour = txt.read_text().split()[1]
        assert np.abs(shape.mean(0) - COLORS[colour]).max() < 40, (txt.name, shape.mean(0))
