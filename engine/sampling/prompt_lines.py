"""Per-prompt sample settings in the per-line syntax of sd-scripts and musubi-tuner, so their prompt files carry over.

A line is a prompt followed by options, each `` --<name> <value>`` (split on " --", as both tools do)::

    A cat walks on the grass, realistic style. --w 640 --h 480 --f 25 --d 1 --s 20

``--w`` width, ``--h`` height, ``--f`` frames (video), ``--d`` seed, ``--s`` steps, ``--g`` the embedded guidance
of a guidance-distilled model (Flux.1-dev), ``--l`` the classifier-free guidance scale, ``--n`` the negative prompt
(classifier-free guidance). An option a line leaves out takes Train LoRA's sample setting. Lines starting with
``#`` are comments. Where those tools log and go on (a value that does not parse, an option they do not know), a
line here is refused with ``PromptLineError`` naming the line and the fix: a preview is never silently drawn with
other settings than written.
"""
from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Optional

from ..errors import ConfigError

#: The options and what they set, as both tools' docs define them.
OPTIONS = {"w": "width", "h": "height", "f": "frames", "d": "seed", "s": "steps", "g": "guidance",
           "l": "cfg_scale", "n": "negative"}


class PromptLineError(ConfigError):
    """A sample prompt line whose options cannot be read."""


@dataclass(frozen=True)
class PromptLine:
    """One sample prompt and the settings its line gives (None: Train LoRA's)."""

    prompt: str
    width: Optional[int] = None
    height: Optional[int] = None
    frames: Optional[int] = None
    seed: Optional[int] = None
    steps: Optional[int] = None
    guidance: Optional[float] = None
    cfg_scale: Optional[float] = None
    negative: Optional[str] = None

    def settings(self) -> dict:
        """The options the line set (for the manifest and the grid's identity)."""
        return {k: v for k, v in asdict(self).items() if k != "prompt" and v is not None}


def is_comment(line: str) -> bool:
    return line.lstrip().startswith("#")


def parse_prompt_line(line: str) -> PromptLine:
    """The prompt and its options; ``PromptLineError`` for an unknown option, a missing or unreadable value."""
    parts = line.strip().split(" --")
    prompt = parts[0].strip()
    if prompt.startswith("--"):
        raise PromptLineError(f"sample prompt line {line.strip()!r} starts with an option; write the prompt first, "
                              f"then its options (e.g. 'a cat --w 512 --h 768')")
    if not prompt:
        raise PromptLineError(f"sample prompt line {line.strip()!r} has no prompt before its options")
    values: dict = {}
    for part in parts[1:]:
        m = re.fullmatch(r"([A-Za-z]+)(?:\s+(.*))?", part.strip(), re.DOTALL)
        name = m.group(1).lower() if m else part.strip()[:8]
        if not m or name not in OPTIONS:
            raise PromptLineError(f"sample prompt line {_short(line)}: '--{name}' is not an option; the options are "
                                  + ", ".join(f"--{k} ({v})" for k, v in OPTIONS.items()))
        field = OPTIONS[name]
        if field in values:
            raise PromptLineError(f"sample prompt line {_short(line)} gives --{name} twice")
        values[field] = _value(line, name, field, (m.group(2) or "").strip())
    return PromptLine(prompt, **values)


def _value(line: str, name: str, field: str, text: str):
    if not text:
        raise PromptLineError(f"sample prompt line {_short(line)}: --{name} has no value")
    if field == "negative":
        return text
    number = r"\d+" if field in ("width", "height", "frames", "seed", "steps") else r"\d+(?:\.\d*)?|\.\d+"
    if not re.fullmatch(number, text):
        kind = "a whole number" if number == r"\d+" else "a number"
        raise PromptLineError(f"sample prompt line {_short(line)}: --{name} {text!r} is not {kind}")
    value = int(text) if number == r"\d+" else float(text)
    if field in ("width", "height") and (value < 64 or value % 16):
        raise PromptLineError(f"sample prompt line {_short(line)}: --{name} {value} must be >= 64 and a multiple of "
                              f"16 (the latent grid)")
    if field == "steps" and not 1 <= value <= 1000:
        raise PromptLineError(f"sample prompt line {_short(line)}: --s {value} must be between 1 and 1000")
    if field == "frames" and value < 1:
        raise PromptLineError(f"sample prompt line {_short(line)}: --f {value} must be at least 1")
    return value


def _short(line: str) -> str:
    line = line.strip()
    return repr(line if len(line) <= 60 else line[:57] + "...")
