"""LTX-2's caption cache on a small card (issue 39): what the Gemma + connectors encoder
(``engine/caching/encoders/gemma_connectors.py``, ``_Projection``) puts on the encoding device does not grow with the
connectors, which stay on the host (3.2B parameters at full size), and grows with the group of captions by its fp32
accumulators and masks only: the fold's temporaries and the connectors' activations are per chunk of captions.
(The values: ``test_family.py`` against LTX2Pipeline.)

Measured, not declared: the projection folds host hidden states and runs the connectors with the meta device as the
encoding device (shapes without values; host tensors stay on the CPU), and a TorchDispatchMode tracks every meta
storage the ops make while it lives: the device's allocations. Exact byte counts, no tolerance."""
import torch

from lowvram_lora.engine.caching.encoders.gemma_connectors import _Projection
from lowvram_lora.engine.families.ltx2 import FAMILY
from lowvram_lora.engine.testing import LiveBytes
from lowvram_lora.engine.families.ltx2.comfy_files import connectors_config

LENGTH = FAMILY.text_encoder_specs(FAMILY.tiny_variant)[0].max_length
DTYPE = torch.bfloat16  # what the encoder runs in on a GPU
#: LTX-2.3's numbers of hidden states and connector blocks on the tiny widths.
FULL_DEPTH = {"text_proj_in_factor": 49, "video_connector_num_layers": 8, "audio_connector_num_layers": 8}


def _connectors(overrides: dict):
    from diffusers.pipelines.ltx2.connectors import LTX2TextConnectors

    config = {**connectors_config("ltx2-tiny"), **overrides}
    torch.manual_seed(0)
    return LTX2TextConnectors(**config).to(DTYPE).eval(), config


def device_peak(overrides: dict, captions: int) -> int:
    """Peak device bytes of one group: every hidden state folded, the connectors run, each chunk's rows taken (as
    ``encode`` copies them to the host)."""
    connectors, config = _connectors(overrides)
    count, hidden = config["text_proj_in_factor"], config["caption_channels"]
    torch.manual_seed(1)
    states = [torch.randn(captions, LENGTH, hidden, dtype=DTYPE) for _ in range(count)]
    mask = (torch.arange(LENGTH) >= torch.randint(0, LENGTH, (captions, 1))).long()  # left padding
    width = config["video_hidden_dim"] + config["audio_hidden_dim"]
    # The blocks' weights read from the module where the encoder reads them from their file.
    proj = _Projection(connectors, connectors.get_parameter, count, hidden, torch.device("meta"))
    with torch.no_grad(), LiveBytes("meta") as mode:
        proj.start(mask)
        for k, h in enumerate(states):
            proj.fold(k, h)
        done = 0
        for rows in proj.finish(DTYPE):
            assert rows.shape[1:] == (LENGTH, width) and rows.dtype == DTYPE
            done += rows.shape[0]
    assert done == captions
    return mode.peak


def test_the_device_holds_no_more_connectors_for_more_states_or_blocks():
    """The connectors stay on the host: one state's projection slices and one block visit the device at a time, so
    LTX-2.3's 49 states and 8 + 8 blocks cost the device what 4 states and 2 + 2 blocks do (moving the connectors to
    the device, as the encoder did, adds their bytes)."""
    assert device_peak(FULL_DEPTH, 4) == device_peak({}, 4)


def test_the_group_costs_the_device_its_accumulators_and_masks_only():
    """Captions beyond a chunk add their fp32 accumulators (video + audio width) and their masks (the tokenizer's
    int64 one, the connectors' additive one and its zeroed return), nothing else: the fold's fp32 temporaries and the
    connectors' activations are per chunk of captions (the whole group's were 13x its accumulators)."""
    _, config = _connectors({})
    width = config["video_hidden_dim"] + config["audio_hidden_dim"]
    per_caption = LENGTH * (width * 4 + torch.tensor(0).element_size() + 2 * DTYPE.itemsize)
    small, large = 4, 12
    assert device_peak({}, large) - device_peak({}, small) <= (large - small) * per_caption


def test_connectors_that_do_not_fit_their_config_are_refused_by_name(tmp_path):
    """The blocks' weights are read when they run, so every tensor's name and shape is checked before: a
    connectors folder whose config asks for a block its weights lack is refused naming the tensor."""
    import json

    import pytest

    from lowvram_lora.engine.caching.encoders import encoder_kind
    from lowvram_lora.engine.errors import ModelLoadError
    from lowvram_lora.engine.families.ltx2.fixtures import build_tiny_pipeline

    folder = build_tiny_pipeline(tmp_path / "ltx2-tiny")
    config_path = folder / "connectors" / "config.json"
    config = json.loads(config_path.read_text())
    config["video_connector_num_layers"] += 1
    config_path.write_text(json.dumps(config))
    spec = FAMILY.text_encoder_specs(FAMILY.tiny_variant)[0]
    kind = encoder_kind(spec.kind)
    missing = f"missing video_connector.transformer_blocks.{config['video_connector_num_layers'] - 1}."
    with pytest.raises(ModelLoadError, match="do not fit its config.json") as e:
        kind.encode(folder, None, FAMILY, spec, ["a red circle"], torch.device("cpu"), torch.float32, LENGTH)
    assert missing in str(e.value) and str(folder / "connectors") in str(e.value)
