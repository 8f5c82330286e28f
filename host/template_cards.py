"""What the editor's template browser shows for each shipped template: a title, a one-line description and a
thumbnail that tells the templates apart.

How the browser gets them (ComfyUI 0.33, frontends 1.49.6 and 1.58.1; read in ``app/custom_node_manager.py`` and
the frontend's ``workflowTemplatesStore``): ``GET /workflow_templates`` returns only ``{pack: [file name, ...]}``,
and the frontend makes each custom-node card from the name alone (title = name, description = name, thumbnail =
``<name>.jpg`` beside the ``.json``, cards in the order the server globbed the folder). A pack's ``index.json`` with
titles is not read by these frontends (Comfy-Org/ComfyUI_frontend#13462; PR #9284 proposes it), and one placed in
``example_workflows/`` would be listed as a template itself. The file name stays the template's id
(``lowvram-lora run NAME``, the README), so the thumbnail carries the readable title and description, drawn over a
schematic of the template's own graph, in the family's colour; ``web/lowvram_lora.js`` puts the demos first.

The title is the note's own opening ("Flux.2-dev (32B) LoRA at 1024x1024 ..." -> "Flux.2-dev (32B) LoRA"; every
family's note starts by naming what it trains); the description is what it trains and at what size, and what it
needs: the planner's figures (``host/template_needs.py``), the same the Note ends with.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from .workflow import REROUTE_TYPE

#: The demos' titles: their notes open with instructions, not with what they train.
DEMO_TITLES = {"demo_tiny_lora": "Demo: a tiny Flux.1 LoRA, trained on the CPU",
               "demo_train_and_try": "Demo: train, then sample with ComfyUI's KSampler"}
#: Thumbnail size: the browser's cards are square (frontends 1.49 and 1.58 letterbox a 16:9 picture).
SIZE = 512


@dataclass(frozen=True)
class Card:
    name: str
    title: str
    kind: str  # "text-to-image", "image edit", "text-to-video", "image-to-video"
    description: str  # one line: what it trains, at what size, the VRAM and RAM it needs
    family: str  # the family id: the thumbnail's colour
    demo: bool = False


def note_title(name: str, note: str) -> str:
    """The note's opening up to its first "LoRA"/"LoRAs" ("Wan 2.2 T2V-A14B LoRAs"); else the file name in words."""
    if name in DEMO_TITLES:
        return DEMO_TITLES[name]
    m = re.match(r"\s*(.{3,80}?\bLoRAs?)\b", note.split("\n", 1)[0])
    return m.group(1) if m else name.replace("_", " ")


def _kind(title: str, video: bool) -> str:
    if video:
        return "image-to-video" if re.search(r"\bI2V\b|image-to-video", title) else "text-to-video"
    return "image edit" if re.search(r"\bEDIT\b|\bEdit\b|Kontext", title) else "text-to-image"


def card_for(t, family, needs, name: str | None = None, kind_note: str = "") -> Card:
    """The card of a training template ``t`` (a ``TrainingTemplate``) of ``family`` with the planner's ``needs``
    (``template_needs.Needs``); ``name``/``kind_note``: a template built on it (train-and-try) and what it adds."""
    name = name or t.name
    title = note_title(name, t.note)
    kind = _kind(note_title(t.name, t.note), bool(family.video))
    res = t.cache.get("resolution")
    size = f" at {res}px" if res else ""
    parts = [f"{kind} LoRA{size}" + (f", {kind_note}" if kind_note else "")]
    if t.split is not None:
        parts.append("2 GPUs")
    if t.chains:
        parts.append(f"{len(t.chains) + 1} experts")
    if needs.peak_vram_gb < 0.05:  # the demo's tiny model: any CPU
        parts.append(f"CPU, RAM {needs.ram_gb:.1f} GB")
    else:
        per_gpu = " per GPU" if t.split is not None else ""
        parts.append(f"VRAM {needs.peak_vram_gb:.1f} GB{per_gpu}, RAM {needs.ram_gb:.0f} GB")
    if t.split is not None and name not in DEMO_TITLES:
        title += " on 2 GPUs"
    return Card(name, title, kind, " · ".join(parts), family.id, demo=name.startswith("demo_"))


#: Family colours, far apart in hue, given out in the registry's order of family ids (the same on every machine).
PALETTE = [(90, 190, 230), (190, 110, 230), (240, 150, 60), (110, 200, 110), (235, 90, 110), (230, 210, 80),
           (80, 120, 235), (60, 200, 180), (200, 140, 110), (160, 160, 170)]


def family_colour(family_id: str) -> tuple[int, int, int]:
    from ..engine.families import family_ids

    ids = sorted(family_ids())
    return PALETTE[ids.index(family_id) % len(PALETTE)] if family_id in ids else PALETTE[-1]


def _font(size: int):
    from PIL import ImageFont

    try:  # Pillow >= 10.1 ships a scalable font: the same pictures on every machine
        return ImageFont.load_default(size=size)
    except TypeError:
        return ImageFont.load_default()


def _wrap(draw, text: str, font, width: int) -> list[str]:
    lines, line = [], ""
    for word in text.split():
        trial = f"{line} {word}".strip()
        if line and draw.textlength(trial, font=font) > width:
            lines.append(line)
            line = word
        else:
            line = trial
    return lines + ([line] if line else [])


#: Node colours in the schematic, by class: what each does reads at a glance across cards.
NODE_COLOURS = {"LowVRAMCacheTextEmbeds": (70, 140, 150), "LowVRAMOffloadConfig": (95, 95, 110),
                "LowVRAMTrainLoRA": (200, 130, 50), "LowVRAMSaveLoRA": (80, 160, 90),
                "LowVRAMDualGPUSplit": (150, 90, 170), "Note": (110, 90, 55),
                # Train LoRA's options: its colour, muted
                "LowVRAMTrainingOptions": (140, 100, 60), "LowVRAMPreviewOptions": (140, 100, 60)}


