"""Small helpers shared by tests (not fixtures)."""
import copy

import torch

from lowvram_lora.engine.caching.encoders import encoder_kind
from lowvram_lora.engine.callbacks import TrainingCallback
from lowvram_lora.engine.families import family_fixtures, get_family, predict_velocity


def model_inputs(model, seed=0, h=8, w=8, length=7, sigma=0.3):
    g = torch.Generator().manual_seed(seed)
    lat = torch.randn(1, 4, h, w, generator=g)
    embeds = {"prompt_embeds": torch.randn(1, length, 32, generator=g), "pooled_prompt_embeds": torch.randn(1, 32, generator=g)}
    return get_family("flux1").model_inputs(model, lat, embeds, torch.tensor([sigma]), 1.0)


def merged(base, state, scale):
    """A copy of ``base`` with W += scale * B @ A for every LoRA module in ``state``."""
    model = copy.deepcopy(base)
    modules = dict(model.named_modules())
    with torch.no_grad():
        for key, a in state.items():
            if ".lora_A." not in key:
                continue
            name = key.split(".lora_A.")[0]
            b = state[f"{name}.lora_B.weight"]
            modules[name].weight += (scale * b.float() @ a.float()).to(modules[name].weight.dtype)
    return model


def slab_cli(*argv):
    """Run ``lowvram-lora slab ...`` in process; returns the exit code."""
    import argparse

    from lowvram_lora.slab_cli import add_slab_parser, run_slab_command

    parser = argparse.ArgumentParser(prog="lowvram-lora")
    add_slab_parser(parser.add_subparsers(dest="command", required=True))
    return run_slab_command(parser.parse_args(list(argv)))


def eval_flow_loss(model, family, dataset, n=16):
    """Flow-matching loss at fixed noise and timesteps: comparable before/after training. Any family: the
    model is called through its own convention (``family.predict_velocity``), captions collated as in training."""
    from lowvram_lora.engine.train.flow_matching import noisy_latents_and_target, sample_sigmas

    g = torch.Generator().manual_seed(123)
    lat, emb = dataset.load_item(dataset.items[0])
    lat = lat[None]
    emb = {k: v.float() if v.is_floating_point() else v for k, v in dataset.collate_text([emb]).items()}
    total = 0.0
    with torch.no_grad():
        for _ in range(n):
            sigma = sample_sigmas(1, g)
            noisy, target = noisy_latents_and_target(lat, torch.randn(lat.shape, generator=g), sigma)
            pred = predict_velocity(family, model, noisy, emb, sigma, 1.0)
            total += torch.nn.functional.mse_loss(pred, target).item()
    return total / n


def family_inputs(model, family, width=64, height=64, length=7, sigma=0.4):
    """Random model inputs for any family's tiny transformer: latents of a width x height image, every cached
    embedding the family takes (``text_widths``; variable-length ones with a mask that leaves 2 tokens out)."""
    g = torch.Generator().manual_seed(0)
    config = dict(model.config)
    latents = torch.randn(1, *family.latent_shape(model, width, height), generator=g)
    variant = family.variant_for_config(config)
    condition = family.first_frame(variant)
    specs = {s.cache_key: s for s in family.text_encoder_specs(family.tiny_variant if variant == "custom" else variant)}
    embeds = {}
    for key, w in family.text_widths(config).items():
        if encoder_kind(specs[key].kind).output == "pooled":
            embeds[key] = torch.randn(1, w, generator=g)
            continue
        embeds[key] = torch.randn(1, length, w, generator=g)
        if specs[key].length == "variable":
            embeds[specs[key].mask_key] = torch.tensor([[1] * (length - 2) + [0, 0]])
    if condition is not None:  # an image-to-video model: its first-frame conditioning, random
        embeds.update({k: v[None] for k, v in condition.example(config, latents.shape[1:], g).items()})
    return latents, embeds, torch.tensor([sigma])


