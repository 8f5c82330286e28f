"""Adapter types (engine/lora_io/adapters/): LoHa, LoKr and DoRA beside LoRA, attached by peft, on float and int8 slab
Linears, trained, resumed and saved. The reference is peft's own merge (``helpers.peft_merged``) and, for DoRA's
diffusers file, diffusers' own loader. ComfyUI's own loader is checked in tests/comfyui/test_adapter_types_in_comfyui.py."""
import pytest
import torch
from torch import nn

from lowvram_lora.engine.config import ADAPTER_TYPES, AdapterConfig, LoraSettings, ModelConfig, TrainConfig
from lowvram_lora.engine.errors import ConfigError, LoraFormatError
from lowvram_lora.engine.lora_io import save_lora
from lowvram_lora.engine.lora_io.adapters import adapter_types, get_adapter
from lowvram_lora.engine.models import load_transformer
from lowvram_lora.engine.offload.footprint import lora_param_count
from lowvram_lora.engine.slab import Int8Linear, build_slab, load_slab_transformer
from lowvram_lora.engine.train import train_lora
from lowvram_lora.engine.train.lora_attach import adapter_parameters, attach_lora, detach_lora

from helpers import model_inputs, peft_merged

NEW = ("loha", "lokr", "dora")


def _settings(kind, rank=4, alpha=8.0, **adapter):
    return LoraSettings(rank=rank, alpha=alpha, adapter=AdapterConfig(type=kind, **adapter))


def test_every_configurable_type_has_a_handler_file():
    assert set(adapter_types()) == set(ADAPTER_TYPES)


@pytest.mark.parametrize("kwargs, match", [
    ({"type": "boft"}, "not one of lora, loha, lokr, dora"),
    ({"type": "lokr", "lokr_factor": 0}, "lokr_factor=0"),
])
def test_bad_adapter_settings_are_named(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        AdapterConfig(**kwargs)


def test_lora_dropout_is_refused_for_loha_and_lokr(tiny_pipeline):
    model, family, _, _ = load_transformer(tiny_pipeline, dtype=torch.float32)
    with pytest.raises(ConfigError, match="dropout=0.1 applies to lora and dora only"):
        attach_lora(model, family, LoraSettings(rank=2, alpha=2, dropout=0.1, adapter=AdapterConfig("loha")), 0)


@pytest.mark.parametrize("kind", ADAPTER_TYPES)
@pytest.mark.parametrize("lokr", [{}, {"lokr_factor": 4, "lokr_decompose_both": True}])
def test_the_plans_count_of_adapter_weights_is_what_peft_attaches(tiny_pipeline, kind, lokr):
    if lokr and kind != "lokr":
        pytest.skip("LoKr's own settings")
    model, family, _, _ = load_transformer(tiny_pipeline, dtype=torch.float32)
    settings = _settings(kind, rank=2, **lokr)
    planned = lora_param_count(model, family, settings)
    params = attach_lora(model, family, settings, seed=0)
    assert sum(p.numel() for p in params) == planned
    assert all(p.dtype == torch.float32 and p.requires_grad for p in params)
    assert [p for _, p in adapter_parameters(model)] == params


@pytest.fixture(scope="module")
def int8_model(tiny_pipeline, tmp_path_factory):
    slab = build_slab(tiny_pipeline, tmp_path_factory.mktemp("int8slab"), progress=False)
    return load_slab_transformer(slab, torch.float32)


@pytest.fixture(scope="module")
def int4_model(tiny_pipeline, tmp_path_factory):
    slab = build_slab(tiny_pipeline, tmp_path_factory.mktemp("int4slab"), progress=False, bits=4)
    return load_slab_transformer(slab, torch.float32)


def _float_copy(model):
    """The slab model with every Int8Linear / Int4Linear replaced by a plain fp32 Linear holding its dequantized
    weight."""
    import copy

    from lowvram_lora.engine.slab import Int4Linear

    ref = copy.deepcopy(model)
    for name, module in list(ref.named_modules()):
        if isinstance(module, (Int8Linear, Int4Linear)):
            plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
            with torch.no_grad():
                plain.weight.copy_(module.dequantized_weight(torch.float32))
                if module.bias is not None:
                    plain.bias.copy_(module.bias.float())
            plain.requires_grad_(False)
            parent, _, child = name.rpartition(".")
            setattr(ref.get_submodule(parent) if parent else ref, child, plain)
    return ref


def _forward_backward(model, family, settings):
    """Attach, set every adapter weight to seeded noise, one forward and backward; (output, grads, magnitudes)."""
    params = attach_lora(model, family, settings, seed=0)
    try:
        magnitudes = {n: p.detach().clone() for n, p in adapter_parameters(model) if "magnitude" in n}
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in adapter_parameters(model):
                if "magnitude" not in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.05)
        out = model(**model_inputs(model))[0]
        out.square().mean().backward()
        return out.detach(), {n: p.grad.clone() for n, p in adapter_parameters(model)}, magnitudes
    finally:
        detach_lora(model)


