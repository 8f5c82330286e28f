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
    label_h, label_w, row_h = 18, 0, cell + strip_h
    grid = Image.new("RGB", (label_w + cell * len(columns), label_h + row_h * len(prompts)), (24, 24, 24))
    draw = ImageDraw.Draw(grid)
    for c, (title, images) in enumerate(columns):
        draw.text((label_w + c * cell + 4, 3), title, fill=(230, 230, 230))
        for r, img in enumerate(images):
            x, y = label_w + c * cell, label_h + r * row_h
            frames = img if isinstance(img, list) else [img]
            grid.paste(frames[0].resize((cell, cell)), (x, y))
            if r < len(prompts) and prompts[r]:
                text = _fit_text(draw, prompts[r], cell - 8)
                draw.rectangle((x, y + cell - PROMPT_BAND, x + cell - 1, y + cell - 1), fill=(16, 16, 16))
                draw.text((x + 4, y + cell - PROMPT_BAND + 2), text, fill=(235, 235, 235))
            if isinstance(img, list):
                for i, frame in enumerate(strip_frames(frames)):
                    grid.paste(frame.resize((cell // STRIP, strip_h)), (x + i * (cell // STRIP), y + cell))
    return grid


#: Height of the band that carries a cell's prompt (PIL's default bitmap font is 11 px high).
PROMPT_BAND = 14


def _fit_text(draw, text: str, width: int) -> str:
    """``text`` on one line, cut (with an ellipsis) to at most ``width`` pixels in the draw's font.

    Linear in the prompt's length, whatever it is (LLM-written captions of thousands of characters are common sample
    prompts): the text is cut to ``width`` characters before anything is measured (no glyph that shows is narrower
    than a pixel), then the longest prefix that fits is found by bisection, a few measurements of a short string."""
    text = " ".join(text.split())  # textlength refuses multi-line text; a label is one line
    if len(text) <= width and draw.textlength(text) <= width:
        return text
    text = text[:width]
    lo, hi = 0, len(text)  # the longest fitting prefix lies in [lo, hi]; the empty one is taken if none fits
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if draw.textlength(text[:mid] + "...") <= width:
            lo = mid
        else:
            hi = mid - 1
    return text[:lo] + "..."
