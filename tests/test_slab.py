"""Int8 slabs: build -> load round trip, name map, identical builds from every source
form, damaged and interrupted slabs, reuse, the CLI, and a bounded build RAM."""
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file

from lowvram_lora.engine.families import get_family
from lowvram_lora.engine.models import load_transformer
from lowvram_lora.engine.slab import (
    Int8Linear, SlabError, build_slab, ensure_slab, load_slab_transformer, manifest_path_for,
    verify_slab,
)
from lowvram_lora.engine.checkpoint import KEY_PREFIXES, open_checkpoint
from lowvram_lora.engine.checkpoint.tensors import strip_prefix
from lowvram_lora.engine.slab.testing import write_random_checkpoint

from helpers import model_inputs, slab_cli


def reference_quantize(w):
    """Written out independently of engine/slab/quantize.py: per-row symmetric int8."""
    w = w.double()
    scale = (w.abs().max(dim=1).values / 127).float()  # fp32 scale as stored
    q = torch.round(w / torch.where(scale > 0, scale, 1).double()[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


@pytest.fixture(scope="module")
def slab(tiny_pipeline, tmp_path_factory):
    return build_slab(tiny_pipeline, tmp_path_factory.mktemp("slab"), progress=False)


@pytest.fixture
def slab_copy(slab, tmp_path):
    """A private copy to damage."""
    dst = tmp_path / slab.name
    shutil.copy(slab, dst)
    shutil.copy(manifest_path_for(slab), manifest_path_for(dst))
    return dst


def _manifest(path):
    return json.loads(manifest_path_for(path).read_text())


# --- round trip ---------------------------------------------------------------------


def test_round_trip_is_bit_exact_against_an_independent_quantization(tiny_pipeline, slab):
    source, family, _, _ = load_transformer(tiny_pipeline, dtype=torch.float32)
    src = source.state_dict()
    model, fam, variant = load_slab_transformer(slab, torch.float32)
    assert fam is family and variant == "flux1-tiny"
    int8 = {n: m for n, m in model.named_modules() if isinstance(m, Int8Linear)}
    # every Linear inside every block, and nothing outside the blocks
    expected = {n for n, m in source.named_modules() if isinstance(m, torch.nn.Linear) and "transformer_blocks." in n}
    assert set(int8) == expected and len(expected) == 2 * 14 + 2 * 6
    for name, module in int8.items():
        q, scale = reference_quantize(src[f"{name}.weight"])
        assert torch.equal(module.weight_int8, q), name
        assert torch.equal(module.weight_scale, scale), name
        assert torch.equal(module.bias, src[f"{name}.bias"]), name
    state = model.state_dict()
    for key, value in src.items():  # everything else is stored as in the checkpoint
        if key.rpartition(".")[0] not in int8:
            assert state[key].dtype == torch.float32 and torch.equal(state[key], value), key
    manifest = _manifest(slab)
    entries = {e["key"]: e for e in manifest["tensors"]}
    for name, module in int8.items():
        e = entries[f"{name}.weight_int8"]
        assert e["canonical"] == f"{name}.weight" and e["dtype"] == "int8" and e["scale_key"] == f"{name}.weight_scale"
        w = src[f"{name}.weight"]
        rel = (module.dequantized_weight() - w).norm() / w.norm()
        assert e["rel_error"] == pytest.approx(rel.item(), rel=1e-4)
    assert manifest["config"]["num_layers"] == 2 and manifest["family"] == "flux1"


def test_int8_model_output_is_close_to_the_source(tiny_pipeline, slab):
    source = load_transformer(tiny_pipeline, dtype=torch.float32)[0]
    model = load_slab_transformer(slab, torch.float32)[0]
    with torch.no_grad():
        ref, out = source(**model_inputs(source))[0], model(**model_inputs(model))[0]
    assert (out - ref).norm() / ref.norm() < 0.01


def test_slab_int8_tensors_are_memory_mapped_not_copied(slab):
    if not os.path.exists("/proc/self/maps"):
        pytest.skip("needs Linux /proc/self/maps")
    model = load_slab_transformer(slab, torch.float32)[0]
    maps = []
    for line in open("/proc/self/maps"):
        if line.rstrip().endswith(str(slab.resolve())):
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            maps.append((lo, hi))
    # int8 weights and scales point into the file's mapping (page cache); plain tensors converted to fp32 do not
    for module in (model.transformer_blocks[0].attn.to_q, model.single_transformer_blocks[1].proj_out):
        for t in (module.weight_int8, module.weight_scale):
            assert any(lo <= t.data_ptr() < hi for lo, hi in maps)


@pytest.mark.parametrize("shape", [(3072, 3072), (512, 15360), (64, 12288)])
def test_dequantized_error_on_gaussian_weights_is_below_1_5_percent(shape):
    from lowvram_lora.engine.slab import dequantize_rows, quantize_rows

    w = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * 0.02
    q, scale = quantize_rows(w)
    rel = ((dequantize_rows(q, scale, torch.float32) - w).norm() / w.norm()).item()
    assert 0.002 < rel < 0.015, rel


def test_gaussian_checkpoint_build_reports_error_below_1_5_percent(tmp_path):
    cfg = dict(get_family("flux1").load_config("flux1-tiny"), num_attention_heads=4, attention_head_dim=32,
               axes_dims_rope=[8, 12, 12], num_layers=1, num_single_layers=1)
    folder = write_random_checkpoint(tmp_path / "gauss", config=cfg, layout="diffusers", dtype=torch.float32)
    manifest = _manifest(build_slab(folder, tmp_path / "out", progress=False))
    errors = [e["rel_error"] for e in manifest["tensors"] if e["role"] == "int8_weight"]
    assert len(errors) == 14 + 6 and max(errors) < 0.015 and manifest["summary"]["max_rel_error"] == max(errors)


# --- every source form gives the same slab ----------------------------------------------


def test_bfl_single_file_and_diffusers_folder_give_identical_slabs(tiny_pipeline, tiny_single_file, slab, tmp_path):
    from_file = build_slab(tiny_single_file, tmp_path / "a.slab.safetensors", progress=False)
    from_sub = build_slab(tiny_pipeline / "transformer", tmp_path / "b.slab.safetensors", progress=False)
    assert from_file.read_bytes() == slab.read_bytes() == from_sub.read_bytes()
    a, b = _manifest(from_file), _manifest(slab)
    assert a["tensors"] == b["tensors"] and a["config"] == b["config"] and a["variant"] == b["variant"]
    assert a["source"]["kind"] == "single_file" and b["source"]["kind"] == "diffusers"


def test_prefixed_single_file_gives_the_same_slab(tiny_single_file, slab, tmp_path):
    state = load_file(str(tiny_single_file))
    prefixed = tmp_path / "comfy-full.safetensors"
    save_file({f"model.diffusion_model.{k}": v for k, v in state.items()}, str(prefixed))
    assert build_slab(prefixed, tmp_path / "p.slab.safetensors", progress=False).read_bytes() == slab.read_bytes()


def test_scaled_fp8_single_file_builds_and_loads(tiny_single_file, tiny_pipeline, tmp_path):
    """ComfyUI's scaled fp8 files: fp8 weights times a per-tensor ``.scale_weight``."""
    state = load_file(str(tiny_single_file))
    fp8 = {}
    for k, v in state.items():
        if k.endswith(".weight") and v.ndim == 2:
            s = v.abs().max() / 448.0
            fp8[k] = (v / s).to(torch.float8_e4m3fn)
            fp8[k[: -len(".weight")] + ".scale_weight"] = s.reshape(1)
        else:
            fp8[k] = v.to(torch.bfloat16)
    path = tmp_path / "flux1-tiny-fp8-scaled.safetensors"
    save_file(fp8, str(path))
    out = build_slab(path, tmp_path / "fp8.slab.safetensors", progress=False)
    manifest = _manifest(out)
    entries = {e["key"]: e for e in manifest["tensors"]}
    assert entries["transformer_blocks.0.attn.to_q.weight_int8"]["source_dtype"] == "float8_e4m3fn"
    assert entries["x_embedder.weight"]["dtype"] == "bfloat16"  # fp8 outside blocks is stored as bf16
    model = load_slab_transformer(out, torch.float32)[0]
    ref = load_transformer(tiny_pipeline, dtype=torch.float32)[0]
    w = ref.transformer_blocks[1].ff.net[2].weight
    deq = model.transformer_blocks[1].ff.net[2].dequantized_weight()
    assert (deq - w).norm() / w.norm() < 0.08  # fp8 then int8


# --- name map -------------------------------------------------------------------------


def test_name_map_covers_every_tensor_from_bfl_and_diffusers_names(tiny_pipeline, tiny_single_file):
    from lowvram_lora.engine.slab.layout import block_linears, meta_model

    family = get_family("flux1")
    config = get_family("flux1").load_config("flux1-tiny")
    model = meta_model(family, config)
    expected = {k: tuple(v.shape) for k, v in model.state_dict(keep_vars=True).items()}
    linears = block_linears(model, family)
    assert len(linears) == 40 and all(f"{n}.weight" in expected for n in linears)
    reference = load_file(str(tiny_pipeline / "transformer" / "diffusion_pytorch_model.safetensors"))
    for path in (tiny_pipeline, tiny_single_file):
        ckpt = open_checkpoint(path)
        assert {k: t.shape for k, t in ckpt.tensors.items()} == expected
        for name in expected:  # every part read through the map equals the diffusers tensor
            assert torch.equal(ckpt.read(name).float(), reference[name].float()), (path, name)
    bfl = open_checkpoint(tiny_single_file).tensors
    d = 32
    assert [(bfl[f"transformer_blocks.0.attn.{p}.weight"].source, bfl[f"transformer_blocks.0.attn.{p}.weight"].row_offset)
            for p in ("to_q", "to_k", "to_v")] == [("double_blocks.0.img_attn.qkv.weight", i * d) for i in range(3)]
    mlp = bfl["single_transformer_blocks.1.proj_mlp.weight"]
    assert (mlp.source, mlp.row_offset, mlp.shape) == ("single_blocks.1.linear1.weight", 3 * d, (4 * d, d))
    assert bfl["norm_out.linear.weight"].swap_halves


@pytest.mark.parametrize("key, canonical", [
    ("transformer_blocks.0.attn.to_q.base_layer.weight", "transformer_blocks.0.attn.to_q.weight"),
    ("model.diffusion_model.double_blocks.0.img_attn.qkv.weight", "double_blocks.0.img_attn.qkv.weight"),
    ("diffusion_model.single_blocks.3.linear2.bias", "single_blocks.3.linear2.bias"),
    ("transformer.single_transformer_blocks.0.proj_out.weight", "single_transformer_blocks.0.proj_out.weight"),
    ("transformer_blocks.0.ff.net.2.weight", "transformer_blocks.0.ff.net.2.weight"),
])
def test_canonical_key_handles_prefixes_and_adapter_renames(key, canonical):
    assert strip_prefix(key, KEY_PREFIXES) == canonical


def test_adapter_renamed_diffusers_folder_builds_the_same_slab(tiny_pipeline, slab, tmp_path):
    folder = tmp_path / "renamed"
    shutil.copytree(tiny_pipeline / "transformer", folder)
    f = folder / "diffusion_pytorch_model.safetensors"
    state = load_file(str(f))
    save_file({k.replace("attn.to_q.weight", "attn.to_q.base_layer.weight"): v for k, v in state.items()}, str(f))
    assert build_slab(folder, tmp_path / "r.slab.safetensors", progress=False).read_bytes() == slab.read_bytes()


def test_sharded_diffusers_folder_builds(tmp_path):
    cfg = get_family("flux1").load_config("flux1-tiny")
    folder = write_random_checkpoint(tmp_path / "sharded", config=cfg, layout="diffusers", shard_bytes=40_000)
    assert len(list(folder.glob("*.safetensors"))) > 3
    one = write_random_checkpoint(tmp_path / "one", config=cfg, layout="diffusers")
    a = build_slab(folder, tmp_path / "a.slab.safetensors", progress=False)
    b = build_slab(one, tmp_path / "b.slab.safetensors", progress=False)
    assert a.read_bytes() == b.read_bytes()


# --- layout -----------------------------------------------------------------------------


def test_layout_is_aligned_and_block_contiguous(slab):
    manifest = _manifest(slab)
    with open(slab, "rb") as f:
        header_len = int.from_bytes(f.read(8), "little")
    assert (8 + header_len) % 64 == 0
    assert all(e["offsets"][0] % 64 == 0 for e in manifest["tensors"])
    blocks = manifest["blocks"]
    assert [b["name"] for b in blocks] == ["transformer_blocks.0", "transformer_blocks.1",
                                            "single_transformer_blocks.0", "single_transformer_blocks.1"]
    for b in blocks:  # a block's tensors lie inside its range, and no other tensor does
        start, end = b["offsets"]
        for e in manifest["tensors"]:
            inside = start <= e["offsets"][0] < end
            assert inside == e["key"].startswith(b["name"] + "."), (b["name"], e["key"])
    assert all(a["offsets"][1] <= b["offsets"][0] for a, b in zip(blocks, blocks[1:]))


# --- damaged slabs ---------------------------------------------------------------------


def _expect_rebuild_hint(exc_info, slab):
    msg = str(exc_info.value)
    assert "lowvram-lora slab build" in msg and str(slab) in msg, msg
    return msg


def test_truncated_slab_is_reported_with_the_rebuild_command(slab_copy, tiny_pipeline):
    with open(slab_copy, "r+b") as f:
        f.truncate(os.path.getsize(slab_copy) - 100)
    with pytest.raises(SlabError) as exc:
        load_slab_transformer(slab_copy)
    msg = _expect_rebuild_hint(exc, slab_copy)
    assert "truncated" in msg and str(tiny_pipeline) in msg


def test_corrupted_header_is_reported(slab_copy):
    data = bytearray(slab_copy.read_bytes())
    i = data.index(b"transformer_blocks.0.attn.to_q.weight_int8")
    data[i] = ord("X")
    slab_copy.write_bytes(bytes(data))
    with pytest.raises(SlabError) as exc:
        load_slab_transformer(slab_copy)
    assert "header does not match" in _expect_rebuild_hint(exc, slab_copy)


def test_corrupted_tensor_bytes_are_found_by_full_verification(slab_copy):
    entry = next(e for e in _manifest(slab_copy)["tensors"] if e["key"] == "single_transformer_blocks.1.proj_out.weight_int8")
    with open(slab_copy, "r+b") as f:
        f.seek(entry["offsets"][0] + 5)
        byte = f.read(1)
        f.seek(entry["offsets"][0] + 5)
        f.write(bytes([byte[0] ^ 0xFF]))
    verify_slab(slab_copy, "quick")  # quick: size and header only
    with pytest.raises(SlabError, match="corrupted bytes"):
        verify_slab(slab_copy)  # the default hashes every tensor on the first use after a change
    with pytest.raises(SlabError, match="corrupted bytes"):
        load_slab_transformer(slab_copy)  # training never reads unverified bytes of a changed file
    with pytest.raises(SlabError) as exc:
        verify_slab(slab_copy, "full")
    msg = _expect_rebuild_hint(exc, slab_copy)
    assert "single_transformer_blocks.1.proj_out.weight_int8" in msg and "corrupted bytes" in msg


def test_slab_without_manifest_is_incomplete(slab_copy):
    manifest_path_for(slab_copy).unlink()
    with pytest.raises(SlabError) as exc:
        load_transformer(slab_copy)  # recognised as a slab by its name and header, not loaded as a checkpoint
    msg = _expect_rebuild_hint(exc, slab_copy)
    assert "no manifest" in msg and "did not finish" in msg


def _edit_manifest(path, **changes):
    m = _manifest(path)
    for key, value in changes.items():
        if key == "config":
            m["config"].update(value)
        else:
            m[key] = value
    manifest_path_for(path).write_text(json.dumps(m))


def test_wrong_family_or_variant_is_a_clear_error(slab_copy):
    with pytest.raises(SlabError, match="variant flux1-dev was asked for"):
        load_slab_transformer(slab_copy, variant="flux1-dev")
    _edit_manifest(slab_copy, variant="flux1-dev")
    with pytest.raises(SlabError, match="config differs from flux1-dev's"):
        load_slab_transformer(slab_copy)
    _edit_manifest(slab_copy, family="flux9", variant="flux9-dev")
    with pytest.raises(SlabError, match="family 'flux9'"):
        load_slab_transformer(slab_copy)


def test_every_unmatched_or_mismatched_tensor_is_listed(slab_copy):
    # The manifest now describes a model with a third double block and a wider text input:
    # the slab lacks block 2 entirely and its text projections have the wrong shape.
    _edit_manifest(slab_copy, variant="custom", config={"num_layers": 3, "joint_attention_dim": 48})
    with pytest.raises(SlabError) as exc:
        load_slab_transformer(slab_copy)
    msg = _expect_rebuild_hint(exc, slab_copy)
    assert "missing block Linear weight 'transformer_blocks.2.attn.to_q.weight' (int8)" in msg
    assert "'context_embedder.weight' is [32, 32] in the slab, the model needs [32, 48]" in msg
    # fewer double blocks than the slab holds: block 1's tensors are unmatched
    _edit_manifest(slab_copy, config={"num_layers": 1, "joint_attention_dim": 32})
    with pytest.raises(SlabError, match="unmatched slab tensor 'transformer_blocks.1.attn.to_q.weight_int8'"):
        load_slab_transformer(slab_copy)


def test_load_transformer_accepts_a_slab(slab):
    model, family, source, variant = load_transformer(slab, dtype=torch.float32)
    assert source.kind == "slab" and variant == "flux1-tiny" and family.id == "flux1"
    assert isinstance(model.single_transformer_blocks[0].proj_mlp, Int8Linear)


# --- interrupted builds and reuse ---------------------------------------------------------


class Stop(Exception):
    pass


def _stop_halfway(done, total):
    if done > total // 2:
        raise Stop


@pytest.mark.parametrize("exc", [Stop, KeyboardInterrupt])
def test_interrupted_build_leaves_no_file_that_looks_complete(tiny_pipeline, tmp_path, exc):
    def cb(done, total):
        if done > total // 2:
            raise exc

    out = tmp_path / "slabs"
    with pytest.raises(exc):
        build_slab(tiny_pipeline, out, callback=cb, progress=False)
    assert list(out.iterdir()) == []  # no slab, no manifest, no temporary file


def test_interrupted_rebuild_keeps_the_previous_complete_slab(tiny_pipeline, slab_copy):
    before = slab_copy.read_bytes()
    with pytest.raises(Stop):
        build_slab(tiny_pipeline, slab_copy, callback=_stop_halfway, progress=False, overwrite=True)
    assert slab_copy.read_bytes() == before and verify_slab(slab_copy, "full")
    assert sorted(p.name for p in slab_copy.parent.iterdir()) == sorted(
        [slab_copy.name, manifest_path_for(slab_copy).name, f".{slab_copy.name}.verified.json"])


def test_ensure_slab_builds_once_then_reuses(tiny_single_file, tmp_path):
    calls = []
    slab_dir = tmp_path / "models" / "slabs"
    first = ensure_slab(tiny_single_file, slab_dir, callback=lambda d, t: calls.append(d), progress=False)
    assert calls and first.name.startswith("flux1-tiny-") and first.name.endswith(".slab.safetensors")
    mtime, n = first.stat().st_mtime_ns, len(calls)
    assert ensure_slab(tiny_single_file, slab_dir, callback=lambda d, t: calls.append(d), progress=False) == first
    assert len(calls) == n and first.stat().st_mtime_ns == mtime
    renamed = tmp_path / "my-flux.safetensors"  # same weights under another name: same slab
    shutil.copy(tiny_single_file, renamed)
    assert ensure_slab(renamed, slab_dir, progress=False) == first
    assert ensure_slab(first, slab_dir) == first  # a slab is returned as is
    with open(first, "r+b") as f:  # damaged: rebuilt
        f.truncate(1000)
    logs = []
    assert ensure_slab(tiny_single_file, slab_dir, progress=False, log=logs.append) == first
    assert verify_slab(first, "full") and any("truncated" in line for line in logs)


_cli = slab_cli


# --- command line ---------------------------------------------------------------------


def test_cli_build_and_verify(tiny_single_file, tmp_path, capsys):
    out = tmp_path / "x.slab.safetensors"
    assert _cli("slab", "build", str(tiny_single_file), "-o", str(out), "--family", "flux1", "--quiet") == 0
    assert "40 int8 Linears" in capsys.readouterr().out
    assert _cli("slab", "verify", str(out), "--full") == 0
    manifest_path_for(out).unlink()
    assert _cli("slab", "verify", str(out)) == 1
    assert "lowvram-lora slab build" in capsys.readouterr().err


# --- build RAM stays bounded ----------------------------------------------------------------


def test_build_peak_ram_is_a_few_chunks_not_the_model(tmp_path):
    """Build a ~140 MB fp32 checkpoint in a fresh process with 4 MiB chunks; the peak RSS
    growth during the build (VmHWM, reset just before) must stay far below the model."""
    if not os.access("/proc/self/clear_refs", os.W_OK):
        pytest.skip("needs Linux /proc/self/clear_refs to reset the peak RSS")
    cfg = dict(get_family("flux1").load_config("flux1-tiny"), num_attention_heads=8, attention_head_dim=64,
               axes_dims_rope=[16, 24, 24], joint_attention_dim=256, pooled_projection_dim=256,
               num_layers=2, num_single_layers=4)
    folder = write_random_checkpoint(tmp_path / "ckpt", config=cfg, layout="diffusers", dtype=torch.float32,
                                     shard_bytes=50 << 20)
    model_bytes = sum(p.stat().st_size for p in folder.glob("*.safetensors"))
    script = textwrap.dedent(f"""
        import json, sys
        from diffusers import FluxTransformer2DModel  # imports and their RSS happen before the reset
        import accelerate, tqdm.auto
        from lowvram_lora.engine.slab import build_slab
        def status(key):
            return int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1]) * 1024
        open("/proc/self/clear_refs", "w").write("5")  # VmHWM := VmRSS
        before = status("VmRSS")
        build_slab({str(folder)!r}, {str(tmp_path / "out")!r}, progress=False, chunk_bytes=4 << 20)
        print(json.dumps({{"growth": status("VmHWM") - before}}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    growth = json.loads(out.stdout.strip().splitlines()[-1])["growth"]
    assert model_bytes > 130e6
    assert growth < 50e6 and growth < model_bytes / 3, (growth, model_bytes)
