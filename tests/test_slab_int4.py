"""int4 slabs: the group-wise 4-bit code against torchao's int4 (tinygemm) primitives, Int4Linear against a
dequantized fp32 reference, the slab file and its safety rules, the planner's sizes, the CLI, and the quality gate
(a LoRA trained on the int4 / int8 base keeps >= 90% / >= 97% of the full base's loss reduction) for every family.
The GPU half (Triton kernel, streaming) is tests/test_slab_int4_gpu.py."""
import inspect
import json

import pytest
import torch
from torch import nn

from lowvram_lora.engine.config import LoraSettings
from lowvram_lora.engine.errors import ConfigError
from lowvram_lora.engine.families import families, get_family
from lowvram_lora.engine.families.tiny import tiny_transformer
from lowvram_lora.engine.offload.footprint import footprint_before_loading, measure_footprint
from lowvram_lora.engine.slab import (
    Int4Linear, SlabError, build_slab, ensure_slab, load_slab_transformer, manifest_path_for, verify_slab,
)
from lowvram_lora.engine.train.slab_quality import RECOVERY_GATE, lora_recovery
from lowvram_lora.engine.slab.quantize import (
    INT4_GROUP, dequantize_groups, pack_int4, quantize_groups, unpack_int4,
)
from lowvram_lora.engine.train.lora_attach import attach_lora, detach_lora

from helpers import int4_decode, model_inputs, slab_cli

#: Relative Frobenius error of an int4 tensor of Gaussian weights: rounding error range / (15 sqrt 12) per element,
#: the range of 64 Gaussians ~4.7 sigma: ~0.09 sigma (~0.06 on the tiny models' rows of 32-48, one group each).
INT4_BOUND = 0.10


def _torchao_tinygemm(w: torch.Tensor, group: int):
    """torchao's int4 weight-only code (tinygemm: asymmetric, float zero point, fp32 parameters here):
    (codes, scale, zero) and its dequantization."""
    from torchao.quantization.quant_primitives import (
        MappingType, _choose_qparams_affine_tinygemm, _dequantize_affine_tinygemm, _quantize_affine_tinygemm,
    )

    block = (1, group)
    scale, zero = _choose_qparams_affine_tinygemm(w, MappingType.ASYMMETRIC, block, torch.int32, 0, 15,
                                                  scale_dtype=torch.float32, zero_point_dtype=torch.float32)
    q = _quantize_affine_tinygemm(w, block, scale, zero, torch.int32, 0, 15)
    return q, scale, zero, lambda q_, s_, z_: _dequantize_affine_tinygemm(q_, block, s_, z_, torch.int32, 0, 15)


def test_int4_code_is_torchaos_tinygemm_code_with_fp16_parameters():
    """Independent reference: torchao's int4 weight-only primitives. Our (q, scale, min) read as tinygemm's
    (q, scale, zero = min + 8 scale) dequantize through torchao to our values; our error is torchao's own
    (fp32 parameters) within 2% (ours rounds scale and min to fp16 and the codes against them)."""
    torch.manual_seed(0)
    w = torch.randn(96, 4 * INT4_GROUP) * 0.02
    packed, scale, low = quantize_groups(w)
    q = unpack_int4(packed, w.shape[1]).to(torch.int32)
    ours = dequantize_groups(packed, scale, low, w.shape[1], torch.float32)
    _, _, _, dequant = _torchao_tinygemm(w, INT4_GROUP)
    s, m = scale.float(), low.float()
    torch.testing.assert_close(dequant(q, s, m + 8 * s), ours, rtol=1e-6, atol=1e-8)
    tq, ts, tz, _ = _torchao_tinygemm(w, INT4_GROUP)
    theirs = dequant(tq, ts, tz)
    err, ref_err = ((ours - w).norm() / w.norm()).item(), ((theirs - w).norm() / w.norm()).item()
    assert err < 1.02 * ref_err and err < INT4_BOUND, (err, ref_err)


