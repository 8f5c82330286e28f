"""Bad input, from issue 11: no lost data, no silent wrong result, no traceback."""
import argparse
import json
import math

import pytest
import torch

from lowvram_lora.engine.config import LoraSettings, ModelConfig, TrainConfig
from lowvram_lora.engine.errors import ConfigError, ModelLoadError, TrainingDivergedError
from lowvram_lora.host.run_command import run_workflow_command
from lowvram_lora.host.templates import WORKFLOWS_DIR
from lowvram_lora.host.workflow import WorkflowError, load_workflow, to_api_graph
from lowvram_lora.nodes import NODE_CLASS_MAPPINGS
from lowvram_lora.nodes.paths import configure_standalone_dirs


def _args(workflow, models, out, overrides=()):
    return argparse.Namespace(workflow=str(workflow), overrides=list(overrides), models_dir=str(models),
                              output_dir=str(out), no_progress=True, traceback=False)


def _write(tmp_path, obj, name="wf.json"):
    path = tmp_path / name
    path.write_text(json.dumps(obj))
    return path


# --- 2, 3: output names -----------------------------------------------------------------------


def test_two_savers_never_get_the_same_name(tmp_path):
    from lowvram_lora.nodes.save_lora import claim_output_paths

    a = claim_output_paths(tmp_path, "loras/x")
    b = claim_output_paths(tmp_path, "loras/x")  # before a's LoRA is written: the name is already taken
    assert a[0] != b[0] and a[1] != b[1] and {a[0].name, b[0].name} == {"x_00001_.safetensors", "x_00002_.safetensors"}


def test_a_kept_loss_png_is_not_overwritten(tmp_path):
    from lowvram_lora.nodes.save_lora import claim_output_paths

    (tmp_path / "loras").mkdir()
    kept = tmp_path / "loras" / "x_00001__loss.png"
    kept.write_bytes(b"the user kept this chart")  # its LoRA was deleted
    lora, curve = claim_output_paths(tmp_path, "loras/x")
    assert lora.name == "x_00002_.safetensors" and curve.name == "x_00002__loss.png"
    assert kept.read_bytes() == b"the user kept this chart"


# --- 4: non-finite numbers --------------------------------------------------------------------


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_nan_and_inf_are_rejected_for_float_inputs(models_with_empty_files, tmp_path, value):
    api = json.loads((WORKFLOWS_DIR / "api" / "demo_tiny_lora.json").read_text())
    api["4"]["inputs"]["alpha"] = value
    with pytest.raises(WorkflowError, match=r'"alpha".*not a finite number'):
        to_api_graph(load_workflow(_write(tmp_path, api)), NODE_CLASS_MAPPINGS)  # json writes NaN, reads it back


@pytest.mark.parametrize("cls, kwargs", [(LoraSettings, {"alpha": math.nan}), (TrainConfig, {"learning_rate": math.nan}),
                                         (TrainConfig, {"max_grad_norm": math.inf}), (TrainConfig, {"guidance": math.nan})])
def test_engine_configs_refuse_non_finite_numbers(cls, kwargs):
    with pytest.raises(ConfigError, match="finite"):
        cls(**kwargs)


def test_diverging_training_stops_with_a_message_and_stores_nothing(tiny_pipeline, tiny_cache, tmp_path):
    from lowvram_lora.engine.models.inspect import inspect_transformer
    from lowvram_lora.engine.runs.result_reuse import train_or_reuse

    model = inspect_transformer(ModelConfig(transformer_path=str(tiny_pipeline)))
    with pytest.raises(TrainingDivergedError, match="Nothing was saved|nothing was saved"):
        train_or_reuse(model, tiny_cache, LoraSettings(rank=2, alpha=1e30),
                       TrainConfig(steps=6, learning_rate=1.0, max_grad_norm=0, save_every=-1), tmp_path)
    assert not (tmp_path / "trained").exists() or not list((tmp_path / "trained").iterdir())


# --- 6: JSON shape ----------------------------------------------------------------------------


def _ui():
    return json.loads((WORKFLOWS_DIR / "demo_tiny_lora.json").read_text())


