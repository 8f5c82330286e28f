"""LoRA files: diffusers reproduces the trained model, ComfyUI maps every key, errors."""
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from lowvram_lora.engine.config import LoraSettings, ModelConfig, TrainConfig
from lowvram_lora.engine.errors import LoraFormatError
from lowvram_lora.engine.families import get_family
from lowvram_lora.engine.families.names import split_native_tensor
from lowvram_lora.engine.lora_io import load_lora, save_lora
from lowvram_lora.engine.models import load_transformer
from lowvram_lora.engine.train import train_lora

from comfyui_lora_reference import comfyui_apply_lora, comfyui_check_flux_lora, flux_bfl_model_keys
from helpers import merged, model_inputs


@pytest.fixture(scope="module")
def trained(tiny_pipeline, tiny_cache):
    """A LoRA with alpha != rank, so a wrong scale would show."""
    return train_lora(ModelConfig(transformer_path=str(tiny_pipeline)), tiny_cache, LoraSettings(rank=4, alpha=8),
                      TrainConfig(steps=8, learning_rate=2e-2, seed=1))


@pytest.fixture(scope="module")
def base(tiny_pipeline):
    return load_transformer(tiny_pipeline, dtype=torch.float32)[0]


def _reference_output(base, trained):
    model = merged(base, trained.state_dict, trained.scale)
    with torch.no_grad():
        out = model(**model_inputs(model))[0]
        plain = base(**model_inputs(base))[0]
    assert (out - plain).abs().max() > 1e-3  # the LoRA really changes the output
    return out


def _output_in_diffusers(tiny_pipeline, path):
    """A fresh diffusers transformer with the LoRA file loaded by diffusers itself, on fixed inputs."""
    from diffusers import FluxTransformer2DModel

    fresh = FluxTransformer2DModel.from_pretrained(tiny_pipeline / "transformer", local_files_only=True,
                                                   use_safetensors=True)
    fresh.load_lora_adapter(str(path), prefix="transformer", adapter_name="trained")
    with torch.no_grad():
        return fresh(**model_inputs(fresh))[0]


def _assert_same_deltas(loaded, trained):
    """Every module's B @ A in the file equals the trained one at its scale."""
    for key, a in trained.state_dict.items():
        if ".lora_A." in key:
            m = key.split(".lora_A.")[0]
            ref = trained.scale * trained.state_dict[f"{m}.lora_B.weight"] @ a
            got = loaded.state_dict[f"{m}.lora_B.weight"] @ loaded.state_dict[f"{m}.lora_A.weight"]
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)


def test_diffusers_file_reproduces_trained_output_in_diffusers(trained, base, tiny_pipeline, tmp_path):
    path = save_lora(trained, tmp_path / "lora.safetensors", fmt="diffusers", dtype="fp32")
    with safe_open(str(path), framework="pt") as f:
        meta = f.metadata()
        assert "lora_adapter_metadata" not in meta  # diffusers refuses it beside alphas; we fold instead
        assert all(k.startswith("transformer.") and (".lora_A." in k or ".lora_B." in k) for k in f.keys())
    torch.testing.assert_close(_output_in_diffusers(tiny_pipeline, path), _reference_output(base, trained),
                               rtol=1e-4, atol=1e-5)


def test_comfyui_file_maps_every_key_and_reproduces_output(trained, base, tiny_pipeline, tmp_path):
    path = save_lora(trained, tmp_path / "lora_comfy.safetensors", fmt="comfyui", dtype="fp32")
    sd = load_file(str(path))
    cfg = trained.model_config
    hidden = cfg["num_attention_heads"] * cfg["attention_head_dim"]
    model_keys = flux_bfl_model_keys(cfg["num_layers"], cfg["num_single_layers"], hidden, 4 * hidden,
                                     in_channels=cfg["in_channels"], context_in_dim=cfg["joint_attention_dim"],
                                     vec_in_dim=cfg["pooled_projection_dim"])
    n_modules = len({k.split(".lora_A.")[0] for k in trained.state_dict if ".lora_A." in k})
    for variant in ("latest", "legacy"):
        patches, unmatched, not_loaded = comfyui_check_flux_lora(sd, model_keys, variant=variant)
        assert not unmatched and not not_loaded and len(patches) == n_modules  # one slice patch per projection

    # Apply it the way ComfyUI does, on the BFL weights, then convert back and compare outputs.
    family = get_family("flux1")
    table = family.param_table(cfg)
    from lowvram_lora.engine.families.names import join_diffusers_tensors
    state = base.state_dict()
    bfl = {f"diffusion_model.{p.name}": join_diffusers_tensors(p, state) for p in table}
    patched = comfyui_apply_lora(bfl, comfyui_check_flux_lora(sd, model_keys)[0])
    new_state = {}
    for p in table:
        new_state.update(split_native_tensor(p, patched[f"diffusion_model.{p.name}"]))
    model = load_transformer(tiny_pipeline, dtype=torch.float32)[0]
    model.load_state_dict(new_state)
    with torch.no_grad():
        got = model(**model_inputs(model))[0]
    torch.testing.assert_close(got, _reference_output(base, trained), rtol=1e-4, atol=1e-5)


