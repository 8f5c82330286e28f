"""The demo's tiny models, trained before it runs.

The VAE, trained to reconstruct: a random AutoencoderKL's decoder does not invert its encoder, so every image it
decodes (even a training image's own latents) is texture, and the demo's sample grid showed the same noise in every
cell (issue 28). Trained for a minute on synthetic coloured shapes, it decodes
flat colours and shape edges, so what the transformer draws becomes visible. The transformer, pretrained
briefly on captioned shapes, draws coloured blobs for coloured words, so the demo's LoRA can visibly steer it.

Only the demo uses this: the tests keep their random tiny models (``build_tiny_pipeline`` is unchanged).
"""
from __future__ import annotations

import json
import random
import time
from pathlib import Path

import torch

#: Written beside the VAE weights once trained; ``ensure_demo_assets`` trains only a folder without it.
MARKER = "demo_trained.json"
#: Trained weights by (config, starting weights, steps), so one process trains once: the tests build many demo
#: folders, all from the same seed.
_TRAINED: dict[tuple, tuple[dict, float, float]] = {}


def shape_image(rng: random.Random, size: int) -> torch.Tensor:
    """(3, size, size) in [-1, 1]: a coloured circle, square or triangle on another colour, anywhere."""
    import numpy as np
    from PIL import Image, ImageDraw

    from .engine.families.tiny import COLORS, SHAPES
    from .engine.testing import draw_shape

    fg, bg = rng.sample(list(COLORS), 2)
    shape = rng.choice(SHAPES)
    img = Image.new("RGB", (size, size), COLORS[bg])
    draw = ImageDraw.Draw(img)
    r = int(size * rng.uniform(0.2, 0.4))
    cx, cy = rng.randint(r, size - r), rng.randint(r, size - r)
    draw_shape(draw, shape, cx, cy, r, COLORS[fg])
    return torch.from_numpy(np.array(img)).permute(2, 0, 1).float() / 127.5 - 1.0


def _sums(model) -> tuple:
    """A fingerprint of a model's weights, for the per-process memo."""
    return tuple(round(float(p.detach().double().sum()), 6) for p in model.parameters())


class _Threads:
    """One intra-op thread while training: the convolutions are tiny, and on a busy 2-core machine two
    threads waited on each other for seconds per step (measured: 5 s vs 0.02 s a step)."""

    def __enter__(self):
        self.before = torch.get_num_threads()
        torch.set_num_threads(1)

    def __exit__(self, *exc):
        torch.set_num_threads(self.before)


def reconstruction_error(vae, count: int = 4, size: int = 128, seed: int = 100) -> float:
    """Mean absolute error of decode(encode(x)) on ``count`` fresh shape images (pixels in [-1, 1])."""
    rng = random.Random(seed)
    x = torch.stack([shape_image(rng, size) for _ in range(count)])
    with torch.no_grad():
        y = vae.decode(vae.encode(x).latent_dist.mean).sample.clamp(-1, 1)
    return float((y - x).abs().mean())


def train_vae(vae, steps: int = 1200, size: int = 48, batch: int = 8, lr: float = 2e-3, seed: int = 0,
              log=None, target: float | None = None, check_every: int = 50) -> float:
    """Train ``vae`` (an AutoencoderKL, float32) in place to reconstruct random shape images; returns the
    reconstruction error afterwards (``reconstruction_error``). ``target``: stop as soon as the error (measured
    every ``check_every`` steps) is below it, ``steps`` being the most.

    Why a target: where a fixed number of steps leaves the error is not the same on every machine. The same seeds
    on another CPU kernel (AVX2 against AVX-512) ended 400 steps at 0.291 instead of 0.273, and seeds alone spread
    it over 0.236-0.291; a fresh clone elsewhere measured 0.333. How far training goes to reach an error is the
    robust measure.

    Small images are enough: the VAE is convolutional and the shapes are flat colours with edges, so what it
    learns at 48 px holds at 128. The latents are kept near N(0, 1) after the VAE's own shift and scale (the
    Flux constants in its config), which is what the transformer's flow-matching noise assumes, and the decoder
    sees them with a little noise, so a transformer's imperfect latents still decode to clean colours.
    """
    scale, shift = float(vae.config.scaling_factor), float(vae.config.shift_factor)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(vae.parameters(), lr=lr)
    vae.train()
    with _Threads():
        for step in range(steps):
            x = torch.stack([shape_image(rng, size) for _ in range(batch)])
            z = vae.encode(x).latent_dist.mean
            normed = (z - shift) * scale
            noisy = z + (0.05 / scale) * torch.randn(z.shape, generator=gen)
            y = vae.decode(noisy).sample
            recon = (y - x).abs().mean() + (y - x).pow(2).mean()
            keep_normal = normed.mean().pow(2) + (normed.std() - 1.0).pow(2)
            loss = recon + 0.1 * keep_normal
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if log and (step % 200 == 0 or step == steps - 1):
                log(f"demo VAE step {step}: reconstruction loss {recon.item():.4f}")
            if target is not None and (step + 1) % check_every == 0 and reconstruction_error(vae) < target:
                break
        vae.eval()
        return reconstruction_error(vae)