def flow_steps(model, family, guidance: float = 1.0, device=None):
    """Two micro-steps of the flow loss on ``family_inputs`` (texts of 8 and 9 tokens, targets from seeds 1 and 2),
    each with its backward: (losses, the LoRA gradients as fp32 CPU copies). ``device``: where the inputs go."""
    losses = []
    for seed in (1, 2):
        latents, embeds, sigma = family_inputs(model, family, length=7 + seed)
        target = torch.randn(latents.shape, generator=torch.Generator().manual_seed(seed))
        if device is not None:
            latents, sigma, target = latents.to(device), sigma.to(device), target.to(device)
            embeds = {k: v.to(device) for k, v in embeds.items()}
        loss = torch.nn.functional.mse_loss(predict_velocity(family, model, latents, embeds, sigma, guidance), target)
        loss.backward()
        losses.append(loss.item())
    return losses, {n: p.grad.detach().float().cpu().clone() for n, p in model.named_parameters() if p.requires_grad}


def block_inputs(model, family):
    """Model inputs for the tiny Flux.1 (16x16 latents) or Flux.2 (8x8) transformer at t=0.4."""
    cfg = model.config
    g = torch.Generator().manual_seed(0)
    if family.id == "flux1":
        latents = torch.randn(1, cfg.in_channels // 4, 16, 16, generator=g)
        embeds = {"prompt_embeds": torch.randn(1, 7, cfg.joint_attention_dim, generator=g),
                  "pooled_prompt_embeds": torch.randn(1, cfg.pooled_projection_dim, generator=g)}
    else:
        latents = torch.randn(1, cfg.in_channels, 8, 8, generator=g)
        embeds = {"prompt_embeds": torch.randn(1, 7, cfg.joint_attention_dim, generator=g)}
    return family.model_inputs(model, latents, embeds, torch.tensor([0.4]), 1.0)


class LogRecorder(TrainingCallback):
    """A training callback that keeps the log lines (and the last step's info); stops never."""

    def __init__(self):
        self.logs, self.last = [], None

    def on_progress(self, *args): pass

    def on_step(self, info): self.last = info

    def on_sample(self, step, grid, path): pass

    def log(self, message): self.logs.append(message)

    def should_stop(self): return False


def trained_grads(model) -> dict:
    """The gradient of every trained parameter, by name (cloned)."""
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def assert_grads_close(g: dict, g_ref: dict, rtol: float, atol: float = 1e-7) -> None:
    """The same trained parameters (at least one), each gradient within ``rtol`` / ``atol`` of the reference."""
    assert g.keys() == g_ref.keys() and len(g) > 0
    for name in g_ref:
        torch.testing.assert_close(g[name], g_ref[name], rtol=rtol, atol=atol, msg=name)


def tiny_lora_transformer(family_id: str, overrides: dict | None = None, seed: int = 0):
    """The family's tiny transformer (its config with ``overrides``: layer counts) with LoRA r4 whose B is random, so
    every LoRA weight gets a gradient, gradient checkpointing on (streaming needs it), in train mode.
    (model, params, family)."""
    from lowvram_lora.engine.config import LoraSettings
    from lowvram_lora.engine.families.tiny import randomize_zero_inits
    from lowvram_lora.engine.train.lora_attach import attach_lora

    family = get_family(family_id)
    torch.manual_seed(seed)
    model = family.transformer_class().from_config(dict(family.load_config(family.tiny_variant), **(overrides or {})))
    randomize_zero_inits(model, seed)
    model.requires_grad_(False)
    model.enable_gradient_checkpointing()
    params = attach_lora(model, family, LoraSettings(rank=4, alpha=4), seed)
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 7)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    model.train()
    return model, params, family


def tiny_lora_model(family_id: str, num_double: int, num_single: int, seed: int = 0):
    """A tiny Flux (flux1-tiny / flux2-tiny widths, the given block counts): ``tiny_lora_transformer``'s
    (model, params)."""
    model, params, _ = tiny_lora_transformer(
        family_id, {"num_layers": num_double, "num_single_layers": num_single}, seed)
    return model, params


