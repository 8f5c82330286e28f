"""``outer_on_host``: the large layers outside the blocks (a family's ``int8_extra_linears``) wait in host memory
between their runs (engine/offload/outer.py). Streamed on the CPU with the real hooks: the losses and LoRA gradients
equal the resident model's, each held layer is copied in once per forward and is back on its host buffer after it;
the planner takes their bytes off the weights and `auto` holds them only when its budget needs it."""
import copy

import pytest
import torch

from lowvram_lora.engine.errors import ConfigError
from lowvram_lora.engine.families import get_family
from lowvram_lora.engine.families.base import meta_model
from lowvram_lora.engine.offload import OffloadConfig, Workload, build_plan
from lowvram_lora.engine.offload.footprint import measure_footprint, outer_modules
from lowvram_lora.engine.offload.host import frozen_bytes
from lowvram_lora.engine.offload.plan import GB, make_plan
from lowvram_lora.engine.offload.streamer import InlineCopyEngine, apply_offload

from helpers import flow_steps, tiny_lora_model

FAMILY = get_family("flux2")


@pytest.mark.parametrize("act", [False, True])
def test_held_outer_layers_train_like_the_resident_model(act):
    ref, _ = tiny_lora_model("flux2", 2, 2)
    model = copy.deepcopy(ref)
    want, want_grads = flow_steps(ref, FAMILY, 4.0)
    held = outer_modules(model, FAMILY)
    assert [n for n, _ in held] == list(FAMILY.memory.int8_extra_linears)  # all four exist in the tiny model too
    fp = measure_footprint(model, FAMILY)
    assert fp.outer_bytes == sum(frozen_bytes(m) for _, m in held) > 0
    plan = build_plan(fp, Workload(1, 64, 9), (), 1, act, outer_on_host=True)
    handle = apply_offload(model, FAMILY, OffloadConfig(mode="stream"), torch.device("cpu"), plan=plan,
                           _engine_factory=InlineCopyEngine)
    try:
        hooks = [h for _, h in handle.outer.hooks]
        assert len(hooks) == len(held)
        got, grads = flow_steps(model, FAMILY, 4.0)
        assert [h.copies for h in hooks] == [2] * len(hooks)  # once per forward, never in the backward
        assert all(h.host.bound_to_host() for h in hooks)  # back on the host buffer after each run
    finally:
        handle.remove()
    assert got == pytest.approx(want, rel=1e-6)
    assert grads.keys() == want_grads.keys() and grads
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-5, atol=1e-7, msg=name)
    assert not any("_lowvram_hook_registry" in vars(m) for _, m in held)  # remove() took the hooks out


def test_a_held_layer_whose_output_needs_a_gradient_is_refused():
    """A LoRA before a held layer would make the backward read its weights again: a named error, not a wrong
    gradient."""
    model, _ = tiny_lora_model("flux2", 1, 1)
    name, module = outer_modules(model, FAMILY)[-1]
    plan = build_plan(measure_footprint(model, FAMILY), Workload(1, 64, 9), (), 1, False, outer_on_host=True)
    handle = apply_offload(model, FAMILY, OffloadConfig(mode="stream"), torch.device("cpu"), plan=plan,
                           _engine_factory=InlineCopyEngine)
    try:
        x = torch.randn(1, module.in_features, requires_grad=True)
        with pytest.raises(ConfigError, match=f"{name}.*outer_on_host=False"):
            module(x)
    finally:
        handle.remove()


def test_the_planner_takes_the_held_bytes_off_and_auto_holds_them_only_when_needed():
    """Flux.2-dev at 1024² (meta model): holding the outer layers takes exactly their bytes off the weights and
    adds them to the pinned host memory and the bytes over the link; `auto` holds them at a budget that needs it and
    not at one that does not."""
    model = meta_model(FAMILY, FAMILY.load_config("flux2-dev"))
    model.requires_grad_(False)
    fp = measure_footprint(model, FAMILY, trainable_params=44_000_000)
    # Flux.2-dev's modulation (566 M) and text embedder (94 M) parameters (the meta model is fp32)
    elements = sum(p.numel() for _, m in outer_modules(model, FAMILY) for p in m.parameters())
    assert elements == pytest.approx(660e6, rel=0.01)
    assert fp.outer_bytes == pytest.approx(4 * elements, rel=1e-4)
    wl = Workload(1, FAMILY.memory.image_tokens(1024, 1024, "flux2-dev"), 512)
    kept = build_plan(fp, wl, (), 1, True, recompute_chunks=2)
    held = build_plan(fp, wl, (), 1, True, recompute_chunks=2, outer_on_host=True)
    assert kept.breakdown["weights"] - held.breakdown["weights"] == fp.outer_bytes
    assert held.pinned_host_bytes - kept.pinned_host_bytes == fp.outer_bytes
    assert held.streamed_bytes_per_step - kept.streamed_bytes_per_step == fp.outer_bytes
    assert "of layers outside the blocks on the host" in held.describe()
    assert held.summary()["outer_on_host"] and not kept.summary()["outer_on_host"]
    cfg = OffloadConfig(mode="auto")
    roomy = make_plan(fp, wl, cfg, int(40 * GB), compiled=True)
    assert not roomy.outer_on_host
    tight = int((held.predicted_peak_bytes + 0.55 * GB))  # fits only with the outer layers held (and as chosen)
    plan = make_plan(fp, wl, cfg, tight, compiled=True)
    assert plan.outer_on_host and plan.predicted_peak_bytes + 0.5 * GB <= tight
    with pytest.raises(ConfigError, match="outer_on_host"):
        OffloadConfig(mode="resident", outer_on_host=True)


@pytest.mark.gpu
def test_held_outer_layers_on_cuda_train_like_the_resident_model():
    """The real CUDA path (pinned host buffers, copies on the compute stream): losses and LoRA gradients equal the
    model resident on the GPU (rtol 1e-4, fp32), and between forwards no held tensor is on the GPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    device = torch.device("cuda")
    ref, _ = tiny_lora_model("flux2", 2, 2)
    model = copy.deepcopy(ref)
    ref.to(device)

    want, want_grads = flow_steps(ref, FAMILY, 4.0, device)
    plan = build_plan(measure_footprint(model, FAMILY), Workload(1, 64, 9), (), 1, True, outer_on_host=True)
    handle = apply_offload(model, FAMILY, OffloadConfig(mode="stream"), device, plan=plan)
    try:
        got, grads = flow_steps(model, FAMILY, 4.0, device)
        hooks = [h for _, h in handle.outer.hooks]
        assert all(h.host.pinned and h.host.bound_to_host() and h.copies == 2 for h in hooks)
    finally:
        handle.remove()
    assert got == pytest.approx(want, rel=1e-4)
    for name, g in want_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)