@pytest.mark.parametrize("mutate, match", [
    (lambda ui: ui["nodes"][0].pop("id"), 'has no "id"'),
    (lambda ui: ui["links"][0].__setitem__(2, "zero"), '"zero" is not a number'),
    (lambda ui: ui["links"].__setitem__(0, "1,2,3"), r'"links"\[0\] must be'),
    (lambda ui: ui["nodes"][1].__setitem__("inputs", {"model": 1}), '"inputs" has the wrong type'),
    (lambda ui: ui["nodes"][1]["inputs"][0].__setitem__("link", "x"), "is not"),
])
def test_malformed_ui_json_is_a_message_not_a_traceback(tmp_path, models_with_empty_files, mutate, match, capsys):
    ui = _ui()
    mutate(ui)
    args = _args(_write(tmp_path, ui), models_with_empty_files, tmp_path / "out")
    assert run_workflow_command(args, NODE_CLASS_MAPPINGS, configure_dirs=configure_standalone_dirs) == 1
    err = capsys.readouterr().err
    assert "malformed" in err and "Traceback" not in err
    assert __import__("re").search(match, err), err


def test_api_node_with_list_inputs_is_a_message(tmp_path, models_with_empty_files, capsys):
    api = json.loads((WORKFLOWS_DIR / "api" / "demo_tiny_lora.json").read_text())
    api["3"]["inputs"] = ["resident"]
    args = _args(_write(tmp_path, api), models_with_empty_files, tmp_path / "out")
    assert run_workflow_command(args, NODE_CLASS_MAPPINGS, configure_dirs=configure_standalone_dirs) == 1
    assert 'node 3: "inputs" must be an object' in capsys.readouterr().err


# --- 7: corrupt cache entries -----------------------------------------------------------------


@pytest.mark.parametrize("damage", ["empty", "garbage", "truncated"])
def test_corrupt_cache_entries_are_rebuilt_with_a_notice(tiny_pipeline, tmp_path, damage):
    from lowvram_lora.engine.caching import build_dataset_cache
    from lowvram_lora.engine.config import DataConfig
    from lowvram_lora.engine.testing import make_tiny_dataset

    class Log:
        def __init__(self):
            self.lines = []

        def log(self, m):
            self.lines.append(m)

        def on_progress(self, *a):
            pass

    data = DataConfig(path=str(make_tiny_dataset(tmp_path / "data", count=2)), resolution=128, bucket_step=32)
    model = ModelConfig(transformer_path=str(tiny_pipeline))
    build_dataset_cache(model, data, tmp_path / "cache")
    for sub in ("latents", "text"):
        entry = sorted((tmp_path / "cache" / sub).glob("*.safetensors"))[0]
        raw = entry.read_bytes()
        entry.write_bytes({"empty": b"", "garbage": b"\xff" * 64, "truncated": raw[: len(raw) - 7]}[damage])
    log = Log()
    cache = build_dataset_cache(model, data, tmp_path / "cache", callback=log)
    notices = [m for m in log.lines if "is unreadable" in m and "rebuilding it" in m]
    assert len(notices) == 2 and all("lowvram" not in m or "safetensors" in m for m in notices)
    assert cache.stats["text_built"] == 1 and cache.stats["latents_built"] == 1
    for item in cache.items:
        cache.load_item(item)


# --- 8: OS errors -----------------------------------------------------------------------------


def test_cache_path_that_is_a_file_is_explained(tiny_pipeline, tmp_path, tiny_dataset):
    from lowvram_lora.engine.caching import build_dataset_cache
    from lowvram_lora.engine.config import DataConfig
    from lowvram_lora.engine.errors import StorageError

    (tmp_path / "cache").write_text("oops")
    with pytest.raises(StorageError, match=r"cache.*a file where a folder is needed.*move or rename"):
        build_dataset_cache(ModelConfig(transformer_path=str(tiny_pipeline)),
                            DataConfig(path=str(tiny_dataset), resolution=128, bucket_step=32), tmp_path / "cache")


# --- 9, 10: messages that name the place and the fix -----------------------------------------


def test_missing_models_dir_says_so(tmp_path, capsys):
    args = _args(WORKFLOWS_DIR / "demo_tiny_lora.json", tmp_path / "nowhere", tmp_path / "out")
    assert run_workflow_command(args, NODE_CLASS_MAPPINGS, configure_dirs=configure_standalone_dirs) == 1
    err = capsys.readouterr().err
    assert "no choices at all" in err and f"the models folder '{tmp_path / 'nowhere'}' does not exist" in err
    assert "use one of \n" not in err and "--models-dir" in err
    (tmp_path / "nowhere").mkdir()
    assert run_workflow_command(args, NODE_CLASS_MAPPINGS, configure_dirs=configure_standalone_dirs) == 1
    assert "is empty" in capsys.readouterr().err


def test_single_file_without_text_encoders_names_the_node_input(tiny_single_file):
    from lowvram_lora.engine.caching.cache import resolve_pipeline_folder

    with pytest.raises(ModelLoadError, match="In Cache Text Embeds, set text_encoders"):
        resolve_pipeline_folder(ModelConfig(transformer_path=str(tiny_single_file)))


