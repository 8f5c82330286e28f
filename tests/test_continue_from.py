"""Continuing from an existing LoRA file (engine/train/continue_from.py): the attached adapter takes exactly the file's
deltas (peft's merge of the file's adapter equals that of the run that wrote it), in every file form the reader maps;
a file of another family, size, type, rank or targets is refused with the reason."""
import pytest
import torch
from safetensors.torch import save_file

from lowvram_lora.engine.config import AdapterConfig, LoraSettings, ModelConfig, TrainConfig
from lowvram_lora.engine.errors import LoraMismatchError
from lowvram_lora.engine.families import get_family
from lowvram_lora.engine.lora_io import save_lora
from lowvram_lora.engine.lora_io.formats import fold_scale, to_kohya_fused
from lowvram_lora.engine.models import load_transformer
from lowvram_lora.engine.train import train_lora
from lowvram_lora.engine.train.lora_attach import attach_lora, detach_lora, lora_state_dict

from helpers import peft_merged


def _settings(kind="lora", rank=4, alpha=8.0, path="", **kw):
    return LoraSettings(rank=rank, alpha=alpha, adapter=AdapterConfig(type=kind, continue_from=str(path)), **kw)


@pytest.fixture(scope="module")
def runs(tiny_pipeline, one_image_cache):
    return {kind: train_lora(ModelConfig(transformer_path=str(tiny_pipeline)), one_image_cache, _settings(kind),
                             TrainConfig(steps=3, learning_rate=1e-2, seed=0, device="cpu"))
            for kind in ("lora", "loha", "lokr", "dora")}


def _weights(model):
    return {k: v for k, v in model.state_dict().items() if k.endswith(".weight")}


def _continued_equals_trained(tiny_pipeline, run, kind, path, alpha=8.0):
    base, family, _, _ = load_transformer(tiny_pipeline, dtype=torch.float32)
    expected = _weights(peft_merged(base, family, _settings(kind), run.state_dict))
    model, family, _, _ = load_transformer(tiny_pipeline, dtype=torch.float32)
    attach_lora(model, family, _settings(kind, alpha=alpha, path=path), seed=1)  # another seed: the file decides
    state = lora_state_dict(model)
    detach_lora(model)
    got = _weights(peft_merged(model, family, _settings(kind, alpha=alpha), state))
    changed = [k for k in expected if not torch.equal(expected[k], _weights(base)[k])]
    assert changed
    for k in changed:
        delta = expected[k] - _weights(base)[k]
        err = float((got[k] - expected[k]).norm() / delta.norm())
        assert err < 1e-5, (k, err)


@pytest.mark.parametrize("form", ["comfyui", "diffusers", "kohya"])
def test_a_lora_file_in_each_form_continues_with_its_exact_deltas(tiny_pipeline, runs, tmp_path, form):
    run = runs["lora"]
    path = tmp_path / f"{form}.safetensors"
    if form == "kohya":  # the kohya / musubi layout: lora_unet_* on the fused BFL modules, alpha = rank
        import json

        table = get_family("flux1").param_table(run.model_config)
        # The tiny model's width is not a multiple of Flux's head size, so the reader cannot infer it from the
        # tensors as it does for a full-size kohya file: the model config rides along, as in our earlier files.
        save_file({k: v.contiguous() for k, v in to_kohya_fused(fold_scale(run.state_dict, run.scale), table).items()},
                  str(path), metadata={"lowvram_lora.model_config": json.dumps(run.model_config)})
    else:
        save_lora(run, path, fmt=form, dtype="fp32")
    # alpha 4 here, 8 in the run that wrote it: the deltas are the file's, whatever the run's scale
    _continued_equals_trained(tiny_pipeline, run, "lora", path, alpha=4.0)


@pytest.mark.parametrize("kind, form", [("loha", "comfyui"), ("lokr", "comfyui"), ("dora", "diffusers")])
def test_our_loha_lokr_and_dora_files_continue_with_their_exact_deltas(tiny_pipeline, runs, tmp_path, kind, form):
    path = save_lora(runs[kind], tmp_path / f"{kind}.safetensors", fmt=form, dtype="fp32")
    _continued_equals_trained(tiny_pipeline, runs[kind], kind, path)


def test_continuing_trains_on_from_the_file(tiny_pipeline, one_image_cache, runs, tmp_path):
    path = save_lora(runs["lora"], tmp_path / "l.safetensors", dtype="fp32")
    go_on = train_lora(ModelConfig(transformer_path=str(tiny_pipeline)), one_image_cache, _settings(path=path),
                       TrainConfig(steps=1, learning_rate=1e-2, seed=0, device="cpu"))
    fresh = runs["lora"].loss_history[0]
    assert go_on.steps == 1 and go_on.loss_history[0] < fresh  # the same first batch, fitted better already


@pytest.mark.parametrize("case, match", [
    ("type", "holds a lora adapter and this run trains loha"),
    ("rank", "has rank 4 and this run rank 2; set rank=4"),
    ("targets", "has no weights for the target"),
    ("fewer_targets", "is not one of this run's targets"),
    ("dora_comfyui", "continue a DoRA from its diffusers-format file"),
    ("missing", "is not a file"),
])
def test_a_file_that_does_not_fit_is_refused_with_the_reason(tiny_pipeline, runs, tmp_path, case, match):
    model, family, _, _ = load_transformer(tiny_pipeline, dtype=torch.float32)
    lora = save_lora(runs["lora"], tmp_path / "l.safetensors", dtype="fp32")
    settings = {
        "type": _settings("loha", path=lora),
        "rank": _settings(rank=2, path=lora),
        "targets": _settings(path=lora, target_modules=family.lora.target_modules(model)
                             + ["transformer_blocks.0.ff.net.0.proj"]),
        "fewer_targets": _settings(path=lora, target_modules=["to_q"]),
        "dora_comfyui": _settings("dora", path=save_lora(runs["dora"], tmp_path / "d.safetensors")),
        "missing": _settings(path=tmp_path / "nope.safetensors"),
    }[case]
    with pytest.raises(LoraMismatchError, match=match):
        attach_lora(model, family, settings, seed=0)
    assert not any("lora_" in n for n, _ in model.named_parameters())  # a refused continue detaches again


def test_a_file_of_another_family_is_refused(tiny_pipeline, tiny_flux2, tiny_flux2_cache, tmp_path):
    other = train_lora(ModelConfig(transformer_path=str(tiny_flux2)), tiny_flux2_cache, _settings(),
                       TrainConfig(steps=1, device="cpu"))
    path = save_lora(other, tmp_path / "flux2.safetensors")
    model, family, _, _ = load_transformer(tiny_pipeline, dtype=torch.float32)
    with pytest.raises(LoraMismatchError, match="is a LoRA for flux2, this model is flux1"):
        attach_lora(model, family, _settings(path=path), seed=0)
