"""Flux.2's single blocks in token chunks on a real GPU. On the GPU machine::

    source bench/gpu_env.sh && python3 -m pytest -m gpu -s engine/families/flux2/test_single_chunks_gpu.py

1. The chunked model (fp32, CUDA attention and matmuls, eager and compiled blocks) gives diffusers' whole-block output
   and LoRA / DoRA gradients (relative error of the whole tensor: outputs 1e-4, gradients 1e-3; chunks change only the
   rows each matmul sees), with float and int8 slab Linears.
2. One single block's forward + backward at klein 9B's width (4096) over 4608 tokens, bf16, LoRA r16: the peak
   allocation chunked is printed beside the whole block's, in B*T*D units (the planner's
   ``chunked_activation_scale`` was derived on the CPU, bench/flux2_working_set.py: 24.1 / 42.3 = 0.57), and must
   be below 0.75 of it.
"""
import pytest
import torch

from lowvram_lora.engine.config import AdapterConfig, LoraSettings
from lowvram_lora.engine.families.flux2 import FAMILY
from lowvram_lora.engine.families.tiny import randomize_zero_inits
from lowvram_lora.engine.offload.recompute import install_chunked_recompute
from lowvram_lora.engine.train.lora_attach import attach_lora

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEV = torch.device("cuda")


def build(device, heads=4, num_double=1, num_single=2, dtype=torch.float32, form="float", adapter="lora", rank=4):
    """A Flux.2 at head dim 128 (width heads x 128, mlp_ratio 3), the adapter on the default targets with every weight
    random, gradient checkpointing on, on ``device``."""
    from lowvram_lora.engine.slab.int8_linear import Int8Linear
    from lowvram_lora.engine.slab.layout import block_linears

    cfg = {**FAMILY.load_config("flux2-tiny"), "num_attention_heads": heads, "attention_head_dim": 128,
           "axes_dims_rope": [32, 32, 32, 32], "num_layers": num_double, "num_single_layers": num_single}
    torch.manual_seed(0)
    model = FAMILY.transformer_class().from_config(cfg)
    randomize_zero_inits(model, 0)
    model.requires_grad_(False)
    if form == "int8":
        for name, linear in block_linears(model, FAMILY).items():
            parent, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent), child, Int8Linear.from_linear(linear))
    model.to(device=device, dtype=dtype)
    model.enable_gradient_checkpointing()
    params = attach_lora(model, FAMILY, LoraSettings(rank=rank, alpha=rank, adapter=AdapterConfig(type=adapter)), 0)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in params:
            p.add_((torch.randn(p.shape, generator=g) * 0.02).to(p.device, p.dtype))
    model.train()
    return model, params, cfg


def inputs(cfg, device, dtype, side=32, text=64):
    """A side x side target, one reference of the same size, ``text`` text tokens."""
    g = torch.Generator().manual_seed(1)
    latents = torch.randn(1, cfg["in_channels"], side, side, generator=g).to(device, dtype)
    embeds = {"prompt_embeds": torch.randn(1, text, cfg["joint_attention_dim"], generator=g).to(device, dtype),
              "control_latents_0": torch.randn(1, cfg["in_channels"], side, side, generator=g).to(device, dtype)}
    guided = type("M", (), {"config": type("C", (), {"guidance_embeds": True})()})()
    return FAMILY.model_inputs(guided, latents, embeds, torch.tensor([0.4], device=device), 1.0)


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def run(model, params, x):
    out = model(**x)[0]
    return out.detach(), torch.autograd.grad(out.square().mean(), params)


@pytest.mark.parametrize("form, adapter, compiled", [("float", "lora", False), ("float", "lora", True),
                                                     ("int8", "dora", False), ("int8", "lora", True)])
def test_chunked_equals_whole_on_cuda(form, adapter, compiled):
    from lowvram_lora.engine.train.compile import compile_blocks

    model, params, cfg = build(DEV, form=form, adapter=adapter)
    x = inputs(cfg, DEV, torch.float32)
    ref, ref_grads = run(model, params, x)
    undo = install_chunked_recompute(model, FAMILY, 4)
    handle = compile_blocks(model, FAMILY, 0.5) if compiled else None
    out, grads = run(model, params, x)
    if handle is not None:
        handle.remove()
    undo.remove()
    assert rel(out, ref) < 1e-4, rel(out, ref)
    errors = [rel(a, b) for a, b in zip(grads, ref_grads)]
    print(f"\n{form} {adapter} compiled={compiled}: output {rel(out, ref):.2e}, gradients worst {max(errors):.2e}")
    assert all(b.abs().max() > 0 for b in ref_grads)
    assert max(errors) < 1e-3


def block_peak(block, args, kwargs) -> int:
    """Peak bytes allocated by the block's forward with grad + backward, above what was allocated before."""
    def leaf(x):
        return x.detach().requires_grad_(True) if isinstance(x, torch.Tensor) and x.is_floating_point() \
            and x.dim() == 3 else x

    args, kwargs = [leaf(a) for a in args], {k: leaf(v) for k, v in kwargs.items()}
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = block(*args, **kwargs)
    out.backward(torch.ones_like(out))
    del out
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def test_chunked_single_block_working_set_on_cuda():
    model, _, cfg = build(DEV, heads=32, num_double=1, num_single=1, dtype=torch.bfloat16, rank=16)
    x = inputs(cfg, DEV, torch.bfloat16, side=64, text=512)  # 2 x 4096 image tokens + 512 text
    captured = {}
    handle = model.single_transformer_blocks[0].register_forward_pre_hook(
        lambda m, a, k: captured.update(args=a, kwargs=k), with_kwargs=True)
    with torch.no_grad():
        model(**x)
    handle.remove()
    block = model.single_transformer_blocks[0]
    tokens = captured["kwargs"]["hidden_states"].shape[1]
    unit = tokens * 4096 * 2
    whole = block_peak(block, captured["args"], captured["kwargs"])
    undo = install_chunked_recompute(model, FAMILY, 3)
    chunked = block_peak(block, captured["args"], captured["kwargs"])
    undo.remove()
    print(f"\nsingle block, {tokens} tokens at width 4096, bf16: whole {whole / unit:.2f} units, 3 chunks "
          f"{chunked / unit:.2f} units ({chunked / whole:.3f} of whole; CPU estimate 0.569)")
    assert chunked < 0.75 * whole
