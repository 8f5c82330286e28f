"""Every registered family, through the engine's shared machinery, on its tiny model.

Parametrized over the registry (``engine/families/<id>/``), so a new family folder is tested by these
without editing them:
- the folder is complete: its variants' configs, its tiny fixtures, its name map covering the model;
- an int8 slab built from its native single file holds the reference weights (each int8 row within half
  an int8 step of the source, other tensors exact) and its forward is within 2% of diffusers' model;
- block streaming with and without activation offload (the real hooks, with synchronous copies standing
  in for CUDA) gives the resident model's losses and LoRA gradients (rtol 1e-5);
- the planner's footprint from the file header equals the loaded model's.
"""
from __future__ import annotations

import copy

import pytest
import torch
from helpers import family_inputs, flow_steps

from lowvram_lora.engine.caching.encoders import encoder_kinds
from lowvram_lora.engine.config import LoraSettings
from lowvram_lora.engine.families import (families, family_fixtures, family_templates, get_family, meta_model,
                                          predict_velocity)

FAMILIES = sorted(families())


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_family_pipeline):
    """family id -> (pipeline folder, native single file), built once per family."""
    built = {}

    def get(family_id):
        if family_id not in built:
            family = get_family(family_id)
            root = tmp_path_factory.mktemp(family_id)
            pipe = tiny_family_pipeline(family_id)
            single = family_fixtures(family).write_single_file(pipe, root / f"{family_id}.safetensors")
            built[family_id] = (pipe, single)
        return built[family_id]
    return get


def test_the_registry_finds_every_family_folder():
    from pathlib import Path

    import lowvram_lora.engine.families as pkg
    from lowvram_lora.engine.families.registry import NOT_FAMILIES

    folders = {p.name for p in Path(pkg.__file__).parent.iterdir() if (p / "__init__.py").exists()}
    assert {f for f in folders if f not in NOT_FAMILIES} == {type(f).__module__.split(".")[-2] for f in families().values()}
    assert {"flux1", "flux2", "z_image", "lumina2"} <= set(families())


@pytest.mark.parametrize("family_id", FAMILIES)
def test_the_folder_is_complete(family_id):
    family = get_family(family_id)
    assert family.tiny_variant in family.variants
    for variant in family.variants:
        config = family.load_config(variant)
        assert family.variant_for_config(config) in family.variants
        specs = family.text_encoder_specs(variant)
        assert specs and all(s.kind in encoder_kinds() for s in specs)  # each kind has its handler file
        assert set(family.text_widths(config)) == {s.cache_key for s in specs}
    model = meta_model(family, family.load_config(family.tiny_variant))
    covered = {p.name for param in family.param_table(dict(model.config)) for p in param.parts}
    assert covered == set(model.state_dict())  # the native name map covers the model, nothing more
    names = dict(model.named_modules())
    assert all(t in names for t in family.lora.target_modules(model))
    assert family.memory.block_lists_of(model) and family_templates(family)


#: What each family's saved LoRA said in ``modelspec.architecture`` before LoraForm declared it (files.py's table):
#: the SAI names for Flux.1 dev and schnell, ``<family>/lora`` for everything else. Files keep saying the same.
ARCHITECTURES_BEFORE = {"flux1-dev": "flux-1-dev/lora", "flux1-schnell": "flux-1-schnell/lora"}


@pytest.mark.parametrize("family_id", FAMILIES)
def test_the_family_declares_its_specs(family_id):
    """Every family declares a MemoryProfile, a NoiseSchedule and a LoraForm (frozen); its LoRA targets sit in the
    block lists it streams, in execution order; the lists are the model's; its fixtures module is found by name."""
    import dataclasses

    from lowvram_lora.engine.families import LoraForm, MemoryProfile, NoiseSchedule, family_fixtures

    family = get_family(family_id)
    assert isinstance(family.memory, MemoryProfile) and isinstance(family.schedule, NoiseSchedule)
    assert isinstance(family.lora, LoraForm)
    with pytest.raises(dataclasses.FrozenInstanceError):
        family.memory.activation_scale = 2.0
    lists = family.memory.block_lists
    assert [name for name in lists if name in family.lora.targets] == list(family.lora.targets)
    model = meta_model(family, family.load_config(family.tiny_variant))
    assert all(isinstance(model.get_submodule(name), torch.nn.ModuleList) for name in lists)
    assert set(family.memory.block_list_tokens) | set(family.memory.dual_stream_lists) <= set(lists)
    assert callable(family_fixtures(family).build_tiny_pipeline)
    for variant in family.variants:
        assert family.lora.architecture_of(variant) == ARCHITECTURES_BEFORE.get(variant, f"{family_id}/lora")
        lo, hi = family.schedule.train_sigma_range(variant)
        assert 0.0 <= lo < hi <= 1.0


