"""Flux.1 Kontext (one reference image) on the tiny Flux.1 model against diffusers 0.42.1's ``FluxKontextPipeline``.

The reference is the pipeline run end to end (``image=``, output_type="latent") with its transformer calls recorded:
the packed reference tokens it appends, their ids ((1, row, col)), the answer cut to the target. Our reference
latent, ``model_inputs`` and ``predict_velocity`` must equal them (1e-5, fp32) and ``sample_latents`` the pipeline's
latents from the same noise (1e-4). The tiny variant keeps the reference at its own size (the pipeline with
``_auto_resize=False``); the full variant's preferred-resolution pick is checked against the size the pipeline
itself resizes to. Then the dataset side: Kontext needs a control image per target, and its LoRA has Flux.1's keys.
"""
import pytest
import torch
from PIL import Image

from lowvram_lora.engine.families import predict_velocity
from lowvram_lora.engine.families.flux1 import FAMILY
from lowvram_lora.engine.families.flux1.kontext import encode_reference, reference_size


def _image(w, h, seed):
    g = torch.Generator().manual_seed(seed)
    return Image.fromarray((torch.rand(h, w, 3, generator=g) * 255).to(torch.uint8).numpy())


@pytest.fixture(scope="module")
def tiny_pipeline(tmp_path_factory):
    from lowvram_lora.engine.families.flux1.fixtures import build_tiny_pipeline

    return build_tiny_pipeline(tmp_path_factory.mktemp("kontext") / "pipe")


@pytest.fixture(scope="module")
def pipe(tiny_pipeline):
    from diffusers import FluxKontextPipeline

    return FluxKontextPipeline.from_pretrained(tiny_pipeline, dtype=torch.float32, use_safetensors=True,
                                               local_files_only=True)


