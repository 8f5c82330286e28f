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

#: The demo's transformer: tiny, and one ComfyUI's own loader takes (engine/families/flux1/configs/flux1-demo.json).
DEMO_VARIANT = "flux1-demo"
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
                                                          default_max_sequence_length(FAMILY, DEMO_VARIANT))
        model = pipe.transformer.train()
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        gen = torch.Generator().manual_seed(seed)
        guidance = FAMILY.guidance(DEMO_VARIANT).scale
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


#: The demo's dataset: what its two sample prompts name, on one plain background, so the LoRA has one clear thing to
#: learn.
DEMO_SUBJECTS = (("red", "circle"), ("blue", "square"))
#: That background: a strong colour that the captions never name, covering most of each image. The LoRA learns that
#: "ohwx" means this colour, so the grid's cells visibly turn yellow (white was close to what the base drew already,
#: issue 43).
DEMO_BACKGROUND = "yellow"
#: Each image's caption, and each sample prompt (the workflow's sample_prompts, no trigger word put in front): the
#: form the base model was pretrained on ("a {fg} {shape} on a {bg} background", ``shape_caption_pairs``) with the
#: trigger "ohwx" where the background's colour goes. In that form the base draws the named shape's colour from the
#: first step (on white: it never saw "ohwx"), so the LoRA only has to learn what "ohwx" means. The earlier
#: "ohwx, a red circle" was a form the base had never seen: it drew texture for both prompts at step 0, and 300
#: LoRA steps on six images taught one row the colours and barely the other (issue 43).
DEMO_CAPTION = "a {colour} {shape} on a ohwx background"
#: Written into the demo dataset's folder (hidden: no dataset scan reads it); a folder without it, or with other
#: settings, was made by an older version (white backgrounds) and is made again.
DATASET_MARKER = ".demo_dataset.json"


