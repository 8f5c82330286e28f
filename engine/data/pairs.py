"""Paired datasets for edit LoRAs (Qwen-Image-Edit): a target image, its instruction, one or more control images.

Layout (``docs/edit_datasets.md``)::

    my_edits/                 the dataset folder: the TARGETS (what the edit should produce)
        cat.png               a target ...
        cat.txt               ... and its instruction ("make the cat wear a red hat")
        dog.jpg
        dog.txt
        control/              the CONTROL images (the inputs to edit), matched to targets by file name
            cat.png           one control image for cat.png (any image extension)
            dog_0.png         several for dog.jpg: numbered from 0 (or 0000), in that order: Picture 1, 2, ...
            dog_1.png

The control folder is ``control/`` (or ``controls/``) inside the dataset folder, or any folders given explicitly:
- ai-toolkit's ``control_path`` (and ``control_path2``, ``control_path3``): one folder per control image, each file
  named as its target (``cat.png``); give them in order as ``control_dirs``;
- musubi-tuner's ``control_directory``: one folder, ``cat.png`` for one control image or ``cat_0.png``,
  ``cat_1.png`` (or ``cat_0000.png``, ...) for several.
Within one folder a target has either its same-name control or numbered ones, never both (an error names the files).
Sub-folders of the dataset other than the control folders are skipped, as for text-to-image datasets.

A target without any control image is an ERROR that names the files and the fix, not a skip: an edit pair without
its input would train the LoRA to ignore the control image (and a silently shrunk dataset is noticed only after
hours of training); checking costs nothing here (file names only, before any model loads). Control images without
a target are reported once through ``log`` and otherwise ignored (a folder of inputs often holds more).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from ..config import DataConfig
from ..errors import DatasetError
from .dataset import IMAGE_EXTENSIONS, MAX_LISTED, ImageRecord, scan_dataset

#: Control folders looked for inside the dataset folder when none are given.
CONTROL_FOLDER_NAMES = ("control", "controls")
_NUMBERED = re.compile(r"^(?P<stem>.+)_(?P<index>\d{1,4})$")


@dataclass(frozen=True)
class PairRecord:
    """One edit example: the target image with its instruction, and its control images in the model's order."""

    target: ImageRecord
    controls: tuple[Path, ...]

    @property
    def caption(self) -> str:
        return self.target.caption


def scan_pairs(cfg: DataConfig, control_dirs: Sequence[str | Path] = (), max_controls: int | None = None,
               log: Callable[[str], None] | None = None) -> list[PairRecord]:
    """The dataset's targets (``scan_dataset``: images with instructions, sorted by name) each with its control
    images. ``control_dirs``: the control folders in order (ai-toolkit's control_path, control_path2, ...; or musubi's
    one control_directory); empty = ``control/`` or ``controls/`` inside the dataset folder. ``max_controls``: the
    most control images the model takes (Qwen-Image-Edit: 1), an error names the targets with more."""
    log = log or (lambda msg: None)
    folder = Path(str(cfg.path).strip()).expanduser()
    dirs = [Path(d).expanduser() for d in control_dirs] or _default_control_dirs(folder)
    for d in dirs:
        if not d.is_dir():
            raise DatasetError(f"control folder {d} does not exist or is not a folder; point it at the folder of the "
                               f"control images (named as their targets), or leave it empty to use {folder}/control")
    skipped = {d.resolve() for d in dirs}
    targets = scan_dataset(cfg, log=lambda msg: None if _names_control_folder(msg, folder, skipped) else log(msg))
    listings = [_images_in(d) for d in dirs]
    stems = {t.image_path.stem for t in targets}
    pairs, missing, problems = [], [], []
    for target in targets:
        controls: list[Path] = []
        for d, files in zip(dirs, listings):
            found, problem = _controls_for(target.image_path.stem, files, stems)
            if problem:
                problems.append(f"{d}: {problem}")
            controls += found
        if not controls:
            missing.append(target.image_path.name)
        elif max_controls is not None and len(controls) > max_controls:
            problems.append(f"{target.image_path.name} has {len(controls)} control images ({', '.join(p.name for p in controls)}) "
                            f"but this model takes {max_controls}; keep {max_controls} or use Qwen-Image-Edit-2509/2511")
        pairs.append(PairRecord(target, tuple(controls)))
    if problems:
        raise DatasetError("; ".join(problems[:MAX_LISTED]))
    if missing:
        raise DatasetError(_missing_controls_message(missing, dirs))
    used = {p for pair in pairs for p in pair.controls}
    orphans = sorted(p.name for files in listings for p in files.values() if p not in used)
    if orphans:
        log(f"dataset: {len(orphans)} control image(s) match no target and are not used: "
            f"{', '.join(orphans[:MAX_LISTED])}")
    return pairs