@pytest.mark.parametrize("kind", NEW)
def test_each_type_on_int8_slab_linears_equals_the_dequantized_float_model(int8_model, kind):
    """peft wraps our Int8Linear for every type; values and gradients equal those on plain fp32 Linears holding the
    dequantized weights. For DoRA this checks the glue: its magnitude starts at the dequantized weight's row norms
    (peft alone would take the norms of the raw int8 storage)."""
    model, family, _ = int8_model
    settings = _settings(kind)
    attach_lora(model, family, settings, seed=0)
    try:
        assert isinstance(model.transformer_blocks[0].attn.to_q.get_base_layer(), Int8Linear)
    finally:
        detach_lora(model)
    out, grads, mags = _forward_backward(model, family, settings)
    ref_out, ref_grads, ref_mags = _forward_backward(_float_copy(model), family, settings)
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-6)
    assert grads.keys() == ref_grads.keys() and grads
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)
    assert mags.keys() == ref_mags.keys() and (kind != "dora" or mags)
    q = model.transformer_blocks[0].attn.to_q
    for name, m in mags.items():
        torch.testing.assert_close(m, ref_mags[name], rtol=1e-5, atol=1e-7)
    if kind == "dora":
        key = "transformer_blocks.0.attn.to_q.lora_magnitude_vector.default.weight"
        torch.testing.assert_close(mags[key], torch.linalg.norm(q.dequantized_weight(torch.float32), dim=1))


def test_dora_on_int4_slab_linears_equals_the_dequantized_float_model(int4_model):
    """DoRA's float view covers the 4-bit slab Linear too: its magnitude starts at the dequantized weight's row norms,
    and values and gradients equal those on plain fp32 Linears holding the dequantized weights."""
    from lowvram_lora.engine.slab import Int4Linear

    model, family, _ = int4_model
    settings = _settings("dora")
    attach_lora(model, family, settings, seed=0)
    try:
        assert isinstance(model.transformer_blocks[0].attn.to_q.get_base_layer(), Int4Linear)
    finally:
        detach_lora(model)
    out, grads, mags = _forward_backward(model, family, settings)
    ref_out, ref_grads, ref_mags = _forward_backward(_float_copy(model), family, settings)
    torch.testing.assert_close(out, ref_out, rtol=1e-4, atol=1e-6)
    assert grads.keys() == ref_grads.keys() and grads
    for name, g in ref_grads.items():
        torch.testing.assert_close(grads[name], g, rtol=1e-4, atol=1e-6, msg=name)
    key = "transformer_blocks.0.attn.to_q.lora_magnitude_vector.default.weight"
    q = model.transformer_blocks[0].attn.to_q
    torch.testing.assert_close(mags[key], torch.linalg.norm(q.dequantized_weight(torch.float32), dim=1))
    torch.testing.assert_close(mags[key], ref_mags[key], rtol=1e-5, atol=1e-7)


@pytest.fixture(scope="module")
def trained(tiny_pipeline, one_image_cache):
    """kind -> a TrainedLora of 3 steps on one image (float base): weights away from their init."""
    runs = {}
    for kind in NEW:
        runs[kind] = train_lora(ModelConfig(transformer_path=str(tiny_pipeline)), one_image_cache, _settings(kind),
                                TrainConfig(steps=3, learning_rate=1e-2, seed=0, device="cpu"))
    return runs


# Each type lowers the flow loss on every family's tiny model: tests/test_adapter_families.py.


@pytest.mark.parametrize("kind", ("loha", "lokr"))
def test_loha_and_lokr_have_no_diffusers_file(trained, tmp_path, kind):
    with pytest.raises(LoraFormatError, match=f"diffusers has no loader for {kind}"):
        save_lora(trained[kind], tmp_path / "x.safetensors", fmt="diffusers")
    assert not (tmp_path / "x.safetensors").exists()


def test_a_dora_diffusers_file_loads_in_diffusers_as_peft_merges_it(tiny_pipeline, trained, tmp_path):
    """diffusers' own load_lora_adapter reads our DoRA file (peft's lora_magnitude_vector, alpha folded into B):
    the model's output equals that of peft's merge of the trained adapter."""
    from safetensors.torch import load_file

    lora = trained["dora"]
    path = save_lora(lora, tmp_path / "dora.safetensors", fmt="diffusers", dtype="fp32")
    keys = load_file(str(path))
    assert any(k.endswith("lora_magnitude_vector") for k in keys) and not any("dora_scale" in k for k in keys)
    base, family, _, _ = load_transformer(tiny_pipeline, dtype=torch.float32)
    expected = peft_merged(base, family, _settings("dora"), lora.state_dict)
    loaded, _, _, _ = load_transformer(tiny_pipeline, dtype=torch.float32)
    loaded.load_lora_adapter(str(path), prefix="transformer", adapter_name="file")
    with torch.no_grad():
        torch.testing.assert_close(loaded(**model_inputs(loaded))[0], expected(**model_inputs(expected))[0],
                                   rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", NEW)
def test_the_comfyui_file_holds_comfyuis_names_for_the_type(trained, tmp_path, kind):
    from safetensors.torch import load_file

    keys = load_file(str(save_lora(trained[kind], tmp_path / f"{kind}.safetensors", dtype="fp32")))
    q = "transformer.transformer_blocks.0.attn.to_q"
    expected = {"loha": {"hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "alpha"},
                "lokr": {"lokr_w1", "lokr_w2"},  # both factors full at this size: no rank, no alpha (scale 1)
                "dora": {"lora_A.weight", "lora_B.weight", "alpha", "dora_scale"}}[kind]
    assert {k[len(q) + 1:] for k in keys if k.startswith(q + ".")} == expected
    if kind == "dora":
        assert keys[f"{q}.dora_scale"].shape == (32, 1)  # (out, 1): ComfyUI divides row by row


# Resume with each type (and EMA) is bit-exact: tests/test_ema_snapshots.py.
