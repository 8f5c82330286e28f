"""Numbers checked on every path: for every family and every file form we accept, the weights each path
produces (bf16 load, slab build then dequantize, the footprint before loading) against the reference
model, which diffusers' own ``from_pretrained`` reads from the pipeline folder.

Tolerances (relative Frobenius error per tensor, ``|a - b| / |b|``):
- lossless forms (diffusers folder, original names in the stored dtype, bf16, fp16): bit for bit against the
  reference cast to the form's dtype;
- fp8 forms: bit for bit against the independent decode ``fp8.float() * scale`` of what the file holds, and
  within FP8_BOUND of the reference (e4m3 keeps 3 mantissa bits: at most 2^-4 per element, ~0.02-0.03 over
  a tensor of Gaussian weights, per-tensor scale);
- slabs: int8 rows within INT8_BOUND of the source's decode (one scale per row, error at most scale / 2 per
  element: ~0.005 over a Gaussian row), and within INT8_BOUND + FP8_BOUND of the reference; int4 slabs within
  INT4_BOUND (groups of 64 with a min and a scale = range / 15: rounding error range / (15 sqrt 12) per element,
  ~0.09 of a Gaussian tensor's norm, ~0.06 on these tiny rows of one 32-48 wide group) and INT4_BOUND + FP8_BOUND.
"""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from lowvram_lora.engine.checkpoint import identify
from lowvram_lora.engine.config import LoraSettings
from lowvram_lora.engine.errors import ModelLoadError
from lowvram_lora.engine.families import get_family
from lowvram_lora.engine.families.names import join_diffusers_tensors, split_native_tensor
from lowvram_lora.engine.models import load_transformer
from lowvram_lora.engine.offload.footprint import footprint_before_loading, measure_footprint
from lowvram_lora.engine.slab import build_slab, ensure_slab, load_slab_transformer, manifest_path_for

from helpers import int4_decode

FP8_BOUND = 0.04
INT8_BOUND = 0.012
INT4_BOUND = 0.10
LOSSLESS = ("diffusers", "transformer_folder", "bfl", "bfl_bf16", "bfl_fp16")
FP8 = ("fp8_plain", "scaled_fp8", "comfy_fp8mixed", "comfy_fp8_rowscale")
FORMS = LOSSLESS + FP8
COMFY_PREFIX = "model.diffusion_model."


def _is_block_weight(name: str, t: torch.Tensor) -> bool:
    return name.endswith(".weight") and t.ndim == 2 and name.startswith(("double_blocks.", "single_blocks."))


def _write_form(family, pipeline, form: str, folder):
    """Writes ``form`` of the pipeline's transformer; returns (path, {original name: decoded fp32 tensor})."""
    if form == "diffusers":
        return pipeline, None
    if form == "transformer_folder":
        return pipeline / "transformer", None
    config = json.loads((pipeline / "transformer" / "config.json").read_text())
    state = load_file(str(pipeline / "transformer" / "diffusion_pytorch_model.safetensors"))
    bfl = {p.name: join_diffusers_tensors(p, state).contiguous() for p in family.param_table(config)}
    out, decoded = {}, {}
    for name, t in bfl.items():
        if form in LOSSLESS:
            dtype = {"bfl": t.dtype, "bfl_bf16": torch.bfloat16, "bfl_fp16": torch.float16}[form]
            out[name] = t.to(dtype)
            decoded[name] = out[name].float()
        elif not _is_block_weight(name, t):
            out[(COMFY_PREFIX if form.startswith("comfy") else "") + name] = t.to(torch.bfloat16)
            decoded[name] = t.to(torch.bfloat16).float()
        elif form == "fp8_plain":
            out[name] = t.to(torch.float8_e4m3fn)
            decoded[name] = out[name].float()
        else:
            base = name[: -len(".weight")]
            rows = form == "comfy_fp8_rowscale"
            scale = (t.abs().amax(dim=1) if rows else t.abs().max()).float() / 448.0
            q = (t.float() / (scale[:, None] if rows else scale)).to(torch.float8_e4m3fn)
            decoded[name] = q.float() * (scale[:, None] if rows else scale)
            if form == "scaled_fp8":  # the legacy form: scaled_fp8 marker, per-layer scale_weight
                out[name], out[f"{base}.scale_weight"] = q, scale.reshape(1)
                out["scaled_fp8"] = torch.zeros(0, dtype=torch.float8_e4m3fn)
            else:  # ComfyUI's mixed files: prefixed, weight_scale + comfy_quant tag
                out[COMFY_PREFIX + name] = q
                out[f"{COMFY_PREFIX}{base}.weight_scale"] = scale if rows else scale.reshape(())
                out[f"{COMFY_PREFIX}{base}.comfy_quant"] = torch.tensor(
                    list(json.dumps({"format": "float8_e4m3fn"}).encode()), dtype=torch.uint8)
    path = folder / f"{family.id}-{form}.safetensors"
    save_file(out, str(path))
    expected = {}
    for param in family.param_table(config):
        expected.update({k: v.clone() for k, v in split_native_tensor(param, decoded[param.name]).items()})
    return path, expected


