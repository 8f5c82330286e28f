"""The step-time model's FLOPs per block (engine/offload/steptime.block_flops) against torch's own FLOP counter
(torch.utils.flop_counter.FlopCounterMode) over a real forward of every family's tiny transformer: each block's
Linear FLOPs must be what torch counts for its matmuls, exactly. This is what ``MemoryProfile.linear_tokens`` is for:
a dual-stream block's image and text Linears multiply different rows, and an AdaLN modulation Linear one row per
sample (counted as every token before, a Flux.1 double block came out at 2.9x its FLOPs and the model saw no copy
stall where the profile showed 79 ms: bench/NOTES.md, issue 26). Text of 32 real tokens (no padding: Lumina 2 and
Z-Image pack or pad the caption themselves; Z-Image pads to a multiple of 32)."""
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from lowvram_lora.engine.families import families, predict_velocity
from lowvram_lora.engine.offload.footprint import measure_footprint, named_blocks
from lowvram_lora.engine.offload.steptime import block_flops

from helpers import family_inputs

TEXT = 32


def assert_block_linear_flops(model, family, latents, embeds, sigma, image_tokens: int) -> None:
    """Each block's Linear FLOPs by ``block_flops`` (image, text, one row per sample, and the audio tokens the planner
    counts for the latents' frames: ``MemoryProfile.audio_tokens``) equal torch's count of the forward's matmuls."""
    with FlopCounterMode(display=False, depth=None) as counter:
        predict_velocity(family, model, latents, embeds, sigma, 1.0)
    counts = counter.get_flop_counts()
    audio = family.memory.audio_tokens(latents.shape[2] if latents.dim() == 5 else 1)
    ours = block_flops(measure_footprint(model, family), image_tokens + TEXT, 1, TEXT, audio_tokens=audio)
    root = type(model).__name__
    blocks = named_blocks(model, family)
    assert len(ours) == len(blocks) > 0
    for (name, _), (linear, _attention) in zip(blocks, ours):
        theirs = sum(v for op, v in counts.get(f"{root}.{name}", {}).items() if "mm" in str(op))
        assert theirs > 0 and linear == pytest.approx(theirs, rel=1e-9), name


@pytest.mark.parametrize("family_id", sorted(families()))
def test_block_linear_flops_equal_torchs_count(family_id):
    family = families()[family_id]
    torch.manual_seed(0)
    model = family.transformer_class().from_config(family.load_config(family.tiny_variant))
    model.eval().requires_grad_(False)
    latents, embeds, sigma = family_inputs(model, family, length=TEXT)
    embeds = {k: torch.ones_like(v) if k.endswith("_mask") else v for k, v in embeds.items()}
    assert_block_linear_flops(model, family, latents, embeds, sigma, family.memory.image_tokens(64, 64,
                                                                                              family.tiny_variant))


def test_ltx2_audio_stream_flops_at_a_clip():
    """LTX-2's audio stream on a clip: 17 frames at 64x64 are 3 x 2 x 2 = 12 video tokens and round(17 / 24 x 25) = 18
    audio tokens beside 32 text tokens, so a Linear counted on the wrong rows cannot match torch's count. The audio
    rows the planner counts (``audio_tokens``) are the ones the forward is fed."""
    from lowvram_lora.engine.families import get_family

    family = get_family("ltx2")
    torch.manual_seed(0)
    model = family.transformer_class().from_config(family.load_config(family.tiny_variant)).eval().requires_grad_(False)
    latents = torch.randn(1, *family.latent_shape(model, 64, 64, frames=17))
    embeds = {k: torch.randn(1, TEXT, w) for k, w in family.text_widths(dict(model.config)).items()}
    sigma = torch.tensor([0.4])
    fed = family.model_inputs(model, latents, embeds, sigma, 1.0)["audio_hidden_states"]
    assert fed.shape[1] == family.memory.audio_tokens(3) == 18
    assert_block_linear_flops(model, family, latents, embeds, sigma, image_tokens=12)


def test_flux1_double_block_counts_its_streams_and_modulation_apart():
    """At Flux.1-dev's size (meta model: no memory): a double block's 340 M weights are 113 M on the image tokens,
    113 M on the text tokens and 113 M of modulation on one row, so its FLOPs per token equal a single block's
    113 M of token Linears, not 2.4x them, as the copies do (bytes: 2.4x)."""
    from lowvram_lora.engine.families import get_family
    from lowvram_lora.engine.families.base import meta_model

    family = get_family("flux1")
    model = meta_model(family, family.load_config("flux1-dev")).requires_grad_(False)  # as loaded
    fp = measure_footprint(model, family)
    double, single = fp.block_token_params[0], fp.block_token_params[-1]
    assert double == {"image": 113_246_208, "text": 113_246_208, "vector": 113_246_208}
    assert single == {"all": 113_246_208, "vector": 28_311_552}
    flops = block_flops(fp, 4608, 1, 512)
    assert flops[0][0] == pytest.approx(flops[-1][0], rel=1e-3)  # same token FLOPs, double and single