def test_pack_and_ragged_groups():
    q = torch.randint(0, 16, (5, 77), dtype=torch.uint8)
    packed = pack_int4(q)
    assert packed.shape == (5, 39) and torch.equal(unpack_int4(packed, 77), q)
    assert torch.equal(packed[:, 0], q[:, 0] | (q[:, 1] << 4))  # column 2j low nibble, 2j + 1 high
    # 77 columns = one group of 64 + one of 13: each group's own min and max are exact after dequantization
    w = torch.randn(5, 77)
    packed, scale, low = quantize_groups(w)
    assert scale.shape == low.shape == (5, 2) and scale.dtype == torch.float16
    deq = dequantize_groups(packed, scale, low, 77, torch.float32)
    for cols in (slice(0, 64), slice(64, 77)):
        torch.testing.assert_close(deq[:, cols].amin(1), w[:, cols].amin(1), rtol=1e-3, atol=1e-4)
        torch.testing.assert_close(deq[:, cols].amax(1), w[:, cols].amax(1), rtol=2e-3, atol=2e-3)
    assert ((deq - w).abs() <= scale.float().repeat_interleave(64, 1)[:, :77] * 0.5 + 1e-3).all()


def test_non_finite_and_out_of_range_weights_are_refused():
    w = torch.randn(4, 64)
    w[1, 3] = float("nan")
    with pytest.raises(ValueError, match="non-finite"):
        quantize_groups(w)
    with pytest.raises(ValueError, match="--bits 8"):
        quantize_groups(torch.full((2, 64), 1e6) * torch.arange(64))


@pytest.mark.parametrize("bias", [True, False])
def test_int4_linear_forward_and_grad_input_match_a_dequantized_fp32_reference(bias):
    torch.manual_seed(0)
    module = Int4Linear.from_linear(nn.Linear(100, 48, bias=bias))
    w = dequantize_groups(module.weight_int4, module.weight_scale, module.weight_min, 100, torch.float32)
    x = torch.randn(3, 5, 100, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_(True)
    y, y_ref = module(x), nn.functional.linear(x_ref, w, module.bias)
    torch.testing.assert_close(y, y_ref, rtol=0, atol=1e-6)
    g = torch.randn(3, 5, 48)
    y.backward(g)
    y_ref.backward(g)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=1e-6)
    # state is buffers only (what a streamer moves); .to(dtype) keeps the packed codes and fp16 scales and mins
    scale = module.weight_scale.clone()
    module.to(torch.bfloat16)
    assert module.weight_int4.dtype == torch.uint8 and module.weight_scale.dtype == torch.float16
    assert torch.equal(module.weight_scale, scale) and list(module.named_parameters()) == []
    assert {n for n, _ in module.named_buffers()} == {n for n in Int4Linear.STREAMED_TENSORS if bias or n != "bias"}


@pytest.fixture(scope="module")
def int4_slab(tiny_pipeline, tmp_path_factory):
    return build_slab(tiny_pipeline, tmp_path_factory.mktemp("int4") / "t-int4.slab.safetensors", progress=False,
                      bits=4)


def test_int4_slab_file_manifest_and_load(int4_slab, tiny_pipeline):
    manifest = verify_slab(int4_slab, "full")
    assert manifest["format_version"] == 2
    q = manifest["quantization"]
    assert (q["bits"], q["group_size"], q["scale_dtype"]) == (4, INT4_GROUP, "float16")
    roles = {e["role"] for e in manifest["tensors"]}
    assert {"int4_weight", "scale", "group_min", "plain"} == roles
    assert 0 < manifest["summary"]["max_rel_error"] < INT4_BOUND
    model, family, _ = load_slab_transformer(int4_slab, torch.float32)
    assert isinstance(model.transformer_blocks[0].attn.to_q, Int4Linear)
    # peft wraps it with its standard LoRA Linear; B = 0 at init adds nothing; LoRA trains
    with torch.no_grad():
        before = model(**model_inputs(model))[0]
    params = attach_lora(model, family, LoraSettings(rank=4, alpha=4), seed=0)
    try:
        out = model(**model_inputs(model))[0]
        torch.testing.assert_close(out, before)
        out.square().mean().backward()
        assert all(p.grad is not None for p in params)
    finally:
        detach_lora(model)
    assert isinstance(model.transformer_blocks[0].attn.to_q, Int4Linear)