def _schematic(draw, ui: dict, box: tuple[int, int, int, int], accent: tuple[int, int, int]) -> None:
    """The template's graph as drawn in the editor, scaled into ``box``: nodes coloured by what they do (the Load
    node in the family's colour, ComfyUI's own nodes blue-grey), links as lines."""
    nodes = {n["id"]: n for n in ui["nodes"]}
    xs = [v for n in nodes.values() for v in (n["pos"][0], n["pos"][0] + n["size"][0])]
    ys = [v for n in nodes.values() for v in (n["pos"][1] - 30, n["pos"][1] + n["size"][1])]
    x0, y0 = min(xs), min(ys)
    scale = min((box[2] - box[0]) / (max(xs) - x0), (box[3] - box[1]) / (max(ys) - y0))
    ox = box[0] + ((box[2] - box[0]) - (max(xs) - x0) * scale) / 2

    def rect(n):
        return (ox + (n["pos"][0] - x0) * scale, box[1] + (n["pos"][1] - 30 - y0) * scale,
                ox + (n["pos"][0] + n["size"][0] - x0) * scale, box[1] + (n["pos"][1] + n["size"][1] - y0) * scale)

    def end(n, side):
        r = rect(n)
        return ((r[0] + r[2]) / 2, (r[1] + r[3]) / 2) if n["type"] == REROUTE_TYPE else (r[side], r[1] + 6)

    for link in ui["links"]:
        draw.line([end(nodes[link[1]], 2), end(nodes[link[3]], 0)], fill=(150, 190, 250), width=2)
    for n in nodes.values():
        if n["type"] == REROUTE_TYPE:
            continue
        colour = (accent if n["type"] == "LowVRAMLoadQuantizedSlab"
                  else NODE_COLOURS.get(n["type"], (80, 100, 130)))
        r = rect(n)
        draw.rounded_rectangle(r, radius=3, fill=tuple(c // 2 for c in colour), outline=colour, width=2)
        draw.rectangle((r[0] + 2, r[1] + 2, r[2] - 2, min(r[3] - 2, r[1] + 6)), fill=colour)


def _demo_subjects(draw, box: tuple[int, int, int, int]) -> None:
    """What the demo's dataset holds and its sample prompts ask for: a red circle, a blue square, on white."""
    from ..demo_models import DEMO_SUBJECTS

    w = (box[2] - box[0]) // len(DEMO_SUBJECTS)
    for i, (colour, shape) in enumerate(DEMO_SUBJECTS):
        x, y, s = box[0] + i * w + 8, box[1], min(w - 16, box[3] - box[1])
        draw.rectangle((x, y, x + s, y + s), fill=(245, 245, 245))
        m = s // 5
        rgb = {"red": (220, 40, 40), "blue": (40, 80, 220)}.get(colour, (120, 120, 120))
        (draw.ellipse if shape == "circle" else draw.rectangle)((x + m, y + m, x + s - m, y + s - m), fill=rgb)


def render_card(card: Card, ui: dict, path: Path) -> None:
    """The thumbnail: the title large, the description below it, then the graph's schematic; a band in the
    family's colour across the top (the demos: their dataset's two shapes beside the schematic)."""
    from PIL import Image, ImageDraw

    accent = family_colour(card.family)
    img = Image.new("RGB", (SIZE, SIZE), (28, 28, 32))
    d = ImageDraw.Draw(img)
    d.rectangle((0, 0, SIZE, 10), fill=accent)
    pad, y = 22, 26
    title_font, text_font, tag_font, badge_font = _font(36), _font(21), _font(18), _font(24)
    tag = card.kind.upper() + ("  ·  DEMO" if card.demo else "")
    # right-aligned: the browser draws its "Node graph" badge over the picture's top-left corner
    d.text((SIZE - pad - d.textlength(tag, font=tag_font), y - 6), tag, font=tag_font, fill=accent)
    y += 30
    for line in _wrap(d, card.title, title_font, SIZE - 2 * pad)[:3]:
        d.text((pad, y), line, font=title_font, fill=(245, 245, 245), stroke_width=1, stroke_fill=(245, 245, 245))
        y += 44
    y += 4
    what, *needs = card.description.split(" · ")
    what = what.replace(card.kind + " ", "", 1)
    for line in _wrap(d, " · ".join([what] + needs[:-1]), text_font, SIZE - 2 * pad)[:2]:
        d.text((pad, y), line, font=text_font, fill=(200, 200, 205))
        y += 27
    x = pad
    for badge in needs[-1].split(", "):  # "VRAM 7.4 GB", "RAM 10 GB" (the demo: "CPU", "RAM 1.7 GB")
        w = d.textlength(badge, font=badge_font) + 20
        d.rounded_rectangle((x, y + 6, x + w, y + 44), radius=8, outline=accent, width=2)
        d.text((x + 10, y + 11), badge, font=badge_font, fill=(245, 245, 245))
        x += w + 12
    y += 48
    graph_box = (pad, y + 14, SIZE - pad, SIZE - pad)
    if card.demo:
        _demo_subjects(d, (SIZE - pad - 190, graph_box[1], SIZE - pad, graph_box[1] + 95))
        graph_box = (pad, graph_box[1], SIZE - pad - 200, graph_box[3])
    _schematic(d, ui, graph_box, accent)
    img.save(path, quality=88)


def order(names) -> list[str]:
    """The browser's order: the demos first, then by title (what ``web/lowvram_lora.js`` applies)."""
    return sorted(names, key=lambda n: (not n.startswith("demo_"), n))
