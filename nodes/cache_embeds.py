"""Cache Text Embeds: encode captions and images once, into an on-disk cache."""
from __future__ import annotations

import os

from ..engine.errors import DatasetError
from . import schema as io
from .load_model import CATEGORY
from .paths import (TEXT_ENCODER_FOLDERS, VAE_FOLDERS, cache_dir, comfy_tokenizer_dirs, list_diffusers_folders,
                    list_files, resolve_choice, resolve_dataset_path, resolve_file)

FROM_CHECKPOINT = "(from checkpoint)"
SINGLE_FILES = "(single files below)"
NONE = "(none)"


def _video_help(name: str) -> str:
    from ..engine.config import field_help
    from ..engine.data.video_config import VideoConfig

    return "Video families (Wan) only. " + field_help(VideoConfig, name)


def _frame_counts(text: str) -> tuple[int, ...]:
    """'33' or '17, 33, 49' -> (17, 33, 49); anything else is a clear error (VideoConfig checks 4k+1)."""
    from ..engine.errors import ConfigError

    try:
        counts = tuple(int(x) for x in str(text).replace(";", ",").split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"video_frames={text!r}: give frame counts as whole numbers separated by commas, e.g. "
                          f"'33' or '17, 33'") from None
    if not counts:
        raise ConfigError("video_frames is empty: give at least one frame count of the form 4k+1, e.g. '33'")
    return counts


def _control_dirs(text: str) -> tuple[str, ...]:
    """control_folder's ';'-separated folders, each resolved as dataset_path is (absolute, or under input/)."""
    return tuple(str(resolve_dataset_path(part.strip())) for part in (text or "").split(";") if part.strip())


def _dataset_problem(folder, default_caption) -> str | None:
    """Why the dataset folder cannot be trained on, told by the engine's own scan (file headers and captions only),
    or None. A folder whose images fail but which holds clips is left to the video scan at run time."""
    from ..engine.config import DataConfig
    from ..engine.data.dataset import scan_dataset
    from ..engine.data.video import clip_kind

    if folder is None:
        return "dataset_path is empty: set it to a folder of images with .txt captions (under ComfyUI's input/ or absolute)"
    try:
        scan_dataset(DataConfig(path=str(folder), default_caption=(default_caption or "").strip() or None))
    except DatasetError as exc:
        if folder.is_dir() and any(clip_kind(p) not in (None, "image") for p in folder.iterdir()):
            return None
        return str(exc)
    return None


#: validate_inputs' default for the ``images`` socket: unconnected (ComfyUI passes None for a connected one).
_UNCONNECTED = object()


def _images_problem(dataset_path, control_folder) -> str | None:
    """Why the ``images`` socket cannot be used with these widgets, or None: it replaces dataset_path, and its images
    have no file names for control images to be matched by."""
    if dataset_path and str(dataset_path).strip():
        return (f"dataset_path is '{str(dataset_path).strip()}' but the images input is connected too: give one "
                f"dataset; clear dataset_path to train on the connected images, or disconnect images")
    if control_folder and str(control_folder).strip():
        return ("control_folder matches control images to dataset images by file name, which images from the images "
                "input do not have; for an edit model give a dataset_path folder (targets) and its control folder")
    return None


def _check_control_folders(text: str) -> None:
    """Each of control_folder's ';'-separated folders exists (resolved as dataset_path is), or a DatasetError."""
    for part in (text or "").split(";"):
        if not part.strip():
            continue
        try:
            folder = resolve_dataset_path(part.strip())
        except DatasetError:
            folder = None
        if folder is None or not folder.is_dir():
            raise DatasetError(f"control_folder: '{part.strip()}' is not a folder; point it at the folder of the "
                               f"control images (named as their targets), or leave it empty to use the dataset's "
                               f"control/ folder")


def _per_family(kind: str) -> str:
    """One help line per registered family (``ModelFamily.file_help``): the help is written once, in the family."""
    from ..engine.families import families

    return " ".join(f"{f.display_name}: {f.file_help[kind]}." for f in families().values() if kind in f.file_help)


DESCRIPTION = (
    "Encodes every caption with the text encoders and every image with the VAE, once, into a cache on disk. "
    "Text encoders run layer by layer on the GPU, so they never need to fit it whole. Reruns reuse the cache; "
    "a changed caption, image or setting re-encodes only what changed."
)


