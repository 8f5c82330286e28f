"""Samples during training (engine/sampling.py): our Euler sampler against diffusers' own Flux pipeline,
determinism, the grid per checkpoint, and that the images change once the LoRA has trained. CPU, tiny model."""
import pytest
import torch

from lowvram_lora.engine.caching import build_dataset_cache
from lowvram_lora.engine.config import DataConfig, LoraSettings, ModelConfig, TrainConfig
from lowvram_lora.engine.errors import ConfigError
from lowvram_lora.engine.families import get_family
from lowvram_lora.engine.models import load_transformer
from lowvram_lora.engine.sampling import SamplingConfig, sample_latents
from lowvram_lora.engine.sampling.grid import title_height
from lowvram_lora.engine.testing import make_tiny_dataset
from lowvram_lora.engine.train import train_lora

from helpers import LogRecorder

PROMPTS = ("a red square", "a blue circle on white")


@pytest.fixture(scope="module")
def prompt_cache(tiny_pipeline, tmp_path_factory):
    root = tmp_path_factory.mktemp("sampled")
    data = make_tiny_dataset(root / "data", count=2, sizes=((64, 64),))
    return build_dataset_cache(ModelConfig(transformer_path=str(tiny_pipeline)),
                               DataConfig(path=str(data), resolution=64, bucket_step=32), root / "cache",
                               sample_prompts=PROMPTS + ("a red square", ""))


def test_prompts_are_cached_like_captions(prompt_cache, tiny_pipeline, tmp_path):
    assert [p for p, _ in prompt_cache.sample_prompts] == list(PROMPTS)  # empty and repeated lines dropped
    from lowvram_lora.engine.caching.cache import open_dataset_cache

    again = open_dataset_cache(prompt_cache.manifest_path)
    assert again.sample_prompts == prompt_cache.sample_prompts and again.pipeline == prompt_cache.pipeline
    rebuilt = build_dataset_cache(ModelConfig(transformer_path=str(tiny_pipeline)),
                                  DataConfig(path=str(prompt_cache.items[0].image).rsplit("/", 1)[0], resolution=64,
                                             bucket_step=32), prompt_cache.cache_dir, sample_prompts=PROMPTS)
    assert rebuilt.stats["text_built"] == 0  # an unchanged prompt list costs nothing


def test_our_sampler_matches_diffusers_flux_pipeline(tiny_pipeline, prompt_cache):
    from diffusers import FluxPipeline

    model, family, _, _ = load_transformer(tiny_pipeline, dtype=torch.float32)
    embeds = prompt_cache.load_text(prompt_cache.sample_prompts[0][1])
    ours = sample_latents(model, family, embeds, 64, 64, 4, seed=7, guidance=3.5, device=torch.device("cpu"),
                          dtype=torch.float32)
    pipe = FluxPipeline.from_pretrained(tiny_pipeline, transformer=model, dtype=torch.float32,
                                        use_safetensors=True, local_files_only=True)
    noise = torch.randn((1, *family.latent_shape(model, 64, 64)), generator=torch.Generator().manual_seed(7))
    theirs = pipe(prompt_embeds=embeds["prompt_embeds"], pooled_prompt_embeds=embeds["pooled_prompt_embeds"],
                  height=64, width=64, num_inference_steps=4, guidance_scale=3.5, output_type="latent",
                  latents=family.pack_latents(noise)).images
    torch.testing.assert_close(family.pack_latents(ours), theirs, rtol=1e-4, atol=1e-5)