def _default_control_dirs(folder: Path) -> list[Path]:
    found = [folder / n for n in CONTROL_FOLDER_NAMES if (folder / n).is_dir()]
    if not found:
        raise DatasetError(f"no control images for the edit dataset {folder}: put them in {folder / 'control'} named as "
                           f"their targets (cat.png for cat.png; cat_0.png, cat_1.png for several), or give the control "
                           f"folder(s) explicitly (ai-toolkit's control_path, musubi-tuner's control_directory)")
    if len(found) > 1:
        raise DatasetError(f"{folder} has both {found[0].name}/ and {found[1].name}/; keep one control folder")
    return found


def _names_control_folder(message: str, folder: Path, control: set[Path]) -> bool:
    """``scan_dataset``'s notice about a skipped sub-folder that is one of our control folders (not news)."""
    return any(f"sub-folder '{d.name}'" in message and d.parent == folder.resolve() for d in control)


def _images_in(folder: Path) -> dict[str, Path]:
    """Stem -> image file directly in ``folder`` (hidden files skipped); two files of one stem are an error."""
    out: dict[str, Path] = {}
    for p in sorted(folder.iterdir(), key=lambda p: p.name):
        if p.name.startswith(".") or not p.is_file() or p.suffix.lower() not in IMAGE_EXTENSIONS:
            continue
        if p.stem in out:
            raise DatasetError(f"control folder {folder} has two images named {p.stem} ({out[p.stem].name}, {p.name}); "
                               f"keep one")
        out[p.stem] = p
    return out


def _controls_for(stem: str, files: dict[str, Path], target_stems: set[str]) -> tuple[list[Path], str]:
    """One folder's controls of target ``stem``: its same-name file, or its numbered ones in order (a numbered
    name that is itself a target's name belongs to that target)."""
    numbered = []
    for s, p in files.items():
        m = _NUMBERED.match(s)
        if m and m.group("stem") == stem and s not in target_stems:
            numbered.append((int(m.group("index")), p))
    exact = files.get(stem)
    if exact is not None and numbered:
        return [], (f"target {stem} has both a same-name control ({exact.name}) and numbered ones "
                    f"({', '.join(p.name for _, p in sorted(numbered))}); use one form")
    if exact is not None:
        return [exact], ""
    numbered.sort()
    indices = [i for i, _ in numbered]
    if indices and indices != list(range(indices[0], indices[0] + len(indices))):
        return [], (f"target {stem}'s numbered controls skip a number ({', '.join(p.name for _, p in numbered)}); "
                    f"number them without gaps")
    return [p for _, p in numbered], ""


def _missing_controls_message(missing: list[str], dirs: list[Path]) -> str:
    listed = ", ".join(missing[:MAX_LISTED]) + (f" ... and {len(missing) - MAX_LISTED} more"
                                                 if len(missing) > MAX_LISTED else "")
    where = ", ".join(str(d) for d in dirs)
    stem = Path(missing[0]).stem
    return (f"{len(missing)} target image(s) have no control image: {listed}. Put each one's input image in {where} "
            f"under the target's name (for {missing[0]}: {stem}.png, or {stem}_0.png, {stem}_1.png for several), or "
            f"remove the target from the dataset folder")
