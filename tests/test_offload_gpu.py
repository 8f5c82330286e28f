"""Block streaming on a real GPU: streamed training matches resident training.

A tiny and a mid-size Flux.1 (the dev layout with 4 double + 8 single blocks at width
1536) with random weights; the same LoRA init and data. Checked: LoRA gradients after
accumulated micro-batches (two buckets, an eval forward in between) for several plans,
whole train_lora runs (loss curves, final LoRA weights), memory order and allocator
hygiene. On the GPU machine::

    source bench/gpu_env.sh && python3 -m pytest -m gpu -s tests/test_offload_gpu.py
"""
import copy
import sys
from pathlib import Path

import pytest
import torch

from lowvram_lora.engine.config import LoraSettings, ModelConfig, TrainConfig
from lowvram_lora.engine.families import get_family
from lowvram_lora.engine.offload import OffloadConfig, Workload, build_plan
from lowvram_lora.engine.offload.footprint import measure_footprint
from lowvram_lora.engine.offload.streamer import apply_offload
from lowvram_lora.engine.train import train_lora
from lowvram_lora.engine.train.lora_attach import attach_lora, detach_lora
from lowvram_lora.engine.attention import training_attention

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

FAMILY = get_family("flux1")
DEV = torch.device("cuda")
SIZES = {  # variant, overrides, (latent h, w) per micro-batch, text tokens
    "tiny": ("flux1-tiny", {"num_layers": 2, "num_single_layers": 3}, [(16, 16), (12, 16)], 32),
    "mid": ("flux1-dev", {"num_layers": 4, "num_single_layers": 8, "num_attention_heads": 12},
            [(64, 64), (48, 64)], 128),
}


def build(size, seed=0):
    variant, overrides, _, _ = SIZES[size]
    cfg = dict(FAMILY.load_config(variant), **overrides)
    with torch.device("meta"):
        model = FAMILY.transformer_class().from_config(cfg)
    torch.nn.Module.to(model, dtype=torch.bfloat16)
    model.to_empty(device=DEV)
    g = torch.Generator(device=DEV).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and "norm" in name and name.endswith(".weight"):
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    model.requires_grad_(False)
    return model, cfg


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