def train_demo_vae(pipeline: str | Path, steps: int = 1200, log=print, target: float | None = None) -> float:
    """Train the VAE of a tiny Flux.1 pipeline folder (``build_tiny_flux1_pipeline``) and save it back in place
    (safetensors), with a marker holding the measured error; returns that error. ``target``: see ``train_vae``."""
    from diffusers import AutoencoderKL

    folder = Path(pipeline) / "vae"
    vae = AutoencoderKL.from_pretrained(folder, local_files_only=True, use_safetensors=True)  # float32
    config = {k: v for k, v in vae.config.items() if not k.startswith("_")}  # not the folder's path
    key = (json.dumps(config, sort_keys=True, default=str), steps, target, _sums(vae))
    start = time.perf_counter()
    if key in _TRAINED:
        state, before, after = _TRAINED[key]
        vae.load_state_dict(state)
    else:
        before = reconstruction_error(vae)
        after = train_vae(vae, steps=steps, log=log, target=target)
        _TRAINED[key] = ({k: v.clone() for k, v in vae.state_dict().items()}, before, after)
    vae.save_pretrained(folder, safe_serialization=True)
    seconds = time.perf_counter() - start
    (folder / MARKER).write_text(json.dumps({"steps": steps, "mae_before": before, "mae_after": after,
                                             "seconds": round(seconds, 1)}))
    if log:
        log(f"demo VAE trained in {seconds:.0f} s: reconstruction error {before:.3f} -> {after:.3f}")
    return after


def shape_caption_pairs(count: int, size: int = 128, seed: int = 1) -> tuple[torch.Tensor, list[str]]:
    """``count`` random shape images (count, 3, size, size) and their captions, "a {fg} {shape} on a {bg}
    background" (what ``shape_image`` drew, drawn again from the same random stream)."""
    from .engine.families.tiny import COLORS, SHAPES

    rng = random.Random(seed)
    images, captions = [], []
    for _ in range(count):
        state = rng.getstate()
        fg, bg = rng.sample(list(COLORS), 2)
        shape = rng.choice(SHAPES)
        rng.setstate(state)  # shape_image draws the same three choices first
        images.append(shape_image(rng, size))
        captions.append(f"a {fg} {shape} on a {bg} background")
    return torch.stack(images), captions


