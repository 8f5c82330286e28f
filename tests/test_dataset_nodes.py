"""ComfyUI's own dataset nodes as the dataset (issue 43, item 2): Load Image-Text (from Folder) puts out lists of IMAGE
tensors ((1, H, W, 3) floats in [0, 1]) and caption strings; Images to Dataset hands them to Cache Text Embeds, which
must cache them exactly as the same images in a folder: the same latents, the same text embeddings."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from lowvram_lora.nodes.cache_embeds import LowVRAMCacheTextEmbeds
from lowvram_lora.nodes.image_dataset import LowVRAMImagesToDataset


def comfy_load_image_text_folder(folder):
    """What ComfyUI 0.33's LoadImageTextDataSetFromFolder returns for a folder (comfy_extras/nodes_dataset.py:
    ``load_and_process_images``: PIL, convert("RGB"), float32 / 255, a batch axis; the caption file stripped)."""
    images, texts = [], []
    for png in sorted(folder.glob("*.png")):
        pixels = np.array(Image.open(png).convert("RGB")).astype(np.float32) / 255.0
        images.append(torch.from_numpy(pixels)[None,])
        texts.append(png.with_suffix(".txt").read_text().strip())
    return images, texts


@pytest.fixture
def demo(tmp_path):
    from lowvram_lora.demo import ensure_demo_assets
    from lowvram_lora.nodes.load_model import LowVRAMLoadQuantizedSlab
    from lowvram_lora.nodes.paths import configure_standalone_dirs

    assets = ensure_demo_assets(tmp_path / "demo", trained=False)  # the random tiny model: the plumbing only
    configure_standalone_dirs(str(assets["models"]), str(tmp_path / "out"))
    model = LowVRAMLoadQuantizedSlab.PREPARE_CLASS_CLONE({}).execute(checkpoint=str(assets["pipeline"])).args[0]
    return assets, model


def _cache(model, **kw):
    node = LowVRAMCacheTextEmbeds.PREPARE_CLASS_CLONE({"UNIQUE_ID": "2"})
    from lowvram_lora.demo_models import DEMO_CAPTION

    # the demo's form: no trigger word, a sample prompt that is one of the two captions (two texts in all)
    args = dict(model=model, text_encoders="(from checkpoint)", dataset_path="", resolution=128, trigger_word="",
                sample_prompts=DEMO_CAPTION.format(colour="red", shape="circle"))
    return node.execute(**(args | kw)).args[0]


def test_images_from_comfyuis_dataset_node_cache_as_the_same_folder_does(demo):
    assets, model = demo
    images, texts = comfy_load_image_text_folder(assets["dataset"])
    from_folder = _cache(model, dataset_path=str(assets["dataset"]))
    given = LowVRAMImagesToDataset.execute(images=images, texts=texts).args[0]
    from_comfy = _cache(model, images=given)

    assert len(from_comfy.items) == len(from_folder.items) == 6
    for a, b in zip(from_folder.items, from_comfy.items):
        assert (a.caption, a.bucket, a.text_key) == (b.caption, b.bucket, b.text_key)
        lat_a, text_a = from_folder.load_item(a)
        lat_b, text_b = from_comfy.load_item(b)
        assert torch.equal(lat_a, lat_b)  # the same pixels, crop and VAE: bit-equal latents
        assert text_a.keys() == text_b.keys() and all(torch.equal(text_a[k], text_b[k]) for k in text_a)
    assert from_comfy.sample_prompts == from_folder.sample_prompts

    # the same images again: the same folder, every entry reused
    again = _cache(model, images=LowVRAMImagesToDataset.execute(images=images, texts=texts).args[0])
    assert again.manifest_path == from_comfy.manifest_path
    assert again.stats.get("latents_reused") == 6 and again.stats.get("text_reused") == 2, again.stats


def test_the_images_key_is_their_pixels_and_captions():
    """One changed pixel level or caption is another set (another folder, re-encoded); the same values are the same
    key; float pixels ComfyUI read from 8-bit files (v / 255) come back as the same bytes."""
    gen = torch.Generator().manual_seed(0)
    levels = torch.randint(0, 256, (2, 16, 24, 3), generator=gen)
    images = [(levels[i:i + 1].float() / 255) for i in range(2)]
    base = LowVRAMImagesToDataset.execute(images=images, texts=["a", "b"]).args[0]
    assert torch.equal(torch.stack(base.images), levels.to(torch.uint8))
    assert LowVRAMImagesToDataset.execute(images=[i.clone() for i in images], texts=["a", "b"]).args[0].key == base.key
    assert LowVRAMImagesToDataset.execute(images=images, texts=["a", "c"]).args[0].key != base.key
    nudged = images[1].clone()
    nudged[0, 5, 7, 1] += 1 / 255
    assert LowVRAMImagesToDataset.execute(images=[images[0], nudged], texts=["a", "b"]).args[0].key != base.key
    # one batch of two is the same two images
    assert LowVRAMImagesToDataset.execute(images=[torch.cat(images)], texts=["a", "b"]).args[0].key == base.key


def test_bad_images_input_names_the_problem_and_the_fix(demo, tmp_path):
    from lowvram_lora.engine.errors import DatasetError, LowVRAMError

    assets, model = demo
    images, texts = comfy_load_image_text_folder(assets["dataset"])
    with pytest.raises(DatasetError, match="6 images but 4 captions"):
        LowVRAMImagesToDataset.execute(images=images, texts=texts[:4])
    bad = images[0].clone()
    bad[0, 0, 0, 0] = float("nan")
    with pytest.raises(DatasetError, match="item 1 holds NaN"):
        LowVRAMImagesToDataset.execute(images=[bad], texts=["x"])
    with pytest.raises(DatasetError, match="not a ComfyUI IMAGE"):
        LowVRAMImagesToDataset.execute(images=[torch.zeros(8, 8)], texts=["x"])
    uncaptioned = LowVRAMImagesToDataset.execute(images=images, texts=["", *texts[1:5], ""]).args[0]
    with pytest.raises(DatasetError, match=r"images 1, 6 \(of 6, counted from 1\) have no caption.*default_caption"):
        _cache(model, images=uncaptioned)
    assert len(_cache(model, images=uncaptioned, default_caption="a shape").items) == 6
    given = LowVRAMImagesToDataset.execute(images=images, texts=texts).args[0]
    with pytest.raises(LowVRAMError, match="give one dataset"):
        _cache(model, images=given, dataset_path=str(assets["dataset"]))
    from lowvram_lora.engine.data.options import DatasetOptions

    with pytest.raises(LowVRAMError, match="mask_source='beside' reads mask files"):
        _cache(model, images=given, options=DatasetOptions(mask_source="beside"))


def test_queue_time_check_knows_a_connected_images_input():
    """ComfyUI passes a linked input to validate_inputs as None and leaves an unconnected optional one out."""
    assert LowVRAMCacheTextEmbeds.validate_inputs(dataset_path="", images=None) is True
    assert "give one dataset" in LowVRAMCacheTextEmbeds.validate_inputs(dataset_path="shapes", images=None)
    assert "control_folder" in LowVRAMCacheTextEmbeds.validate_inputs(dataset_path="", control_folder="c", images=None)
    assert "empty" in LowVRAMCacheTextEmbeds.validate_inputs(dataset_path="")  # unconnected: a folder is needed


def test_images_to_dataset_takes_whole_lists_in_comfyui():
    """Its inputs arrive as whole lists (``is_input_list``), so ComfyUI runs it once on the dataset, and its texts
    input is a socket (``forceInput``), not a text box."""
    info = LowVRAMImagesToDataset.GET_NODE_INFO_V1()
    assert info["is_input_list"] is True and LowVRAMImagesToDataset.INPUT_IS_LIST is True
    assert info["input"]["required"]["images"][0] == "IMAGE"
    assert info["input"]["optional"]["texts"][1]["forceInput"] is True
    assert LowVRAMCacheTextEmbeds.INPUT_IS_LIST is False
    assert LowVRAMCacheTextEmbeds.GET_NODE_INFO_V1()["input"]["optional"]["images"][0] == "LOWVRAM_IMAGES"
