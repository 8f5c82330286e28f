"""Every family's shipped template, run end to end on its tiny model under the real file names.

Parametrized over the registry: each template whose Cache Text Embeds reads one text-encoder single file
(Z-Image, Lumina 2, Flux.2-dev) gets the family's tiny transformer, text encoder and VAE written under the
names the template expects (``fixtures.py`` of the family), then runs through ``lowvram-lora run`` with only
sizes and steps overridden. Checked against independent references:
- the base model trained on (the slab the run built, or the file it read) gives the forward of diffusers'
  own model from the pipeline folder (int8 slab: 0.02 relative L2; a lossless file: 1e-5);
- the saved LoRA, merged into that reference, lowers the flow-matching loss on the cached image;
- the same LoRA saved in diffusers' format loads through diffusers' ``load_lora_adapter`` and gives our
  merge's output (1e-4), and changes it.
"""
from __future__ import annotations

import argparse

import pytest
import torch
from helpers import eval_flow_loss, family_inputs, merged, write_template_files

from lowvram_lora.engine.families import families, family_templates, predict_velocity
from lowvram_lora.nodes.paths import configure_standalone_dirs
from lowvram_lora.host.run_command import run_workflow_command
from lowvram_lora.host.templates import CHAIN_IDS, WORKFLOWS_DIR
from lowvram_lora.nodes import NODE_CLASS_MAPPINGS

#: (node id in the first chain, setting): sizes and steps of a quick run; a further chain's nodes get them too.
#: Samples at steps 0 and 8 only (each video sample's VAE decode costs seconds on the CPU): the test reads the last.
OVERRIDES = [(2, "resolution=128"), (2, "sample_prompts=ohwx, a red circle"), (4, "steps=8"), (4, "learning_rate=0.01"),
             (4, "warmup_steps=0"), (4, "sample_every=8"), (4, "sample_resolution=64"), (4, "sample_steps=2"),
             (4, "sample_frames=5")]

def _one_text_file(t) -> bool:
    """One text-encoder file, or a second that is an image encoder ComfyUI keeps in clip_vision (Wan 2.1 I2V's
    clip_vision_h, which the family fixtures write beside umT5)."""
    second = t.cache.get("text_encoder_2")
    return second is None or t.download_folders.get(second) == "clip_vision"


#: LTX-2.3's templates (no VAE file: their all-in-one checkpoint bundles it; clips of 8k+1 frames, not the 5 above)
#: run end to end in their own tests (engine/families/ltx2/test_family.py, test_i2v.py) and, in a real ComfyUI,
#: through tests/comfyui/ltx2_comfy_run.py.
SINGLE_TE = [pytest.param(f.id, t, id=t.name) for f in families().values() for t in family_templates(f)
             if t.cache.get("text_encoders") == "(single files below)" and _one_text_file(t)
             and "vae_file" in t.cache and t.split is None]
#: Edit templates of Flux.1 (two text-encoder files): Kontext's pairs end to end as well.
SINGLE_TE += [pytest.param(f.id, t, id=t.name) for f in families().values() for t in family_templates(f)
              if t.name == "flux1_kontext_lora"]


