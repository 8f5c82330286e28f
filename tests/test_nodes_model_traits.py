"""Which inputs apply to the loaded model (nodes/model_traits.py; the editor hides the rest): an image model
hides the video inputs, a video model shows them, control_folder shows only for a model that takes control
images, and Loss & Validation Options' first_frame_p only for a model that holds its first frame (LTX-2's image-to-video
twin; not Wan, whose image-to-video models take the frame as input channels); each answer is the family's own
(``video``, ``control_images``, ``first_frame``), read from the file's header."""
import shutil

import pytest

from lowvram_lora.engine.families import get_family
from lowvram_lora.nodes.model_traits import EDIT_INPUTS, HELD_INPUTS, TASK_INPUTS, VIDEO_INPUTS, model_traits
from lowvram_lora.nodes.paths import configure_standalone_dirs


@pytest.mark.parametrize("family_id", ["flux1", "wan", "ltx2"])
def test_traits_follow_the_familys_own_answers(family_id, tiny_family_pipeline, tmp_path):
    models = tmp_path / "models"
    (models / "diffusers").mkdir(parents=True)
    shutil.copytree(tiny_family_pipeline(family_id), models / "diffusers" / "tiny")
    configure_standalone_dirs(str(models), str(tmp_path / "out"))
    t = model_traits("diffusers/tiny", "auto")
    family = get_family(family_id)
    assert t["family"] == family_id
    assert t["video"] == bool(family.video)
    assert t["edit"] == (family.control_images(t["variant"]) is not None)
    hidden = {(n, i) for n, names in t["hide"].items() for i in names}
    video = {(n, i) for n, names in VIDEO_INPUTS.items() for i in names}
    edit = {(n, i) for n, names in EDIT_INPUTS.items() for i in names}
    task = {(n, i) for n, names in TASK_INPUTS.items() for i in names}
    held = {(n, i) for n, names in HELD_INPUTS.items() for i in names}
    # image_to_video shows only where another variant of the same config file takes a first frame (LTX-2's twins)
    config = family.variants[t["variant"]]
    both = family.first_frame(t["variant"]) is None and any(
        c == config and v != t["variant"] and family.first_frame(v) is not None for v, c in family.variants.items())
    assert both == (family_id == "ltx2")
    # first_frame_p shows where the model or such a twin holds its first frame
    holds = any(c == config and (family.first_frame(v) is not None and family.first_frame(v).held)
                for v, c in family.variants.items())
    assert holds == (family_id == "ltx2")
    assert (video <= hidden) == (not t["video"]) and (edit <= hidden) == (not t["edit"])
    assert hidden == ((set() if t["video"] else video) | (set() if t["edit"] else edit) | (set() if both else task)
                      | (set() if holds else held))
    assert set(t["inputs"]["LowVRAMLossOptions"]) == {"first_frame_p"}


def test_a_missing_file_raises_what_the_load_node_raises(tmp_path):
    configure_standalone_dirs(str(tmp_path / "models"), str(tmp_path / "out"))
    with pytest.raises(FileNotFoundError):
        model_traits("nope.safetensors")


@pytest.mark.parametrize("family_id", ["flux2", "wan", "ltx2", "qwen_image"])
def test_a_file_not_there_yet_with_its_family_chosen_gets_the_familys_answers(family_id, tmp_path):
    """A template opened before its files are downloaded names its family: the inputs no variant of it uses are
    hidden, each by the family's own answer over its variants."""
    configure_standalone_dirs(str(tmp_path / "models"), str(tmp_path / "out"))
    family = get_family(family_id)
    t = model_traits("not_downloaded_yet.safetensors", family_id)
    assert t["family"] == family_id and t["variant"] is None
    hidden = {(n, i) for n, names in t["hide"].items() for i in names}
    video = {(n, i) for n, names in VIDEO_INPUTS.items() for i in names}
    edit = {(n, i) for n, names in EDIT_INPUTS.items() for i in names}
    assert (video <= hidden) == (not family.video)
    assert (edit <= hidden) == all(family.control_images(v) is None for v in family.variants)
    # Flux.2 and Qwen-Image have edit variants (control_folder shown); no image family shows a video input
    assert t["edit"] == (family_id in ("flux2", "qwen_image"))
    assert t["video"] == (family_id in ("wan", "ltx2"))
    with pytest.raises(Exception, match="unknown model family"):
        model_traits("not_downloaded_yet.safetensors", "no_such_family")
