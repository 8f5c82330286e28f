"""What the loaded model does, for the editor: which of our inputs apply to it.

``web/lowvram_lora.js`` hides the inputs that do nothing for the model a graph trains (the video inputs for an
image model, ``control_folder`` for a model that takes no control images) and shows them again when the model
changes. It asks ``GET /lowvram_lora/model_traits?checkpoint=NAME&family=ID`` with the Load Quantized Slab
node's values: the checkpoint is identified as that node identifies it (its header only: nothing is loaded).
Hidden widgets stay in the node, so a saved workflow's positional widget values are unchanged.
"""
from __future__ import annotations

#: Inputs that apply only to a video model / only to a model that takes control images, by node id.
VIDEO_INPUTS = {"LowVRAMCacheTextEmbeds": ["video_frames", "video_fps", "video_window", "windows_per_clip"],
                "LowVRAMTrainLoRA": ["sample_frames"]}
EDIT_INPUTS = {"LowVRAMCacheTextEmbeds": ["control_folder"]}
#: ... only to a checkpoint that trains both text- and image-to-video (LTX-2: engine/caching/task_choice.py).
TASK_INPUTS = {"LowVRAMCacheTextEmbeds": ["image_to_video"]}
#: ... only to a model that holds its first frame, or whose image-to-video twin does (LTX-2; not Wan I2V, whose
#: condition is extra input channels): the Loss & Validation Options feeding its Train LoRA.
HELD_INPUTS = {"LowVRAMLossOptions": ["first_frame_p"]}


def model_traits(checkpoint: str, family: str = "auto") -> dict:
    """``{"family", "variant", "video", "edit", "hide": {node id: [input names]}, "inputs": {node id: [every
    input that depends on the model]}}`` for a Load Quantized Slab choice; raises what the Load node would (a
    missing file, an unknown family). A file not there yet (a template opened before its download) with the
    family chosen: the family's answers, an input kept where any of its variants uses it (``variant`` None)."""
    from ..engine.checkpoint import identify
    from ..engine.families import get_family
    from .paths import resolve_choice

    try:
        path = resolve_choice(checkpoint)
    except FileNotFoundError:
        if family in ("", "auto"):
            raise
        fam = get_family(family)  # an unknown family raises here, as the Load node would
        return _traits(fam, None, list(fam.variants))
    ident = identify(path, family)
    return _traits(ident.family, ident.variant, [ident.variant])


def _traits(family, variant, variants: list[str]) -> dict:
    video = bool(family.video)
    edit = any(family.control_images(v) is not None for v in variants)
    both = holds = False
    for v in variants:
        first = family.first_frame(v)
        twin = _twin(family, v) if video and first is None else None
        both = both or twin is not None
        # first_frame_p does something where the model, or the twin it also trains, holds its first frame
        held = first if first is not None else (family.first_frame(twin) if twin is not None else None)
        holds = holds or (held is not None and held.held)
    hide: dict[str, list[str]] = {}
    for applies, inputs in ((video, VIDEO_INPUTS), (edit, EDIT_INPUTS), (both, TASK_INPUTS), (holds, HELD_INPUTS)):
        if not applies:
            for node, names in inputs.items():
                hide.setdefault(node, []).extend(names)
    managed: dict[str, list[str]] = {}
    for inputs in (VIDEO_INPUTS, EDIT_INPUTS, TASK_INPUTS, HELD_INPUTS):
        for node, names in inputs.items():
            managed.setdefault(node, []).extend(names)
    return {"family": family.id, "variant": variant, "video": video, "edit": edit, "hide": hide, "inputs": managed}


def _twin(family, variant: str) -> str | None:
    """The image-to-video variant the checkpoint also trains (Cache Text Embeds' image_to_video), or None."""
    from ..engine.caching.task_choice import image_to_video_variant
    from ..engine.errors import ConfigError

    try:
        return image_to_video_variant(family, variant)
    except ConfigError:
        return None


def register_routes() -> None:
    """The route above on ComfyUI's server (called when ComfyUI loads the pack; nothing without a server)."""
    try:
        from aiohttp import web
        from server import PromptServer  # type: ignore[import-not-found]
    except ImportError:
        return

    @PromptServer.instance.routes.get("/lowvram_lora/model_traits")
    async def _model_traits(request):
        q = request.rel_url.query
        try:
            return web.json_response(model_traits(q.get("checkpoint", ""), q.get("family", "auto")))
        except Exception as e:  # a file that is not there or not a model: the editor then shows every input
            return web.json_response({"error": str(e)}, status=404)
