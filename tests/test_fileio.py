"""engine/fileio: atomic writes with ordinary modes, name claims, stale temp cleanup, explained OS errors."""
import json
import os
import stat
import subprocess
import sys

import pytest
import torch

from lowvram_lora.engine.errors import StorageError
from lowvram_lora.engine.fileio import (
    atomic_write, claim_names, clean_stale_temps, default_file_mode, temp_path_for, write_json_atomic,
)
from lowvram_lora.engine.lora_io.trained import TrainedLora


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def _tiny_lora() -> TrainedLora:
    sd = {"transformer_blocks.0.attn.to_q.lora_A.weight": torch.ones(2, 8),
          "transformer_blocks.0.attn.to_q.lora_B.weight": torch.ones(8, 2)}
    return TrainedLora(state_dict=sd, rank=2, alpha=2.0, family="flux1", variant="dev", steps=1,
                       requested_steps=1, dataset_hash="x", base_model="m", loss_history=[0.5])


def test_saved_lora_and_json_get_the_umask_mode_not_0600(tmp_path):
    from lowvram_lora.engine.lora_io import save_lora

    from safetensors.torch import load_file

    lora = _tiny_lora()
    path = save_lora(lora, tmp_path / "a.safetensors", fmt="diffusers")
    assert _mode(path) == default_file_mode() != 0o600
    assert _mode(write_json_atomic(tmp_path / "b.json", {"a": 1})) == default_file_mode()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.safetensors", "b.json"]  # no temp file left
    # what was written is what was given: the JSON reads back equal, the LoRA file holds the state dict
    # (scale alpha/rank = 1 folded in; bf16 holds 1.0 exactly, so tolerance 0)
    assert json.loads((tmp_path / "b.json").read_text()) == {"a": 1}
    written = load_file(str(path))
    assert set(written) == {f"transformer.{k}" for k in lora.state_dict}
    for k, v in lora.state_dict.items():
        torch.testing.assert_close(written[f"transformer.{k}"].float(), v, rtol=0, atol=0, msg=k)


def test_failed_write_leaves_target_and_no_temp(tmp_path):
    target = tmp_path / "keep.txt"
    target.write_text("old")
    with pytest.raises(RuntimeError):
        with atomic_write(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("writer died")
    assert target.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["keep.txt"]


def test_no_overwrite_refuses_a_file_that_appeared(tmp_path):
    target = tmp_path / "x.bin"
    with pytest.raises(FileExistsError):
        with atomic_write(target, overwrite=False) as tmp:
            tmp.write_bytes(b"new")
            target.write_bytes(b"someone else's")  # created between any check and our rename
    assert target.read_bytes() == b"someone else's"


def test_claim_names_is_all_or_nothing(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    b.write_text("kept")
    assert claim_names([a, b]) is False
    assert not a.exists() and b.read_text() == "kept"
    b.unlink()
    assert claim_names([a, b]) is True and claim_names([a, b]) is False


def test_stale_temps_of_dead_writers_are_removed_live_and_foreign_kept(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(dead.stdout)
    stale = tmp_path / f".x.slab.safetensors.tmp-{pid}"          # older naming
    stale2 = tmp_path / f".x.slab.safetensors.tmp-{pid}-0a1b2c3d"
    live = temp_path_for(tmp_path / "x.slab.safetensors")       # ours, running
    other = tmp_path / ".y.tmp-notapid"
    for p in (stale, stale2, live, other):
        p.write_bytes(b"0" * 10)
    removed = clean_stale_temps(tmp_path, "x.slab.safetensors")
    assert sorted(removed) == sorted([stale, stale2]) and live.exists() and other.exists()


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="needs POSIX permissions as non-root")
def test_read_only_folder_is_explained(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        with pytest.raises(StorageError, match=r"cannot write the LoRA file at .*ro.*not writable.*writable folder"):
            from lowvram_lora.engine.lora_io import save_lora

            save_lora(_tiny_lora(), ro / "a.safetensors")
    finally:
        ro.chmod(0o700)


def test_file_in_the_way_and_long_names_are_explained(tmp_path):
    (tmp_path / "cache").write_text("a file where a folder should be")
    with pytest.raises(StorageError, match="is a file where a folder is needed"):
        write_json_atomic(tmp_path / "cache" / "datasets" / "x.json", {})
    with pytest.raises(StorageError, match="too long.*shorter"):
        write_json_atomic(tmp_path / ("n" * 300 + ".json"), {})


def test_disk_full_is_explained(tmp_path):
    import errno

    with pytest.raises(StorageError, match="disk is full.*free space"):
        with atomic_write(tmp_path / "x.bin", "the slab"):
            raise OSError(errno.ENOSPC, "No space left on device")
    assert list(tmp_path.iterdir()) == []


def test_read_only_filesystem_is_explained_even_as_root(tmp_path, monkeypatch):
    import errno

    def read_only(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(os, "replace", read_only)
    with pytest.raises(StorageError, match=r"cannot write the loss-curve image at .*not writable.*--output-dir"):
        with atomic_write(tmp_path / "x.png", "the loss-curve image") as tmp:
            tmp.write_bytes(b"png")
    assert list(tmp_path.iterdir()) == []
