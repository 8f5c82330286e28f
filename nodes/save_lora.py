"""Save LoRA: write the trained LoRA (and its loss curve) to the output folder."""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from . import schema as io
from .load_model import CATEGORY
from .paths import output_dir

if TYPE_CHECKING:
    from ..engine.lora_io.trained import TrainedLora


_MAX_COUNTER = 99_999


def check_filename_prefix(root: Path, prefix: str) -> Path:
    """The target stem ``<root>/<prefix>`` for a valid prefix; raises ValueError naming the
    problem and the fix. Run before training (validate_inputs), so a bad prefix never costs
    a training run."""
    prefix = prefix.strip().replace("\\", "/") or "lowvram_lora"
    if "\x00" in prefix:
        raise ValueError("filename_prefix contains a NUL character; remove it")
    parts = [p for p in prefix.split("/") if p]
    long = [p for p in parts if len(p.encode("utf-8")) > 200]
    if long:
        raise ValueError(f"filename_prefix part '{long[0][:40]}...' is {len(long[0].encode())} bytes long; "
                         f"keep each folder/file name under 200 characters")
    target = (root / prefix).resolve()
    if root.resolve() not in target.parents:
        raise ValueError(f"filename_prefix '{prefix}' must stay inside the output folder {root}; "
                         f"use a relative path such as loras/my_lora")
    for parent in list(target.parents)[::-1]:
        if parent.exists() and not parent.is_dir():
            raise ValueError(f"filename_prefix '{prefix}': '{parent}' is a file, but a folder is needed there; "
                             f"rename that file or choose another prefix")
    if target.is_dir():
        raise ValueError(f"filename_prefix '{prefix}' names the folder '{target}'; add a file name, "
                         f"e.g. '{prefix.rstrip('/')}/my_lora'")
    return target


EMA_SUFFIX = "_ema.safetensors"  # the EMA's own file beside the LoRA: <name>_ema.safetensors


def claim_output_paths(root: Path, prefix: str, extra: tuple[str, ...] = ()) -> tuple[Path, Path]:
    """``<root>/<prefix>_00001_.safetensors`` and its ``_loss.png``, counting up past any number
    where either exists (ComfyUI's convention). Both names are claimed by exclusive create,
    so two runs saving into one folder never pick the same pair and nothing is replaced; the
    claimed files are empty until the caller writes over them. ``extra``: suffixes of more files beside the LoRA
    (``<stem><suffix>``: the EMA's), claimed with them."""
    from ..engine.fileio import claim_names, ensure_dir

    target = check_filename_prefix(root, prefix)
    ensure_dir(target.parent, "the LoRA")
    for n in range(1, _MAX_COUNTER + 1):
        lora = target.parent / f"{target.name}_{n:05d}_.safetensors"
        curve = lora.with_name(lora.stem + "_loss.png")
        names = [lora, curve] + [lora.with_name(lora.stem + suffix) for suffix in extra]
        if any(p.exists() for p in names):
            continue
        if claim_names(names, "the LoRA"):
            return lora, curve
    raise ValueError(f"'{target.parent}' already holds {_MAX_COUNTER} files named {target.name}_NNNNN_; "
                     f"choose another filename_prefix")


DESCRIPTION = (
    "Saves the LoRA as .safetensors in the output folder (plus a loss-curve PNG beside it). The 'comfyui' "
    "format loads in ComfyUI's LoRA loaders; 'diffusers' loads with diffusers' load_lora_weights and in ComfyUI. "
    "With EMA on (LoRA Adapter's ema_decay), the EMA of the weights is saved beside it as <name>_ema.safetensors."
)


class LowVRAMSaveLoRA(io.Node):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LowVRAMSaveLoRA", display_name="Save LoRA (LowVRAM)", category=CATEGORY,
            description=DESCRIPTION, is_output_node=True,
            inputs=[
                io.Custom("LOWVRAM_LORA", "lora", tooltip="The trained LoRA from Train LoRA."),
                io.String("filename_prefix", default="loras/flux_lora",
                          tooltip="Path inside the output folder; a counter is added, existing files are never "
                                  "replaced. Under loras/ (the default), ComfyUI's LoRA loaders list the file as it "
                                  "is (ComfyUI adds output/loras to their folders); elsewhere, copy it to "
                                  "models/loras. To try it without saving, use Train LoRA's lora_model output."),
                io.Combo("format", ["comfyui", "diffusers"], default="comfyui",
                         tooltip="comfyui: one LoRA per projection under 'transformer.' names with an explicit "
                                 "alpha tensor (scale 1); ComfyUI maps every key into its fused layers, and "
                                 "diffusers loads it too. diffusers: the same names without alpha tensors "
                                 "(diffusers' own layout; ComfyUI reads it at scale 1 as well). Both are the same "
                                 "size."),
                io.Combo("dtype", ["bf16", "fp16", "fp32"], default="bf16",
                         tooltip="Precision of the saved weights. bf16 halves the file with no visible loss."),
            ])

    @classmethod
    def validate_inputs(cls, filename_prefix=None):
        """ComfyUI calls this when the prompt is queued (the headless runner too), before any
        node runs: a bad prefix is reported before hours of training, not after."""
        if isinstance(filename_prefix, str):
            try:
                check_filename_prefix(output_dir(), filename_prefix)
            except ValueError as exc:
                return str(exc)
        return True

    @classmethod
    def execute(cls, lora, filename_prefix: str = "loras/flux_lora", format: str = "comfyui",
                dtype: str = "bf16") -> io.NodeOutput:
        # A two-expert run (Dual-GPU Split mode 'experts') carries the other expert's LoRA: each is saved under the
        # prefix + its role (loras/wan22_lora_high_noise_00001_.safetensors and ..._low_noise_...).
        loras = [lora] + ([lora.companion] if lora.companion is not None else [])
        texts, curves, files, emas = [], [], [], []
        for one in loras:
            role = one.settings.get("expert_role", "")
            prefix = f"{filename_prefix}_{role.split()[0].replace('-', '_')}" if len(loras) > 1 and role else \
                filename_prefix
            path, curve, saved, ema = _save_one(one, prefix, format, dtype)
            texts.append(str(path))
            emas += [str(ema)] if ema is not None else []
            curves.append(str(curve))
            files += saved
        snapshots = [str(p) for one in loras for p in one.snapshots]
        return io.NodeOutput(ui={"text": texts, "loss_curve": curves, "files": files,
                                 **({"ema": emas} if emas else {}), **({"snapshots": snapshots} if snapshots else {})})


