"""klein's Qwen3 single file as ComfyUI ships it (``qwen_3_4b.safetensors``: weights only, no tokenizer).

Inside ComfyUI the file's tokenizer is ComfyUI's bundled ``qwen25_tokenizer`` folder (the one its own KleinTokenizer
uses), found through the spec's ``comfyui_tokenizer``; standalone, a file without tokenizer files beside it is refused
with the folder to fill and the ComfyUI alternative. That klein's written-out prompt equals what Flux2KleinPipeline
encodes is tests/test_flux2.py's ``test_layer_major_text_equals_the_diffusers_pipeline[qwen3]``; the templates on
these file names, end to end, tests/test_family_workflows.py and tests/comfyui."""
import shutil

import pytest

from lowvram_lora.engine.caching.single_files import decoder_lm_source
from lowvram_lora.engine.errors import ModelLoadError
from lowvram_lora.engine.families.flux2 import FAMILY
from lowvram_lora.engine.families.flux2.fixtures import build_tiny_pipeline, write_text_and_vae_files


@pytest.fixture(scope="module")
def comfy_file(tmp_path_factory):
    """The tiny klein Qwen3 as ComfyUI's file: ``model.`` names, and beside it only its (tiny) config, no tokenizer."""
    tmp = tmp_path_factory.mktemp("klein")
    pipe = build_tiny_pipeline(tmp / "pipe", variant="flux2-klein-tiny")
    files = write_text_and_vae_files(pipe, tmp / "files")
    path = tmp / "text_encoders" / "qwen_3_4b.safetensors"
    path.parent.mkdir()
    shutil.copy(files["text_encoder"], path)
    (path.parent / "qwen_3_4b").mkdir()
    shutil.copy(pipe / "text_encoder" / "config.json", path.parent / "qwen_3_4b" / "config.json")
    return path, pipe / "tokenizer"


@pytest.mark.parametrize("variant", ["flux2-klein-base-4b", "flux2-klein-9b"])
def test_comfyuis_bundled_tokenizer_serves_the_qwen3_file(comfy_file, variant):
    path, bundled = comfy_file
    spec = FAMILY.text_encoder_specs(variant)[0]
    assert spec.comfyui_tokenizer == "qwen25_tokenizer"
    _, config, tokenizer = decoder_lm_source(path, FAMILY, spec, {"qwen25_tokenizer": bundled})
    assert tokenizer == bundled and config.model_type == "qwen3"


def test_standalone_the_file_without_a_tokenizer_names_the_folder_and_comfyui(comfy_file):
    path, _ = comfy_file
    spec = FAMILY.text_encoder_specs("flux2-klein-base-4b")[0]
    with pytest.raises(ModelLoadError, match=r"no tokenizer for 'qwen_3_4b\.safetensors'.*qwen_3_4b/.*inside ComfyUI"):
        decoder_lm_source(path, FAMILY, spec, {})