def test_int4_slab_safety_rules(int4_slab, tiny_pipeline, tmp_path):
    # an existing file is never replaced without --force, the source never
    with pytest.raises(SlabError, match="--force"):
        build_slab(tiny_pipeline, int4_slab, progress=False, bits=4)
    # a flipped byte inside a quantized tensor is found by the full check, and the error says how to rebuild
    copy = tmp_path / "c-int4.slab.safetensors"
    copy.write_bytes(int4_slab.read_bytes())
    manifest_path_for(copy).write_text(manifest_path_for(int4_slab).read_text().replace(int4_slab.name, copy.name))
    manifest = json.loads(manifest_path_for(copy).read_text())
    entry = next(e for e in manifest["tensors"] if e["role"] == "int4_weight")
    data = bytearray(copy.read_bytes())
    data[entry["offsets"][0] + 3] ^= 0xFF
    copy.write_bytes(bytes(data))
    with pytest.raises(SlabError, match="--bits 4"):
        verify_slab(copy, "full")
    # unknown bits: refused by name
    with pytest.raises(ConfigError, match="8 or 4"):
        build_slab(tiny_pipeline, tmp_path / "x.slab.safetensors", progress=False, bits=3)


def test_ensure_slab_keeps_int8_and_int4_apart(tiny_pipeline, tmp_path):
    slabs = tmp_path / "slabs"
    a4 = ensure_slab(tiny_pipeline, slabs, progress=False, bits=4)
    a8 = ensure_slab(tiny_pipeline, slabs, progress=False)
    assert a4 != a8 and a4.name.endswith("-int4.slab.safetensors")
    notes = []
    assert ensure_slab(tiny_pipeline, slabs, progress=False, bits=4, log=notes.append) == a4
    assert any("reusing" in n for n in notes)
    assert json.loads(manifest_path_for(a8).read_text())["format_version"] == 1  # int8 slabs stay readable by 1.x


def test_planner_sizes_of_an_int4_slab(int4_slab, tiny_pipeline, tmp_path):
    """Before loading, the footprint of an int4 slab equals that of the loaded slab (what streams per step), its
    blocks are smaller than the int8 slab's, and both count the same weights (FLOPs)."""
    lora = LoraSettings(rank=4)
    fp4, family, _ = footprint_before_loading(int4_slab, torch.bfloat16, lora)  # as training loads it
    model = load_slab_transformer(int4_slab, torch.bfloat16)[0]
    loaded = measure_footprint(model, family, trainable_params=fp4.trainable_params)
    assert (fp4.block_bytes, fp4.unit_bytes, fp4.other_bytes, fp4.block_params) == \
        (loaded.block_bytes, loaded.unit_bytes, loaded.other_bytes, loaded.block_params)
    assert "int4 slab" in fp4.name
    int8 = build_slab(tiny_pipeline, tmp_path / "t8.slab.safetensors", progress=False)
    fp8, _, _ = footprint_before_loading(int8, torch.bfloat16, lora)
    assert all(b4 < 0.85 * b8 for b4, b8 in zip(fp4.block_bytes, fp8.block_bytes))
    # the same weights: packed int4 counts two per byte; int8 also counts its row scales (out per Linear)
    assert all(abs(p4 - p8) / p8 < 0.1 for p4, p8 in zip(fp4.block_params, fp8.block_params))


def test_cli_builds_an_int4_slab(tiny_pipeline, tmp_path, capsys):
    out = tmp_path / "cli-int4.slab.safetensors"
    assert slab_cli("slab", "build", str(tiny_pipeline), "-o", str(out), "--bits", "4", "--quiet") == 0
    assert "int4 Linears" in capsys.readouterr().out
    assert json.loads(manifest_path_for(out).read_text())["quantization"]["bits"] == 4
    assert isinstance(load_slab_transformer(out, torch.float32)[0].transformer_blocks[0].ff.net[2], Int4Linear)


