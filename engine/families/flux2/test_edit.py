"""Flux.2 editing (reference images) on tiny models against diffusers 0.42.1's own pipelines.

The reference is the pipeline run end to end (``Flux2Pipeline`` / ``Flux2KleinPipeline`` with ``image=[...]``,
output_type="latent") with its transformer calls recorded: the packed reference tokens it appends
(``prepare_image_latents``), their ids (``_prepare_image_ids``: T = 10, 20, ...), the answer cut to the target. Our
reference latents, ``model_inputs`` and ``predict_velocity`` must equal them (1e-5, fp32), and ``sample_latents``
with the references in the embeds must give the pipeline's latents from the same noise (1e-4; klein's pipeline
answers in the VAE's space, compared through ``FLUX2_VAE.to_vae``). Then the dataset side: a pairs dataset (the
Qwen-Image-Edit layouts) caches the caption's ordinary text entry beside the references' latents, and the planner
counts the references' tokens. Training on pairs (the LoRA lowers the reference model's flow loss) is checked end to
end by tests/test_family_workflows.py[flux2_dev_edit_lora] and, in real ComfyUI, tests/comfyui.
"""
from types import SimpleNamespace

import pytest
import torch
from PIL import Image

from lowvram_lora.engine.families import predict_velocity
from lowvram_lora.engine.families.flux2 import FAMILY
from lowvram_lora.engine.families.flux2.family import FLUX2_VAE
from lowvram_lora.engine.families.flux2.references import encode_references, reference_size
from lowvram_lora.engine.families.tiny import add_tiny_controls


def _image(w, h, seed):
    g = torch.Generator().manual_seed(seed)
    return Image.fromarray((torch.rand(h, w, 3, generator=g) * 255).to(torch.uint8).numpy())


@pytest.fixture(scope="module")
def pipes(tmp_path_factory):
    """Flux2Pipeline on the tiny pipeline folder, and Flux2KleinPipeline on the same parts with a klein-like
    transformer (no guidance embedding)."""
    from diffusers import Flux2KleinPipeline, Flux2Pipeline, Flux2Transformer2DModel

    from lowvram_lora.engine.families.flux2.fixtures import build_tiny_pipeline

    folder = build_tiny_pipeline(tmp_path_factory.mktemp("f2edit") / "pipe")
    dev = Flux2Pipeline.from_pretrained(folder, dtype=torch.float32, use_safetensors=True, local_files_only=True)
    torch.manual_seed(1)
    klein_tr = Flux2Transformer2DModel.from_config({**dev.transformer.config, "guidance_embeds": False})
    klein = Flux2KleinPipeline(scheduler=dev.scheduler, vae=dev.vae, text_encoder=dev.text_encoder,
                               tokenizer=dev.tokenizer, transformer=klein_tr)
    return {"dev": dev, "klein": klein, "folder": folder}


def _run(pipe, images, guidance, monkeypatch, size=(64, 48), negative=None):
    calls = []
    forward = pipe.transformer.forward

    def recorded(*a, **k):
        out = forward(*a, **k)
        calls.append({**k, "output": out[0]})
        return out

    monkeypatch.setattr(pipe.transformer, "forward", recorded)
    cfg = pipe.transformer.config
    prompt = torch.randn(1, 16, cfg.joint_attention_dim, generator=torch.Generator().manual_seed(1))
    width, height = size
    extra = {} if negative is None else {"negative_prompt_embeds": negative}  # Flux2Pipeline (dev) takes none
    latents = pipe(image=images, prompt_embeds=prompt, width=width, height=height, num_inference_steps=3,
                   guidance_scale=guidance, generator=torch.Generator().manual_seed(3), output_type="latent",
                   **extra).images
    monkeypatch.setattr(pipe.transformer, "forward", forward)
    return latents, calls, prompt