# --- 11: filename_prefix before training -------------------------------------------------------


@pytest.mark.parametrize("prefix, match", [
    ("loras/" + "n" * 300, "under 200 characters"), ("lo\x00ras/x", "NUL"), ("../x", "inside the output folder"),
    ("afile/x", "is a file"),
])
def test_bad_filename_prefix_fails_before_training(tmp_path, capsys, prefix, match):
    from lowvram_lora.demo import ensure_demo_assets

    assets = ensure_demo_assets(tmp_path / "demo", trained=False)
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "afile").write_text("")
    args = _args(WORKFLOWS_DIR / "api" / "demo_tiny_lora.json", assets["models"], tmp_path / "out",
                 [f"2.dataset_path={assets['dataset']}"])
    api = json.loads((WORKFLOWS_DIR / "api" / "demo_tiny_lora.json").read_text())
    api["5"]["inputs"]["filename_prefix"] = prefix
    args.workflow = str(_write(tmp_path, api))
    assert run_workflow_command(args, NODE_CLASS_MAPPINGS, configure_dirs=configure_standalone_dirs) == 1
    captured = capsys.readouterr()
    assert match in captured.err and "filename_prefix" in captured.err
    assert not (tmp_path / "out" / "lowvram_cache").exists()  # nothing ran: no caching, no training


# --- 13: never unpickle ------------------------------------------------------------------------


def test_pickle_only_vae_is_refused_not_loaded(tiny_pipeline, tmp_path, monkeypatch):
    import shutil

    from diffusers import AutoencoderKL

    from lowvram_lora.engine.caching.vae_encoding import load_vae

    pipe = tmp_path / "pipe"
    (pipe / "vae").mkdir(parents=True)
    AutoencoderKL.from_pretrained(tiny_pipeline / "vae", use_safetensors=True).save_pretrained(pipe / "vae", safe_serialization=False)
    assert list((pipe / "vae").glob("*.bin")) and not list((pipe / "vae").glob("*.safetensors"))
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("torch.load (unpickling) was called"))
    with pytest.raises(ModelLoadError, match="only pickle weights.*safetensors only"):
        load_vae(pipe, torch.float32)
    shutil.rmtree(pipe)


# --- 14: shipped warmup vs short runs -----------------------------------------------------------


def test_warmup_not_below_steps_is_clamped_with_a_note(tmp_path, capsys):
    from lowvram_lora.demo import ensure_demo_assets

    assets = ensure_demo_assets(tmp_path / "demo", trained=False)
    args = _args(WORKFLOWS_DIR / "demo_tiny_lora.json", assets["models"], tmp_path / "out",
                 [f"2.dataset_path={assets['dataset']}", "4.steps=2", "4.warmup_steps=50"])
    assert run_workflow_command(args, NODE_CLASS_MAPPINGS, configure_dirs=configure_standalone_dirs) == 0
    assert "warmup_steps=50 is not below steps=2; using 0" in capsys.readouterr().out


def test_shipped_flux_workflow_warmup_is_below_its_steps():
    from helpers import train_input

    api = json.loads((WORKFLOWS_DIR / "api" / "flux1_dev_lora.json").read_text())
    train = next(k for k, n in api.items() if n["class_type"] == "LowVRAMTrainLoRA")
    assert 0 < train_input(api, train, "warmup_steps") < train_input(api, train, "steps")


# --- 15: nothing skipped silently ---------------------------------------------------------------


def test_defaulted_widget_values_get_a_notice(tmp_path, models_with_empty_files, capsys):
    ui = _ui()
    train = next(n for n in ui["nodes"] if n["type"] == "LowVRAMTrainLoRA")
    train["widgets_values"] = train["widgets_values"][:-1]  # saved before the last widget existed
    to_api_graph(load_workflow(_write(tmp_path, ui)), NODE_CLASS_MAPPINGS)
    err = capsys.readouterr().err
    assert "has no saved value" in err and '"sample_frames"' in err


def test_skipped_subfolders_and_broken_links_get_a_notice(tiny_dataset):
    from lowvram_lora.engine.config import DataConfig
    from lowvram_lora.engine.data import scan_dataset

    (tiny_dataset / "more").mkdir()
    (tiny_dataset / "gone.png").symlink_to(tiny_dataset / "missing.png")
    lines = []
    records = scan_dataset(DataConfig(path=str(tiny_dataset), resolution=128, bucket_step=32), log=lines.append)
    assert len(records) == 4
    assert any("sub-folder 'more' is skipped" in m for m in lines)
    assert any("'gone.png' is a broken link" in m for m in lines)