# --- the quality gate, every family ------------------------------------------------------------------------------


@pytest.mark.parametrize("family_id", sorted(families()))
def test_a_lora_trained_on_the_slab_works_on_the_full_base(family_id, tmp_path):
    """int4 >= 90% and int8 >= 97% of the full base's LoRA loss reduction (engine/train/slab_quality.py says how),
    on the family's tiny transformer (docs/int4.md has the table, the demo's pretrained model included)."""
    folder = tmp_path / "transformer"
    tiny_transformer(get_family(family_id)).save_pretrained(folder, safe_serialization=True)
    # lr 1e-2: every family's tiny LoRA then learns 7-33% in 40 steps (at the CLI's 3e-3 FLUX.3's learned 0.5%,
    # too little to judge a recovery by)
    rows = lora_recovery(folder, tmp_path, bits=(4, 8), lr=1e-2)
    for row in rows:
        print(row.as_dict())
        assert row.loss_full_lora < 0.995 * row.loss_base, row  # the LoRA learned something to recover
        assert row.recovery >= RECOVERY_GATE[row.bits], row
        assert row.weight_rel_error < (INT4_BOUND if row.bits == 4 else 0.012), row


@pytest.mark.parametrize("family_id", sorted(families()))
def test_every_familys_int4_slab_from_every_form(family_id, tmp_path):
    """The checkpoint-forms check for int4 (tests/test_checkpoint_reader.py has the full matrix for Flux.1 and
    Flux.2): the diffusers folder and the native single file (bf16; fp8 e4m3fn) of the family's tiny transformer,
    built into int4 slabs through the one checkpoint reader, decoded independently (``int4_decode``): every block
    Linear within INT4_BOUND of diffusers' from_pretrained (+0.04 for fp8's own rounding), the rest as stored."""
    from safetensors.torch import load_file

    from lowvram_lora.engine.families import family_fixtures
    from lowvram_lora.engine.slab.layout import block_linears

    family = get_family(family_id)
    pipe = tmp_path / "pipe"
    tiny_transformer(family).save_pretrained(pipe / "transformer", safe_serialization=True)
    ref_model = family.transformer_class().from_pretrained(pipe / "transformer", use_safetensors=True)
    ref = ref_model.float().state_dict()
    quantized = {f"{n}.weight" for n in block_linears(ref_model, family)}
    write = family_fixtures(family).write_single_file
    forms = {"diffusers": (pipe / "transformer", 0.0)}
    if "dtype" in inspect.signature(write).parameters:
        forms["bf16"] = (write(pipe, tmp_path / "bf16.safetensors", dtype=torch.bfloat16), 0.0)
        forms["fp8"] = (write(pipe, tmp_path / "fp8.safetensors", dtype=torch.float8_e4m3fn), 0.04)
    else:  # Flux.2's fixture writes as stored (its fp8 forms are in tests/test_checkpoint_reader.py's matrix)
        forms["native"] = (write(pipe, tmp_path / "native.safetensors"), 0.0)
    for form, (path, extra) in forms.items():
        slab = load_file(str(build_slab(path, tmp_path / f"{form}-int4.slab.safetensors", progress=False, bits=4)))
        assert {k[: -len("_int4")] for k in slab if k.endswith("_int4")} == quantized, form
        for name in quantized:
            if form == "fp8" and ref[name].abs().max() < 2 ** -6:  # tiny weights sit in e4m3's subnormals
                continue
            rel = ((int4_decode(slab, name, ref[name].shape[1]) - ref[name]).norm() / ref[name].norm()).item()
            assert rel < INT4_BOUND + extra, (form, name, rel)
        for name in set(ref) - quantized:
            if form != "fp8":
                assert torch.allclose(slab[name].float(), ref[name], rtol=1e-2, atol=1e-6), (form, name)
