"""The sample grid: prompts (rows) x checkpoints (columns) as one PIL image, a clip shown as a frame and a strip."""
from __future__ import annotations


#: Frames of a clip the grid shows in the strip under its first frame (evenly spaced, the last included).
STRIP = 4


def strip_frames(frames: list, count: int = STRIP) -> list:
    """``count`` frames evenly spaced over the clip, from the second to the last (the first is shown large)."""
    rest = frames[1:] or frames
    if len(rest) <= count:
        return rest
    return [rest[round(i * (len(rest) - 1) / (count - 1))] for i in range(count)]


def grid_image(columns: list[tuple[str, list]], prompts: list[str], cell: int = 256):
    """Prompts (rows) x checkpoints (columns, labelled) as one PIL image. A clip (a list of frames) shows its first
    frame in the cell and a strip of a few later frames below it: frontends that show a PNG cannot animate. Each
    cell carries its prompt on a dark band along its bottom edge (cut to the cell's width), so a row says what
    it was asked for."""
    from PIL import Image, ImageDraw

    clips = any(isinstance(x, list) for _, images in columns for x in images)
    strip_h = cell // STRIP if clips else 0
    font, size = _label_font(cell * len(columns))
    band = PROMPT_BAND if font is None else size + 8
    label_h, label_w, row_h = title_height(cell * len(columns)), 0, cell + strip_h
    grid = Image.new("RGB", (label_w + cell * len(columns), label_h + row_h * len(prompts)), (24, 24, 24))
    draw = ImageDraw.Draw(grid)
    for c, (title, images) in enumerate(columns):
        draw.text((label_w + c * cell + 4, 3), title, fill=(230, 230, 230), font=font)
        for r, img in enumerate(images):
            x, y = label_w + c * cell, label_h + r * row_h
            frames = img if isinstance(img, list) else [img]
            grid.paste(frames[0].resize((cell, cell)), (x, y))
            if r < len(prompts) and prompts[r]:
                text = _fit_text(draw, prompts[r], cell - 8, font)
                draw.rectangle((x, y + cell - band, x + cell - 1, y + cell - 1), fill=(16, 16, 16))
                draw.text((x + 4, y + cell - band + 2), text, fill=(235, 235, 235), font=font)
            if isinstance(img, list):
                for i, frame in enumerate(strip_frames(frames)):
                    grid.paste(frame.resize((cell // STRIP, strip_h)), (x + i * (cell // STRIP), y + cell))
    return grid


#: Height of the band that carries a cell's prompt in a narrow grid (PIL's default font, about 11 px high).
PROMPT_BAND = 14
#: Pixels of grid width per pixel of label font: the editor shows a grid scaled to the node's width (~380 px at
#: 100% zoom), so a 4-column grid (1024 px) with the default 11 px font drew 4 px letters. This keeps ~10 px.
GRID_WIDTH_PER_FONT_PX = 36


def title_height(grid_width: int) -> int:
    """Height of the grid's title row (the checkpoints' labels): 18 px, or the labels' font size + 8 on a wide grid."""
    font, size = _label_font(grid_width)
    return 18 if font is None else size + 8


def _label_font(grid_width: int):
    """(None, 11): PIL's default font, for a grid narrow enough to show near full size; else (a FreeType font of
    PIL's own, its size) scaled with the grid's width (``GRID_WIDTH_PER_FONT_PX``)."""
    size = grid_width // GRID_WIDTH_PER_FONT_PX
    if size <= 11:
        return None, 11
    from PIL import ImageFont

    return ImageFont.load_default(size=size), size


def _fit_text(draw, text: str, width: int, font=None) -> str:
    """``text`` on one line, cut (with an ellipsis) to at most ``width`` pixels in the draw's font.

    Linear in the prompt's length, whatever it is (LLM-written captions of thousands of characters are common sample
    prompts): the text is cut to ``width`` characters before anything is measured (no glyph that shows is narrower
    than a pixel), then the longest prefix that fits is found by bisection, a few measurements of a short string."""
    text = " ".join(text.split())  # textlength refuses multi-line text; a label is one line
    if len(text) <= width and draw.textlength(text, font=font) <= width:
        return text
    text = text[:width]
    lo, hi = 0, len(text)  # the longest fitting prefix lies in [lo, hi]; the empty one is taken if none fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if draw.textlength(text[:mid] + "...", font=font) <= width:
            lo = mid
        else:
            hi = mid - 1
    return text[:lo] + "..."
