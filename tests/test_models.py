"""Loading Flux.1 from a diffusers folder and from a BFL single file."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from lowvram_lora.engine.errors import ModelLoadError
from lowvram_lora.engine.families import get_family
from lowvram_lora.engine.families.names import join_diffusers_tensors, split_native_tensor
from lowvram_lora.engine.models import load_transformer


def _inputs(model, seed=0):
    g = torch.Generator().manual_seed(seed)
    fam = get_family("flux1")
    lat = torch.randn(1, 4, 8, 8, generator=g)
    embeds = {"prompt_embeds": torch.randn(1, 7, 32, generator=g), "pooled_prompt_embeds": torch.randn(1, 32, generator=g)}
    return fam.model_inputs(model, lat, embeds, torch.tensor([0.3]), 1.0)


def test_folder_subfolder_and_single_file_give_identical_outputs(tiny_pipeline, tiny_single_file):
    outs, states = [], []
    for path in (tiny_pipeline, tiny_pipeline / "transformer", tiny_single_file):
        model, family, source, variant = load_transformer(path, dtype=torch.float32)
        assert family.id == "flux1" and variant == "flux1-tiny"
        states.append(model.state_dict())
        with torch.no_grad():
            outs.append(model(**_inputs(model))[0])
    assert outs[0].abs().sum() > 0
    for state in states[1:]:  # bit-identical weights...
        assert set(state) == set(states[0]) and all(torch.equal(state[k], states[0][k]) for k in state)
    # ...and outputs equal up to fp32 kernel reassociation (different buffer alignment)
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=1e-6)
    torch.testing.assert_close(outs[0], outs[2], rtol=0, atol=1e-6)


def test_single_file_loads_on_meta_then_assigns(tiny_single_file):
    model, *_ = load_transformer(tiny_single_file, dtype=torch.bfloat16)
    assert all(p.device.type == "cpu" and p.dtype == torch.bfloat16 for p in model.parameters())
    assert not any(p.requires_grad for p in model.parameters())


def test_bfl_name_map_round_trip_at_tiny_width(tiny_pipeline):
    family = get_family("flux1")
    config = json.loads((tiny_pipeline / "transformer" / "config.json").read_text())
    state = load_file(str(tiny_pipeline / "transformer" / "diffusion_pytorch_model.safetensors"))
    table = family.param_table(config)
    covered = set()
    for param in table:
        bfl = join_diffusers_tensors(param, state)
        for name, t in split_native_tensor(param, bfl).items():
            assert torch.equal(t, state[name]), name
            covered.add(name)
    assert covered == set(state), set(state) ^ covered  # every diffusers tensor has a BFL name


def test_real_dev_config_table_has_expected_blocks():
    family = get_family("flux1")
    table = family.param_table(get_family("flux1").load_config("flux1-dev"))
    names = {p.name for p in table}
    assert "double_blocks.18.img_attn.qkv.weight" in names and "double_blocks.19.img_attn.qkv.weight" not in names
    assert "single_blocks.37.linear1.weight" in names and "guidance_in.in_layer.weight" in names
    linear1 = next(p for p in table if p.name == "single_blocks.0.linear1.weight")
    assert linear1.rows == 3 * 3072 + 4 * 3072


def test_fp8_single_file_loads(tiny_single_file, tmp_path):
    sd = load_file(str(tiny_single_file))
    fp8 = {k: v.to(torch.float8_e4m3fn) if v.dim() == 2 else v for k, v in sd.items()}
    path = tmp_path / "flux1-tiny-fp8.safetensors"
    save_file(fp8, str(path))
    model, *_ = load_transformer(path, dtype=torch.bfloat16)
    ref, *_ = load_transformer(tiny_single_file, dtype=torch.bfloat16)
    w, r = model.x_embedder.weight.float(), ref.x_embedder.weight.float()
    assert (w - r).norm() / r.norm() < 0.1


def test_comfyui_prefixed_single_file_loads(tiny_single_file, tmp_path):
    sd = load_file(str(tiny_single_file))
    path = tmp_path / "prefixed.safetensors"
    save_file({f"model.diffusion_model.{k}": v for k, v in sd.items()}, str(path))
    model, *_ = load_transformer(path, dtype=torch.float32)
    assert model.config.num_layers == 2


def test_wrong_family_names_file_family_and_first_tensor(tmp_path):
    path = tmp_path / "sdxl.safetensors"
    save_file({"conv_in.weight": torch.zeros(4, 4), "time_embedding.linear_1.weight": torch.zeros(4, 4)}, str(path))
    with pytest.raises(ModelLoadError) as e:
        load_transformer(path)
    msg = str(e.value)
    assert "sdxl.safetensors" in msg and "Flux.1" in msg and "conv_in.weight" in msg
    with pytest.raises(ModelLoadError, match="not a Flux.1 checkpoint"):
        load_transformer(path, family_id="flux1")


def test_wrong_shape_names_first_mismatching_tensor(tiny_single_file, tmp_path):
    sd = load_file(str(tiny_single_file))
    sd["double_blocks.1.img_attn.proj.weight"] = torch.zeros(32, 16)
    path = tmp_path / "broken.safetensors"
    save_file(sd, str(path))
    with pytest.raises(ModelLoadError) as e:
        load_transformer(path)
    msg = str(e.value)
    assert "broken.safetensors" in msg and "double_blocks.1.img_attn.proj.weight" in msg and "[32, 16]" in msg


def test_truncated_single_file(tiny_single_file, tmp_path):
    path = tmp_path / "truncated.safetensors"
    path.write_bytes(tiny_single_file.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match="truncated.safetensors"):
        load_transformer(path)


@pytest.mark.parametrize("make, match", [
    (lambda p: p / "nope", "does not exist"),
    (lambda p: (p / "x.ckpt").write_bytes(b"0") and p / "x.ckpt", "not a .safetensors"),
    (lambda p: (p / "emptydir").mkdir() or p / "emptydir", "neither a diffusers pipeline"),
])
def test_bad_paths(tmp_path, make, match):
    with pytest.raises(ModelLoadError, match=match):
        load_transformer(make(tmp_path))


def test_lora_targets_never_the_final_projection(tiny_pipeline):
    model, family, *_ = load_transformer(tiny_pipeline, dtype=torch.float32)
    targets = family.lora.target_modules(model)
    assert "proj_out" not in targets
    assert "single_transformer_blocks.0.proj_out" in targets
    assert "transformer_blocks.1.attn.add_k_proj" in targets
    assert len(targets) == 2 * 8 + 2 * 5
    modules = dict(model.named_modules())
    assert all(isinstance(modules[t], torch.nn.Linear) for t in targets)
