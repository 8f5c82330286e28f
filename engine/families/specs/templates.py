"""``TrainingTemplate``: a shipped workflow of a family (the folder's ``templates.py`` lists them as ``TEMPLATES``;
the registry finds that module by its name, ``host/templates.py`` lays the graphs out)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class TrainingTemplate:
    """A shipped workflow of the family: the five-node training graph (Load, Cache, Offload, Train, Save;
    ``host/templates.py`` lays it out) with these widget values, a note for the user, and optionally a
    Dual-GPU Split node. A family lists its own in ``<folder>/templates.py`` as ``TEMPLATES``."""

    name: str  # the workflow's file name (example_workflows/<name>.json)
    load: dict[str, Any]
    cache: dict[str, Any]
    offload: dict[str, Any]
    train: dict[str, Any]
    save: dict[str, Any]
    note: str
    split: dict[str, Any] | None = None
    note_pos: tuple[int, int] = (40, 420)
    #: file name -> the download URL ComfyUI's own templates give for that file (Comfy-Org's repackaged files on
    #: Hugging Face); the editor's Missing Models dialog offers it. Only files the widgets above name.
    downloads: dict[str, str] = field(default_factory=dict)
    #: file name -> the ComfyUI model folder its download goes to, where it is not the widget's own
    #: (``host/templates.py`` ``MODEL_FOLDERS``): an all-in-one checkpoint lives in ``checkpoints``, as ComfyUI's
    #: own templates place it (LTX-2.3).
    download_folders: dict[str, str] = field(default_factory=dict)
    #: Further training chains in the same graph, each laid out below the one before: a dict of sections
    #: (``load``, ``cache``, ``offload``, ``train``, ``save``) whose values update this template's own (Wan 2.2
    #: A14B: one chain per expert file, each saving its own LoRA). The Dual-GPU Split (``split``) joins the first.
    #: A chain's ``label`` (a string) ends its nodes' titles, as ``label`` does the first chain's.
    chains: tuple[dict[str, Any], ...] = ()
    label: str = ""
    #: The variant its first chain trains, as the Load node identifies the file: the planner's VRAM and RAM figures
    #: in its Note and the README's table (host/template_needs.py); ``partner_variant``: the preview partner's, where
    #: chains preview each other (Wan 2.2 A14B: the other expert, held in host RAM while it samples).
    variant: str = ""
    partner_variant: str = ""
    #: Links between chains: ``(chain, Train LoRA input, source chain)`` feeds that input of the chain's Train LoRA
    #: from the source chain's Load Quantized Slab (chain 0 is this template's own). Wan 2.2 A14B: each expert's
    #: ``preview_partner`` is the other chain's model, so previews switch expert at the boundary.
    chain_links: tuple[tuple[int, str, int], ...] = ()
    #: The tiny stand-in tests build for this template's files ("": the family's ``tiny_variant``): a variant whose
    #: inputs differ (Wan I2V's condition channels) needs its own (the family's fixtures take ``variant=``).
    tiny_variant: str = ""