def test_sampling_during_training(tiny_pipeline, prompt_cache, tmp_path):
    grids = []

    class CB:
        def on_progress(self, *a): pass
        def on_step(self, info): self.last = info
        def log(self, m): pass
        def should_stop(self): return False
        def on_sample(self, step, grid, path): grids.append((step, grid.size, path))

    cb = CB()
    cfg = SamplingConfig(every=5, steps=3, resolution=64, seed=1)
    result = train_lora(ModelConfig(transformer_path=str(tiny_pipeline)), prompt_cache, LoraSettings(rank=4, alpha=4),
                        TrainConfig(steps=10, learning_rate=5e-3, seed=0), cb, sampling=cfg, sample_dir=tmp_path)
    assert [g[0] for g in grids] == [0, 5, 10]
    # checkpoints x prompts, under a title row as tall as the labels' font (a 36th of the grid's width) + 8
    top = title_height(3 * 256)
    assert top == 3 * 256 // 36 + 8 and grids[-1][1] == (3 * 256, top + 2 * 256)
    assert [p.rsplit("/", 1)[1] for p in result.sample_grids] == [
        "samples_step0000000.png", "samples_step0000005.png", "samples_step0000010.png"]
    assert 0 < cb.last.sample_seconds < result.sample_seconds  # the last checkpoint samples after its step
    # the same seed gives the same image; the trained LoRA changes it
    from PIL import Image

    last = Image.open(result.sample_grids[-1]).convert("RGB")
    image = 256 - top - 2  # above the prompt band, as tall as the title row: it grows with the grid's width
    first_col = last.crop((0, top, 256, top + image))
    again = Image.open(result.sample_grids[0]).convert("RGB").crop((0, title_height(256), 256, title_height(256) + image))
    trained_col = last.crop((512, top, 768, top + image))
    assert list(first_col.getdata()) == list(again.getdata())
    diff = sum(abs(a - b) for pa, pb in zip(first_col.getdata(), trained_col.getdata()) for a, b in zip(pa, pb))
    assert diff > 0


def test_bad_sampling_settings(prompt_cache, tiny_pipeline):
    for bad in (dict(every=-1), dict(every=5, resolution=100), dict(every=5, steps=0),
                dict(guidance=float("nan"))):
        with pytest.raises(ConfigError):
            SamplingConfig(**bad)
    no_prompts = type(prompt_cache)(**{**vars(prompt_cache), "sample_prompts": []})
    with pytest.raises(ConfigError, match="no sample prompts"):
        train_lora(ModelConfig(transformer_path=str(tiny_pipeline)), no_prompts, LoraSettings(rank=4),
                   TrainConfig(steps=2), sampling=SamplingConfig(every=1, resolution=64))


