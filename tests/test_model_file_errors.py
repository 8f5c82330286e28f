"""Every way a model file is not a whole safetensors file gives an error naming the file, what it seems to be, and
the fix: re-download it or pick the right file (issue 43, finding 12). Each damage is a form seen in the wild: an
interrupted download, a login page saved under the model's name, a pickle renamed .safetensors, an LFS pointer."""
from __future__ import annotations

import io
import pickle
import random

import pytest
import torch

from lowvram_lora.engine.errors import ModelLoadError
from lowvram_lora.engine.models import load_transformer


def _torch_save_zip() -> bytes:
    buf = io.BytesIO()
    torch.save({"w": torch.zeros(4)}, buf)  # the zip form torch.save writes (a .pt/.ckpt)
    return buf.getvalue()


DAMAGES = {  # name: (bytes from the good file -> bytes written, what the message must say it is)
    "empty": (lambda raw: b"", r"is 0 bytes: too short"),
    "five bytes": (lambda raw: raw[:5], r"is 5 bytes: too short"),
    "random bytes": (lambda raw: random.Random(0).randbytes(4096), r"not a readable safetensors file.*truncated, or not"),
    "torch.save zip renamed": (lambda raw: _torch_save_zip(), r"zip archive, the form torch.save writes"),
    "pickle renamed": (lambda raw: pickle.dumps({"w": [0.0] * 64}, protocol=4), r"a Python pickle.*never loaded"),
    "html page": (lambda raw: b"<!DOCTYPE html><html><body>Sign in to download</body></html>" * 4, r"a web page"),
    "git lfs pointer": (lambda raw: b"version https://git-lfs.github.com/spec/v1\noid sha256:" + b"0" * 64
                        + b"\nsize 23802932552\n", r"a Git LFS pointer"),
    "truncated data": (lambda raw: raw[: len(raw) - 100], r"the file is truncated"),
    "corrupted header": (lambda raw: raw[:8] + b"\x00" * (len(raw) - 8), r"corrupted safetensors header"),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_a_damaged_transformer_file_names_itself_what_it_seems_and_the_fix(tiny_single_file, tmp_path, damage):
    make, says = DAMAGES[damage]
    path = tmp_path / "flux1-dev.safetensors"
    path.write_bytes(make(tiny_single_file.read_bytes()))
    with pytest.raises(ModelLoadError) as err:
        load_transformer(path)
    msg = str(err.value)
    assert str(path) in msg, msg
    assert __import__("re").search(says, msg), msg
    assert "re-download it" in msg and "pick the right file" in msg, msg


@pytest.mark.parametrize("damage", ["empty", "pickle renamed", "html page"])
def test_a_damaged_text_encoder_file_names_the_fix_too(tmp_path, damage):
    from lowvram_lora.engine.caching.single_files import text_encoder_kind

    path = tmp_path / "t5xxl_fp16.safetensors"
    path.write_bytes(DAMAGES[damage][0](b""))
    with pytest.raises(ModelLoadError, match=r"t5xxl_fp16.safetensors.*re-download it.*pick the right file"):
        text_encoder_kind(path)

