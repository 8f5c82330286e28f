"""Self-test of tests/comfyui_lora_reference.py (the ComfyUI Flux LoRA loader port)."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from comfyui_lora_reference import (  # noqa: E402
    VARIANT_LEGACY,
    comfyui_apply_lora,
    comfyui_check_flux_lora,
    comfyui_flux_key_map,
    comfyui_load_lora,
    comfyui_not_loaded,
    flux_bfl_model_keys,
    swap_scale_shift,
)

H, MLP = 32, 128
P = "diffusion_model."


@pytest.fixture(scope="module")
def shapes():
    return flux_bfl_model_keys(2, 2, H, MLP, context_in_dim=48, vec_in_dim=24)


@pytest.fixture(scope="module")
def key_map(shapes):
    return comfyui_flux_key_map(shapes)


@pytest.fixture()
def weights(shapes):
    g = torch.Generator().manual_seed(0)
    return {k: torch.randn(s, generator=g) for k, s in shapes.items()}


def _lora_pair(out_f, in_f, rank, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(out_f, rank, generator=g), torch.randn(rank, in_f, generator=g)


def test_model_key_shapes(shapes):
    assert shapes[P + "double_blocks.1.img_attn.qkv.weight"] == (3 * H, H)
    assert shapes[P + "double_blocks.0.txt_mlp.0.weight"] == (MLP, H)
    assert shapes[P + "double_blocks.0.txt_mlp.2.weight"] == (H, MLP)
    assert shapes[P + "double_blocks.0.img_mod.lin.weight"] == (6 * H, H)
    assert shapes[P + "single_blocks.1.linear1.weight"] == (3 * H + MLP, H)
    assert shapes[P + "single_blocks.1.linear2.weight"] == (H, H + MLP)
    assert shapes[P + "single_blocks.0.modulation.lin.weight"] == (3 * H, H)
    assert shapes[P + "final_layer.adaLN_modulation.1.weight"] == (2 * H, H)
    assert shapes[P + "final_layer.linear.weight"] == (64, H)
    assert shapes[P + "guidance_in.in_layer.weight"] == (H, 256)
    assert shapes[P + "single_blocks.1.linear1.bias"] == (3 * H + MLP,)
    assert all(k.startswith(P) for k in shapes)


def test_key_map_names(key_map):
    qkv = P + "double_blocks.0.img_attn.qkv.weight"
    assert key_map["lora_unet_double_blocks_0_img_attn_qkv"] == qkv
    assert key_map[P + "double_blocks.0.img_attn.qkv"] == qkv
    assert key_map[P + "double_blocks.0.img_attn.qkv.bias"] == P + "double_blocks.0.img_attn.qkv.bias"
    assert key_map["transformer.transformer_blocks.0.attn.to_q"] == (qkv, (0, 0, H))
    assert key_map["transformer.transformer_blocks.0.attn.to_k"] == (qkv, (0, H, H))
    assert key_map["transformer.transformer_blocks.0.attn.to_v"] == (qkv, (0, 2 * H, H))
    txt = P + "double_blocks.1.txt_attn.qkv.weight"
    assert key_map["transformer.transformer_blocks.1.attn.add_v_proj"] == (txt, (0, 2 * H, H))
    assert key_map["transformer.transformer_blocks.0.attn.to_out.0"] == P + "double_blocks.0.img_attn.proj.weight"
    assert key_map["transformer.transformer_blocks.0.ff_context.net.2"] == P + "double_blocks.0.txt_mlp.2.weight"
    lin1 = P + "single_blocks.1.linear1.weight"
    assert key_map["transformer.single_transformer_blocks.1.proj_mlp"] == (lin1, (0, 3 * H, 4 * H))
    assert key_map["transformer.single_transformer_blocks.1.proj_out"] == P + "single_blocks.1.linear2.weight"
    assert key_map["lora_transformer_single_transformer_blocks_1_attn_to_q"] == (lin1, (0, 0, H))
    assert key_map["lycoris_transformer_blocks_0_norm1_linear"] == P + "double_blocks.0.img_mod.lin.weight"
    norm_out = key_map["transformer.norm_out.linear"]
    assert norm_out[0] == P + "final_layer.adaLN_modulation.1.weight" and norm_out[1] is None
    assert norm_out[2] is swap_scale_shift
    # latest only: bare diffusers names (DiffSynth) and USO linear1_qkv
    assert key_map["transformer_blocks.0.attn.to_q"] == (qkv, (0, 0, H))
    assert key_map[P + "single_blocks.0.linear1_qkv"] == (P + "single_blocks.0.linear1.weight", (0, 0, 3 * H))
    assert "lora_prior_unet_double_blocks_0_img_attn_qkv" not in key_map


def test_key_map_legacy_variant(shapes):
    km = comfyui_flux_key_map(shapes, variant=VARIANT_LEGACY)
    assert "transformer_blocks.0.attn.to_q" not in km
    assert P + "single_blocks.0.linear1_qkv" not in km
    assert km["lora_prior_unet_double_blocks_0_img_attn_qkv"] == P + "double_blocks.0.img_attn.qkv.weight"
    assert "transformer.transformer_blocks.0.attn.to_q" in km


def test_kohya_lora_with_alpha(key_map, weights):
    rank, alpha, strength = 4, 2.0, 0.7
    up, down = _lora_pair(3 * H, H, rank, 1)
    name = "lora_unet_double_blocks_0_img_attn_qkv"
    lora = {f"{name}.lora_up.weight": up, f"{name}.lora_down.weight": down, f"{name}.alpha": torch.tensor(alpha)}
    patches, unmatched = comfyui_load_lora(lora, key_map)
    assert unmatched == set()
    target = P + "double_blocks.0.img_attn.qkv.weight"
    assert list(patches) == [target]
    p = patches[target]
    assert p.alpha == alpha and p.rank == rank and p.scale == pytest.approx(alpha / rank)
    assert p[0] is up and p[1] is down
    out = comfyui_apply_lora(weights, patches, strength)
    expected = weights[target] + strength * (alpha / rank) * (up @ down)
    torch.testing.assert_close(out[target], expected)
    # everything else untouched
    for k in weights:
        if k != target:
            assert out[k] is weights[k]
    assert not torch.equal(out[target], weights[target])


def test_missing_alpha_means_scale_one(key_map, weights):
    up, down = _lora_pair(H, MLP, 8, 2)
    name = "lora_unet_double_blocks_1_img_mlp_2"
    lora = {f"{name}.lora_up.weight": up, f"{name}.lora_down.weight": down}
    patches, unmatched = comfyui_load_lora(lora, key_map)
    assert not unmatched
    target = P + "double_blocks.1.img_mlp.2.weight"
    assert patches[target].alpha is None and patches[target].scale == 1.0
    out = comfyui_apply_lora(weights, patches)
    torch.testing.assert_close(out[target], weights[target] + up @ down)


def test_diffusers_to_k_patches_the_k_slice(key_map, weights):
    up, down = _lora_pair(H, H, 4, 3)
    name = "transformer.transformer_blocks.0.attn.to_k"
    lora = {f"{name}.lora_B.weight": up, f"{name}.lora_A.weight": down}  # peft: B = up, A = down
    patches, unmatched = comfyui_load_lora(lora, key_map)
    assert not unmatched
    key = P + "double_blocks.0.img_attn.qkv.weight"
    assert list(patches) == [(key, (0, H, H))]
    out = comfyui_apply_lora(weights, patches)
    w0, w1 = weights[key], out[key]
    torch.testing.assert_close(w1[H:2 * H], w0[H:2 * H] + up @ down)
    assert torch.equal(w1[:H], w0[:H]) and torch.equal(w1[2 * H:], w0[2 * H:])


def test_single_block_slices_and_alpha(key_map, weights):
    rank, alpha = 4, 8.0
    uq, dq = _lora_pair(H, H, rank, 4)
    um, dm = _lora_pair(4 * H, H, rank, 5)
    q = "transformer.single_transformer_blocks.1.attn.to_q"
    m = "transformer.single_transformer_blocks.1.proj_mlp"
    lora = {f"{q}.lora_B.weight": uq, f"{q}.lora_A.weight": dq, f"{q}.alpha": torch.tensor(alpha),
            f"{m}.lora_B.weight": um, f"{m}.lora_A.weight": dm}
    patches, unmatched = comfyui_load_lora(lora, key_map)
    assert not unmatched and len(patches) == 2
    out = comfyui_apply_lora(weights, patches)
    key = P + "single_blocks.1.linear1.weight"
    w0, w1 = weights[key], out[key]
    torch.testing.assert_close(w1[:H], w0[:H] + (alpha / rank) * (uq @ dq))
    torch.testing.assert_close(w1[H:3 * H], w0[H:3 * H])
    torch.testing.assert_close(w1[3 * H:], w0[3 * H:] + um @ dm)


def test_norm_out_delta_is_half_swapped(key_map, weights):
    up, down = _lora_pair(2 * H, H, 2, 6)
    name = "transformer.norm_out.linear"
    patches, unmatched = comfyui_load_lora({f"{name}.lora_B.weight": up, f"{name}.lora_A.weight": down}, key_map)
    assert not unmatched
    key = P + "final_layer.adaLN_modulation.1.weight"
    out = comfyui_apply_lora(weights, patches)
    delta = up @ down
    torch.testing.assert_close(out[key], weights[key] + torch.cat([delta[H:], delta[:H]]))


def test_garbage_and_orphan_alpha_reported(key_map):
    up, down = _lora_pair(H, H, 2, 7)
    lora = {
        "lora_unet_double_blocks_0_img_attn_proj.lora_up.weight": up,
        "lora_unet_double_blocks_0_img_attn_proj.lora_down.weight": down,
        "lora_unet_double_blocks_0_img_attn_proj.alpha": torch.tensor(2.0),
        "this.is.garbage.lora_up.weight": up,
        "this.is.garbage.alpha": torch.tensor(1.0),
        "lora_unet_double_blocks_9_img_attn_proj.lora_down.weight": down,  # block 9 does not exist
        "lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_up.weight": up,  # CLIP: not in the unet map
    }
    patches, unmatched = comfyui_load_lora(lora, key_map)
    assert list(patches) == [P + "double_blocks.0.img_attn.proj.weight"]
    assert unmatched == {
        "this.is.garbage.lora_up.weight",
        "this.is.garbage.alpha",
        "lora_unet_double_blocks_9_img_attn_proj.lora_down.weight",
        "lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_up.weight",
    }


def test_bare_diffusers_names_depend_on_version(shapes):
    up, down = _lora_pair(H, H, 2, 8)
    name = "transformer_blocks.0.attn.to_q"
    lora = {f"{name}.lora_B.weight": up, f"{name}.lora_A.weight": down}
    patches, unmatched, not_loaded = comfyui_check_flux_lora(lora, shapes)
    assert not unmatched and not not_loaded and len(patches) == 1
    patches, unmatched, _ = comfyui_check_flux_lora(lora, shapes, variant=VARIANT_LEGACY)
    assert not patches and unmatched == set(lora)


@pytest.mark.parametrize("up_fmt,down_fmt", [
    ("{}.lora_up.weight", "{}.lora_down.weight"),
    ("{}_lora.up.weight", "{}_lora.down.weight"),
    ("{}.lora_B.weight", "{}.lora_A.weight"),
    ("{}.lora.up.weight", "{}.lora.down.weight"),
    ("{}.lora_linear_layer.up.weight", "{}.lora_linear_layer.down.weight"),
])
def test_accepted_up_down_names(key_map, up_fmt, down_fmt):
    up, down = _lora_pair(H, H, 2, 9)
    x = "transformer.transformer_blocks.1.attn.to_add_out"
    patches, unmatched = comfyui_load_lora({up_fmt.format(x): up, down_fmt.format(x): down}, key_map)
    assert not unmatched
    assert list(patches) == [P + "double_blocks.1.txt_attn.proj.weight"]


def test_lora_up_wins_over_lora_b(key_map):
    up, down = _lora_pair(H, H, 2, 10)
    x = "lora_unet_double_blocks_1_txt_attn_proj"
    lora = {f"{x}.lora_up.weight": up, f"{x}.lora_down.weight": down,
            f"{x}.lora_B.weight": up * 2, f"{x}.lora_A.weight": down}
    patches, unmatched = comfyui_load_lora(lora, key_map)
    assert unmatched == {f"{x}.lora_B.weight", f"{x}.lora_A.weight"}
    assert patches[P + "double_blocks.1.txt_attn.proj.weight"][0] is up


def test_every_linear_fully_mapped_kohya(shapes, weights):
    lora = {}
    for k, s in shapes.items():
        if k.endswith(".weight"):
            name = "lora_unet_" + k[len(P):-len(".weight")].replace(".", "_")
            up, down = _lora_pair(s[0], s[1], 2, len(lora))
            lora[f"{name}.lora_up.weight"], lora[f"{name}.lora_down.weight"] = up, down
            lora[f"{name}.alpha"] = torch.tensor(1.0)
    patches, unmatched, not_loaded = comfyui_check_flux_lora(lora, shapes)
    assert not unmatched and not not_loaded
    assert set(patches) == {k for k in shapes if k.endswith(".weight")}
    out = comfyui_apply_lora(weights, patches, 0.5)
    assert all(not torch.equal(out[k], weights[k]) for k in patches)


def test_not_loaded_and_shape_errors(key_map, weights):
    up, down = _lora_pair(H, H, 2, 11)
    # q/k norm targets end in ".weight" in ComfyUI's table, the model has ".scale": NOT LOADED.
    x = "transformer.transformer_blocks.0.attn.norm_q"
    patches, unmatched = comfyui_load_lora({f"{x}.lora_B.weight": up, f"{x}.lora_A.weight": down}, key_map)
    assert not unmatched
    assert comfyui_not_loaded(patches, weights) == list(patches)
    with pytest.raises(KeyError):
        comfyui_apply_lora(weights, patches)
    assert comfyui_apply_lora(weights, patches, strict=False).keys() == weights.keys()
    # wrong rank/width: ComfyUI logs "ERROR lora ..." and leaves the weight alone.
    bad_up, bad_down = _lora_pair(H, 2 * H, 2, 12)
    x = "lora_unet_double_blocks_0_img_attn_proj"
    patches, _ = comfyui_load_lora({f"{x}.lora_up.weight": bad_up, f"{x}.lora_down.weight": bad_down}, key_map)
    with pytest.raises(ValueError):
        comfyui_apply_lora(weights, patches)
    key = P + "double_blocks.0.img_attn.proj.weight"
    assert torch.equal(comfyui_apply_lora(weights, patches, strict=False)[key], weights[key])


def test_dtype_roundtrip(key_map, weights):
    up, down = _lora_pair(H, H, 2, 13)
    x = "lora_unet_double_blocks_0_img_attn_proj"
    patches, _ = comfyui_load_lora({f"{x}.lora_up.weight": up.half(), f"{x}.lora_down.weight": down.half()},
                                   key_map)
    key = P + "double_blocks.0.img_attn.proj.weight"
    w = {key: weights[key].to(torch.bfloat16)}
    out = comfyui_apply_lora(w, patches)
    assert out[key].dtype == torch.bfloat16
    torch.testing.assert_close(out[key].float(), (w[key].float() + up.half().float() @ down.half().float()),
                               atol=0.1, rtol=0.02)