@pytest.fixture(scope="module")
def references(tiny_pipeline, tiny_flux2):
    """family id -> (pipeline folder, diffusers' own fp32 state dict of its transformer)."""
    out = {}
    for fid, pipe in (("flux1", tiny_pipeline), ("flux2", tiny_flux2)):
        model = get_family(fid).transformer_class().from_pretrained(pipe / "transformer", use_safetensors=True,
                                                               torch_dtype=torch.float32, local_files_only=True)
        out[fid] = (pipe, model)
    return out


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)).item()


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("family_id", ["flux1", "flux2"])
def test_every_path_gives_the_reference_weights(family_id, form, references, tmp_path):
    family = get_family(family_id)
    pipe, ref_model = references[family_id]
    ref = ref_model.state_dict()
    path, decoded = _write_form(family, pipe, form, tmp_path)

    # Identity: once, from headers.
    ident = identify(path)
    assert (ident.family.id, ident.variant) == (family_id, f"{family_id}-tiny")

    # Path 1: loading.
    loaded = load_transformer(path, dtype=torch.float32)[0].state_dict()
    assert loaded.keys() == ref.keys()
    for name, r in ref.items():
        if form in ("diffusers", "transformer_folder", "bfl"):
            assert torch.equal(loaded[name], r), name
        elif form in LOSSLESS:  # the reference cast to bf16 / fp16, bit for bit
            assert torch.equal(loaded[name], r.to({"bfl_bf16": torch.bfloat16, "bfl_fp16": torch.float16}[form]).float()), name
        else:
            assert torch.equal(loaded[name], decoded[name]), name  # exactly the fp8 values times their scale
            if form != "fp8_plain":  # unscaled fp8 of tiny weights sits in subnormals: far from the reference
                assert _rel(loaded[name], r) < FP8_BOUND, (name, _rel(loaded[name], r))

    # Path 2: slab build, then dequantize what the slab file holds (int8 * row scale), read independently.
    slab_path = build_slab(path, tmp_path / "s.slab.safetensors", progress=False)
    slab = load_file(str(slab_path))
    source = decoded if decoded is not None else ref
    int8_names = [k[: -len("_int8")] for k in slab if k.endswith(".weight_int8")]
    assert int8_names, "the slab quantized nothing"
    for name in int8_names:
        deq = slab[name + "_int8"].float() * slab[name[: -len("weight")] + "weight_scale"].float()[:, None]
        assert _rel(deq, source[name]) < INT8_BOUND, (name, _rel(deq, source[name]))
        if form != "fp8_plain":
            bound = INT8_BOUND + (FP8_BOUND if form in FP8 else 0.0)
            assert _rel(deq, ref[name]) < bound, (name, _rel(deq, ref[name]))
    for name, r in ref.items():  # everything else as stored (fp8 outside blocks would become bf16)
        if name not in int8_names:
            assert torch.equal(slab[name].float(), source[name].to(slab[name].dtype).float()), name

    # Path 2b: the int4 slab of the same file, decoded independently (tests/helpers.int4_decode): the same Linears.
    slab4 = load_file(str(build_slab(path, tmp_path / "s4.slab.safetensors", progress=False, bits=4)))
    assert sorted(k[: -len("_int4")] for k in slab4 if k.endswith(".weight_int4")) == sorted(int8_names)
    for name in int8_names:
        deq = int4_decode(slab4, name, source[name].shape[1])
        assert _rel(deq, source[name]) < INT4_BOUND, (name, _rel(deq, source[name]))
        if form != "fp8_plain":
            assert _rel(deq, ref[name]) < INT4_BOUND + (FP8_BOUND if form in FP8 else 0.0), name
    for name in ref:
        if name not in int8_names:
            assert torch.equal(slab4[name].float(), slab[name].float()), name

    # Path 3: the footprint before loading equals the footprint of diffusers' model.
    lora = LoraSettings(rank=4)
    fp, fam, variant = footprint_before_loading(path, torch.float32, lora)
    want = measure_footprint(ref_model.requires_grad_(False), family,
                             trainable_params=fp.trainable_params)
    assert (fam.id, variant) == (family_id, f"{family_id}-tiny")
    assert (fp.block_names, fp.block_bytes, fp.other_bytes, fp.unit_bytes, fp.hidden_size) == \
        (want.block_names, want.block_bytes, want.other_bytes, want.unit_bytes, want.hidden_size)


