"""Where model files are found and outputs go, inside ComfyUI or standalone.

Inside ComfyUI we ask its ``folder_paths`` (imported lazily: this module must
import without ComfyUI). Standalone, the headless runner calls
``configure_standalone_dirs`` with ``--models-dir`` / ``--output-dir``; the
sub-folders mirror ComfyUI's (diffusion_models, unet, checkpoints, diffusers,
text_encoders, clip, vae).
"""
from __future__ import annotations

import os
from pathlib import Path

# ComfyUI folder names per kind of file we offer in combos.
TRANSFORMER_FOLDERS = ("diffusion_models", "unet", "checkpoints")
DIFFUSERS_FOLDERS = ("diffusers",)
DIFFUSERS_PREFIX = "diffusers/"  # combo entries naming a diffusers folder rather than a file
#: clip_vision: an image-to-video model's image encoder (Wan 2.1 I2V's clip_vision_h.safetensors) is given beside its
#: text encoder and told apart by its tensors, as the text encoders are.
TEXT_ENCODER_FOLDERS = ("text_encoders", "clip", "clip_vision")
VAE_FOLDERS = ("vae",)

_standalone = {"models_dir": Path("models").resolve(), "output_dir": Path("output").resolve()}


def configure_standalone_dirs(models_dir: str, output_dir: str) -> None:
    """Set by the headless runner (``lowvram-lora run --models-dir ... --output-dir ...``)."""
    _standalone["models_dir"] = Path(models_dir)
    _standalone["output_dir"] = Path(output_dir)


def comfy_folder_paths():
    """ComfyUI's folder_paths module, or None outside ComfyUI."""
    try:
        import folder_paths  # type: ignore[import-not-found]
    except ImportError:
        return None
    return folder_paths if hasattr(folder_paths, "get_folder_paths") else None


def _roots(kinds: tuple[str, ...]) -> list[Path]:
    fp = comfy_folder_paths()
    roots: list[Path] = []
    for kind in kinds:
        if fp is not None:
            try:
                roots += [Path(p) for p in fp.get_folder_paths(kind)]
            except Exception:  # a kind this ComfyUI version does not know
                continue
        else:
            roots.append(_standalone["models_dir"] / kind)
    return [r for r in roots if r.is_dir()]


def list_transformer_choices() -> list[str]:
    """Single .safetensors files and diffusers folders (``diffusers/<name>``), sorted."""
    files = set()
    for root in _roots(TRANSFORMER_FOLDERS):
        for f in root.rglob("*.safetensors"):
            if not f.name.endswith(".slab.safetensors"):
                files.add(f.relative_to(root).as_posix())
    return sorted(files) + list_diffusers_folders()


def list_files(kinds: tuple[str, ...]) -> list[str]:
    """``.safetensors`` files under the folders of ``kinds`` (relative names), sorted."""
    return sorted({f.relative_to(root).as_posix() for root in _roots(kinds) for f in root.rglob("*.safetensors")})


def resolve_file(name: str, kinds: tuple[str, ...]) -> Path:
    for root in _roots(kinds):
        if (root / name).is_file():
            return (root / name).resolve()
    where = ", ".join(str(r) for r in _roots(kinds)) or f"models/{kinds[0]}/ (missing)"
    raise FileNotFoundError(f"'{name}' was not found in {where}; put the file there or pick another entry")


def comfy_tokenizer_dirs() -> dict[str, str]:
    """Inside ComfyUI, its bundled tokenizer folders (CLIP-L: ``comfy/sd1_tokenizer``, T5:
    ``comfy/text_encoders/t5_tokenizer``, and every ``comfy/text_encoders/*_tokenizer`` under its own name, which
    a family's ``TextEncoderSpec.comfyui_tokenizer`` names), for single-file text encoders that carry none."""
    if comfy_folder_paths() is None:
        return {}
    try:
        import comfy  # type: ignore[import-not-found]
    except ImportError:
        return {}
    # ComfyUI's comfy/ is a namespace package (no __init__.py, so no __file__): take its path.
    paths = list(getattr(comfy, "__path__", [])) or ([str(Path(comfy.__file__).parent)] if comfy.__file__ else [])
    if not paths:
        return {}
    root = Path(paths[0]).resolve()
    dirs = {"clip_l": root / "sd1_tokenizer", "t5xxl": root / "text_encoders" / "t5_tokenizer"}
    bundled = root / "text_encoders"
    if bundled.is_dir():
        dirs.update({p.name: p for p in bundled.iterdir() if p.is_dir() and p.name.endswith("_tokenizer")})
    return {k: str(v) for k, v in dirs.items() if v.is_dir()}


