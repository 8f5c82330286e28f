"""LoHa, LoKr and DoRA files we write, through ComfyUI's own loader, for every family.

For each family and type: train a few steps on the family's tiny model, save the ComfyUI-format file, and run ComfyUI's
``model_lora_keys_unet`` + ``load_lora`` + ``calculate_weight`` on it in ComfyUI's environment (the script of
``test_real_comfyui.py``, no server). The reference is peft's own merge of the trained adapter into the float model
(``helpers.peft_merged``), joined into the family's native tensors: every key mapped, exactly the merged weights
patched, relative delta error <= 1e-6 (fp32 file). LoKr on Lumina 2's fused qkv is refused before training.

    LOWVRAM_COMFYUI_DIR=/work/comfyui /work/wt/pt tests/comfyui/test_adapter_types_in_comfyui.py
"""
from __future__ import annotations

import functools
import json
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parents[1]))
from test_real_comfyui import _COMFY_LORA_CHECK, COMFY_DIR, _python  # noqa: E402

from lowvram_lora.engine.families import families, family_fixtures  # noqa: E402

pytestmark = pytest.mark.skipif(not COMFY_DIR, reason="set LOWVRAM_COMFYUI_DIR to a real ComfyUI to run these")

TYPES = ("loha", "lokr", "dora")


@functools.lru_cache(maxsize=None)
def _comfy_has_model(model_class: str) -> bool:
    """Whether this ComfyUI's ``comfy.model_base`` has the class (probed once per class in ComfyUI's venv)."""
    comfy_dir = Path(COMFY_DIR).resolve()
    probe = ("import sys; sys.argv += ['--cpu']; import comfy.options; comfy.options.enable_args_parsing(); "
             f"import comfy.model_base as m; print(hasattr(m, '{model_class}'))")
    done = subprocess.run([str(_python(comfy_dir)), "-c", probe], cwd=comfy_dir, capture_output=True, text=True)
    return done.stdout.strip() == "True"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """family id -> (pipeline folder, dataset cache), built once."""
    from lowvram_lora.engine.caching import build_dataset_cache
    from lowvram_lora.engine.config import DataConfig, ModelConfig
    from lowvram_lora.engine.testing import make_tiny_dataset

    built = {}

    def get(family_id):
        if family_id not in built:
            root = tmp_path_factory.mktemp(family_id)
            pipe = family_fixtures(families()[family_id]).build_tiny_pipeline(root / "pipe")
            data = make_tiny_dataset(root / "data", count=1)
            cache = build_dataset_cache(ModelConfig(transformer_path=str(pipe)),
                                        DataConfig(path=str(data), resolution=128, bucket_step=32), root / "cache")
            built[family_id] = (pipe, cache)
        return built[family_id]
    return get


@pytest.mark.parametrize("adapter", TYPES)
@pytest.mark.parametrize("family_id", sorted(families()))
def test_adapter_file_maps_exactly_in_comfyuis_own_loader(tiny, tmp_path, family_id, adapter):
    import torch
    from safetensors.torch import load_file, save_file

    from lowvram_lora.engine.config import AdapterConfig, LoraSettings, ModelConfig, TrainConfig
    from lowvram_lora.engine.errors import ConfigError
    from lowvram_lora.engine.families.names import join_diffusers_tensors
    from lowvram_lora.engine.lora_io import save_lora
    from lowvram_lora.engine.models import load_transformer
    from lowvram_lora.engine.train import train_lora
    from helpers import peft_merged

    family = families()[family_id]
    fixtures = family_fixtures(family)
    model_class, unet_config = fixtures.comfyui_model(family.load_config(family.tiny_variant))
    if not _comfy_has_model(model_class):  # as the LoRA check does: FLUX.3 is newer than ComfyUI 0.33
        pytest.skip(f"this ComfyUI has no comfy.model_base.{model_class}")
    pipe, cache = tiny(family_id)
    settings = LoraSettings(rank=4, alpha=8, adapter=AdapterConfig(type=adapter))
    train = TrainConfig(steps=3, learning_rate=2e-2, device="cpu")
    if adapter == "lokr" and family.lora.comfyui_form == "native_fused" and family_id == "lumina2":
        with pytest.raises(ConfigError, match="fused Linear"):
            train_lora(ModelConfig(transformer_path=str(pipe)), cache, settings, train)
        return
    lora = train_lora(ModelConfig(transformer_path=str(pipe)), cache, settings, train)
    assert lora.adapter == adapter and lora.steps == 3
    save_lora(lora, tmp_path / "lora.safetensors", fmt="comfyui", dtype="fp32")
    base_file = fixtures.write_single_file(pipe, tmp_path / "base.safetensors")
    model, fam, _, _ = load_transformer(pipe, dtype=torch.float32)
    state = peft_merged(model, fam, settings, lora.state_dict).state_dict()
    save_file({p.name: join_diffusers_tensors(p, state).contiguous() for p in family.param_table(lora.model_config)},
              str(tmp_path / "ref.safetensors"))
    args = {"lora": str(tmp_path / "lora.safetensors"), "base": str(base_file), "ref": str(tmp_path / "ref.safetensors"),
            "model_class": model_class, "unet_config": unet_config}
    (tmp_path / "args.json").write_text(json.dumps(args))
    code = _COMFY_LORA_CHECK.replace("ARGS", repr(str(tmp_path / "args.json")))
    comfy_dir = Path(COMFY_DIR).resolve()
    done = subprocess.run([str(_python(comfy_dir)), "-c", code], cwd=comfy_dir, capture_output=True, text=True,
                          timeout=300)
    if done.returncode and f"has no attribute '{model_class}'" in done.stderr:
        pytest.skip(f"this ComfyUI has no comfy.model_base.{model_class}")
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    print(family_id, adapter, {k: v for k, v in result.items() if k not in ("targets", "changed_by_our_merge")})
    file_keys = load_file(str(tmp_path / "lora.safetensors"))
    prefixes = {k.rsplit(".", 2)[0] if k.endswith(".weight") else k.rsplit(".", 1)[0] for k in file_keys}
    assert result["patches"] == len(prefixes) and not result["not_loaded"], result
    assert result["targets"] == result["changed_by_our_merge"], "ComfyUI patches other weights than peft's merge changes"
    assert result["worst_rel_delta_error"] < 1e-6, result