def test_fp8mixed_slab_equals_the_bf16_slab_within_fp8_and_int8_error(tiny_flux2, tmp_path):
    """The reproduction of issue 22: 32 tensors compared, worst relative difference was 5082."""
    from lowvram_lora.engine.testing import write_flux2_single_file

    fp8 = write_flux2_single_file(tiny_flux2, tmp_path / "fp8mixed.safetensors", comfy_fp8=True)
    bf = write_flux2_single_file(tiny_flux2, tmp_path / "bfl.safetensors")
    a = load_file(str(build_slab(fp8, tmp_path / "a.slab.safetensors", family="flux2", progress=False)))
    b = load_file(str(build_slab(bf, tmp_path / "b.slab.safetensors", family="flux2", progress=False)))
    names = [k[: -len("_int8")] for k in a if k.endswith("_int8")]
    worst = max(_rel(a[n + "_int8"].float() * a[n[:-6] + "weight_scale"][:, None],
                     b[n + "_int8"].float() * b[n[:-6] + "weight_scale"][:, None]) for n in names)
    assert len(names) == 32 and worst < 2 * INT8_BOUND + FP8_BOUND, worst


# --- named refusals ---------------------------------------------------------------------------------


def _fp8_file(tiny_single_file, tmp_path, edit):
    state = {COMFY_PREFIX + k: v for k, v in load_file(str(tiny_single_file)).items()}
    key = COMFY_PREFIX + "double_blocks.0.img_attn.qkv"
    w = state[key + ".weight"]
    state[key + ".weight"] = (w / (w.abs().max() / 448)).to(torch.float8_e4m3fn)
    state[key + ".weight_scale"] = (w.abs().max() / 448).reshape(())
    state[key + ".comfy_quant"] = torch.tensor(list(b'{"format": "float8_e4m3fn"}'), dtype=torch.uint8)
    edit(state, key)
    path = tmp_path / "edited.safetensors"
    save_file(state, str(path))
    return path


@pytest.mark.parametrize("edit, match", [
    (lambda s, k: s.__setitem__(k + ".comfy_quant", torch.tensor(list(b'{"format": "nvfp4"}'), dtype=torch.uint8)),
     "'double_blocks.0.img_attn.qkv' is stored as 'nvfp4'.*cannot dequantize"),
    (lambda s, k: s.__setitem__(k + ".weight_scale_2", torch.ones(())), "weight_scale_2: nvfp4"),
    (lambda s, k: s.__setitem__(k + ".weight_scale", torch.ones(3, 5)), "block-wise format"),
    (lambda s, k: s.__setitem__(k + ".weight", torch.zeros(s[k + ".weight"].shape, dtype=torch.int8)),
     "stored as torch.int8"),
])
def test_formats_that_cannot_be_decoded_are_refused_by_name(tiny_single_file, tmp_path, edit, match):
    path = _fp8_file(tiny_single_file, tmp_path, edit)
    for action in (lambda: load_transformer(path), lambda: build_slab(path, tmp_path / "x.slab.safetensors",
                                                                          progress=False)):
        with pytest.raises(ModelLoadError, match=match):
            action()
    assert not (tmp_path / "x.slab.safetensors").exists()


