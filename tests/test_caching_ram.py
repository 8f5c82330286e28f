"""The caching pass's host RAM (engine/caching/ram.py): sizes from the headers against safetensors' own reader, the
layer-major count of a decoder LLM, and the refusal before any model loads."""
from __future__ import annotations

import math

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from lowvram_lora.engine.caching.model_sources import open_models
from lowvram_lora.engine.caching.ram import _elements, caching_host_bytes, check_caching_ram
from lowvram_lora.engine.config import ModelConfig
from lowvram_lora.engine.errors import ConfigError
from lowvram_lora.engine.offload.plan import PROCESS_BASE_BYTES


def _numel(folder) -> int:
    total = 0
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            total += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())
    return total


def test_caching_ram_counts_each_model_at_the_cache_dtype(tiny_pipeline):
    models = open_models(ModelConfig(transformer_path=str(tiny_pipeline), dtype="fp32"), "cpu")
    parts = caching_host_bytes(models)
    by_folder = {k.split(" ")[0]: v for k, v in parts.items()}
    assert by_folder == {sub: _numel(tiny_pipeline / sub) * 4 for sub in ("text_encoder", "text_encoder_2", "vae")}
    assert all(v > 0 for v in parts.values())
    peak = check_caching_ram(models, ram_budget_gb=64)
    assert peak == PROCESS_BASE_BYTES + max(parts.values())
    with pytest.raises(ConfigError, match=r"caching needs [0-9.]+ GB of host RAM .* Free host RAM"):
        check_caching_ram(models, ram_budget_gb=0.5)


def test_a_decoder_llm_counts_one_layer(tmp_path):
    f = tmp_path / "lm.safetensors"
    save_file({"model.embed_tokens.weight": torch.zeros(10, 4), "model.layers.0.mlp.weight": torch.zeros(4, 4),
               "model.layers.0.attn.weight": torch.zeros(4, 2), "model.layers.1.mlp.weight": torch.zeros(4, 5)}, str(f))
    assert _elements([f], per_layer=False) == 40 + 16 + 8 + 20
    assert _elements([f], per_layer=True) == 24  # layer 0: 16 + 8