def test_a_spec_refuses_an_unknown_lora_form():
    from lowvram_lora.engine.families import LoraForm

    with pytest.raises(ValueError, match="native_fused"):
        LoraForm(targets={"blocks": ("attn.to_q",)}, architecture="x/lora", comfyui_form="kohya")


@pytest.mark.parametrize("family_id", FAMILIES)
def test_int8_slab_of_the_native_file_holds_the_reference(family_id, tiny, tmp_path):
    from lowvram_lora.engine.slab import build_slab, load_slab_transformer

    family = get_family(family_id)
    pipe, single = tiny(family_id)
    ref = family.transformer_class().from_pretrained(pipe / "transformer", use_safetensors=True,
                                                     torch_dtype=torch.float32, local_files_only=True)
    slab = build_slab(single, tmp_path, progress=False)
    model, slab_family, variant = load_slab_transformer(slab, torch.float32)
    assert slab_family is family and variant == family.tiny_variant
    latents, embeds, sigma = family_inputs(ref, family)
    with torch.no_grad():
        want = predict_velocity(family, ref, latents, embeds, sigma, 1.0)
        got = predict_velocity(family, model, latents, embeds, sigma, 1.0)
    assert ((got - want).norm() / want.norm()).item() < 0.02


def _lora_model(family, seed=0):
    from helpers import tiny_lora_transformer

    return tiny_lora_transformer(family.id, None, seed)[0]


@pytest.mark.parametrize("act", [False, True])
@pytest.mark.parametrize("family_id", FAMILIES)
def test_streamed_gradients_equal_resident(family_id, act):
    from lowvram_lora.engine.offload import OffloadConfig, Workload, build_plan
    from lowvram_lora.engine.offload.footprint import measure_footprint
    from lowvram_lora.engine.offload.streamer import InlineCopyEngine, apply_offload

    family = get_family(family_id)
    ref = _lora_model(family)
    model = copy.deepcopy(ref)
    want, _ = flow_steps(ref, family)
    plan = build_plan(measure_footprint(model, family), Workload(1, 64, 9), (), 1, act)
    handle = apply_offload(model, family, OffloadConfig(mode="stream"), torch.device("cpu"), plan=plan,
                           _engine_factory=InlineCopyEngine)
    from lowvram_lora.engine.offload.recompute import install_chunked_recompute

    recompute = install_chunked_recompute(model, family, 1)  # as training does: every block checkpointed
    try:
        got, _ = flow_steps(model, family)
        assert got == pytest.approx(want, rel=1e-6)
        g_ref = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
        g = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        assert g.keys() == g_ref.keys() and g
        for name in g_ref:
            # A parameter no output depends on (the last Qwen-Image block's text-stream output projection) has
            # no gradient resident and a zero one streamed: the same update.
            a, b = (t if t is not None else torch.zeros_like(dict(ref.named_parameters())[name]) for t in (g[name], g_ref[name]))
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7, msg=name)
        assert handle.stats()["loads"] >= len(plan.footprint.block_names)
    finally:
        recompute.remove()
        handle.remove()


@pytest.mark.parametrize("family_id", [f for f in FAMILIES if get_family(f).memory.chunked_recompute])
def test_token_chunked_recompute_gives_the_same_losses_and_gradients(family_id):
    """A family that declares token-chunked recompute: its token-wise parts in 3 checkpointed chunks give the
    whole-block losses and LoRA gradients (rtol 1e-5), and the chunks really run (the parts' forwards are
    replaced while installed)."""
    from lowvram_lora.engine.offload.recompute import install_chunked_recompute

    family = get_family(family_id)
    ref = _lora_model(family)
    model = copy.deepcopy(ref)
    want, _ = flow_steps(ref, family)
    recompute = install_chunked_recompute(model, family, 3)
    try:
        assert any("forward" in vars(m) for m in model.modules()), "install_chunked_recompute changed nothing"
        got, _ = flow_steps(model, family)
    finally:
        recompute.remove()
    assert got == pytest.approx(want, rel=1e-5)
    g_ref = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
    for name, p in model.named_parameters():
        if p.requires_grad and g_ref[name] is not None:
            torch.testing.assert_close(p.grad, g_ref[name], rtol=1e-5, atol=1e-7, msg=name)


