"""The demo visibly learns (issue 43, item 7): the shipped demo workflow, run headless as `make demo` runs it, must draw
its last grid column with its dataset's look, each row that of its own prompt's images. Measured on the grid PNG it
saves beside the LoRA, against the dataset's images as the same VAE draws them (decode(encode(image))) and against
the step-0 column.

Two measures: a cell's mean colour (its distance to the prompt's images' mean colour), and its look, the fractions of
its pixels near the prompt's shape colour and near the dataset's background (yellow): a red circle on yellow is
~25% red and ~70% yellow."""
from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch

#: RGB distance within which a pixel counts as a colour of ``engine.families.tiny.COLORS`` (the nearest other
#: colours, orange to yellow and to red, are 72 and 101 away; the VAE's drawn edges are softer than the dataset's).
NEAR = 90


def _cell_pixels(grid_path, rows: int, columns: int, cell: int = 256) -> list[list[np.ndarray]]:
    """Each grid cell's (N, 3) RGB pixels above its prompt band, in [0, 255]: [row][column]."""
    from PIL import Image

    from lowvram_lora.engine.sampling.grid import title_height

    grid = np.asarray(Image.open(grid_path).convert("RGB"), dtype=np.float64)
    assert grid.shape[:2] == (title_height(cell * columns) + rows * cell, cell * columns), grid.shape
    top = title_height(cell * columns)
    return [[grid[top + r * cell: top + r * cell + cell * 3 // 4, c * cell:(c + 1) * cell].reshape(-1, 3)
             for c in range(columns)] for r in range(rows)]


def _near(pixels: np.ndarray, colour: str) -> float:
    """Fraction of ``pixels`` within NEAR of the named colour."""
    from lowvram_lora.engine.families.tiny import COLORS

    return float((np.linalg.norm(pixels - np.array(COLORS[colour], dtype=np.float64), axis=1) < NEAR).mean())


def _drawn_dataset(pipeline, dataset) -> dict[str, np.ndarray]:
    """Each caption's images as the pipeline's VAE draws them (decode(encode(image))), their pixels (N, 3) in
    [0, 255]: what a sample reaches when the LoRA reproduces that caption's training latents, whatever the VAE."""
    from diffusers import AutoencoderKL
    from PIL import Image

    vae = AutoencoderKL.from_pretrained(pipeline / "vae", use_safetensors=True).eval()
    out: dict[str, list] = {}
    for png in sorted(dataset.glob("*.png")):
        x = torch.from_numpy(np.asarray(Image.open(png).convert("RGB"), dtype=np.float32) / 127.5 - 1)
        with torch.no_grad():
            drawn = vae.decode(vae.encode(x.permute(2, 0, 1)[None]).latent_dist.mean).sample.clamp(-1, 1)
        out.setdefault(png.with_suffix(".txt").read_text().strip(), []).append(
            ((drawn[0] + 1) * 127.5).permute(1, 2, 0).reshape(-1, 3).numpy())
    return {caption: np.concatenate(images) for caption, images in out.items()}


def _run_shipped_demo(models, output) -> tuple[list[str], list[list[np.ndarray]]]:
    """The shipped demo workflow as is, headless; (its sample prompts, its grid's cells [row][column])."""
    from lowvram_lora.demo import WORKFLOW
    from lowvram_lora.demo_models import _Threads
    from lowvram_lora.engine.families.flux1.templates import TEMPLATES
    from lowvram_lora.host.run_command import run_workflow_command
    from lowvram_lora.nodes import NODE_CLASS_MAPPINGS
    from lowvram_lora.nodes.paths import configure_standalone_dirs

    demo = next(t for t in TEMPLATES if t.name == "demo_tiny_lora")
    args = argparse.Namespace(workflow=str(WORKFLOW), overrides=[], models_dir=str(models), output_dir=str(output),
                              no_progress=True, traceback=True)
    with _Threads():  # as `make demo` runs it (demo.run_demo)
        assert run_workflow_command(args, NODE_CLASS_MAPPINGS, configure_dirs=configure_standalone_dirs) == 0
    (grid,) = (output / "loras").glob("demo_tiny_lora_*_samples.png")
    prompts = demo.cache["sample_prompts"].split("\n")
    columns = demo.train["steps"] // demo.train["sample_every"] + 1
    return prompts, _cell_pixels(grid, len(prompts), columns)


def test_the_demo_lora_moves_its_samples_toward_the_datasets_colour(tmp_path):
    """The shipped workflow as is (its steps, learning rate, rank, sample_every, dataset), on a model cheaper to make
    than the demo's: its VAE trained to reconstruct as the demo's is (to test_demo_vae's error target: the same
    seed, so a test session trains it once), its transformer random (pretraining the demo's takes minutes: the real
    demo's grid, each row against its own prompt's images, is measured by the opt-in test below). A random base
    draws no shapes and tells the prompts apart only as its LoRA learns to; what the LoRA learns first from the
    demo's data and settings is their common look, the pull toward the dataset's yellow. Threshold: each prompt's
    last cell is at most 0.8 times as far from the dataset's mean colour (its images as the VAE draws them) as its
    step-0 cell (Euclidean distance of mean RGB; a LoRA that learns nothing stays at 1.0). Measured: 97 -> 61 and
    98 -> 58 (ratios 0.63, 0.58). ~35 s on an idle 2-core machine (47 s of CPU; 3.2 min of wall time at load 5)."""
    from lowvram_lora.demo import ensure_demo_assets
    from lowvram_lora.demo_models import train_demo_vae

    assets = ensure_demo_assets(tmp_path / "demo", trained=False)
    train_demo_vae(assets["pipeline"], steps=1200, log=None, target=0.27)  # a random VAE draws texture (issue 28)
    prompts, cells = _run_shipped_demo(assets["models"], tmp_path / "out")
    target = np.concatenate(list(_drawn_dataset(assets["pipeline"], assets["dataset"]).values())).mean(0)
    before = np.linalg.norm(np.array([row[0].mean(0) for row in cells]) - target, axis=1)
    after = np.linalg.norm(np.array([row[-1].mean(0) for row in cells]) - target, axis=1)
    print("prompts", prompts, "dataset colour", target.round(1), "distance", before.round(1), "->", after.round(1))
    assert (after <= 0.8 * before).all(), (before, after)


@pytest.mark.slow
def test_the_real_demo_draws_each_prompts_shape_colour_on_the_datasets_yellow(tmp_path):
    """What `make demo` does (preparing the demo's files: its VAE trained, its transformer pretrained; then the
    shipped workflow), and its grid measured: at the last step each row's cell has the look of its own prompt's
    images, its shape's colour on the dataset's yellow, far more than its step-0 cell. Opt-in (`-m slow`): the
    preparation takes minutes (see the demo template's Note).

    A cell's look: the fractions of its pixels near the prompt's shape colour and near yellow (``_near``). Its
    prompt's images as the VAE draws them: red 0.21-0.34 of an image and yellow 0.66-0.80; blue 0.23-0.47 and
    0.50-0.74. Thresholds, for each prompt: at the last step each fraction is at least half the images' share, and
    the look's distance to the images' (the sum of both fractions' differences) is at most 0.6 times the step-0
    cell's. Measured (2026-11-28, 8.4 min at load 4-7, most of it preparing; see the Note): red circle, images
    0.26 / 0.75, step 0 0.44 / 0.06 (a red blob on white), last 0.18 / 0.79, distance 0.87 -> 0.13; blue square,
    images 0.32 / 0.65, step 0 0.07 / 0.00 (a purple-blue blob on white), last 0.52 / 0.41, distance 0.90 -> 0.44.
    A LoRA that learns nothing keeps the step-0 cell (ratio 1.0) and fails."""
    from lowvram_lora.demo import DEMO_DATASET, run_demo
    from lowvram_lora.demo_models import DEMO_BACKGROUND

    root = tmp_path / "demo"
    assert run_demo(root, prepare_only=True) == 0
    prompts, cells = _run_shipped_demo(root / "models", tmp_path / "out")
    drawn = _drawn_dataset(root / "models" / "diffusers" / "flux1-tiny", root / "input" / DEMO_DATASET)
    for prompt, row in zip(prompts, cells):
        colour = prompt.split()[1]  # "a red circle on a ohwx background"

        def look(pixels):
            return np.array([_near(pixels, colour), _near(pixels, DEMO_BACKGROUND)])

        want, first, last = look(drawn[prompt]), look(row[0]), look(row[-1])
        before, after = np.abs(first - want).sum(), np.abs(last - want).sum()
        print(f"{prompt!r}: {colour} / {DEMO_BACKGROUND} fractions: images {want.round(2)}, step 0 {first.round(2)}, "
              f"last {last.round(2)}; distance {before:.2f} -> {after:.2f}")
        assert (last >= 0.5 * want).all(), (prompt, want, first, last)
        assert after <= 0.6 * before, (prompt, want, first, last)