def _comfy_patch_check(tmp_path, family, fixtures, pipe, file, ref_state, model_config):
    """ComfyUI's loader on ``file`` against the native tensors of ``ref_state`` (a merged float model's state)."""
    from safetensors.torch import save_file

    from lowvram_lora.engine.families.names import join_diffusers_tensors

    model_class, unet_config = fixtures.comfyui_model(family.load_config(family.tiny_variant))
    base_file = fixtures.write_single_file(pipe, tmp_path / "base.safetensors")
    save_file({p.name: join_diffusers_tensors(p, ref_state).contiguous() for p in family.param_table(model_config)},
              str(tmp_path / "ref.safetensors"))
    args = {"lora": str(file), "base": str(base_file), "ref": str(tmp_path / "ref.safetensors"),
            "model_class": model_class, "unet_config": unet_config}
    (tmp_path / "args.json").write_text(json.dumps(args))
    comfy_dir = Path(COMFY_DIR).resolve()
    done = subprocess.run([str(_python(comfy_dir)), "-c", _COMFY_LORA_CHECK.replace("ARGS", repr(str(tmp_path / "args.json")))],
                          cwd=comfy_dir, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("family_id, adapter", [("flux1", "lora"), ("lumina2", "lora"), ("wan", "lora"),
                                                ("flux1", "loha"), ("qwen_image", "lokr")])
def test_continuing_from_a_file_takes_the_deltas_comfyui_reads_from_it(tiny, tmp_path, family_id, adapter):
    """Continue from a ComfyUI-format file (alpha 4 here, 8 in the run that wrote it): peft's merge of the continued
    adapter equals what ComfyUI's own loader makes of the file (relative delta error <= 1e-6)."""
    import torch

    from lowvram_lora.engine.config import AdapterConfig, LoraSettings, ModelConfig, TrainConfig
    from lowvram_lora.engine.lora_io import save_lora
    from lowvram_lora.engine.models import load_transformer
    from lowvram_lora.engine.train import train_lora
    from lowvram_lora.engine.train.lora_attach import attach_lora, detach_lora, lora_state_dict
    from helpers import peft_merged

    family = families()[family_id]
    fixtures = family_fixtures(family)
    pipe, cache = tiny(family_id)
    lora = train_lora(ModelConfig(transformer_path=str(pipe)), cache,
                      LoraSettings(rank=4, alpha=8, adapter=AdapterConfig(type=adapter)),
                      TrainConfig(steps=3, learning_rate=2e-2, device="cpu"))
    file = save_lora(lora, tmp_path / "lora.safetensors", fmt="comfyui", dtype="fp32")
    settings = LoraSettings(rank=4, alpha=4, adapter=AdapterConfig(type=adapter, continue_from=str(file)))
    model, fam, _, _ = load_transformer(pipe, dtype=torch.float32)
    attach_lora(model, fam, settings, seed=7)
    state = lora_state_dict(model)
    detach_lora(model)
    ref = peft_merged(model, fam, LoraSettings(rank=4, alpha=4, adapter=AdapterConfig(type=adapter)), state)
    result = _comfy_patch_check(tmp_path, family, fixtures, pipe, file, ref.state_dict(), lora.model_config)
    print(family_id, adapter, {k: v for k, v in result.items() if k not in ("targets", "changed_by_our_merge")})
    assert not result["not_loaded"] and result["targets"] == result["changed_by_our_merge"], result
    assert result["worst_rel_delta_error"] < 1e-6, result