def test_our_sampler_matches_diffusers_flux2_pipeline(tiny_flux2):
    from diffusers import Flux2Pipeline

    pipe = Flux2Pipeline.from_pretrained(tiny_flux2, dtype=torch.float32, use_safetensors=True, local_files_only=True)
    family = get_family("flux2")
    cfg = pipe.transformer.config
    embeds = torch.randn(1, 16, cfg.joint_attention_dim, generator=torch.Generator().manual_seed(1))
    theirs = pipe(prompt_embeds=embeds, height=128, width=128, num_inference_steps=4, guidance_scale=4.0,
                  generator=torch.Generator().manual_seed(3), output_type="latent").images  # (1, tokens, C)
    ours = sample_latents(pipe.transformer, family, {"prompt_embeds": embeds}, 128, 128, 4, seed=3, guidance=4.0,
                          device=torch.device("cpu"), dtype=torch.float32)
    b, c, h, w = ours.shape
    torch.testing.assert_close(ours.reshape(b, c, h * w).permute(0, 2, 1), theirs, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sampling_during_a_compiled_streamed_run_on_gpu(tiny_pipeline, prompt_cache, tmp_path):
    """compile='auto' compiles long runs, and shipped workflows sample: the compiled blocks also serve the
    sampler's no-grad forwards (another graph), with blocks streaming."""
    from lowvram_lora.engine.offload import OffloadConfig

    cb = LogRecorder()
    result = train_lora(ModelConfig(transformer_path=str(tiny_pipeline)), prompt_cache,
                        LoraSettings(rank=4, alpha=4), TrainConfig(steps=4, learning_rate=5e-3, device="cuda"), cb,
                        offload=OffloadConfig(mode="stream", compile="blocks"),
                        sampling=SamplingConfig(every=2, steps=2, resolution=64, seed=1), sample_dir=tmp_path)
    assert len(result.sample_grids) == 3 and result.settings["compile"]["graphs"] > 0, cb.logs


def test_the_grid_labels_each_row_with_its_prompt():
    """Each cell carries its prompt on a dark band along its bottom edge (long prompts cut to the cell's width), and
    the band holds the text (light pixels: PIL's own font); the grid's size is unchanged."""
    from PIL import Image, ImageDraw

    from lowvram_lora.engine.sampling import PROMPT_BAND, _fit_text, grid_image

    cell = 64
    white = Image.new("RGB", (cell, cell), (255, 255, 255))
    prompts = ["ohwx, a red circle", "ohwx, a blue square on a very long and winding road"]
    grid = grid_image([("step 0", [white, white]), ("step 10", [white, white])], prompts, cell=cell)
    assert grid.size == (2 * cell, 18 + 2 * cell)
    for r in range(2):
        band = grid.crop((0, 18 + r * cell + cell - PROMPT_BAND, cell, 18 + (r + 1) * cell))
        pixels = list(band.getdata())
        dark = sum(1 for p in pixels if max(p) < 40)
        light = sum(1 for p in pixels if min(p) > 150)
        assert dark > len(pixels) // 2 and light > 10  # a dark band with text on it
        above = grid.crop((0, 18 + r * cell, cell, 18 + r * cell + cell - PROMPT_BAND))
        assert set(above.getdata()) == {(255, 255, 255)}  # the image itself is untouched above the band
    draw = ImageDraw.Draw(grid)
    cut = _fit_text(draw, prompts[1], cell - 8)
    assert cut.endswith("...") and draw.textlength(cut) <= cell - 8


def test_a_100_kb_prompt_is_labelled_in_a_moment():
    """Label fitting is linear in the prompt's length (issue 43: it re-measured the whole string once per character
    dropped, so a 5,000-character prompt took 54 s a label and a 100 KB one stalled training): a 100 KB prompt with
    newlines is cut to the same one-line label as its first words, well within a second."""
    import time

    from PIL import Image, ImageDraw

    from lowvram_lora.engine.sampling import _fit_text

    draw = ImageDraw.Draw(Image.new("RGB", (8, 8)))
    head = "ohwx, a red circle on a white background,\nsharp edges, "
    prompt = head + "soft light, " * (100_000 // 12)
    start = time.perf_counter()
    cut = _fit_text(draw, prompt, 248)
    seconds = time.perf_counter() - start
    assert seconds < 0.5, seconds
    assert cut.endswith("...") and "\n" not in cut and draw.textlength(cut) <= 248
    assert " ".join(prompt.split()).startswith(cut[:-3])
    # the longest prefix that fits: one more character would not
    flat = " ".join(prompt.split())
    assert draw.textlength(flat[:len(cut) - 3 + 1] + "...") > 248


def test_a_wide_grid_draws_its_labels_large_enough_to_read_in_the_node():
    """The editor shows the grid scaled to the node's width (~380 px): a 4-column grid of 256 px cells carries its
    labels in a font of a 36th of its width (28 px: ~10 px on screen), on a band that tall; the labels fit."""
    from PIL import Image, ImageDraw

    from lowvram_lora.engine.sampling.grid import GRID_WIDTH_PER_FONT_PX, _label_font, grid_image

    cell, cols = 256, 4
    white = Image.new("RGB", (cell, cell), (255, 255, 255))
    grid = grid_image([(f"step {i}", [white]) for i in range(cols)], ["ohwx, a red circle on a white background"],
                      cell=cell)
    font, size = _label_font(cell * cols)
    assert size == cell * cols // GRID_WIDTH_PER_FONT_PX == 28
    header = size + 8
    assert grid.size == (cols * cell, header + cell)
    band = grid.crop((0, header + cell - size - 8, cell, header + cell))
    text_rows = [y for y in range(band.height) if any(min(band.getpixel((x, y))) > 150 for x in range(cell))]
    assert len(text_rows) >= 0.5 * size  # letters about as tall as the font, not 11 px ones
    above = grid.crop((0, header, cell, header + cell - size - 8))
    assert set(above.getdata()) == {(255, 255, 255)}
    assert ImageDraw.Draw(grid).textlength("step 0", font=font) > 60
