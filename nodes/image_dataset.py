"""Images to Dataset: ComfyUI's own dataset nodes (Load Image-Text (from Folder), and the nodes that resize, crop or
shuffle their lists) as the dataset of Cache Text Embeds, into its optional ``images`` socket.

Why a node of its own: ComfyUI's dataset nodes put out lists (``is_output_list``), and a node that does not take
lists (``is_input_list``) is run once per list item. Cache Text Embeds must run once, on everything, so this node
takes the lists whole and hands them on as one value. The images are cached as the same images in a folder would be
(engine/data/image_set.py).
"""
from __future__ import annotations

from . import schema as io
from .load_model import CATEGORY

DESCRIPTION = (
    "Takes the images and captions of ComfyUI's dataset nodes (Load Image-Text (from Folder), and the nodes that "
    "resize, crop or shuffle them) for Cache Text Embeds: plug its output into Cache Text Embeds' 'images' input and "
    "leave dataset_path empty. They are cached as the same images in a folder would be; a changed image or caption "
    "re-encodes only what changed."
)


class LowVRAMImagesToDataset(io.Node):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LowVRAMImagesToDataset", display_name="Images to Dataset", category=CATEGORY,
            description=DESCRIPTION, is_input_list=True,
            search_aliases=["dataset from images", "image list to dataset", "load image-text dataset"],
            outputs=[io.Output("LOWVRAM_IMAGES", "images",
                               "The images with their captions, for Cache Text Embeds' 'images' input.")],
            inputs=[
                io.Custom("IMAGE", "images", tooltip="The images: the 'images' output of Load Image-Text (from "
                                                     "Folder) or of any node giving a list of images (or a batch)."),
                io.String("texts", force_input=True, optional=True,
                          tooltip="One caption per image, in the images' order: the 'texts' output of Load "
                                  "Image-Text (from Folder). Unconnected (or empty captions): Cache Text Embeds' "
                                  "default_caption is used."),
            ])

    @classmethod
    def execute(cls, images, texts=None) -> io.NodeOutput:
        from ..engine.data.image_set import image_caption_set

        return io.NodeOutput(image_caption_set(images, texts))
