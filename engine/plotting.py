"""Loss-curve PNG with pillow alone (no matplotlib dependency for one chart)."""
from __future__ import annotations

from pathlib import Path


def _ema(values: list[float], beta: float = 0.9) -> list[float]:
    out, avg = [], None
    for v in values:
        avg = v if avg is None else beta * avg + (1 - beta) * v
        out.append(avg)
    return out


def render_loss_curve(losses: list[float], width: int = 640, height: int = 360, title: str = "training loss",
                      validation: list[tuple[int, float]] = ()):
    """A PIL image: raw losses in light grey, their moving average in blue, min/max labels; the validation loss
    ((step, loss) pairs, steps from 1) in orange."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (width, height), (255, 255, 255))
    d = ImageDraw.Draw(img)
    left, right, top, bottom = 56, width - 16, 28, height - 32
    d.rectangle((left, top, right, bottom), outline=(180, 180, 180))
    d.text((left, 8), f"{title} ({len(losses)} steps)", fill=(30, 30, 30))
    if not losses:
        d.text((left + 10, top + 10), "no steps yet", fill=(120, 120, 120))
        return img
    lo, hi = min(losses + [v for _, v in validation]), max(losses + [v for _, v in validation])
    span = (hi - lo) or 1.0
    n = max(len(losses) - 1, 1)

    def xy(i: int, v: float) -> tuple[float, float]:
        return left + (right - left) * i / n, bottom - (bottom - top) * (v - lo) / span

    for series, color, w in ((losses, (190, 190, 190), 1), (_ema(losses), (30, 90, 200), 2)):
        pts = [xy(i, v) for i, v in enumerate(series)]
        if len(pts) > 1:
            d.line(pts, fill=color, width=w)
        else:
            d.ellipse((pts[0][0] - 2, pts[0][1] - 2, pts[0][0] + 2, pts[0][1] + 2), fill=color)
    if validation:
        pts = [xy(s - 1, v) for s, v in validation]
        if len(pts) > 1:
            d.line(pts, fill=(230, 120, 20), width=2)
        for x, y in pts:
            d.ellipse((x - 3, y - 3, x + 3, y + 3), fill=(230, 120, 20))
        d.text((right - 150, 8), f"validation {validation[-1][1]:.4f}", fill=(230, 120, 20))
    d.text((4, top - 4), f"{hi:.3f}", fill=(60, 60, 60))
    d.text((4, bottom - 8), f"{lo:.3f}", fill=(60, 60, 60))
    d.text((left, bottom + 8), "step 1", fill=(60, 60, 60))
    d.text((right - 60, bottom + 8), f"step {len(losses)}", fill=(60, 60, 60))
    return img


def save_loss_curve(losses: list[float], path: str | Path, title: str = "training loss",
                    overwrite: bool = False, validation: list[tuple[int, float]] = ()) -> Path:
    """Write the curve as a PNG; an existing file is kept (FileExistsError) unless ``overwrite``."""
    from .fileio import atomic_write

    path = Path(path)
    with atomic_write(path, "the loss-curve image", overwrite=overwrite) as tmp:
        render_loss_curve(losses, title=title, validation=validation).save(tmp, format="PNG")
    return path