def write_template_files(template, root, scratch):
    """The template's family's tiny model under the template's file names in a ComfyUI-style ``root``
    (models/diffusion_models, text_encoders, vae with companion folders; input/<dataset_path>), built in
    ``scratch``. Returns (the tiny pipeline folder, what was written under ``root``)."""
    import shutil

    from lowvram_lora.engine.families import get_family
    from lowvram_lora.engine.testing import make_tiny_dataset

    import zlib

    fixtures = family_fixtures(get_family(template.load["family"]))
    # A seed per template: two templates of one family must not write byte-identical files (a real T2I and Edit
    # file never are), or content-keyed caches (slabs, ComfyUI's node cache) would serve one template's run to
    # the other inside one ComfyUI server.
    tiny = {"variant": template.tiny_variant} if template.tiny_variant else {}
    pipeline = fixtures.build_tiny_pipeline(scratch / "pipe", seed=zlib.crc32(template.name.encode()) % 997, **tiny)
    models = root / "models"
    written = [fixtures.write_single_file(pipeline, models / "diffusion_models" / template.load["checkpoint"])]
    for k, chain in enumerate(getattr(template, "chains", ()), 1):  # a further chain's model (an A14B expert)
        other = chain.get("load", {}).get("checkpoint")
        if other and other != template.load["checkpoint"]:
            # The tiny model with other weights, as the real experts differ: content-keyed slabs would otherwise
            # make one expert's slab stand for the other (its manifest names the first file's variant).
            again = fixtures.build_tiny_pipeline(scratch / f"pipe{k}", seed=zlib.crc32(template.name.encode()) % 997 + k,
                                                 **tiny)
            written.append(fixtures.write_single_file(again, models / "diffusion_models" / other))
    files = fixtures.write_text_and_vae_files(pipeline, scratch / "files")
    if "clip_l" in files:  # Flux.1's two text encoders (clip_l, t5xxl), in the template's two inputs
        pairs = [("text_encoder_1", "text_encoders", files["clip_l"]), ("text_encoder_2", "text_encoders", files["t5xxl"]),
                 ("vae_file", "vae", files["vae"])]
    else:
        pairs = [("text_encoder_1", "text_encoders", files["text_encoder"]), ("vae_file", "vae", files["vae"])]
    if "image_encoder" in files:  # an image-to-video model's image encoder, given as the second text encoder
        pairs.append(("text_encoder_2", "clip_vision", files["image_encoder"]))
    for key, folder, source in pairs:
        dest = models / folder / template.cache[key]
        dest.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(source, dest)
        written.append(dest)
        if source.with_suffix("").is_dir():  # the companion folder: tiny config (and tokenizer)
            shutil.copytree(source.with_suffix(""), dest.with_suffix(""), dirs_exist_ok=True)
            written.append(dest.with_suffix(""))
    family = get_family(template.load["family"])
    variant = family.variant_from_name(family.tiny_variant, template.load["checkpoint"])
    control = family.control_images(variant)
    if control is not None and (not control.optional or template.cache.get("control_folder")):  # pairs: + control/
        written.append(fixtures.add_tiny_controls(make_tiny_dataset(root / "input" / template.cache["dataset_path"],
                                                                    count=1)))
    else:
        written.append(make_tiny_dataset(root / "input" / template.cache["dataset_path"], count=1))
    return pipeline, written