def test_comfyui_keys_are_per_projection_with_float_alpha(trained, tmp_path):
    """Per-projection names (ComfyUI maps them into slices of the fused BFL Linears), each with a
    float32 scalar alpha = rank: the file is as small as the diffusers one (issue 9, item 8)."""
    sd = load_file(str(save_lora(trained, tmp_path / "k.safetensors", fmt="comfyui")))
    modules = sorted({k.split(".lora_A.")[0] for k in trained.state_dict if ".lora_A." in k})
    expected = {f"transformer.{m}.{s}" for m in modules for s in ("lora_A.weight", "lora_B.weight", "alpha")}
    assert set(sd) == expected
    q = "transformer.transformer_blocks.0.attn.to_q"
    assert sd[f"{q}.lora_A.weight"].shape == (4, 32) and sd[f"{q}.lora_B.weight"].shape == (32, 4)
    assert sd[f"{q}.alpha"].dtype == torch.float32 and sd[f"{q}.alpha"].dim() == 0 and float(sd[f"{q}.alpha"]) == 4.0
    diffusers = load_file(str(save_lora(trained, tmp_path / "d.safetensors", fmt="diffusers")))
    size = lambda d: sum(v.numel() * v.element_size() for v in d.values())
    assert size(sd) - size(diffusers) == 4 * len(modules)  # only the alphas differ


def test_comfyui_file_also_loads_in_diffusers(trained, base, tiny_pipeline, tmp_path):
    path = save_lora(trained, tmp_path / "lora_comfy.safetensors", fmt="comfyui", dtype="fp32")
    torch.testing.assert_close(_output_in_diffusers(tiny_pipeline, path), _reference_output(base, trained),
                               rtol=1e-4, atol=1e-5)


def test_kohya_fused_files_of_earlier_versions_still_load(trained, tmp_path):
    from safetensors.torch import save_file

    from lowvram_lora.engine.lora_io.formats import fold_scale, to_kohya_fused

    table = get_family("flux1").param_table(trained.model_config)
    old = to_kohya_fused(fold_scale(trained.state_dict, trained.scale), table)
    save_file({k: v.contiguous() for k, v in old.items()}, str(tmp_path / "old.safetensors"),
              metadata={"lowvram_lora.model_config": json.dumps(trained.model_config)})
    loaded = load_lora(tmp_path / "old.safetensors")
    assert loaded.format == "comfyui"
    _assert_same_deltas(loaded, trained)


@pytest.mark.parametrize("fmt", ["comfyui", "diffusers"])
def test_read_back_both_formats(trained, tmp_path, fmt):
    path = save_lora(trained, tmp_path / f"{fmt}.safetensors", fmt=fmt, dtype="fp32")
    loaded = load_lora(path)
    assert loaded.format == fmt and loaded.rank == 4
    meta = loaded.metadata
    assert meta["lowvram_lora.rank"] == "4" and float(meta["lowvram_lora.alpha"]) == 8.0
    assert meta["lowvram_lora.family"] == "flux1" and meta["lowvram_lora.steps"] == "8"
    assert meta["lowvram_lora.dataset_hash"] == trained.dataset_hash and meta["lowvram_lora.version"]
    assert json.loads(meta["lowvram_lora.model_config"])["num_layers"] == 2
    _assert_same_deltas(loaded, trained)


def test_the_file_names_its_architecture_from_the_family(trained, tmp_path):
    """``modelspec.architecture`` comes from the family's LoraForm: the SAI name for Flux.1-dev, ``flux1/lora`` for
    a variant without one (the tiny model)."""
    import dataclasses

    for variant, want in (("flux1-tiny", "flux1/lora"), ("flux1-dev", "flux-1-dev/lora")):
        path = save_lora(dataclasses.replace(trained, variant=variant), tmp_path / f"{variant}.safetensors")
        with safe_open(str(path), framework="pt") as f:
            assert f.metadata()["modelspec.architecture"] == want


def test_save_never_clobbers_and_writes_atomically(trained, tmp_path):
    path = tmp_path / "keep.safetensors"
    path.write_bytes(b"precious")
    with pytest.raises(LoraFormatError, match="already exists"):
        save_lora(trained, path)
    assert path.read_bytes() == b"precious"
    save_lora(trained, path, overwrite=True, dtype="fp32")
    overwritten = load_lora(path)
    assert overwritten.format == "comfyui"
    _assert_same_deltas(overwritten, trained)  # the new file holds the trained LoRA (rtol 1e-5, atol 1e-6 per B @ A)
    assert [p.name for p in tmp_path.iterdir()] == ["keep.safetensors"]  # no temp files left


@pytest.mark.parametrize("kwargs, match", [
    ({"fmt": "ckpt"}, "comfyui, diffusers"), ({"dtype": "int4"}, "bf16"),
])
def test_save_bad_arguments(trained, tmp_path, kwargs, match):
    with pytest.raises(LoraFormatError, match=match):
        save_lora(trained, tmp_path / "x.safetensors", **kwargs)


def test_save_bad_suffix_and_load_errors(trained, tmp_path):
    with pytest.raises(LoraFormatError, match=".safetensors"):
        save_lora(trained, tmp_path / "x.pt")
    with pytest.raises(LoraFormatError, match="does not exist"):
        load_lora(tmp_path / "missing.safetensors")
    from safetensors.torch import save_file
    save_file({"foo.weight": torch.zeros(2)}, str(tmp_path / "notlora.safetensors"))
    with pytest.raises(LoraFormatError, match="no LoRA keys"):
        load_lora(tmp_path / "notlora.safetensors")


def test_train_lora_gives_comfyui_the_saved_files_tensors(trained, tmp_path):
    """Train LoRA's lora_model output (LORA_MODEL, for ComfyUI's Load LoRA Model) holds exactly what Save LoRA's
    default file holds, key for key, dtype and bits, so sampling with it equals sampling with the file through
    LoraLoaderModelOnly."""
    from safetensors.torch import load_file

    from lowvram_lora.nodes.train_lora import _comfy_lora

    saved = load_file(str(save_lora(trained, tmp_path / "x.safetensors")))  # Save LoRA's defaults: comfyui, bf16
    given = _comfy_lora(trained)
    assert sorted(given) == sorted(saved)
    for k, v in saved.items():
        assert given[k].dtype == v.dtype and torch.equal(given[k], v), k
