"""The "native_fused" ComfyUI LoRA form (Lumina 2): per-projection LoRAs joined on the fused native Linears.

ComfyUI maps diffusers-named Lumina 2 LoRAs nowhere (its Lumina2 branch assumes Z-Image's names and MHA
offsets; new-families-facts §4.5), but its generic key map takes ``diffusion_model.<module>`` for every
``diffusion_model.<module>.weight`` of the model and applies ``W += alpha / rank * up @ down``
(``comfy/lora.py`` ``model_lora_keys_unet``, ``weight_adapter/lora.py``). So the file must say, per native
Linear, one LoRA whose delta equals the per-projection deltas in their row ranges of the fused ``qkv``.
References: the deltas computed per projection (B @ A, placed by the name table), and peft's own merge of
the same LoRA into the diffusers model, re-fused with the table.
"""
import json

import pytest
import torch

from lowvram_lora.engine.families import get_family
from lowvram_lora.engine.families.names import join_diffusers_tensors
from lowvram_lora.engine.lora_io.formats import from_native_fused, to_comfyui_form, to_native_fused

FAMILY = get_family("lumina2")
CONFIG = FAMILY.load_config(FAMILY.tiny_variant)


def _model():
    torch.manual_seed(0)
    return FAMILY.transformer_class().from_config(CONFIG).eval()


def _random_lora(model, rank_of=lambda name: 3, skip=()) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    state = {}
    for name in FAMILY.lora.target_modules(model):
        if name in skip:
            continue
        linear = model.get_submodule(name)
        r = rank_of(name)
        state[f"{name}.lora_A.weight"] = torch.randn(r, linear.in_features, generator=gen)
        state[f"{name}.lora_B.weight"] = torch.randn(linear.out_features, r, generator=gen)
    return state