def check_checkpoint_forms(family, pipeline_folder, tmp_path, fp8_bound: float | None = None) -> None:
    """The one checkpoint reader on a family's native single file (bf16; with ComfyUI's full-checkpoint prefix; fp8
    e4m3fn when ``fp8_bound`` is given) and on the diffusers folder, against diffusers' ``from_pretrained`` of the
    same folder (the reference): identified as the tiny variant, the same tensor names, bit for bit after the same
    bf16 cast, and each fp8 tensor within ``fp8_bound`` relative L2 of the fp32 reference."""
    from lowvram_lora.engine.checkpoint.transformer import identify, open_checkpoint

    write = family_fixtures(family).write_single_file
    ref = family.transformer_class().from_pretrained(pipeline_folder / "transformer", use_safetensors=True)
    expected = ref.to(torch.bfloat16).state_dict()
    files = {"bf16": write(pipeline_folder, tmp_path / "form_bf16.safetensors", dtype=torch.bfloat16),
             "prefixed": write(pipeline_folder, tmp_path / "form_pref.safetensors", dtype=torch.bfloat16,
                               prefix="model.diffusion_model."),
             "diffusers": pipeline_folder}
    for form, path in files.items():
        ident = identify(path)
        assert (ident.family, ident.variant) == (family, family.tiny_variant), form
        got = open_checkpoint(ident).load_model(torch.bfloat16).state_dict()
        assert sorted(got) == sorted(expected), form
        assert all(torch.equal(got[k], expected[k]) for k in expected), form
    if fp8_bound is None:
        return
    fp8 = write(pipeline_folder, tmp_path / f"{family.id}_fp8_e4m3fn.safetensors", dtype=torch.float8_e4m3fn)
    got = open_checkpoint(identify(fp8)).load_model(torch.float32).state_dict()
    for k, v in ref.float().state_dict().items():
        assert ((got[k] - v).norm() / v.norm().clamp_min(1e-12)).item() < fp8_bound, k


def int4_decode(slab: dict, name: str, cols: int) -> torch.Tensor:
    """An int4 slab's ``<name>`` weight (``name`` ends in ``.weight``) decoded from the file's tensors on its own terms,
    without the engine's code: nibbles (column 2j low, 2j + 1 high), group = column // 64, w = q * scale + min."""
    packed = slab[name + "_int4"]
    q = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(packed.shape[0], -1)[:, :cols].float()
    group = torch.arange(cols) // 64
    base = name[: -len("weight")]
    return q * slab[base + "weight_scale"].float()[:, group] + slab[base + "weight_min"].float()[:, group]


def peft_merged(base, family, settings, state):
    """A copy of ``base`` with an adapter of ``settings`` (any type) holding ``state``, merged into the weights by
    peft's own ``merge`` (the independent reference for LoHa, LoKr and DoRA; ComfyUI-only keys such as DoRA's
    dora_scale are not peft's and are left out)."""
    from peft.tuners.tuners_utils import BaseTunerLayer
    from peft.utils import set_peft_model_state_dict

    from lowvram_lora.engine.lora_io.adapters import get_adapter
    from lowvram_lora.engine.train.lora_attach import ADAPTER, attach_lora, detach_lora

    model = copy.deepcopy(base)
    attach_lora(model, family, settings, seed=0)
    adapter = get_adapter(settings.adapter.type)
    peft_state = {f"{m}.{k}": v for m, ms in adapter.modules(state).items() for k, v in adapter.diffusers(ms).items()}
    result = set_peft_model_state_dict(model, peft_state, adapter_name=ADAPTER)
    assert not result.unexpected_keys, result.unexpected_keys[:3]
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, BaseTunerLayer):
                module.merge(adapter_names=[ADAPTER])
    detach_lora(model)
    return model


def train_input(api: dict, train_id: str, name: str):
    """A Train LoRA setting in an API-format graph: its own widget's value, else the plugged Training Options' or
    Preview Options' (where the rarely changed settings live), else KeyError."""
    inputs = api[train_id]["inputs"]
    if name in inputs:
        return inputs[name]
    for socket in ("training_options", "preview_options"):
        if socket in inputs and name in api[inputs[socket][0]]["inputs"]:
            return api[inputs[socket][0]]["inputs"][name]
    raise KeyError(f"Train LoRA {train_id} has no {name} (nor an options node that sets it)")


def bench_module(name: str):
    """bench/<name>.py imported as a module (the bench scripts are not a package): their functions tested directly."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parents[1] / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