#: What each kind samples as: the variant whose rule the preview takes, the pipeline's guidance_scale.
KINDS = {"dev": ("flux2-dev", 4.0), "klein": ("flux2-klein-4b", 1.0), "klein-base": ("flux2-klein-base-4b", 4.0)}


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("count", [1, 3])
def test_forward_and_previews_equal_the_pipeline(pipes, monkeypatch, kind, count):
    """1 and 3 references of other sizes than the target: the reference latents, the ids, the training forward and
    the preview latents equal Flux2Pipeline's (dev, embedded guidance 4), Flux2KleinPipeline's without guidance (the
    distilled klein) and with classifier-free guidance 4 (the base klein, ``is_distilled=False``: a second forward on
    the negative prompt, the references in both)."""
    from lowvram_lora.engine.sampling import sample_latents

    pipe = pipes["dev" if kind == "dev" else "klein"]
    variant, guidance = KINDS[kind]
    rule = FAMILY.guidance(variant)
    assert rule.mode == {"dev": "embedded", "klein": "none", "klein-base": "cfg"}[kind]
    images = [_image(100, 70, 1), _image(70, 90, 2), _image(64, 64, 3)][:count]
    cfg = pipe.transformer.config
    negative = (torch.randn(1, 12, cfg.joint_attention_dim, generator=torch.Generator().manual_seed(2))
                if rule.mode == "cfg" else None)
    want, calls, prompt = _run(pipe, images, guidance, monkeypatch, negative=negative)
    assert len(calls) == 3 * (2 if rule.mode == "cfg" else 1)  # the pipeline guided as the rule says
    call = calls[-2] if rule.mode == "cfg" else calls[-1]  # the last step's conditional forward
    refs = encode_references(pipe.vae, images, FLUX2_VAE)
    assert [tuple(r.shape[-2:]) for r in refs.values()] == [(h // 16, w // 16) for w, h in
                                                           (reference_size(i.width, i.height) for i in images)]
    h, w = 48 // 16, 64 // 16
    n = h * w
    packed = torch.cat([r.flatten(2).permute(0, 2, 1) for r in refs.values()], dim=1)
    torch.testing.assert_close(packed, call["hidden_states"][:, n:], atol=1e-5, rtol=1e-5)
    noisy = call["hidden_states"][:, :n].permute(0, 2, 1).reshape(1, -1, h, w)
    embeds = {"prompt_embeds": prompt, **refs}
    inputs = FAMILY.model_inputs(pipe.transformer, noisy, embeds, call["timestep"], guidance)
    torch.testing.assert_close(inputs["img_ids"], call["img_ids"][0].float())
    assert inputs["img_ids"][n:, 0].unique().tolist() == [10.0 * (k + 1) for k in range(count)]
    with torch.no_grad():
        ours = predict_velocity(FAMILY, pipe.transformer, noisy, embeds, call["timestep"], guidance)
    torch.testing.assert_close(ours, FAMILY.unpack_prediction(call["output"], noisy), atol=1e-5, rtol=1e-5)
    noise = torch.randn((1, pipe.transformer.config.in_channels, h, w), generator=torch.Generator().manual_seed(3))
    neg = {"prompt_embeds": negative, **refs} if negative is not None else None  # an edit's negative keeps its references
    got = sample_latents(pipe.transformer, FAMILY, embeds, 64, 48, 3, 3, guidance, torch.device("cpu"), torch.float32,
                         rule=rule, noise=noise, negative=neg)
    if kind == "dev":  # packed tokens, normalised
        torch.testing.assert_close(got.flatten(2).permute(0, 2, 1), want, atol=1e-4, rtol=1e-4)
    else:  # the klein pipeline returns the VAE's latents: un-normalised and unpatchified
        torch.testing.assert_close(FLUX2_VAE.to_vae(pipe.vae, got), want, atol=1e-4, rtol=1e-4)
    # the references matter: without them the preview differs
    plain = sample_latents(pipe.transformer, FAMILY, {"prompt_embeds": prompt}, 64, 48, 3, 3, guidance,
                           torch.device("cpu"), torch.float32, rule=rule, noise=noise,
                           negative=None if negative is None else {"prompt_embeds": negative})
    assert (plain - got).abs().max() > 1e-3


def test_reference_sizes_follow_the_pipeline():
    """Over 1024² scaled to about 1024² at its aspect ratio, floored to 16; smaller ones only floored; a reference the
    pipeline refuses (under 64 px, over 8:1) is refused by name; klein 9B KV files are refused."""
    from lowvram_lora.engine.errors import ConfigError

    assert reference_size(100, 70) == (96, 64)
    assert reference_size(2048, 1536) == (1168, 880)  # int(2048 * 0.5773) = 1182 -> 1168; int(1536 * .5773) -> 880
    assert reference_size(1024, 1024) == (1024, 1024)
    for bad in ((50, 200), (1000, 100)):
        with pytest.raises(ValueError, match="Flux.2"):
            reference_size(*bad)
    with pytest.raises(ConfigError, match="klein 9B KV"):
        FAMILY.variant_from_name("flux2-klein-9b", "flux-2-klein-9b-kv.safetensors")
    assert FAMILY.variant_from_name("flux2-klein-9b", "flux-2-klein-base-9b.safetensors") == "flux2-klein-base-9b"


def test_klein_base_is_told_apart_by_name_and_samples_with_cfg():
    """The base klein (the klein templates' files) has the distilled klein's shapes: the file or folder name tells it
    apart, and only it samples with classifier-free guidance (the pipeline's defaults: scale 4, 50 steps); its text
    encoder is the distilled one's."""
    names = {"flux-2-klein-base-4b.safetensors": "flux2-klein-base-4b", "FLUX.2-klein-base-9B": "flux2-klein-base-9b",
             "flux-2-klein-4b.safetensors": "flux2-klein-4b", "FLUX.2-klein-9B": "flux2-klein-9b",
             "flux2_klein_base_4b_fp8.safetensors": "flux2-klein-base-4b"}
    for name, want in names.items():
        shapes = want.replace("base-", "")  # what the config matches first
        assert FAMILY.variant_for_config(FAMILY.load_config(want)) == shapes
        assert FAMILY.variant_from_name(shapes, name) == want, name
    assert FAMILY.variant_from_name("flux2-dev", "flux2-dev-base.safetensors") == "flux2-dev"
    for size in ("4b", "9b"):
        base, distilled = FAMILY.guidance(f"flux2-klein-base-{size}"), FAMILY.guidance(f"flux2-klein-{size}")
        assert (base.mode, base.scale, base.steps, base.formula) == ("cfg", 4.0, 50, "standard")
        assert distilled.mode == "none"
        assert FAMILY.text_encoder_specs(f"flux2-klein-base-{size}") == FAMILY.text_encoder_specs(f"flux2-klein-{size}")


@pytest.fixture(scope="module")
def pair_cache(pipes, tmp_path_factory):
    from lowvram_lora.engine.caching import build_dataset_cache
    from lowvram_lora.engine.config import DataConfig, ModelConfig
    from lowvram_lora.engine.testing import make_tiny_dataset

    tmp = tmp_path_factory.mktemp("f2pairs")
    data = add_tiny_controls(make_tiny_dataset(tmp / "data", count=2))
    cfg = ModelConfig(transformer_path=str(pipes["folder"]), dtype="fp32")
    cache = build_dataset_cache(cfg, DataConfig(path=str(data), resolution=128), tmp / "cache", device="cpu",
                                sample_prompts=["invert it"])
    return cfg, data, cache, tmp


def test_pairs_cache_the_caption_and_the_reference_latents(pipes, pair_cache):
    """Each item's text entry is the caption's ordinary entry (the same tensors an image dataset caches for that
    caption) with its control image's reference latent, equal to ``encode_references`` on diffusers' VAE; a dataset
    without control images stays a text-to-image dataset; the planner counts the references' tokens."""
    from safetensors.torch import load_file

    from lowvram_lora.engine.caching.keys import cache_keys
    from lowvram_lora.engine.caching.model_sources import open_models
    from lowvram_lora.engine.caching.records import takes_pairs
    from lowvram_lora.engine.config import DataConfig
    from lowvram_lora.engine.offload.footprint import workload_for

    cfg, data, cache, tmp = pair_cache
    assert cache.variant == "flux2-tiny" and len(cache.items) == 2
    keys = cache_keys(open_models(cfg, "cpu"))
    for item in cache.items:
        assert len(item.controls) == 1
        _, embeds = cache.load_item(item)
        control = Image.open(item.controls[0]).convert("RGB")
        want = encode_references(pipes["dev"].vae, [control], FLUX2_VAE)["control_latents_0"]
        torch.testing.assert_close(embeds["control_latents_0"], want[0], atol=1e-5, rtol=1e-5)
        plain = load_file(str(cache.cache_dir / "text" / f"{keys.caption(item.caption)}.safetensors"))
        assert torch.equal(embeds["prompt_embeds"], plain["prompt_embeds"])
        assert item.control_sizes == [list(reference_size(control.width, control.height))]
    assert "control_latents_0" in cache.load_text(cache.sample_prompts[0][1])  # previews get pair 1's reference
    models = SimpleNamespace(family=FAMILY, variant="flux2-tiny")
    assert takes_pairs(models, DataConfig(path=str(data)), ())
    assert not takes_pairs(models, DataConfig(path=str(tmp)), ())  # no control/ folder: text-to-image
    wl = workload_for(cache, FAMILY, "flux2-tiny", 1)
    item = max(cache.items, key=lambda i: i.bucket[0] * i.bucket[1])
    refs = sum(FAMILY.memory.image_tokens(w, h) for w, h in item.control_sizes)
    assert wl.reference_tokens == refs > 0 and wl.image_tokens == FAMILY.memory.image_tokens(*item.bucket) + refs


@pytest.mark.parametrize("name", ['flux2_klein_edit_lora'])
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