def test_forward_and_previews_equal_the_kontext_pipeline(pipe, monkeypatch):
    from lowvram_lora.engine.sampling import sample_latents

    calls = []
    forward = pipe.transformer.forward

    def recorded(*a, **k):
        out = forward(*a, **k)
        calls.append({**k, "output": out[0]})
        return out

    monkeypatch.setattr(pipe.transformer, "forward", recorded)
    cfg = pipe.transformer.config
    prompt = torch.randn(1, 8, cfg.joint_attention_dim, generator=torch.Generator().manual_seed(1))
    pooled = torch.randn(1, cfg.pooled_projection_dim, generator=torch.Generator().manual_seed(2))
    image = _image(100, 70, 1)
    want = pipe(image=image, prompt_embeds=prompt, pooled_prompt_embeds=pooled, width=64, height=48,
                max_area=64 * 48, _auto_resize=False, num_inference_steps=3, guidance_scale=3.5,
                generator=torch.Generator().manual_seed(3), output_type="latent").images
    monkeypatch.setattr(pipe.transformer, "forward", forward)
    call = calls[-1]
    control = FAMILY.control_images("flux1-kontext-tiny")
    refs = control.encode_latents(pipe.vae, [image])
    assert control.size(100, 70) == (96, 64) and refs["control_latents_0"].shape[-2:] == (64 // 8, 96 // 8)
    h, w = 48 // 8, 64 // 8
    n = (h // 2) * (w // 2)
    torch.testing.assert_close(FAMILY.pack_latents(refs["control_latents_0"]), call["hidden_states"][:, n:],
                               atol=1e-5, rtol=1e-5)
    noisy = FAMILY.unpack_latents(call["hidden_states"][:, :n], h, w)
    embeds = {"prompt_embeds": prompt, "pooled_prompt_embeds": pooled, **refs}
    inputs = FAMILY.model_inputs(pipe.transformer, noisy, embeds, call["timestep"], 3.5)
    torch.testing.assert_close(inputs["img_ids"], call["img_ids"].float())
    assert inputs["img_ids"][n:, 0].unique().tolist() == [1.0]
    with torch.no_grad():
        ours = predict_velocity(FAMILY, pipe.transformer, noisy, embeds, call["timestep"], 3.5)
    torch.testing.assert_close(ours, FAMILY.unpack_prediction(call["output"], noisy), atol=1e-5, rtol=1e-5)
    noise = torch.randn((1, cfg.in_channels // 4, h, w), generator=torch.Generator().manual_seed(3))
    got = sample_latents(pipe.transformer, FAMILY, embeds, 64, 48, 3, 3, 3.5, torch.device("cpu"), torch.float32,
                         rule=FAMILY.guidance("flux1-kontext"), noise=noise)
    torch.testing.assert_close(FAMILY.pack_latents(got), want, atol=1e-4, rtol=1e-4)


def test_the_full_variant_picks_the_preferred_resolution_the_pipeline_resizes_to(pipe, monkeypatch):
    """Kontext's ``_auto_resize``: the pipeline's own resize call (stopped there) gets the size ours picks."""
    seen = {}

    class Stop(Exception):
        pass

    def resize(image, height, width, *a, **k):
        seen["size"] = (width, height)
        raise Stop

    monkeypatch.setattr(pipe.image_processor, "resize", resize)
    for w, h in ((100, 70), (70, 100), (300, 100), (64, 64)):
        with pytest.raises(Stop):
            pipe(image=_image(w, h, 0), prompt_embeds=torch.zeros(1, 4, pipe.transformer.config.joint_attention_dim),
                 pooled_prompt_embeds=torch.zeros(1, pipe.transformer.config.pooled_projection_dim), num_inference_steps=1)
        assert reference_size(w, h) == seen["size"] == FAMILY.control_images("flux1-kontext").size(w, h), (w, h)
    assert reference_size(100, 70, auto_resize=False) == (96, 64)


def test_kontext_is_told_by_name_needs_its_reference_and_trains_flux1_keys(tiny_pipeline, tmp_path):
    """ComfyUI's and BFL's Kontext names pick the variant; a Kontext dataset without control images is refused naming
    the file; a LoRA trained on Kontext pairs has exactly the Flux.1 LoRA's keys (ComfyUI maps them as Flux.1's)."""
    from lowvram_lora.engine.caching import build_dataset_cache
    from lowvram_lora.engine.checkpoint.transformer import identify
    from lowvram_lora.engine.config import DataConfig, ModelConfig
    from lowvram_lora.engine.errors import DatasetError
    from lowvram_lora.engine.families.flux1.fixtures import write_single_file
    from lowvram_lora.engine.families.tiny import add_tiny_controls
    from lowvram_lora.engine.lora_io import save_lora
    from lowvram_lora.engine.testing import make_tiny_dataset

    name = FAMILY.variant_from_name
    assert name("flux1-dev", "flux1-dev-kontext_fp8_scaled.safetensors") == "flux1-kontext"
    assert name("flux1-dev", "FLUX.1-Kontext-dev") == "flux1-kontext"
    assert name("flux1-dev", "flux1-dev.safetensors") == "flux1-dev"
    assert name("flux1-schnell", "kontext-schnell") == "flux1-schnell"
    assert FAMILY.control_images("flux1-dev") is None and FAMILY.control_images("flux1-kontext").max_count == 1
    kontext = write_single_file(tiny_pipeline, tmp_path / "flux1-dev-kontext_tiny.safetensors")
    assert identify(kontext).variant == "flux1-kontext-tiny"
    data = make_tiny_dataset(tmp_path / "data", count=1, sizes=((64, 64),))
    named = tmp_path / "FLUX.1-Kontext-tiny"  # a diffusers folder is told by its name too
    named.symlink_to(tiny_pipeline, target_is_directory=True)
    cfg = ModelConfig(transformer_path=str(named), dtype="fp32")
    with pytest.raises(DatasetError, match="control"):
        build_dataset_cache(cfg, DataConfig(path=str(data), resolution=64), tmp_path / "cache", device="cpu")
    add_tiny_controls(data)
    cache = build_dataset_cache(cfg, DataConfig(path=str(data), resolution=64), tmp_path / "cache", device="cpu")
    assert cache.variant == "flux1-kontext-tiny" and cache.items[0].control_sizes == [[48, 48]]
    assert set(cache.load_item(cache.items[0])[1]) == {"prompt_embeds", "pooled_prompt_embeds", "control_latents_0"}
    from lowvram_lora.engine.config import LoraSettings, TrainConfig
    from lowvram_lora.engine.families.base import meta_model
    from lowvram_lora.engine.train import train_lora

    lora = train_lora(cfg, cache, LoraSettings(rank=2, alpha=2), TrainConfig(steps=1, device="cpu"))
    flux1 = set(FAMILY.lora.target_modules(meta_model(FAMILY, FAMILY.load_config("flux1-tiny"))))
    assert {k.rsplit(".", 2)[0] for k in lora.state_dict} == flux1
    save_lora(lora, tmp_path / "kontext.safetensors", fmt="comfyui", dtype="fp32")


@pytest.mark.parametrize("name", ['flux1_kontext_lora'])
def test_the_full_size_template_without_its_files_names_them(name, tmp_path):
    """The shipped template with its files absent fails before anything runs, naming the checkpoint it needs."""
    from lowvram_lora.host.templates import SHIPPED, WORKFLOWS_DIR
    from lowvram_lora.host.workflow import WorkflowError, load_workflow, to_api_graph
    from lowvram_lora.nodes import NODE_CLASS_MAPPINGS
    from lowvram_lora.nodes.paths import configure_standalone_dirs

    configure_standalone_dirs(str(tmp_path / "empty"), str(tmp_path / "out"))
    with pytest.raises(WorkflowError) as e:
        to_api_graph(load_workflow(WORKFLOWS_DIR / f"{name}.json"), NODE_CLASS_MAPPINGS)
    assert SHIPPED[name].load["checkpoint"] in str(e.value)
    assert SHIPPED[name].cache["control_folder"] == "my_edits/control"  # the edit layout, said in the graph