def list_diffusers_folders() -> list[str]:
    out = set()
    for root in _roots(DIFFUSERS_FOLDERS):
        for child in root.iterdir():
            if (child / "model_index.json").exists() or (child / "config.json").exists():
                out.add(DIFFUSERS_PREFIX + child.name)
    return sorted(out)


def resolve_choice(name: str) -> Path:
    """A combo entry -> the absolute path of its file or folder."""
    if name.startswith(DIFFUSERS_PREFIX):
        kinds, rel = DIFFUSERS_FOLDERS, name[len(DIFFUSERS_PREFIX):]
    else:
        kinds, rel = TRANSFORMER_FOLDERS, name
    for root in _roots(kinds):
        if (root / rel).exists():
            return (root / rel).resolve()
    where = ", ".join(str(r) for r in _roots(kinds)) or f"models/{kinds[0]}/ (missing)"
    raise FileNotFoundError(f"'{name}' was not found in {where}; put the file there or pick another entry")


def slab_dir() -> Path:
    """models/slabs: where int8 slabs are built once and found again."""
    fp = comfy_folder_paths()
    root = Path(fp.models_dir) if fp is not None and hasattr(fp, "models_dir") else _standalone["models_dir"]
    return root / "slabs"


def output_dir() -> Path:
    fp = comfy_folder_paths()
    return Path(fp.get_output_directory()) if fp is not None else _standalone["output_dir"]


def temp_dir() -> Path:
    """Preview images: ComfyUI's temp folder (wiped at its start-up), or standalone ``temp/`` beside the
    output folder (what ``lowvram-lora serve`` shows with /view?type=temp)."""
    fp = comfy_folder_paths()
    return Path(fp.get_temp_directory()) if fp is not None else output_dir().parent / "temp"


def cache_dir() -> Path:
    """Dataset caches and trained-LoRA reuse live under the output folder, which
    survives restarts (ComfyUI's temp folder is wiped at start-up)."""
    return output_dir() / "lowvram_cache"


def input_dir() -> Path:
    """Where relative dataset paths are looked up first: ComfyUI's input folder, or standalone the
    ``input/`` beside ``--models-dir`` (the ComfyUI root layout)."""
    fp = comfy_folder_paths()
    if fp is not None:
        return Path(fp.get_input_directory())
    return _standalone["models_dir"].parent / "input"


def dataset_candidates(path: str) -> list[tuple[Path, str]]:
    """The folders a ``dataset_path`` may name, in the order they are tried, each with what it is: an absolute
    path as given; a relative one in the input folder (where the Notes and README say to put a dataset),
    then in the working directory."""
    p = Path(os.path.expanduser(path.strip()))
    if p.is_absolute():
        return [(p, "as given")]
    where = "ComfyUI's input folder" if comfy_folder_paths() is not None else "the input folder"
    return [(input_dir() / p, where), (Path.cwd() / p, "the working directory")]


def resolve_dataset_path(path: str) -> Path:
    """The dataset folder ``path`` names (see ``dataset_candidates``); when none exists, an error naming every
    folder tried and where to put the images."""
    from ..engine.errors import DatasetError

    tried = dataset_candidates(path)
    for folder, _ in tried:
        if folder.exists():
            return folder.resolve()
    listed = "; ".join(f"{folder} ({what})" for folder, what in tried)
    first = tried[0][0]
    raise DatasetError(
        f"dataset folder '{path}' was not found. Looked in: {listed}. Put the images (png/jpg/webp) with their "
        f".txt captions in {first}" + ("" if len(tried) == 1 else ", or set dataset_path to the folder's "
                                       "absolute path"))
