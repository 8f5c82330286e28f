"""Slab build never destroys a file; slab bytes are verified on first use after a change."""
import os
import shutil
import subprocess
import sys

import pytest

from lowvram_lora.engine.slab import build_slab, load_slab_transformer, manifest_path_for, verify_slab
from lowvram_lora.engine.slab.format import SlabError
from lowvram_lora.engine.slab.load import verified_stamp_path

from helpers import slab_cli as _cli


def test_build_refuses_the_source_even_with_force(tiny_single_file, tmp_path, capsys):
    src = tmp_path / "flux.safetensors"
    shutil.copy(tiny_single_file, src)
    before = src.read_bytes()
    for extra in ((), ("--force",)):
        assert _cli("slab", "build", str(src), "-o", str(src), "--quiet", *extra) == 1
        assert "is the source checkpoint itself" in capsys.readouterr().err
    assert src.read_bytes() == before


def test_build_refuses_an_existing_file_unless_force(tiny_single_file, tmp_path, capsys):
    lora = tmp_path / "my_lora.safetensors"
    lora.write_bytes(b"a user's LoRA")
    assert _cli("slab", "build", str(tiny_single_file), "-o", str(lora), "--quiet") == 1
    err = capsys.readouterr().err
    assert "already exists" in err and "--force" in err and lora.read_bytes() == b"a user's LoRA"
    assert _cli("slab", "build", str(tiny_single_file), "-o", str(lora), "--quiet", "--force") == 0
    assert verify_slab(lora)
    assert oct(os.stat(lora).st_mode & 0o777) != oct(0o600)
    # the file now holds the source's weights: every slab tensor, dequantized, equals the source model's within
    # int8 row-quantization error (half a step of each row's scale, plus fp32 rounding)
    import torch

    from lowvram_lora.engine.models import load_transformer
    from lowvram_lora.engine.slab import Int8Linear, dequantize_rows

    slab_model = load_slab_transformer(lora, torch.float32)[0]
    ref = load_transformer(tiny_single_file, dtype=torch.float32)[0].state_dict()
    int8 = 0
    for name, module in slab_model.named_modules():
        if isinstance(module, Int8Linear):
            w, half_step = ref[f"{name}.weight"], module.weight_scale[:, None] / 2
            got = dequantize_rows(module.weight_int8, module.weight_scale, torch.float32)
            assert torch.all((got - w).abs() <= half_step * (1 + 1e-5) + 1e-7), name
            int8 += 1
    assert int8 == 2 * 14 + 2 * 6
    for k, v in slab_model.state_dict().items():  # the tensors kept as they are (norms, embedders, biases)
        if k in ref:
            torch.testing.assert_close(v, ref[k], rtol=0, atol=0, msg=k)


def test_build_removes_stale_temp_files_of_killed_builds(tiny_single_file, tmp_path):
    dead = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                              capture_output=True, text=True).stdout)
    out = tmp_path / "x.slab.safetensors"
    stale = tmp_path / f".{out.name}.tmp-{dead}"
    stale.write_bytes(b"\0" * 4096)  # what a SIGKILLed build left
    build_slab(tiny_single_file, out, progress=False)
    assert not stale.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [out.name, manifest_path_for(out).name, verified_stamp_path(out).name])


def test_bytes_corrupted_after_verification_are_caught_on_next_use(tiny_single_file, tmp_path, capsys):
    out = build_slab(tiny_single_file, tmp_path / "x.slab.safetensors", progress=False)
    assert verified_stamp_path(out).exists()  # the build hashed what it wrote
    assert _cli("slab", "verify", str(out)) == 0
    assert "file is unchanged since" in capsys.readouterr().out
    entry = next(e for e in verify_slab(out)["tensors"] if e["key"].endswith("weight_int8"))
    with open(out, "r+b") as f:  # flip one byte in place: size unchanged, mtime changes
        f.seek(entry["offsets"][0] + 3)
        b = f.read(1)
        f.seek(entry["offsets"][0] + 3)
        f.write(bytes([b[0] ^ 0x55]))
    assert _cli("slab", "verify", str(out)) == 1
    assert "corrupted bytes" in capsys.readouterr().err
    with pytest.raises(SlabError, match="corrupted bytes"):
        load_slab_transformer(out)


def test_unchanged_verified_slab_is_not_rehashed(tiny_single_file, tmp_path, monkeypatch):
    import lowvram_lora.engine.slab.load as load

    out = build_slab(tiny_single_file, tmp_path / "x.slab.safetensors", progress=False)
    calls = []
    monkeypatch.setattr(load, "sha256_range", lambda *a, **k: calls.append(a) or "x")
    load_slab_transformer(out)
    assert calls == []
    os.utime(out)  # touched (copied back, restored from a backup...): checked again
    with pytest.raises(SlabError):
        load_slab_transformer(out)
    assert calls
