"""Per-prompt sample settings in sd-scripts' / musubi's per-line syntax: parsed from their own examples, named errors
for malformed lines, and each prompt sampled with its own settings."""
import pytest
import torch

from lowvram_lora.engine.sampling.prompt_lines import PromptLine, PromptLineError, is_comment, parse_prompt_line

# musubi-tuner's docs/sampling_during_training.md, verbatim.
MUSUBI = """# prompt 1: for generating a cat video
A cat walks on the grass, realistic style. --w 640 --h 480 --f 25 --d 1 --s 20

# prompt 2: for generating a dog image
A dog runs on the beach, realistic style. --w 960 --h 544 --f 1 --d 2 --s 20"""
# sd-scripts' docs (train_network README), a line with a negative prompt and a CFG scale.
SD_SCRIPTS = ("masterpiece, best quality, (1girl), in white shirts, upper body, looking at viewer, simple background "
              "--n low quality, worst quality, bad anatomy,bad composition, poor, low effort --w 768 --h 768 --d 1 "
              "--l 7.5 --s 28")


def test_musubis_and_sd_scripts_examples_parse_as_their_docs_define():
    lines = [parse_prompt_line(l) for l in MUSUBI.splitlines() if l.strip() and not is_comment(l)]
    assert lines == [
        PromptLine("A cat walks on the grass, realistic style.", width=640, height=480, frames=25, seed=1, steps=20),
        PromptLine("A dog runs on the beach, realistic style.", width=960, height=544, frames=1, seed=2, steps=20)]
    line = parse_prompt_line(SD_SCRIPTS)
    assert line.prompt.endswith("simple background") and line.negative == (
        "low quality, worst quality, bad anatomy,bad composition, poor, low effort")
    assert (line.width, line.height, line.seed, line.cfg_scale, line.steps, line.guidance) == (768, 768, 1, 7.5, 28,
                                                                                              None)
    assert parse_prompt_line("a cat --g 3.5 --W 512").settings() == {"guidance": 3.5, "width": 512}
    assert parse_prompt_line("a cat").settings() == {}


@pytest.mark.parametrize("line, match", [
    ("a cat --w big", r"--w 'big' is not a whole number"),
    ("a cat --x 3", r"'--x' is not an option; the options are --w \(width\)"),
    ("a cat --w 500", r"--w 500 must be >= 64 and a multiple of 16"),
    ("a cat --s 0", r"--s 0 must be between 1 and 1000"),
    ("a cat --f 0", r"--f 0 must be at least 1"),
    ("a cat --g nan", r"--g 'nan' is not a number"),
    ("a cat --l", r"--l has no value"),
    ("a cat --d 1 --d 2", r"gives --d twice"),
    ("--w 512 a cat", r"starts with an option"),
    ("a cat --g 1.2.3", r"--g '1.2.3' is not a number"),
])
def test_malformed_lines_are_named(line, match):
    with pytest.raises(PromptLineError, match=match):
        parse_prompt_line(line)


def test_each_prompt_is_sampled_with_its_lines_settings(tiny_pipeline, tmp_path):
    """A cache built from option lines keeps each prompt's settings; the sampler draws prompt 2 at its own size and
    seed, equal to sampling it alone with those settings; a malformed line stops the build with its name."""
    from lowvram_lora.engine.caching import build_dataset_cache, open_dataset_cache
    from lowvram_lora.engine.config import DataConfig, ModelConfig
    from lowvram_lora.engine.families import get_family
    from lowvram_lora.engine.models import load_transformer
    from lowvram_lora.engine.sampling import SamplingConfig, Sampler
    from lowvram_lora.engine.sampling.denoise import sample_latents
    from lowvram_lora.engine.testing import make_tiny_dataset
    from lowvram_lora.engine.callbacks import TrainingCallback

    data = make_tiny_dataset(tmp_path / "data", count=1)
    mc, dc = ModelConfig(transformer_path=str(tiny_pipeline)), DataConfig(path=str(data), resolution=128,
                                                                        bucket_step=32)
    with pytest.raises(PromptLineError, match="'--q' is not an option"):
        build_dataset_cache(mc, dc, tmp_path / "cache", sample_prompts=["a red circle --q 1"])
    cache = build_dataset_cache(mc, dc, tmp_path / "cache",
                                sample_prompts=["# a comment", "a red circle", "a blue square --w 96 --h 64 --d 7 --s 3"])
    cache = open_dataset_cache(cache.manifest_path)
    assert [p for p, _ in cache.sample_prompts] == ["a red circle", "a blue square"]
    assert cache.sample_settings == [{}, {"width": 96, "height": 64, "seed": 7, "steps": 3}]
    model, family, _, variant = load_transformer(tiny_pipeline, dtype=torch.float32)
    sampler = Sampler(SamplingConfig(every=1, steps=2, resolution=64, seed=1, guidance=2.0), cache, family, model,
                      torch.device("cpu"), torch.float32, None, TrainingCallback())
    latents = sampler._sample_groups(None, None)
    alone = sample_latents(model, family, cache.load_text(cache.sample_prompts[1][1]), 96, 64, 3, 7, 2.0,
                           torch.device("cpu"), torch.float32, rule=sampler.rule)
    assert latents[1].shape == alone.shape and torch.allclose(latents[1], alone, atol=1e-5)
    first = sample_latents(model, family, cache.load_text(cache.sample_prompts[0][1]), 64, 64, 2, 1, 2.0,
                           torch.device("cpu"), torch.float32, rule=sampler.rule)
    assert torch.allclose(latents[0], first, atol=1e-5)


def test_own_negatives_replace_the_shared_empty_prompt_per_line():
    from types import SimpleNamespace

    from lowvram_lora.engine.caching.cache import _own_negatives
    from lowvram_lora.engine.caching.items import SampleItems, text_item
    from lowvram_lora.engine.caching.keys import CacheKeys

    keys = CacheKeys("t", "v", 77)
    specs = (SimpleNamespace(negative_template=None),)
    models = SimpleNamespace(specs=specs, family=SimpleNamespace(display_name="X"), variant="x")
    lines = [parse_prompt_line("a cat --n blurry"), parse_prompt_line("a dog"), parse_prompt_line("a cow --n blurry")]
    empty = text_item("", "empty-key")
    samples = SampleItems([text_item(l.prompt, keys.caption(l.prompt)) for l in lines], shared_negative=empty)
    made = _own_negatives(models, keys, lines, samples, SimpleNamespace(log=print))
    assert [m.caption for m in made] == ["blurry"]  # one entry for the two lines that share it
    assert [n.text_key for n in samples.negatives] == [made[0].text_key, "empty-key", made[0].text_key]
    said = []
    no_cfg = SampleItems(samples.prompts)
    assert _own_negatives(models, keys, lines, no_cfg, SimpleNamespace(log=said.append)) == []
    assert "--n on a sample prompt line is ignored" in said[0]
