"""Sample Prompt Conditioning: a cached sample prompt as ComfyUI's CONDITIONING (for KSampler after Load LoRA
Model), checked against the diffusers pipeline's own encoding of the prompt."""
from __future__ import annotations

import pytest
import torch

PROMPTS = ["ohwx, a red circle", "a blue square"]


@pytest.fixture(scope="module")
def cache(tiny_pipeline, tmp_path_factory):
    from lowvram_lora.engine.caching import build_dataset_cache
    from lowvram_lora.engine.config import DataConfig, ModelConfig
    from lowvram_lora.engine.testing import make_tiny_dataset

    root = tmp_path_factory.mktemp("cond")
    data = make_tiny_dataset(root / "data", count=1)
    return build_dataset_cache(ModelConfig(transformer_path=str(tiny_pipeline)),
                               DataConfig(path=str(data), resolution=128, bucket_step=32), root / "cache",
                               sample_prompts=PROMPTS)


def test_conditioning_is_the_pipelines_encoding_of_the_prompt(cache, tiny_pipeline):
    from diffusers import FluxPipeline

    from lowvram_lora.engine.families import default_max_sequence_length
    from lowvram_lora.engine.families.flux1 import FAMILY
    from lowvram_lora.nodes.prompt_conditioning import LowVRAMSamplePromptConditioning

    (out,) = LowVRAMSamplePromptConditioning.execute(cache, prompt=2).result
    [[cond, options]] = out
    pipe = FluxPipeline.from_pretrained(tiny_pipeline, local_files_only=True, use_safetensors=True,
                                        transformer=None, vae=None)
    with torch.no_grad():
        embeds, pooled, _ = pipe.encode_prompt(PROMPTS[1], None, max_sequence_length=default_max_sequence_length(
            FAMILY, FAMILY.tiny_variant))
    # ComfyUI's Flux: T5's states as the tensor, CLIP's pooled vector as pooled_output, the embedded guidance
    assert cond.shape == embeds.shape and options["pooled_output"].shape == pooled.shape
    torch.testing.assert_close(cond, embeds.float(), atol=2e-2, rtol=2e-2)  # the cache may hold bf16
    torch.testing.assert_close(options["pooled_output"], pooled.float(), atol=2e-2, rtol=2e-2)
    assert options["guidance"] == 3.5
    (first,) = LowVRAMSamplePromptConditioning.execute(cache, prompt=1).result
    assert not torch.allclose(first[0][0], cond)  # another line, another conditioning


def test_a_prompt_past_the_last_line_or_an_unknown_family_is_refused(cache, monkeypatch):
    from lowvram_lora.engine.errors import ConfigError
    from lowvram_lora.engine.families.flux1 import FAMILY
    from lowvram_lora.nodes.prompt_conditioning import prompt_conditioning

    with pytest.raises(ConfigError, match="has 2 sample prompt.*pick 1 to 2"):
        prompt_conditioning(cache, 3)
    import dataclasses

    specs = FAMILY.text_encoder_specs(cache.variant)  # a family whose encoders ComfyUI's slots are not known for
    monkeypatch.setattr(type(FAMILY), "text_encoder_specs",
                        lambda self, variant: tuple(dataclasses.replace(s, comfy_slot=None) for s in specs))
    with pytest.raises(ConfigError, match="CLIP Text Encode"):
        prompt_conditioning(cache, 1)