def _comfyui_deltas(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What ComfyUI adds to each ``diffusion_model.<module>.weight``: alpha / rank * up @ down."""
    out = {}
    for key in sd:
        if key.endswith(".lora_down.weight"):
            base = key[: -len(".lora_down.weight")]
            down, up, alpha = sd[key], sd[f"{base}.lora_up.weight"], sd[f"{base}.alpha"]
            out[base[len("diffusion_model."):] + ".weight"] = up @ down * (float(alpha) / down.shape[0])
    return out


def test_keys_are_native_modules_comfyui_maps():
    """Every key names a Linear weight of the native file (``diffusion_model.X`` -> ``X.weight``), with a float32
    scalar alpha equal to the total rank (scale 1); q/k/v of a block are one ``attention.qkv`` LoRA of rank 3r."""
    model = _model()
    sd = to_native_fused(_random_lora(model), FAMILY.param_table(CONFIG))
    native = {p.name for p in FAMILY.param_table(CONFIG)}
    for key in sd:
        assert key.startswith("diffusion_model."), key
        module = key[len("diffusion_model."):].rsplit(".lora_", 1)[0].removesuffix(".alpha")
        assert f"{module}.weight" in native, key
    qkv = "diffusion_model.layers.1.attention.qkv"
    dim, kv = CONFIG["hidden_size"], CONFIG["num_kv_heads"] * CONFIG["hidden_size"] // CONFIG["num_attention_heads"]
    assert sd[f"{qkv}.lora_down.weight"].shape == (9, dim)
    assert sd[f"{qkv}.lora_up.weight"].shape == (dim + 2 * kv, 9)
    assert sd[f"{qkv}.alpha"].dtype == torch.float32 and sd[f"{qkv}.alpha"].dim() == 0 and float(sd[f"{qkv}.alpha"]) == 9
    blocks = 2 * CONFIG["num_refiner_layers"] + CONFIG["num_layers"]
    assert len(sd) == 3 * 2 * blocks  # qkv + out per block, three tensors each


@pytest.mark.parametrize("case", ["uniform", "mixed_ranks_and_missing_parts"])
def test_native_delta_is_the_per_projection_deltas_in_their_rows(case):
    model = _model()
    table = FAMILY.param_table(CONFIG)
    if case == "uniform":
        state = _random_lora(model)
    else:  # different ranks per projection; a block without to_k, another without to_q and to_out
        state = _random_lora(model, rank_of=lambda n: {"to_q": 2, "to_k": 4, "to_v": 1}.get(n.split(".")[-1], 3),
                             skip=("layers.0.attn.to_k", "noise_refiner.0.attn.to_q", "noise_refiner.0.attn.to_out.0"))
    deltas = _comfyui_deltas(to_native_fused(state, table))
    checked = 0
    for param in table:
        present = [p for p in param.parts if f"{p.name.removesuffix('.weight')}.lora_A.weight" in state]
        if not present:
            assert param.name not in deltas
            continue
        expected = torch.zeros(param.rows, deltas[param.name].shape[1])
        for part in param.parts:
            module = part.name.removesuffix(".weight")
            if f"{module}.lora_A.weight" in state:
                expected[part.offset:part.offset + part.rows] = (state[f"{module}.lora_B.weight"]
                                                                 @ state[f"{module}.lora_A.weight"])
        torch.testing.assert_close(deltas[param.name], expected, rtol=0, atol=1e-6)
        checked += 1
    assert checked == len(deltas) and checked > 0


@pytest.mark.parametrize("case", ["uniform", "mixed"])
def test_round_trip_is_exact(case):
    model = _model()
    table = FAMILY.param_table(CONFIG)
    state = (_random_lora(model) if case == "uniform" else
             _random_lora(model, rank_of=lambda n: 1 + len(n) % 3, skip=("context_refiner.0.attn.to_v",)))
    back = from_native_fused(to_native_fused(state, table), table)
    assert set(back) == set(state)
    for k in state:
        torch.testing.assert_close(back[k], state[k], rtol=0, atol=0)


def test_comfyui_application_equals_peft_merge():
    """Independent reference: peft merges the same LoRA (scale 1) into the diffusers model; the native weights
    plus ComfyUI's deltas, split with the table, are those merged weights (1e-6)."""
    from peft import LoraConfig, inject_adapter_in_model, set_peft_model_state_dict

    model = _model()
    table = FAMILY.param_table(CONFIG)
    state = _random_lora(model)
    native = {p.name: join_diffusers_tensors(p, model.state_dict()) for p in table}
    for name, delta in _comfyui_deltas(to_native_fused(state, table)).items():
        native[name] = native[name] + delta
    merged = model
    inject_adapter_in_model(LoraConfig(r=3, lora_alpha=3, target_modules=FAMILY.lora.target_modules(model)), merged)
    result = set_peft_model_state_dict(merged, state)
    assert not result.unexpected_keys
    for module in FAMILY.lora.target_modules(merged):
        merged.get_submodule(module).merge()
    merged_sd = {k.replace(".base_layer", ""): v for k, v in merged.state_dict().items() if "lora_" not in k}
    for param in table:
        torch.testing.assert_close(native[param.name], join_diffusers_tensors(param, merged_sd), rtol=0, atol=1e-6)


def test_comfyui_form_follows_the_family():
    model = _model()
    state = _random_lora(model)
    sd = to_comfyui_form(state, FAMILY, CONFIG)
    assert all(k.startswith("diffusion_model.") for k in sd)


def test_save_and_load_lora_files(tmp_path):
    """Through the LoRA file API: "comfyui" for Lumina 2 writes the native form and reads back the same LoRA.
    Needs engine/lora_io/files.py to import (the lead's family-interface change of the engine)."""
    from safetensors.torch import load_file

    from lowvram_lora.engine.lora_io.files import load_lora, save_lora
    from lowvram_lora.engine.lora_io.trained import TrainedLora

    model = _model()
    state = _random_lora(model)
    lora = TrainedLora(state_dict=state, rank=3, alpha=6.0, family="lumina2", variant=FAMILY.tiny_variant, steps=1,
                       requested_steps=1, model_config=CONFIG)
    path = save_lora(lora, tmp_path / "lumina.safetensors", fmt="comfyui", dtype="fp32")
    sd = load_file(str(path))
    assert sd and all(k.startswith("diffusion_model.") for k in sd)
    loaded = load_lora(path)
    assert loaded.format == "comfyui" and json.loads(loaded.metadata["lowvram_lora.model_config"]) == CONFIG
    for k in state:
        expected = state[k] * (2.0 if ".lora_B." in k else 1.0)  # alpha / rank = 2 folded into B
        torch.testing.assert_close(loaded.state_dict[k], expected, rtol=0, atol=1e-6)