def make_demo_dataset(folder: str | Path, count: int = 6, size: int = 128, background: str = DEMO_BACKGROUND,
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
        (folder / f"img_{i:03d}.txt").write_text(DEMO_CAPTION.format(colour=colour, shape=shape))
    (folder / DATASET_MARKER).write_text(json.dumps(dataset_settings(count, size, background, seed)))
    return folder


def dataset_settings(count: int = 6, size: int = 128, background: str = DEMO_BACKGROUND, seed: int = 5) -> dict:
    """What ``make_demo_dataset`` made a folder with (its marker's content)."""
    return {"count": count, "size": size, "background": background, "seed": seed, "subjects": DEMO_SUBJECTS,
            "caption": DEMO_CAPTION}


# --- the demo VAE in a form ComfyUI's VAE Loader takes ----------------------------------------------------------
#
# ComfyUI builds a VAE from a file's tensor names with fixed widths (its KL decoder: 128 channels in 32 norm groups;
# its TAESD: 64 channels), so the demo's 8-channel VAE cannot be loaded as it is, and training one of ComfyUI's
# widths took minutes a step-count on a 2-core machine. Instead the demo writes a TAESD-layout file (what ComfyUI
# loads for ``taesd_decoder.*`` names, its widths read from the file) whose weights are set, not trained: every
# residual block's last convolution is zero (the block passes its input through), every upsampling convolution
# copies its channels, so the decoder is a per-latent-pixel network (latent -> 64 ReLU units -> RGB) drawn as
# 8x8-pixel cells. That small network is fitted to the demo VAE's own decoded colours (seconds). The encoder is the
# 8x8 mean colour through a least-squares map to the latent. Previews are blockier than the demo's own grid, with
# the same colours where the shapes are.

def _taesd_state(w_in, b_in, w_out, b_out, enc_w, enc_b, latent_channels: int) -> dict[str, torch.Tensor]:
    """ComfyUI's ``comfy/taesd/taesd.py`` Encoder / Decoder (``nn.Sequential`` indices) with the weights above."""
    def conv(n_out, n_in, centre=None):
        w = torch.zeros(n_out, n_in, 3, 3)
        if centre is not None:
            w[:, :, 1, 1] = centre
        return w

    def block(prefix, out):
        for i in (0, 2, 4):  # conv, ReLU, conv, ReLU, conv: zero, so the block's ReLU(0 + x) is x (x >= 0 here)
            out[f"{prefix}.conv.{i}.weight"] = conv(64, 64)
            out[f"{prefix}.conv.{i}.bias"] = torch.zeros(64)

    eye = torch.eye(64)
    out: dict[str, torch.Tensor] = {}
    d = "taesd_decoder"
    out[f"{d}.1.weight"], out[f"{d}.1.bias"] = conv(64, latent_channels, w_in), b_in
    for i in (3, 4, 5, 8, 9, 10, 13, 14, 15, 18):
        block(f"{d}.{i}", out)
    for i in (7, 12, 17):  # after each nearest-neighbour upsampling: copy
        out[f"{d}.{i}.weight"] = conv(64, 64, eye)
    out[f"{d}.19.weight"], out[f"{d}.19.bias"] = conv(3, 64, w_out), b_out
    e = "taesd_encoder"
    first = torch.zeros(64, 3)
    first[:3] = torch.eye(3)
    out[f"{e}.0.weight"], out[f"{e}.0.bias"] = conv(64, 3, first), torch.zeros(64)
    for i in (1, 3, 4, 5, 7, 8, 9, 11, 12, 13):
        block(f"{e}.{i}", out)
    mean2 = torch.zeros(64, 64, 3, 3)  # stride 2, padding 1: taps (1, 1), (1, 2), (2, 1), (2, 2) are a 2x2 mean
    for a in (1, 2):
        for b in (1, 2):
            mean2[:, :, a, b] = eye / 4
    for i in (2, 6, 10):
        out[f"{e}.{i}.weight"] = mean2.clone()
    centre = torch.zeros(latent_channels, 64)
    centre[:, :3] = enc_w
    out[f"{e}.14.weight"], out[f"{e}.14.bias"] = conv(latent_channels, 64, centre), enc_b
    return {k: v.contiguous() for k, v in out.items()}


def write_comfy_preview_vae(pipeline: str | Path, out_file: str | Path, count: int = 48, steps: int = 600,
                            seed: int = 3) -> Path:
    """The pipeline folder's (trained) VAE as a TAESD-layout file ComfyUI's VAE Loader takes (see above); written
    under a temporary name and renamed. Deterministic: fixed seeds, one thread."""
    from diffusers import AutoencoderKL
    from safetensors.torch import save_file

    out_file = Path(out_file)
    vae = AutoencoderKL.from_pretrained(Path(pipeline) / "vae", local_files_only=True, use_safetensors=True).eval()
    scale, shift = float(vae.config.scaling_factor), float(vae.config.shift_factor)
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    with _Threads(), torch.no_grad():
        x = torch.stack([shape_image(rng, 128) for _ in range(count)])
        normed = (vae.encode(x).latent_dist.mean - shift) * scale
        # the transformer's latents are not exact: fit on noisier ones too, with what the VAE draws for them
        normed = torch.cat([normed, normed + 0.3 * torch.randn(normed.shape, generator=gen)])
        drawn = vae.decode(normed / scale + shift).sample.clamp(-1, 1)
        cells = torch.nn.functional.avg_pool2d(drawn, 8)  # the colour each latent pixel stands for
        c = normed.shape[1]
        inputs = normed.permute(0, 2, 3, 1).reshape(-1, c)
        targets = (cells.permute(0, 2, 3, 1).reshape(-1, 3) + 1) / 2  # TAESD decodes to [0, 1]
        means = (torch.nn.functional.avg_pool2d(x, 8).permute(0, 2, 3, 1).reshape(-1, 3) + 1) / 2
        pixels = normed[:count].permute(0, 2, 3, 1).reshape(-1, c)
        solved = torch.linalg.lstsq(torch.cat([means[:len(pixels)], torch.ones(len(pixels), 1)], 1), pixels).solution
    torch.manual_seed(seed)
    hidden = torch.nn.Linear(c, 64)
    head = torch.nn.Linear(64, 3)
    opt = torch.optim.Adam([*hidden.parameters(), *head.parameters()], lr=1e-2)
    clamped = torch.tanh(inputs / 3) * 3  # the TAESD decoder's first layer
    with _Threads():
        for _ in range(steps):
            loss = (head(torch.relu(hidden(clamped))) - targets).pow(2).mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
    with torch.no_grad():
        state = _taesd_state(hidden.weight, hidden.bias, head.weight, head.bias, solved[:3].T, solved[3], c)
    state["vae_scale"], state["vae_shift"] = torch.tensor(scale), torch.tensor(shift)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_file.with_name(out_file.name + ".tmp")
    save_file({k: v.detach().clone().contiguous() for k, v in state.items()}, str(tmp),
              metadata={"lowvram_lora.fit_mse": f"{float(loss):.5f}"})
    tmp.replace(out_file)
    return out_file
