"""The planner's per-token modulation term for LTX-2 image-to-video (``Ltx2Memory.token_modulation``,
engine/offload/plan.py ``token_modulation_bytes``) against a measured training forward + backward of the tiny model.

The measurement is independent of the declaration: every storage the ops allocate is tracked while it lives (a
``TorchDispatchMode``; storages die through ``weakref.finalize``), and the step's peak of live bytes is taken for the
same clip once as text-to-video (one timestep per sample) and once as image-to-video (per-token timestep, frame 0 at
0). Everything else is the same shape, so the difference of the two peaks is what the per-token timestep adds at the
step's peak: the planner's extra term must equal it. Tolerance: 2% of the term (other tensors of the I2V run that differ
in size: the (B, N) fp32 timestep and its sinusoidal projection, (B, N, 256) fp32, are transients of the time
embedding, gone at the backward's peak)."""
import pytest
import torch

from lowvram_lora.engine.families import meta_model, predict_velocity  # noqa: F401 - meta_model: the planner's path
from lowvram_lora.engine.families.ltx2 import FAMILY
from lowvram_lora.engine.testing import LiveBytes
from lowvram_lora.engine.families.ltx2.i2v import example_first_frame
from lowvram_lora.engine.families.ltx2.text import PROMPT_KEY
from lowvram_lora.engine.offload.block_checkpoint import checkpoint
from lowvram_lora.engine.offload.footprint import measure_footprint, per_token_timestep
from lowvram_lora.engine.offload.plan import Workload, token_modulation_bytes

TINY, TINY_I2V = FAMILY.tiny_variant, "ltx2-tiny-i2v"


def measured_peak(model, latents, embeds, sigma) -> int:
    with LiveBytes() as mode:
        pred = predict_velocity(FAMILY, model, latents, embeds, sigma, 1.0)
        pred.float().square().mean().backward()
        del pred
    return mode.peak


def test_the_planners_modulation_term_is_the_measured_growth():
    """Tiny model in bf16, every block checkpointed as training runs it (the engine's block checkpoint), a
    trainable query Linear in each block (LoRA's place: the blocks' activations then need grad), 8 x 24 x 24 latents
    (4,608 video tokens, so the modulation dominates the other differences): peak(I2V) - peak(T2V) equals the
    planner's ``token_modulation_bytes`` within 2%."""
    torch.manual_seed(0)
    config = FAMILY.load_config(TINY)
    model = FAMILY.transformer_class().from_config(config).to(torch.bfloat16)
    model.requires_grad_(False)
    for block in model.transformer_blocks:
        block.attn1.to_q.weight.requires_grad_(True)
    model.enable_gradient_checkpointing(gradient_checkpointing_func=checkpoint)
    model.train()

    g = torch.Generator().manual_seed(1)
    shape = (int(config["in_channels"]), 8, 24, 24)  # (C, F', h, w): 65 frames at 768x768
    latents = torch.randn((1, *shape), generator=g).to(torch.bfloat16)
    width = int(config["cross_attention_dim"]) + int(config["audio_cross_attention_dim"])
    text = {PROMPT_KEY: torch.randn(1, 16, width, generator=g).to(torch.bfloat16)}
    held = {k: v[None].to(torch.bfloat16) for k, v in example_first_frame(config, shape, g).items()}
    sigma = torch.tensor([0.7])

    t2v = measured_peak(model, latents, text, sigma)
    i2v = measured_peak(model, latents, {**text, **held}, sigma)

    assert not per_token_timestep(FAMILY, TINY) and per_token_timestep(FAMILY, TINY_I2V)
    fp = measure_footprint(model, FAMILY)
    fp.act_bytes_per_elem = 2
    tokens = shape[1] * shape[2] * shape[3]
    wl = Workload(1, tokens, 16, timestep_tokens=tokens)
    planned, _ = token_modulation_bytes(fp, wl, 1, 0)
    row = tokens * fp.hidden_size * 2
    assert planned == (9 + 12) * row  # 2.3's layout: 9 modulation rows held, 9 + 3 in the running block
    assert i2v - t2v == pytest.approx(planned, rel=0.02), (t2v, i2v, (i2v - t2v) / row)
    assert token_modulation_bytes(fp, Workload(1, tokens, 16), 1, 0) == (0, 0)  # text-to-video: nothing


def test_activation_offload_keeps_the_shared_modulation_on_the_device():
    """With activation offload the per-token modulation every block reads stays where the forward holds it
    (engine/offload/activations.py ``_shared``): no block's backward brings a copy of it back (at 960x544x89 that
    would be 0.45 GB of host RAM and of link traffic per offloaded block), only the first block copies it out once,
    and the LoRA gradients equal those of torch's checkpoint (fp32, 1e-5)."""
    from lowvram_lora.engine.offload.activations import ActivationOffloader
    from lowvram_lora.engine.offload.footprint import named_blocks

    torch.manual_seed(0)
    config = FAMILY.load_config(TINY)
    model = FAMILY.transformer_class().from_config(config)
    model.requires_grad_(False)
    for block in model.transformer_blocks:
        block.attn1.to_q.weight.requires_grad_(True)
    model.enable_gradient_checkpointing()
    model.train()
    g = torch.Generator().manual_seed(2)
    shape = (int(config["in_channels"]), 3, 8, 8)
    width = int(config["cross_attention_dim"]) + int(config["audio_cross_attention_dim"])
    embeds = {PROMPT_KEY: torch.randn(1, 16, width, generator=g),
              **{k: v[None] for k, v in example_first_frame(config, shape, g).items()}}
    latents, sigma = torch.randn((1, *shape), generator=g), torch.tensor([0.6])

    def grads():
        for p in model.parameters():
            p.grad = None
        predict_velocity(FAMILY, model, latents, embeds, sigma, 1.0).square().mean().backward()
        return [b.attn1.to_q.weight.grad.clone() for b in model.transformer_blocks]

    reference = grads()
    tokens = shape[1] * shape[2] * shape[3]
    off = ActivationOffloader(model, named_blocks(model, FAMILY), torch.device("cpu"), Workload(1, tokens, 16),
                              FAMILY.memory.hidden_size(config), inline=True)
    try:
        offloaded = grads()
    finally:
        off.remove()
    for a, b in zip(offloaded, reference):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    temb = tokens * 9 * FAMILY.memory.hidden_size(config) * 4  # fp32
    assert off.bytes_in < temb  # the token states come back, the modulation never
    assert temb <= off.bytes_out - off.bytes_in < 2 * temb  # one copy out, from the first block


def test_the_workload_takes_image_to_video_from_the_cache():
    """The checkpoint is identified as the text-to-video variant (I2V is never told by shape); a cache built for the
    I2V twin makes the run's workload count per-token timesteps on all its video tokens, a T2V cache none."""
    from types import SimpleNamespace

    from lowvram_lora.engine.offload.footprint import workload_for

    item = SimpleNamespace(bucket=(64, 64), frames=list(range(9)), control_sizes=[])
    i2v = workload_for(SimpleNamespace(items=[item], variant=TINY_I2V), FAMILY, TINY, 1)
    t2v = workload_for(SimpleNamespace(items=[item], variant=TINY), FAMILY, TINY, 1)
    assert i2v.timestep_tokens == i2v.image_tokens == 2 * 2 * 2 and t2v.timestep_tokens == 0