def _save_one(lora: TrainedLora, filename_prefix: str, format: str, dtype: str):
    """One LoRA, its loss curve and its last samples under a new numbered name, and with EMA on, the EMA's own file
    beside it (``<name>_ema.safetensors``); (LoRA path, curve path, the files as ComfyUI's output entries, the EMA's
    path or None)."""
    from ..engine.lora_io import save_lora
    from ..engine.plotting import save_loss_curve

    path, curve = claim_output_paths(output_dir(), filename_prefix, (EMA_SUFFIX,) if lora.ema_state_dict else ())
    ema = path.with_name(path.stem + EMA_SUFFIX) if lora.ema_state_dict else None
    try:  # the names are ours (claimed, empty): write over them
        save_lora(lora, path, fmt=format, dtype=dtype, overwrite=True)
        if ema is not None:
            save_lora(lora.as_ema(), ema, fmt=format, dtype=dtype, overwrite=True)
        val = lora.settings.get("validation") or {}
        save_loss_curve(lora.loss_history, curve, overwrite=True,
                        validation=list(zip(val.get("steps", []), val.get("loss", []))))
    except BaseException:
        for p in (path, curve) + ((ema,) if ema is not None else ()):
            if p.exists() and p.stat().st_size == 0:
                p.unlink()
        raise
    print(f"[lowvram-lora] saved LoRA: {path}\n[lowvram-lora] loss curve: {curve}")
    if ema is not None:
        print(f"[lowvram-lora] saved its EMA: {ema}")
    samples = _copy_last_samples(lora, path)
    if samples is not None:
        print(f"[lowvram-lora] sample grid: {samples}")
    log_csv = _copy_log(lora, path)
    if log_csv is not None:
        print(f"[lowvram-lora] training log: {log_csv}")
    clips = _copy_last_clips(lora, path)
    for clip in clips:
        print(f"[lowvram-lora] sample clip: {clip}")
    # filename/subfolder/type entries are what ComfyUI clients (comfy run --wait) list as outputs.
    root = output_dir().resolve()
    files = [{"filename": p.name, "subfolder": p.parent.resolve().relative_to(root).as_posix(), "type": "output"}
             for p in (path, curve) + ((ema,) if ema is not None else ()) + ((samples,) if samples is not None else ())
             + tuple(clips)
             + ((log_csv,) if log_csv is not None else ())]
    for snap in lora.snapshots:  # LoRA Adapter's snapshot_every: the loadable files of earlier steps
        print(f"[lowvram-lora] snapshot: {snap}")
    return path, curve, files, ema


def _copy_last_samples(lora: TrainedLora, path: Path):
    """The last sample grid next to the LoRA as ``<name>_samples.png`` (a new name: never replaces a file)."""
    import shutil

    from ..engine.fileio import atomic_write, claim_names

    grids = [g for g in lora.sample_grids if Path(g).exists()]
    if not grids:
        return None
    target = path.with_name(path.stem + "_samples.png")
    if not claim_names([target], "the sample grid"):
        return None
    with atomic_write(target, "the sample grid", overwrite=True) as tmp:
        shutil.copyfile(grids[-1], tmp)
    return target


def _copy_log(lora: TrainedLora, path: Path):
    """The run's CSV log (Loss & Validation Options) next to the LoRA as ``<name>_log.csv`` (a new name only)."""
    import shutil

    from ..engine.fileio import atomic_write, claim_names

    source = (lora.settings.get("logs") or {}).get("csv")
    if not source or not Path(source).exists():
        return None
    target = path.with_name(path.stem + "_log.csv")
    if not claim_names([target], "the training log"):
        return None
    with atomic_write(target, "the training log", overwrite=True) as tmp:
        shutil.copyfile(source, tmp)
    return target


def _copy_last_clips(lora: TrainedLora, path: Path) -> list[Path]:
    """A video model's last checkpoint clips next to the LoRA as ``<name>_samples_pNN.webp`` (new names only)."""
    import shutil

    from ..engine.fileio import atomic_write, claim_names
    from ..engine.sampling import saved_clips

    grids = [g for g in lora.sample_grids if Path(g).exists()]
    clips = saved_clips(grids[-1]) if grids else []
    targets = [path.with_name(f"{path.stem}_samples_{c.stem.rsplit('_', 1)[-1]}.webp") for c in clips]
    if not clips or not claim_names(targets, "the sample clips"):
        return []
    for clip, target in zip(clips, targets):
        with atomic_write(target, "a sample clip", overwrite=True) as tmp:
            shutil.copyfile(clip, tmp)
    return targets
