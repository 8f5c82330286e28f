"""Each adapter type (LoHa, LoKr, DoRA) trains on the tiny model of every family and lowers the flow loss against the
reference model. Parametrized over the registry, so a new family folder is covered without editing this file.

Per family: the tiny pipeline (its own text encoders and VAE) caches one 64x64 image; ``train_lora`` trains each type
for a few steps at a high learning rate; the reference is diffusers' own transformer read from the pipeline folder,
with the trained adapter merged by peft's own ``merge`` (``helpers.peft_merged``). Its flow loss at fixed noise and
timesteps (``helpers.eval_flow_loss``) must be lower than the reference's without the adapter. Where a type cannot be
saved for a family (LoKr on Lumina 2's fused qkv), the run is refused before training with the named reason.
"""
from __future__ import annotations

import pytest
import torch
from helpers import eval_flow_loss, peft_merged

from lowvram_lora.engine.config import AdapterConfig, DataConfig, LoraSettings, ModelConfig, TrainConfig
from lowvram_lora.engine.errors import ConfigError
from lowvram_lora.engine.families import families, get_family
from lowvram_lora.engine.lora_io.adapters import get_adapter
from lowvram_lora.engine.train import train_lora

KINDS = ("loha", "lokr", "dora")
#: (family, type) pairs refused before training, with the reason's words: ComfyUI holds Lumina 2's q/k/v in one fused
#: Linear, and a Kronecker product of stacked parts is not one (docs/training.md).
REFUSED = {("lumina2", "lokr"): "lokr cannot be saved for Lumina 2"}


@pytest.fixture(scope="module")
def tiny_family(tmp_path_factory, tiny_family_pipeline):
    """family id -> (pipeline folder, one-image cache, reference model, its flow loss), built once per family."""
    from lowvram_lora.engine.caching import build_dataset_cache
    from lowvram_lora.engine.testing import make_tiny_dataset

    built = {}

    def get(family_id):
        if family_id not in built:
            family = get_family(family_id)
            root = tmp_path_factory.mktemp(f"adapters-{family_id}")
            pipe = tiny_family_pipeline(family_id)
            data = make_tiny_dataset(root / "data", count=1, sizes=((64, 64),))
            cache = build_dataset_cache(ModelConfig(transformer_path=str(pipe)),
                                        DataConfig(path=str(data), resolution=64, bucket_step=32), root / "cache")
            ref = family.transformer_class().from_pretrained(pipe / "transformer", use_safetensors=True,
                                                             torch_dtype=torch.float32, local_files_only=True)
            built[family_id] = (pipe, cache, ref, eval_flow_loss(ref, family, cache, n=8))
        return built[family_id]
    return get


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("family_id", sorted(families()))
def test_each_type_lowers_the_flow_loss_of_the_reference_model(tiny_family, family_id, kind):
    family = get_family(family_id)
    pipe, cache, ref, before = tiny_family(family_id)
    settings = LoraSettings(rank=4, alpha=8.0, adapter=AdapterConfig(type=kind))
    train = TrainConfig(steps=6, learning_rate=3e-2, seed=0, device="cpu")
    if (family_id, kind) in REFUSED:
        with pytest.raises(ConfigError, match=REFUSED[family_id, kind]):
            train_lora(ModelConfig(transformer_path=str(pipe)), cache, settings, train)
        return
    lora = train_lora(ModelConfig(transformer_path=str(pipe)), cache, settings, train)
    assert lora.adapter == kind and lora.steps == 6 and not lora.interrupted and lora.family == family_id
    assert lora.state_dict and all(get_adapter(kind).owns(k) for k in lora.state_dict)
    after = eval_flow_loss(peft_merged(ref, family, settings, lora.state_dict), family, cache, n=8)
    assert after < before, f"{kind} on {family_id} did not lower the reference's flow loss: {before:.5f} -> {after:.5f}"