@pytest.mark.parametrize("family_id", FAMILIES)
def test_training_checkpoints_every_block_with_the_same_result(family_id):
    """Block streaming brings a block's weights back for its backward through its recompute, so training runs
    every block of ``block_lists`` through the model's checkpoint function (``checkpoint_every_block``: diffusers'
    Lumina 2 leaves its refiners out). The losses and LoRA gradients equal the plain model's (rtol 1e-5)."""
    from torch.utils.checkpoint import checkpoint

    from lowvram_lora.engine.offload.footprint import named_blocks
    from lowvram_lora.engine.offload.recompute import install_chunked_recompute

    family = get_family(family_id)
    ref = _lora_model(family)
    ref.disable_gradient_checkpointing()
    model = copy.deepcopy(ref)
    want, _ = flow_steps(ref, family)
    seen = []
    model.enable_gradient_checkpointing(gradient_checkpointing_func=lambda block, *args: seen.append(id(block))
                                        or checkpoint(block, *args, use_reentrant=False))
    recompute = install_chunked_recompute(model, family, 1)
    try:
        got, _ = flow_steps(model, family)
    finally:
        recompute.remove()
    assert got == pytest.approx(want, rel=1e-6)
    for (name, p), (_, q) in zip(ref.named_parameters(), model.named_parameters()):
        if p.requires_grad:
            torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=name)
    assert {id(b) for _, b in named_blocks(model, family)} <= set(seen)


@pytest.mark.parametrize("family_id", FAMILIES)
def test_footprint_from_the_header_equals_the_loaded_model(family_id, tiny):
    from lowvram_lora.engine.models import load_transformer
    from lowvram_lora.engine.offload.footprint import footprint_before_loading, measure_footprint

    family = get_family(family_id)
    _, single = tiny(family_id)
    lora = LoraSettings(rank=4, alpha=4)
    before, _, variant = footprint_before_loading(single, torch.bfloat16, lora)
    model = load_transformer(single, dtype=torch.bfloat16)[0]
    from lowvram_lora.engine.offload.footprint import lora_param_count

    loaded = measure_footprint(model, family, trainable_params=lora_param_count(model, family, lora))
    assert variant == family.tiny_variant
    assert (before.block_names, before.block_bytes, before.other_bytes, before.hidden_size, before.trainable_params) == \
        (loaded.block_names, loaded.block_bytes, loaded.other_bytes, loaded.hidden_size, loaded.trainable_params)


@pytest.mark.gpu
@pytest.mark.parametrize("act", [False, True])
@pytest.mark.parametrize("family_id", FAMILIES)
def test_streamed_on_cuda_equals_resident(family_id, act):
    """The real CUDA copy engine (side stream, pinned host copies, activation offload) on each family's tiny model:
    losses and LoRA gradients equal the model resident on the GPU (rtol 1e-4, fp32)."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from lowvram_lora.engine.offload import OffloadConfig, Workload, build_plan
    from lowvram_lora.engine.offload.footprint import measure_footprint
    from lowvram_lora.engine.offload.recompute import install_chunked_recompute
    from lowvram_lora.engine.offload.streamer import apply_offload

    family = get_family(family_id)
    device = torch.device("cuda")
    ref = _lora_model(family)
    model = copy.deepcopy(ref)
    ref.to(device)
    undo_ref = install_chunked_recompute(ref, family, 1)

    want, _ = flow_steps(ref, family, device=device)
    undo_ref.remove()
    plan = build_plan(measure_footprint(model, family), Workload(1, 64, 9), (), 1, act)
    handle = apply_offload(model, family, OffloadConfig(mode="stream"), device, plan=plan)
    recompute = install_chunked_recompute(model, family, 1)
    try:
        got, _ = flow_steps(model, family, device=device)
        torch.cuda.synchronize()
        assert got == pytest.approx(want, rel=1e-4)
        g_ref = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
        for n, p in model.named_parameters():
            if p.requires_grad:
                torch.testing.assert_close(p.grad, g_ref[n], rtol=1e-4, atol=1e-6, msg=n)
    finally:
        recompute.remove()
        handle.remove()


@pytest.mark.parametrize("family_id", FAMILIES)
def test_auto_plans_token_chunks_only_for_families_that_have_them(family_id):
    """A tight budget may make auto split the recompute into token chunks; a family without token-wise parts
    (Z-Image, Lumina 2) gets no such plan (it could not run it), and asking for chunks explicitly is refused
    by name before anything loads."""
    from lowvram_lora.engine.errors import ConfigError
    from lowvram_lora.engine.offload import OffloadConfig, Workload, make_plan
    from lowvram_lora.engine.offload.footprint import measure_footprint

    family = get_family(family_id)
    model = _lora_model(family)
    fp = measure_footprint(model, family)
    wl = Workload(1, 65536, 256)  # tokens enough that, at these budgets, only chunks would fit the tiny model
    plans = []
    for budget in [0.5 + 0.01 * i for i in range(40)]:  # the plan keeps 0.5 GB of headroom
        try:
            plans.append(make_plan(fp, wl, OffloadConfig(mode="auto"), int(budget * 1e9)))
        except ConfigError:
            pass
    if family.memory.chunked_recompute:
        assert any(p.recompute_chunks > 1 for p in plans)  # the budgets do reach the chunked plans
    else:
        assert plans and all(p.recompute_chunks == 1 for p in plans)
        with pytest.raises(ConfigError, match="no token-wise block parts"):
            make_plan(fp, wl, OffloadConfig(mode="stream", recompute_chunks=4), None)