@pytest.mark.parametrize("family_id, template", SINGLE_TE)
def test_template_trains_the_right_thing_on_the_tiny_model(family_id, template, tmp_path, capsys):
    from lowvram_lora.engine.caching.cache import open_dataset_cache
    from lowvram_lora.engine.lora_io import load_lora
    from lowvram_lora.engine.models import load_transformer
    from lowvram_lora.engine.slab import load_slab_transformer

    family = families()[family_id]
    root = tmp_path / "root"
    pipeline, _ = write_template_files(template, root, tmp_path)
    args = argparse.Namespace(workflow=str(WORKFLOWS_DIR / f"{template.name}.json"), models_dir=str(root / "models"),
                              output_dir=str(root / "output"), no_progress=True, traceback=True,
                              overrides=[f"{CHAIN_IDS * k + node}.{setting}" for k in range(1 + len(template.chains))
                                         for node, setting in OVERRIDES])
    code = run_workflow_command(args, NODE_CLASS_MAPPINGS, configure_dirs=configure_standalone_dirs)
    captured = capsys.readouterr()
    out = captured.out
    assert code == 0, out + captured.err
    for save in [template.save] + [{**template.save, **c.get("save", {})} for c in template.chains]:
        prefix = save["filename_prefix"].rsplit("/", 1)[-1]  # every chain saves its own LoRA
        assert len(sorted((root / "output" / "loras").glob(f"{prefix}_*_.safetensors"))) == 1, out
    prefix = template.save["filename_prefix"].rsplit("/", 1)[-1]
    saved = sorted((root / "output" / "loras").glob(f"{prefix}_*_.safetensors"))
    assert len(saved) == 1, out
    if family.video:  # a video family's samples are clips: an animated WebP per prompt next to the LoRA
        from PIL import Image

        with Image.open(saved[0].with_name(saved[0].stem + "_samples_p00.webp")) as clip:
            assert clip.n_frames == 5
    lora = load_lora(saved[0])
    assert lora.metadata["lowvram_lora.family"] == family_id and lora.metadata["lowvram_lora.steps"] == "8"
    assert "sampled 1 prompt(s) at step 8" in out

    ref = family.transformer_class().from_pretrained(pipeline / "transformer", use_safetensors=True,
                                                     torch_dtype=torch.float32, local_files_only=True)
    stem = template.load["checkpoint"].rsplit(".", 1)[0]  # the first chain's (further chains may reuse it)
    slabs = sorted((root / "models" / "slabs").glob(f"{stem}-*.slab.safetensors"))
    if template.load["precision"] == "int8 slab":
        assert len(slabs) == 1
        trained_on, bound = load_slab_transformer(slabs[0], torch.float32)[0], 0.02
    else:
        trained_on = load_transformer(root / "models" / "diffusion_models" / template.load["checkpoint"],
                                      dtype=torch.float32)[0]
        bound = 1e-5
    latents, embeds, sigma = family_inputs(ref, family)
    with torch.no_grad():
        want = predict_velocity(family, ref, latents, embeds, sigma, 1.0)
        got = predict_velocity(family, trained_on, latents, embeds, sigma, 1.0)
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < bound, f"the model trained on is {rel:.4f} away from the reference (bound {bound})"

    cache = open_dataset_cache(next((root / "output" / "lowvram_cache").rglob("datasets/*.json")))
    before = eval_flow_loss(ref, family, cache)
    after = eval_flow_loss(merged(ref, lora.state_dict, 1.0), family, cache)
    assert after < before, f"the trained LoRA did not lower the loss: {before:.5f} -> {after:.5f}"

    # The diffusers form of the same LoRA through diffusers' own loader equals our merge.
    from safetensors.torch import save_file

    from lowvram_lora.engine.lora_io.formats import to_diffusers

    save_file(to_diffusers(lora.state_dict), str(tmp_path / "diffusers.safetensors"))
    with_adapter = family.transformer_class().from_pretrained(pipeline / "transformer", use_safetensors=True,
                                                              torch_dtype=torch.float32, local_files_only=True)
    with_adapter.load_lora_adapter(str(tmp_path / "diffusers.safetensors"), adapter_name="lowvram",
                                   prefix="transformer")
    ours = merged(ref, load_lora(tmp_path / "diffusers.safetensors").state_dict, 1.0)
    with torch.no_grad():
        a = predict_velocity(family, with_adapter, latents, embeds, sigma, 1.0)
        b = predict_velocity(family, ours, latents, embeds, sigma, 1.0)
    assert ((a - b).norm() / b.norm()).item() < 1e-4
    assert ((b - want).norm() / want.norm()).item() > 1e-6, "the LoRA changed nothing"


@pytest.mark.parametrize("family_id, template", SINGLE_TE)
def test_template_without_its_files_names_them(family_id, template, tmp_path):
    """The full-size template with its files absent: a clear error naming the missing file, before anything runs."""
    from lowvram_lora.host.workflow import WorkflowError, load_workflow, to_api_graph

    configure_standalone_dirs(str(tmp_path / "empty"), str(tmp_path / "out"))
    with pytest.raises(WorkflowError) as e:
        to_api_graph(load_workflow(WORKFLOWS_DIR / f"{template.name}.json"), NODE_CLASS_MAPPINGS)
    assert template.load["checkpoint"] in str(e.value)
