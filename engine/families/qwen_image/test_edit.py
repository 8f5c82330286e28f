"""Qwen-Image-Edit (Edit, 2509, 2511) on tiny models against diffusers 0.42.1's own Edit pipelines.

The reference is the pipeline run end to end (``QwenImageEditPlusPipeline.__call__``, output_type="latent") with its
transformer calls recorded: the prompt embeddings it feeds, the packed control latents it appends (its
``prepare_latents`` / ``_encode_vae_image``), ``img_shapes``, the timestep and the answer. The pipeline's text
encoder gets the processor's ``mm_token_type_ids`` (diffusers PR #14189; without it transformers 5 falls back to 1-D
positions, see edit_text.py); a test shows that this changes the embeddings. The 1024² / 384² areas are shrunk in
both the pipeline module and our calls so that everything runs on the CPU in seconds. Tolerance 1e-5 (fp32).
"""
import pytest
import torch
from PIL import Image

from lowvram_lora.engine.families import predict_velocity
from lowvram_lora.engine.families.qwen_image import FAMILY
from lowvram_lora.engine.families.qwen_image import edit_text as et
from lowvram_lora.engine.families.qwen_image.controls import control_embeds, encode_controls
from lowvram_lora.engine.families.qwen_image.fixtures import tiny_edit_pipeline

VAE_AREA, COND_AREA = 96 * 96, 64 * 64  # stand-ins for 1024² and 384²
PROMPT = "make the red circle blue and put a hat on the dog"


def _image(w, h, seed):
    g = torch.Generator().manual_seed(seed)
    return Image.fromarray((torch.rand(h, w, 3, generator=g) * 255).to(torch.uint8).numpy())


def _run_pipeline(pipe, images, monkeypatch, fixed=True, steps=2, size=(64, 48)):
    """The pipeline's latents and every transformer call's inputs and output (and the processor's last output)."""
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as plus

    monkeypatch.setattr(plus, "VAE_IMAGE_SIZE", VAE_AREA)
    monkeypatch.setattr(plus, "CONDITION_IMAGE_SIZE", COND_AREA)
    seen, calls = {}, []
    proc_cls, real_call = type(pipe.processor), type(pipe.processor).__call__

    def processor_call(self, *a, **k):
        out = real_call(self, *a, **k)
        seen.update(out)
        return out

    monkeypatch.setattr(proc_cls, "__call__", processor_call)
    te_forward = pipe.text_encoder.forward

    def text_encoder_forward(*a, **k):
        if fixed:
            k["mm_token_type_ids"] = seen["mm_token_type_ids"]
        return te_forward(*a, **k)

    monkeypatch.setattr(pipe.text_encoder, "forward", text_encoder_forward)
    tr_forward = pipe.transformer.forward

    def transformer_forward(*a, **k):
        out = tr_forward(*a, **k)
        calls.append({**k, "output": out[0]})
        return out

    monkeypatch.setattr(pipe.transformer, "forward", transformer_forward)
    width, height = size
    latents = pipe(image=images, prompt=PROMPT, num_inference_steps=steps, true_cfg_scale=1.0, width=width,
                   height=height, output_type="latent", generator=torch.Generator().manual_seed(5)).images
    return latents, calls


