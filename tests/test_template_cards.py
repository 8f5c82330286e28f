"""The template browser's cards: a readable title and description per template, thumbnails that tell the
templates apart, the demos first (host/template_cards.py; web/lowvram_lora.js applies the order)."""
import itertools
import re
import subprocess
import shutil

import numpy as np
import pytest
from PIL import Image

from types import SimpleNamespace

from lowvram_lora.host.template_cards import SIZE, card_for, note_title, order
from lowvram_lora.host.templates import SHIPPED, TRY_TEMPLATES, WORKFLOWS_DIR, card_source as source

NAMES = sorted(SHIPPED) + sorted(TRY_TEMPLATES)


def test_titles_are_words_and_descriptions_say_the_needs():
    # the planner's figures (template_needs, ~3 s a template) are stood in for: the text is what is tested here
    needs = SimpleNamespace(peak_vram_gb=7.4, ram_gb=10.5)
    cards = {n: card_for(*source(n)[:2], needs, name=n, kind_note=source(n)[2]) for n in NAMES}
    for name, c in cards.items():
        assert c.title != name and "_" not in c.title and len(c.title) <= 60, c
        assert re.search(r"\bLoRAs?\b", c.title) or c.demo, c
        assert c.description.endswith("VRAM 7.4 GB, RAM 10 GB") or c.description.endswith("per GPU, RAM 10 GB"), c
    # two templates of one model differ in their titles (the dual-GPU one says so)
    assert cards["flux2_dev_dual_gpu"].title != cards["flux2_dev_lora"].title
    assert cards["qwen_image_edit_lora"].kind == "image edit" and cards["wan22_i2v_lora"].kind == "image-to-video"


def test_note_title_is_the_notes_opening():
    assert note_title("x", "Qwen-Image (20B) LoRA at 1024x1024 on a 6 GB VRAM budget.") == "Qwen-Image (20B) LoRA"
    assert note_title("my_thing", "no such word here") == "my thing"


def test_thumbnails_are_square_and_tell_the_templates_apart():
    pics = {n: np.asarray(Image.open(WORKFLOWS_DIR / f"{n}.jpg").convert("L"), dtype=np.float32) for n in NAMES}
    assert all(p.shape == (SIZE, SIZE) for p in pics.values())
    for a, b in itertools.combinations(NAMES, 2):
        # the title rows alone differ (not only the graph below): mean absolute difference of the top third
        assert np.abs(pics[a][: SIZE // 3] - pics[b][: SIZE // 3]).mean() > 2.0, (a, b)


def test_demos_come_first_and_the_web_extension_sorts_the_same():
    names = list(reversed(NAMES))
    assert order(names)[:2] == ["demo_tiny_lora", "demo_train_and_try"]
    node = shutil.which("node")
    if not node:
        pytest.skip("node is not installed")
    js = (WORKFLOWS_DIR.parent / "web" / "lowvram_lora.js").read_text()
    sort = re.search(r"const demo = .*?\n\s*all\[pack\] = \[\.\.\.names\]\.sort\((.*?)\);", js, re.S)
    script = (sort.group(0).split("\n")[0] + f"\nconsole.log(JSON.stringify({names!r}.sort({sort.group(1)})));")
    out = subprocess.run([node, "-e", script.replace("'", '"')], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(order(names)).replace("'", '"').replace(", ", ",")