def pretrain_demo_transformer(pipeline: str | Path, steps: int = 2500, count: int = 256, batch: int = 16,
                              lr: float = 3e-3, seed: int = 0, log=print) -> float:
    """Teach the tiny Flux.1 transformer of a pipeline folder (all its weights) to draw captioned shapes, with the
    engine's flow-matching objective on latents of the folder's (trained) VAE and embeddings of its own text
    encoders; saves it back in place (safetensors). Returns the last steps' mean loss.

    Why: a random transformer draws the same texture for every prompt, and a LoRA of a few hundred steps on six
    images cannot teach it to draw; a base that draws coloured blobs for coloured words can be steered by one."""
    from diffusers import AutoencoderKL, FluxPipeline

    from .engine.families import default_max_sequence_length
    from .engine.families.flux1 import FAMILY
    from .engine.train.flow_matching import noisy_latents_and_target, sample_sigmas

    pipeline = Path(pipeline)
    start = time.perf_counter()
    with _Threads():
        pipe = FluxPipeline.from_pretrained(pipeline, local_files_only=True, use_safetensors=True)  # float32
        key = ("transformer", steps, count, batch, lr, seed, _sums(pipe.transformer), _sums(pipe.vae),
               _sums(pipe.text_encoder), _sums(pipe.text_encoder_2))
        if key in _TRAINED:  # this process pretrained these same weights already (the tests build many folders)
            state, final, _ = _TRAINED[key]
            pipe.transformer.load_state_dict(state)
            pipe.transformer.save_pretrained(pipeline / "transformer", safe_serialization=True)
            (pipeline / "transformer" / MARKER).write_text(json.dumps({"steps": steps, "loss": final}))
            return final
        vae = AutoencoderKL.from_pretrained(pipeline / "vae", local_files_only=True, use_safetensors=True).eval()
        images, captions = shape_caption_pairs(count)
        scale, shift = float(vae.config.scaling_factor), float(vae.config.shift_factor)
        with torch.no_grad():  # the latents as the engine caches them: the mean, shifted and scaled
            latents = torch.cat([(vae.encode(images[i:i + 32]).latent_dist.mean - shift) * scale
                                 for i in range(0, count, 32)])
            prompt_embeds, pooled, _ = pipe.encode_prompt(captions, None, max_sequence_length=
                                                          default_max_sequence_length(FAMILY, FAMILY.tiny_variant))
        model = pipe.transformer.train()
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        gen = torch.Generator().manual_seed(seed)
        guidance = FAMILY.guidance(FAMILY.tiny_variant).scale
        recent = []
        for step in range(steps):
            idx = torch.randint(0, count, (batch,), generator=gen)
            x0 = latents[idx]
            noise = torch.randn(x0.shape, generator=gen)
            sigmas = sample_sigmas(batch, gen, mu=FAMILY.schedule.train_shift_mu(x0))
            noisy, target = noisy_latents_and_target(x0, noise, sigmas)
            embeds = {"prompt_embeds": prompt_embeds[idx], "pooled_prompt_embeds": pooled[idx]}
            out = model(**FAMILY.model_inputs(model, noisy, embeds, sigmas, guidance))[0]
            loss = (FAMILY.unpack_prediction(out, noisy) - target).pow(2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            recent = (recent + [loss.item()])[-100:]
            if log and (step % 500 == 0 or step == steps - 1):
                log(f"demo transformer step {step}: loss {sum(recent) / len(recent):.4f}")
        model.eval().save_pretrained(pipeline / "transformer", safe_serialization=True)
    final = sum(recent) / len(recent)
    _TRAINED[key] = ({k: v.clone() for k, v in model.state_dict().items()}, final, None)
    (pipeline / "transformer" / MARKER).write_text(json.dumps({"steps": steps, "loss": final,
                                                               "seconds": round(time.perf_counter() - start, 1)}))
    if log:
        log(f"demo transformer pretrained in {time.perf_counter() - start:.0f} s: loss {final:.3f}")
    return final


#: The demo's dataset: what its two sample prompts name ("ohwx, a red circle" / "ohwx, a blue square"; the Cache
#: node puts the trigger "ohwx" in front), on one plain background, so the LoRA has one clear thing to learn.
DEMO_SUBJECTS = (("red", "circle"), ("blue", "square"))


def make_demo_dataset(folder: str | Path, count: int = 6, size: int = 128, background: str = "white",
                      seed: int = 5) -> Path:
    """``count`` captioned images alternating DEMO_SUBJECTS, at random places and sizes."""
    from PIL import Image, ImageDraw

    from .engine.families.tiny import COLORS
    from .engine.testing import draw_shape

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    for i in range(count):
        colour, shape = DEMO_SUBJECTS[i % len(DEMO_SUBJECTS)]
        img = Image.new("RGB", (size, size), COLORS[background])
        draw = ImageDraw.Draw(img)
        r = rng.randint(size * 7 // 32, size * 11 // 32)
        cx, cy = rng.randint(r, size - r), rng.randint(r, size - r)
        draw_shape(draw, shape, cx, cy, r, COLORS[colour])
        img.save(folder / f"img_{i:03d}.png")
        (folder / f"img_{i:03d}.txt").write_text(f"a {colour} {shape}")
    return folder
