"""Exceptions the engine raises for bad input.

Every message names the offending argument or file and says how to fix it, because
these reach users through a node's error popup or the headless runner's stderr.
"""


#: The package's module path as imported here: "lowvram_lora" from pip, but inside ComfyUI the folder's path
#: ("/home/.../custom_nodes/lowvram-lora"), which the editor then printed before every message of ours.
_ROOT = __name__.removesuffix(".engine.errors")


def _readable_module(name: str) -> str:
    """``<the pack's folder path>.engine.x`` -> ``lowvram_lora.engine.x`` (importable wherever the pack is installed)."""
    return "lowvram_lora" + name[len(_ROOT):] if name == _ROOT or name.startswith(_ROOT + ".") else name


class LowVRAMError(Exception):
    """Base class: a problem the user can fix (bad path, wrong model, bad setting). Its classes are named by the
    package (``lowvram_lora.engine.errors.DatasetError``) wherever the pack was imported from, so an editor's
    error shows no file-system path."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.__module__ = _readable_module(cls.__module__)


class ConfigError(LowVRAMError, ValueError):
    """A setting is out of range or inconsistent with another."""


class ModelLoadError(LowVRAMError):
    """A checkpoint is missing, of the wrong family, or has mismatching tensors."""


class DatasetError(LowVRAMError):
    """The dataset folder is missing, empty, or has images without captions."""


class CacheError(LowVRAMError):
    """The on-disk cache is unreadable or inconsistent."""


class LoraFormatError(LowVRAMError):
    """A LoRA file cannot be written or read in the requested format."""


class LoraMismatchError(ConfigError):
    """A LoRA file to continue from does not fit this run (another family, model size, type, rank or targets)."""


class StorageError(LowVRAMError, OSError):
    """A file or folder cannot be written (read-only, disk full, a file in the way, name
    too long); says what was being written, where, and what to do."""


class TrainingDivergedError(LowVRAMError):
    """The loss or the LoRA weights became NaN/inf; nothing is saved."""


class WorkerError(LowVRAMError):
    """A data-parallel worker process failed or could not be stopped."""


def safetensors_only_message(folder, what: str, exc: BaseException) -> str:
    """Why a diffusers/transformers folder did not load, when only .safetensors are accepted."""
    from pathlib import Path

    folder = Path(folder)
    pickles = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
    if pickles and not list(folder.glob("*.safetensors")):
        return (f"the {what} in '{folder}' has only pickle weights ({', '.join(pickles[:3])}); lowvram-lora loads "
                f".safetensors only, because loading a pickle can run arbitrary code. Get the .safetensors "
                f"version of this model (or convert it in a trusted environment)")
    return f"could not load the {what} from '{folder}': {exc}"


LowVRAMError.__module__ = _readable_module(LowVRAMError.__module__)