def test_quantization_metadata_in_the_header_is_read(tiny_single_file, tmp_path):
    """ComfyUI's other spelling of per-layer formats: the header's ``_quantization_metadata``."""
    path = _fp8_file(tiny_single_file, tmp_path, lambda s, k: s.pop(k + ".comfy_quant"))
    state = load_file(str(path))
    meta = {"_quantization_metadata": json.dumps(
        {"format_version": "1.0", "layers": {COMFY_PREFIX + "double_blocks.0.img_attn.qkv": {"format": "nvfp4"}}})}
    save_file(state, str(path), metadata=meta)
    with pytest.raises(ModelLoadError, match="stored as 'nvfp4'"):
        load_transformer(path)


@pytest.mark.parametrize("name, match", [("model.gguf", "GGUF"), ("model.ckpt", "pickle"), ("model.pt", "pickle")])
def test_gguf_and_pickles_are_refused_by_name(tmp_path, name, match):
    (tmp_path / name).write_bytes(b"\0" * 64)
    with pytest.raises(ModelLoadError, match=match):
        load_transformer(tmp_path / name)


# --- slabs built under the old rule -----------------------------------------------------------------


def test_a_slab_built_from_fp8_by_the_old_reader_is_not_reused(tiny_flux2, tmp_path):
    from lowvram_lora.engine.testing import write_flux2_single_file

    fp8 = write_flux2_single_file(tiny_flux2, tmp_path / "m" / "flux2_fp8mixed.safetensors", comfy_fp8=True)
    slabs = tmp_path / "slabs"
    fresh = ensure_slab(fp8, slabs, progress=False)
    # What the old version left: the same file under the key without the decoder version, a manifest
    # without ``decoder_version``.
    from lowvram_lora.engine.checkpoint import open_checkpoint

    legacy = open_checkpoint(fp8).fingerprint()["legacy_key"]
    old = slabs / f"flux2_fp8mixed-{legacy[:12]}.slab.safetensors"
    fresh.rename(old)
    manifest = json.loads(manifest_path_for(fresh).read_text())
    manifest["source"].pop("decoder_version")
    manifest["source"]["key"] = legacy
    manifest_path_for(fresh).unlink()
    manifest_path_for(old).write_text(json.dumps(manifest))
    with pytest.raises(Exception, match="older lowvram-lora that ignored ComfyUI's per-layer weight_scale"):
        load_slab_transformer(old, torch.float32)
    notes = []
    rebuilt = ensure_slab(fp8, slabs, progress=False, log=notes.append)
    assert rebuilt != old and rebuilt.exists()
    assert any("older version that ignored its fp8 weight_scale" in n for n in notes), notes


# --- the dataset cache is checked against the model before it loads -----------------------------------


def _must_not_load(*args, **kwargs):
    raise AssertionError("the transformer was loaded before the cache was checked")


def test_a_cache_of_another_width_is_refused_before_loading(tiny_flux2, tiny_flux2_cache, tmp_path, monkeypatch):
    """A Flux.2-dev cache (15360 wide) given to a klein model (7680 wide), in tiny: a 48-wide cache, a 32-wide model."""
    from lowvram_lora.engine.config import ModelConfig, TrainConfig
    from lowvram_lora.engine.errors import ConfigError
    from lowvram_lora.engine.families import get_family
    from lowvram_lora.engine.train import loop, train_lora

    family = get_family("flux2")
    narrow = family.transformer_class().from_config(dict(get_family("flux2").load_config("flux2-tiny"), joint_attention_dim=32))
    narrow.save_pretrained(tmp_path / "klein-like", safe_serialization=True)
    monkeypatch.setattr(loop, "load_transformer", _must_not_load)
    with pytest.raises(ConfigError, match=r"'prompt_embeds' are 48 wide .* takes 32; run Cache Text Embeds again"):
        train_lora(ModelConfig(transformer_path=str(tmp_path / "klein-like")), tiny_flux2_cache, LoraSettings(rank=2),
                   TrainConfig(steps=1, device="cpu"))


def test_a_cache_of_another_family_is_refused_before_loading(tiny_single_file, tiny_flux2_cache, monkeypatch):
    from lowvram_lora.engine.config import ModelConfig, TrainConfig
    from lowvram_lora.engine.errors import ConfigError
    from lowvram_lora.engine.train import loop, train_lora

    monkeypatch.setattr(loop, "load_transformer", _must_not_load)
    with pytest.raises(ConfigError, match="built for flux2 but the model is flux1"):
        train_lora(ModelConfig(transformer_path=str(tiny_single_file)), tiny_flux2_cache, LoraSettings(rank=2),
                   TrainConfig(steps=1, device="cpu"))