class LowVRAMCacheTextEmbeds(io.Node):
    @classmethod
    def define_schema(cls) -> io.Schema:
        from ..engine.config import DataConfig, field_help

        def data(name: str, extra: str = "") -> str:
            return field_help(DataConfig, name, extra)

        return io.Schema(
            node_id="LowVRAMCacheTextEmbeds", display_name="Cache Text Embeds", category=CATEGORY,
            description=DESCRIPTION, hidden=["unique_id"],
            outputs=[io.Output("LOWVRAM_DATASET", "dataset", "A handle to the cached text embeddings and latents.")],
            inputs=[
                io.Custom("LOWVRAM_MODEL", "model", tooltip="The base model from Load Quantized Slab."),
                io.Combo("text_encoders", [FROM_CHECKPOINT, SINGLE_FILES] + list_diffusers_folders(),
                         default=FROM_CHECKPOINT,
                         tooltip="Diffusers pipeline folder (models/diffusers) whose text encoders, tokenizers and "
                                 "VAE are used. " + _per_family("pipeline") + " '(from checkpoint)' works when the "
                                 "checkpoint is itself a pipeline folder. '(single files below)' uses the "
                                 "text_encoder_1/2 and vae_file inputs instead."),
                io.String("dataset_path", default="",
                          tooltip=data("path", "A relative path (e.g. my_subject) is looked up in ComfyUI's input "
                                               "folder (input/my_subject), then in the working directory; an "
                                               "absolute path is used as given.")),
                io.Int("resolution", default=1024, min=64, max=4096, step=64,
                       tooltip=data("resolution")),
                io.String("trigger_word", default="",
                          tooltip=data("trigger_word")),
                io.String("default_caption", default="",
                          tooltip=data("default_caption")),
                io.Int("repeats", default=1, min=1, max=1000,
                       tooltip=data("repeats")),
                io.Boolean("flip", default=False,
                           tooltip=data("flip")),
                io.Int("max_sequence_length", default=0, min=0, max=512,
                       tooltip="Text tokens kept per caption (by the sequence encoder: T5, or the LLM). 0 = the "
                               "model's own default (its pipeline's). Shorter is faster if captions are short."),
                # Last: UI-format workflows store widget values by position.
                io.Combo("text_encoder_1", [NONE] + list_files(TEXT_ENCODER_FOLDERS), default=NONE,
                         tooltip="With text_encoders '(single files below)': a text-encoder file from "
                                 "models/text_encoders (fp8 / scaled fp8 too); which file is which is told from its "
                                 "tensors, so the inputs may be in either order; a family with one text encoder "
                                 "leaves text_encoder_2 '(none)'. " + _per_family("single_files")),
                io.Combo("text_encoder_2", [NONE] + list_files(TEXT_ENCODER_FOLDERS), default=NONE,
                         tooltip="A second text-encoder file, for families with two (Flux.1: clip_l + t5xxl; see "
                                 "text_encoder_1); for Wan 2.1 image-to-video, its image encoder "
                                 "(models/clip_vision/clip_vision_h.safetensors)."),
                io.Combo("vae_file", [NONE] + list_files(VAE_FOLDERS), default=NONE,
                         tooltip="With text_encoders '(single files below)': the VAE file from models/vae (the "
                                 "Flux.1 ae.safetensors serves Flux.1, Z-Image and Lumina 2; Flux.2 has its own)."),
                io.String("sample_prompts", default="", multiline=True,
                          tooltip="Prompts for sample images while training, one per line (empty: none). Encoded "
                                  "here once with the captions; Train LoRA's sample_every turns sampling on. "
                                  "Include the trigger word where you want the LoRA's subject. A line may carry its "
                                  "own settings as in sd-scripts and musubi-tuner prompt files: --w width, --h "
                                  "height, --f frames, --d seed, --s steps, --g guidance, --l CFG scale, --n negative "
                                  "prompt (e.g. 'a cat --w 768 --h 512 --d 3'); lines starting with # are comments."),
                # Video families only (Wan): how clips become training windows. Optional and after every older
                # widget, so saved workflows keep their positions; image families ignore them.
                io.String("video_frames", default="33", optional=True,
                          tooltip=_video_help("frame_counts") + " Comma-separated."),
                io.Float("video_fps", default=16.0, min=0.0, max=120.0, step=1.0, optional=True,
                         tooltip=_video_help("fps")),
                io.Combo("video_window", ["head", "uniform", "random"], default="head", optional=True,
                         tooltip=_video_help("window")),
                io.Int("windows_per_clip", default=1, min=1, max=64, optional=True,
                       tooltip=_video_help("windows_per_clip")),
                # Edit models only (Qwen-Image-Edit); after the video widgets so saved workflows keep positions.
                io.String("control_folder", default="", optional=True,
                          tooltip="Edit models (Qwen-Image-Edit, Flux.1 Kontext, Flux.2) only: the folder of "
                                  "CONTROL images (the inputs to edit, Flux.2's reference images; Flux.2 trains "
                                  "text-to-image when there are none), each named as its target image (cat.png for cat.png; cat_0.png, cat_1.png "
                                  "for several, in order). Empty: the 'control' (or 'controls') folder inside the "
                                  "dataset folder. Several folders (ai-toolkit's control_path, control_path2): "
                                  "separate them with ';'. A path under input/ may be relative. The dataset "
                                  "folder's images are the TARGETS and their .txt files the instructions. For "
                                  "sample images while training, sample_prompts line 1 is drawn against the first "
                                  "target's control images, line 2 the second's (targets in file-name order)."),
                # Video families whose one checkpoint does both (LTX-2): after every older widget (saved positions).
                io.Boolean("image_to_video", default=False, optional=True, tooltip=_video_help("image_to_video")),
                io.Custom("LOWVRAM_DATASET_OPTIONS", "options", optional=True,
                          tooltip="From Dataset Options: loss masks and a validation split. Unconnected: none."),
                io.Custom("LOWVRAM_IMAGES", "images", optional=True,
                          tooltip="From Images to Dataset: the images and captions of ComfyUI's own dataset nodes "
                                  "(Load Image-Text (from Folder)), instead of dataset_path (leave it empty). "
                                  "Cached as the same images in a folder would be."),
            ])

    @classmethod
    def validate_inputs(cls, dataset_path=None, control_folder=None, default_caption=None, images=_UNCONNECTED):
        """Checked when the graph is queued, before any node runs (so before a 20-60 GB checkpoint loads): the dataset
        folder exists and its images have captions, and each control folder exists. The editor marks the node with
        the message. A value that comes from a link is not known yet (None) and is checked when the node runs. The
        family is not known here either: a folder of clips (video families) is left to the run's own scan. With the
        ``images`` socket connected (None here: a link), dataset_path must be empty."""
        if images is not _UNCONNECTED:
            return _images_problem(dataset_path, control_folder) or True
        if dataset_path is None:
            return True
        try:
            folder = resolve_dataset_path(dataset_path) if str(dataset_path).strip() else None
            problem = _dataset_problem(folder, default_caption)
            if problem:
                return problem
            _check_control_folders(control_folder)
        except DatasetError as exc:
            return str(exc)
        return True

    @classmethod
    def fingerprint_inputs(cls, dataset_path="", **_):
        # Rerun when files in the dataset folder change; the cache then re-encodes only those.
        try:
            folder = resolve_dataset_path(dataset_path)
            return ";".join(f"{e.name}:{e.stat().st_size}:{e.stat().st_mtime_ns}"
                            for e in sorted(os.scandir(folder), key=lambda e: e.name))
        except (OSError, DatasetError):  # not there (yet): the node's run says where it looked
            return dataset_path

    @classmethod
    def execute(cls, model, text_encoders: str, dataset_path: str, resolution: int = 1024, trigger_word: str = "",
                default_caption: str = "", repeats: int = 1, flip: bool = False, max_sequence_length: int = 0,
                text_encoder_1: str = NONE, text_encoder_2: str = NONE, vae_file: str = NONE, sample_prompts: str = "",
                video_frames: str = "33", video_fps: float = 16.0, video_window: str = "head",
                windows_per_clip: int = 1, control_folder: str = "", options=None, images=None,
                image_to_video: bool = False) -> io.NodeOutput:
        from dataclasses import replace

        from ..engine.caching import build_dataset_cache
        from ..engine.config import DataConfig
        from .progress import free_comfy_vram, make_callback, node_library_bars

        free_comfy_vram()
        model_cfg = model.config
        if text_encoders == SINGLE_FILES:
            files = tuple(str(resolve_file(f, TEXT_ENCODER_FOLDERS)) for f in (text_encoder_1, text_encoder_2)
                          if f != NONE)
            vae = str(resolve_file(vae_file, VAE_FOLDERS)) if vae_file != NONE else ""
            model_cfg = replace(model_cfg, text_encoder_files=files, vae_file=vae, tokenizer_dirs=comfy_tokenizer_dirs())
        elif text_encoders != FROM_CHECKPOINT:
            model_cfg = replace(model_cfg, pipeline_path=str(resolve_choice(text_encoders)))
        if images is not None:  # ComfyUI's dataset nodes, through Images to Dataset: written once as a folder
            from ..engine.data.image_set import write_image_set
            from ..engine.errors import ConfigError

            problem = _images_problem(dataset_path, control_folder)
            if options is not None and options.mask_source != "none":
                problem = (f"Dataset Options' mask_source={options.mask_source!r} reads mask files beside the images "
                           f"(or their alpha), which images from the images input do not have; set mask_source "
                           f"'none', or give a dataset_path folder with the masks")
            if problem:
                raise ConfigError(problem)
            dataset_path = str(write_image_set(images, cache_dir() / "images", default_caption))
        data = DataConfig(path=str(resolve_dataset_path(dataset_path)) if dataset_path else "", resolution=resolution,
                          trigger_word=trigger_word.strip(), default_caption=default_caption.strip() or None,
                          repeats=repeats, flip=flip)
        from ..engine.families import get_family

        video = None
        if image_to_video and not get_family(model.family).video:
            raise ValueError(f"image_to_video is on, but {model.family} is an image model; turn image_to_video off")
        if get_family(model.family).video:
            from ..engine.data.video_config import VideoConfig

            video = VideoConfig(frame_counts=_frame_counts(video_frames), fps=float(video_fps), window=video_window,
                                windows_per_clip=int(windows_per_clip), image_to_video=bool(image_to_video))
        with node_library_bars():
            dataset = build_dataset_cache(model_cfg, data, cache_dir(), max_sequence_length=max_sequence_length,
                                          callback=make_callback(cls.hidden.unique_id),
                                          sample_prompts=sample_prompts.splitlines(), video=video,
                                          control_dirs=_control_dirs(control_folder), options=options)
        return io.NodeOutput(dataset)