def _check_against_pipeline(pipe, images, monkeypatch, drop):
    model = pipe.transformer
    _, calls = _run_pipeline(pipe, images, monkeypatch)
    call = calls[-1]
    h, w = 48 // 8, 64 // 8
    n = (h // 2) * (w // 2)
    # 3. the multimodal prompt equals what the pipeline fed the transformer
    ours_text = et.encode_with_model(pipe.text_encoder, pipe.processor, [PROMPT], [images], "plus", drop=drop,
                                     condition_area=COND_AREA)[0]
    torch.testing.assert_close(ours_text[None], call["encoder_hidden_states"], atol=1e-5, rtol=1e-5)
    # 5. the control latents equal the pipeline's packed image_latents
    controls = encode_controls(pipe.vae, images, area=VAE_AREA)
    from lowvram_lora.engine.families.patches import pack_2x2

    torch.testing.assert_close(torch.cat([pack_2x2(c) for c in controls], dim=1), call["hidden_states"][:, n:],
                               atol=1e-5, rtol=1e-5)
    # 4. predict_velocity on the same noisy target equals the pipeline's call, cut back to the target
    noisy = FAMILY.unpack_prediction(call["hidden_states"][:, :n], torch.zeros(1, 16, h, w))
    embeds = {"prompt_embeds": ours_text[None], **control_embeds(controls)}
    inputs = FAMILY.model_inputs(model, noisy, embeds, call["timestep"], 0.0)
    assert inputs["img_shapes"] == [list(s) for s in call["img_shapes"]]
    with torch.no_grad():
        ours = predict_velocity(FAMILY, model, noisy, embeds, call["timestep"], 0.0)
    torch.testing.assert_close(ours, FAMILY.unpack_prediction(call["output"][:, :n], noisy), atol=1e-5, rtol=1e-5)
    return ours, noisy, embeds, call


@pytest.fixture(scope="module")
def plus_pipe():
    return tiny_edit_pipeline("plus")


@pytest.mark.parametrize("count", [1, 2])
def test_edit_plus_text_controls_and_forward_match_the_pipeline(plus_pipe, monkeypatch, count):
    """One and two control images (of different aspect ratios): the prompt embedding (vision tower + 3-D positions),
    the reference latents and the training forward equal QwenImageEditPlusPipeline's transformer call."""
    images = [_image(80, 60, 1), _image(50, 70, 2)][:count]
    _check_against_pipeline(plus_pipe, images, monkeypatch, plus_pipe.prompt_template_encode_start_idx)
    assert FAMILY.edit_mode("qwen-image-edit-2509") == "plus"


def test_edit_2511_zero_cond_t_matches_the_pipeline_and_matters(plus_pipe, monkeypatch):
    """The 2511 variant (zero_cond_t: the references modulated at t = 0) equals the pipeline's call on a 2511 model;
    the same weights without zero_cond_t answer differently, so the test would see it missing."""
    pipe = tiny_edit_pipeline("plus", variant="qwen-image-edit-2511-tiny")
    assert pipe.transformer.config.zero_cond_t and FAMILY.load_config("qwen-image-edit-2511")["zero_cond_t"]
    ours, noisy, embeds, call = _check_against_pipeline(pipe, [_image(80, 60, 1), _image(50, 70, 2)], monkeypatch,
                                                        pipe.prompt_template_encode_start_idx)
    plain = plus_pipe.transformer  # same seed, same weights, zero_cond_t false
    assert all(torch.equal(a, b) for a, b in zip(plain.state_dict().values(), pipe.transformer.state_dict().values()))
    with torch.no_grad():
        other = predict_velocity(FAMILY, plain, noisy, embeds, call["timestep"], 0.0)
    assert (other - ours).abs().max() > 1e-3


def test_positions_fix_changes_the_embedding(plus_pipe, monkeypatch):
    """Without mm_token_type_ids (diffusers 0.42.1 as shipped, transformers 5) the pipeline's embedding differs from
    ours: the reference above really is the 3-D-position one."""
    images = [_image(80, 60, 1)]
    _, calls = _run_pipeline(plus_pipe, images, monkeypatch, fixed=False, steps=1)
    ours = et.encode_with_model(plus_pipe.text_encoder, plus_pipe.processor, [PROMPT], [images], "plus",
                                drop=plus_pipe.prompt_template_encode_start_idx, condition_area=COND_AREA)[0]
    assert ours.shape == calls[0]["encoder_hidden_states"][0].shape
    assert (ours - calls[0]["encoder_hidden_states"][0]).abs().max() > 1e-3


def test_edit_text_of_the_first_release_matches_its_pipeline(monkeypatch):
    """Qwen-Image-Edit (not Plus): one bare image slot, its VL image at the VAE area; our encoding equals
    QwenImageEditPipeline.encode_prompt on the image its __call__ would give the processor (here already at a
    32-multiple size of the stand-in area, so our resize keeps it)."""
    pipe = tiny_edit_pipeline("edit")
    image = _image(96, 64, 3)
    seen = {}
    real_call = type(pipe.processor).__call__

    def processor_call(self, *a, **k):
        out = real_call(self, *a, **k)
        seen.update(out)
        return out

    monkeypatch.setattr(type(pipe.processor), "__call__", processor_call)
    te_forward = pipe.text_encoder.forward
    monkeypatch.setattr(pipe.text_encoder, "forward",
                        lambda *a, **k: te_forward(*a, **{**k, "mm_token_type_ids": seen["mm_token_type_ids"]}))
    with torch.no_grad():
        ref, _ = pipe.encode_prompt(PROMPT, image=image, device=torch.device("cpu"))
    ours = et.encode_with_model(pipe.text_encoder, pipe.processor, [PROMPT], [[image]], "edit",
                                drop=pipe.prompt_template_encode_start_idx, vae_area=96 * 64)[0]
    torch.testing.assert_close(ours[None], ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="exactly one control image"):
        et.prompt_text(PROMPT, 2, "edit")


def test_a_group_of_prompts_equals_each_alone(plus_pipe):
    """Caching encodes many instructions at once (right-padded, different image counts and sizes): each row equals
    its prompt encoded alone."""
    pipe = plus_pipe
    groups = [[_image(80, 60, 1), _image(50, 70, 2)], [_image(64, 64, 4)]]
    prompts = [PROMPT, "remove the hat"]
    kw = dict(drop=pipe.prompt_template_encode_start_idx, condition_area=COND_AREA)
    together = et.encode_with_model(pipe.text_encoder, pipe.processor, prompts, groups, "plus", **kw)
    for p, g, t in zip(prompts, groups, together):
        alone = et.encode_with_model(pipe.text_encoder, pipe.processor, [p], [g], "plus", **kw)[0]
        torch.testing.assert_close(t, alone, atol=1e-5, rtol=1e-5)
    assert together[0].shape[0] != together[1].shape[0]


def test_variants_from_names_and_the_2511_flag(tmp_path):
    """ComfyUI's file names and the hub's folder names pick the variant; a single file carrying
    __index_timestep_zero__ is 2511 (with zero_cond_t in its config) even when renamed."""
    from lowvram_lora.engine.checkpoint.transformer import identify
    from lowvram_lora.engine.families.tiny import save_tensors, tiny_transformer

    name = FAMILY.variant_from_name
    assert name("qwen-image", "qwen_image_edit_fp8_e4m3fn.safetensors") == "qwen-image-edit"
    assert name("qwen-image", "qwen_image_edit_bf16.safetensors") == "qwen-image-edit"
    assert name("qwen-image", "qwen_image_edit_2509_fp8_e4m3fn.safetensors") == "qwen-image-edit-2509"
    assert name("qwen-image", "Qwen-Image-Edit-2509") == "qwen-image-edit-2509"
    assert name("qwen-image", "qwen_image_edit_2511_bf16.safetensors") == "qwen-image-edit-2511"
    assert name("qwen-image", "qwen_image_2512_bf16.safetensors") == "qwen-image"
    assert name("qwen-image-edit-2511", "my_model.safetensors") == "qwen-image-edit-2511"  # its config says so
    assert FAMILY.edit_mode("qwen-image-edit") == "edit" and FAMILY.edit_mode("qwen-image") == ""
    state = tiny_transformer(FAMILY).state_dict()
    flagged = save_tensors({**state, "__index_timestep_zero__": torch.tensor([])}, tmp_path / "renamed.safetensors")
    ident = identify(flagged)
    assert ident.variant == "qwen-image-edit-2511-tiny" and ident.config["zero_cond_t"] is True
    plain = save_tensors(state, tmp_path / "qwen_image_edit_2509_tiny.safetensors")
    ident = identify(plain)
    assert ident.variant == "qwen-image-edit-tiny" and ident.config["zero_cond_t"] is False


def test_model_inputs_checks_the_control_latents():
    """A control latent whose batch or channels do not fit, or numbering with a gap, is a clear error."""
    model = None
    latents = torch.zeros(2, 16, 4, 4)
    embeds = {"prompt_embeds": torch.zeros(2, 3, 32)}
    with pytest.raises(ValueError, match="do not fit"):
        FAMILY.model_inputs(model, latents, {**embeds, "control_latents_0": torch.zeros(1, 16, 4, 4)},
                            torch.tensor([0.5, 0.5]), 0.0)
    with pytest.raises(ValueError, match="without gaps"):
        FAMILY.model_inputs(model, latents, {**embeds, "control_latents_1": torch.zeros(2, 16, 4, 4)},
                            torch.tensor([0.5, 0.5]), 0.0)


@pytest.mark.parametrize("layout", ["folder", "comfyui"])
def test_layer_major_from_the_memory_map_equals_the_whole_model(plus_pipe, tmp_path, layout):
    """engine/caching/vl_text: the vision tower read from the file, the language model layer-major (weights per
    layer from the memory map, 3-D positions passed in) give what the whole model gives (itself equal to the
    pipeline, above); from a diffusers text_encoder/ folder and from ComfyUI's single-file names. 1e-5."""
    from safetensors.torch import save_file

    from lowvram_lora.engine.caching.vl_text import vision_language_parts

    te = plus_pipe.text_encoder
    state = {k: v.contiguous() for k, v in te.state_dict().items()}
    if layout == "comfyui":  # qwen_2.5_vl_7b.safetensors: model.layers.N, visual.blocks.N
        state = {k.replace("model.language_model.", "model.", 1).replace("model.visual.", "visual.", 1): v
                 for k, v in state.items()}
    save_file(state, str(tmp_path / "model.safetensors"))
    parts = vision_language_parts([tmp_path / "model.safetensors"], te.config, torch.device("cpu"), torch.float32)
    groups = [[_image(80, 60, 1), _image(50, 70, 2)], [_image(64, 64, 4)]]
    prompts = [PROMPT, "remove the hat"]
    kw = dict(drop=plus_pipe.prompt_template_encode_start_idx, condition_area=COND_AREA)
    try:
        ours = et.encode_edit_prompts(prompts, groups, "plus", plus_pipe.processor, parts.visual, parts.embed_tokens,
                                      parts.config, parts.language_model, **kw)
    finally:
        parts.close()
    ref = et.encode_with_model(te, plus_pipe.processor, prompts, groups, "plus", **kw)
    for o, r in zip(ours, ref):
        torch.testing.assert_close(o, r, atol=1e-5, rtol=1e-5)


def test_edit_text_specs_say_the_prompt_carries_images():
    """Edit variants' spec: the Edit system turn, 64 tokens dropped (the tiny tokenizer happens to make 64 of it too),
    the control images in the prompt; text-to-image variants unchanged."""
    from lowvram_lora.engine.families.qwen_image.fixtures import tiny_qwen25_tokenizer

    for variant in ("qwen-image-edit", "qwen-image-edit-2509", "qwen-image-edit-2511", "qwen-image-edit-tiny"):
        (spec,) = FAMILY.text_encoder_specs(variant)
        assert spec.control_images and spec.drop_tokens == et.EDIT_DROP and spec.template.prefix == et.EDIT_SYSTEM
    assert et.tiny_drop(tiny_qwen25_tokenizer()[0]) == et.EDIT_DROP
    assert not FAMILY.text_encoder_specs("qwen-image")[0].control_images