def micro_batches(size, cfg):
    _, _, shapes, text = SIZES[size]
    g = torch.Generator().manual_seed(5)
    out = []
    for h, w in shapes:
        lat = torch.randn(1, cfg["in_channels"] // 4, h, w, generator=g)
        emb = {"prompt_embeds": torch.randn(1, text, cfg["joint_attention_dim"], generator=g),
               "pooled_prompt_embeds": torch.randn(1, cfg["pooled_projection_dim"], generator=g)}
        target = torch.randn(1, (h // 2) * (w // 2), cfg["in_channels"], generator=g)
        out.append((lat, emb, target))
    return out


def lora_grads(base, size, cfg, plan_spec):
    """LoRA gradients after [train mb0, eval mb0, train mb1] under bf16 autocast; plan_spec None = resident."""
    model = copy.deepcopy(base)
    model.enable_gradient_checkpointing()
    attach_lora(model, FAMILY, LoraSettings(rank=8, alpha=8), seed=0)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    handle = None
    if plan_spec is not None:
        resident, k, act = plan_spec
        mbs = micro_batches(size, cfg)
        tokens = max(l.shape[2] * l.shape[3] // 4 for l, _, _ in mbs)
        plan = build_plan(measure_footprint(model, FAMILY), Workload(1, tokens, SIZES[size][3]), resident, k, act)
        handle = apply_offload(model, FAMILY, OffloadConfig(mode="stream"), DEV, plan=plan)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    model.train()
    losses = []
    with training_attention(DEV), torch.autocast("cuda", dtype=torch.bfloat16):
        for i, (lat, emb, target) in enumerate(micro_batches(size, cfg)):
            inp = FAMILY.model_inputs(model, lat.to(DEV, torch.bfloat16),
                                      {k: v.to(DEV, torch.bfloat16) for k, v in emb.items()},
                                      torch.tensor([0.5], device=DEV), 1.0)
            pred = model(**inp)[0]
            loss = torch.nn.functional.mse_loss(pred.float(), target.to(DEV))
            loss.backward()
            losses.append(loss.item())
            if i == 0:
                with torch.no_grad():
                    model(**inp)  # an eval forward between micro-batches: the scheduler must follow
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated()
    grads = {n: p.grad.detach().float().cpu() for n, p in model.named_parameters() if p.requires_grad}
    stats = handle.stats() if handle else {}
    if handle:
        handle.remove()
    detach_lora(model)
    del model
    torch.cuda.empty_cache()
    return grads, losses, peak, stats


@pytest.fixture(scope="module", params=["tiny", "mid"])
def base(request):
    model, cfg = build(request.param)
    ref = lora_grads(model, request.param, cfg, None)
    noise = lora_grads(model, request.param, cfg, None)
    yield request.param, model, cfg, ref, noise
    del model
    torch.cuda.empty_cache()


def _flat(grads):
    return torch.cat([v.flatten() for _, v in sorted(grads.items())])


@pytest.mark.parametrize("plan_spec", [((), 1, False), ((), 2, False), ((1, 3), 3, False), ((), 2, True)],
                         ids=["k1", "k2", "k3-2resident", "k2-actoffload"])
def test_streamed_gradients_match_resident(base, plan_spec):
    size, model, cfg, (g_ref, l_ref, peak_ref, _), (g_noise, _, _, _) = base
    grads, losses, peak, stats = lora_grads(model, size, cfg, plan_spec)
    err, noise = rel(_flat(grads), _flat(g_ref)), rel(_flat(g_noise), _flat(g_ref))
    worst = max(rel(grads[k], g_ref[k]) for k in g_ref)
    print(f"\n[{size} {plan_spec}] grad rel err {err:.2e} (resident vs resident {noise:.2e}), worst tensor "
          f"{worst:.2e}; losses {losses} vs {l_ref}; peak {peak / 1e9:.3f} GB vs resident {peak_ref / 1e9:.3f} GB; "
          f"stats {stats}")
    assert err <= max(1e-2, 3 * noise)
    assert losses == pytest.approx(l_ref, rel=1e-2)
    # The no-grad forward between micro-batches tells the scheduler it has no backward (StartPass): it follows the
    # forward-only cycle, so neither it nor the training forwards around it miss a prefetch.
    assert stats["loads"] > 0 and stats["resyncs"] == 0 and stats["sync_loads"] == 0
    if size == "mid":
        assert peak < peak_ref  # streaming saves memory


def test_train_lora_streamed_matches_resident(tmp_path):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
    from train_bench import write_synthetic_cache

    model, cfg = build("mid")
    dataset = write_synthetic_cache(tmp_path, FAMILY, "flux1-dev", cfg, 512, 2, 0)
    lora, steps = LoraSettings(rank=16, alpha=16), 4

    def run(offload):
        logs = []

        class CB:
            def on_progress(self, *a): pass
            def on_step(self, info): pass
            def log(self, m): logs.append(m)
            def should_stop(self): return False

        torch.cuda.empty_cache()
        r = train_lora(ModelConfig(dtype="bf16", family="flux1"), dataset, lora,
                       TrainConfig(steps=steps, learning_rate=1e-3, device="cuda"), CB(),
                       preloaded=(model, FAMILY, "flux1-dev"), offload=offload)
        resv = torch.cuda.max_memory_reserved() / 1e9
        return r, logs, resv

    ref, _, _ = run(None)
    ref2, _, _ = run(None)
    # auto at 1.5 GB: below the resident plan's 1.13 GB (the modulation window holds 0.37 GB of its weights on the
    # host) + 0.5 GB headroom, so it streams (and holds the allocator
    # to the budget plus what this process held before)
    for offload in (OffloadConfig(mode="stream", prefetch_depth=2), OffloadConfig(mode="auto", vram_budget_gb=1.5),
                    OffloadConfig(mode="stream", prefetch_depth=1, activation_offload=True)):
        r, logs, resv = run(offload)
        keys = sorted(ref.state_dict)  # all LoRA weights as one vector: a single tensor's early AdamW steps are sign-noisy
        noise = rel(_flat({k: ref2.state_dict[k] for k in keys}), _flat({k: ref.state_dict[k] for k in keys}))
        err = rel(_flat({k: r.state_dict[k] for k in keys}), _flat({k: ref.state_dict[k] for k in keys}))
        print(f"\n[train_lora {offload.mode} k={offload.prefetch_depth} act={offload.activation_offload}] "
              f"losses {[round(x, 5) for x in r.loss_history]} vs resident {[round(x, 5) for x in ref.loss_history]}; "
              f"LoRA weights rel err {err:.2e} (resident twice {noise:.2e}); peak {r.peak_vram_gb:.3f} GB "
              f"(resident {ref.peak_vram_gb:.3f}), reserved {resv:.3f} GB\n" + "\n".join(logs))
        assert r.settings["offload_plan"]["mode"] == "stream"
        assert r.loss_history == pytest.approx(ref.loss_history, rel=2e-2)
        assert err <= max(2e-2, 3 * noise)
        assert r.peak_vram_gb < ref.peak_vram_gb
        assert any("predicted peak" in m for m in logs) and any("measured" in m for m in logs)
    # the model is back as it was: every block's weights in pinned host memory or where they started
    assert all(p.device.type in ("cpu", "cuda") for p in model.parameters())


def test_a_registered_buffer_is_page_locked_and_copies_exactly():
    """engine/offload/host._register, in one thread and in several: the buffer is pinned as torch sees it
    (``is_pinned``), and bytes written after registering reach the GPU and come back equal. A guard against a
    registration that no longer pins or corrupts; the speed of the fault-in is bench/bench_pin.py's, and its order
    (pages touched before the driver locks them) tests/test_host_register.py's."""
    from lowvram_lora.engine.offload.host import _register, _unregister

    threads = torch.get_num_threads()
    for n in (1, max(2, threads)):
        torch.set_num_threads(n)
        try:
            t = torch.empty(64 << 20, dtype=torch.uint8)
            assert _register(t) and t.is_pinned()
            t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(n)))
            back = t.to(DEV, non_blocking=True).cpu()
            assert torch.equal(back, t)
            _unregister(t)
            assert not t.is_pinned()
        finally:
            torch.set_num_threads(threads)


def test_a_pinned_buffer_takes_its_size_where_torch_pin_memory_rounds_up():
    """PinnedBuffer (AdamW's moments on the host, a resume save's staging) adds its own bytes to the process's
    resident memory; torch.empty(pin_memory=True), the reference, adds the next power of two (bench/bench_pin.py)."""
    from lowvram_lora.engine.offload.host import PinnedBuffer
    from lowvram_lora.engine.offload.hostmem import process_memory

    n = 340_000_000  # bytes: 0.34 GB, rounded by torch to 2**29 (0.537 GB)
    torch._C._host_emptyCache()  # no free cached pinned block left by another test may serve the reference
    before = process_memory()
    ours = PinnedBuffer(n // 4, torch.float32)
    added = process_memory().rss - before.rss
    assert ours.pinned and ours.tensor.is_pinned() and ours.tensor.numel() == n // 4
    assert abs(added - n) < 0.02 * n, added
    before = process_memory()
    reference = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    try:
        reference_added = process_memory().rss - before.rss
        assert reference_added > 1.4 * n, reference_added  # torch's rounding, which ours avoids
        ours.tensor.copy_(torch.arange(n // 4, dtype=torch.float32))
        assert torch.equal(ours.tensor.to(DEV, non_blocking=True).cpu(), ours.tensor)
    finally:
        del reference
        torch._C._host_emptyCache()
