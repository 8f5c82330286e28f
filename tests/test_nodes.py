"""Node classes: registration, ComfyUI conventions, cheap import, progress bridge."""
import subprocess
import sys
import types

import pytest

import lowvram_lora
from lowvram_lora.nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

COMFY_BUILTIN_IDS = {"TrainLoraNode", "SaveLoRA", "LoraModelLoader", "LoadImage", "SaveImage", "CheckpointLoaderSimple"}
# Display names of ComfyUI 0.33's training nodes (comfy_extras/nodes_train.py): search would show two of each.
COMFY_BUILTIN_DISPLAY = {"Train LoRA", "Save LoRA Weights", "Load LoRA Model", "Plot Loss Graph", "Save LoRA"}


def test_pack_exports_and_display_names():
    assert not hasattr(lowvram_lora, "NODE_CLASS_MAPPINGS") and callable(lowvram_lora.comfy_entrypoint)
    assert all(cls.__name__ == node_id == cls.GET_SCHEMA().node_id for node_id, cls in NODE_CLASS_MAPPINGS.items())
    assert lowvram_lora.WEB_DIRECTORY == "./web"
    assert set(NODE_DISPLAY_NAME_MAPPINGS.values()) == {
        "Load Quantized Slab", "Cache Text Embeds", "Offload Config", "Dual-GPU Split", "Train LoRA (LowVRAM)",
        "Save LoRA (LowVRAM)", "LoRA Adapter (LowVRAM)", "Dataset Options", "Loss & Validation Options",
        "Sample Prompt Conditioning", "Images to Dataset", "Training Options", "Preview Options", "Offload Tuning"}
    assert not set(NODE_CLASS_MAPPINGS) & COMFY_BUILTIN_IDS
    assert not set(NODE_DISPLAY_NAME_MAPPINGS.values()) & COMFY_BUILTIN_DISPLAY
    assert all(k.startswith("LowVRAM") for k in NODE_CLASS_MAPPINGS)


@pytest.mark.parametrize("node_id", sorted(NODE_CLASS_MAPPINGS))
def test_node_class_follows_comfyui_conventions(node_id):
    cls = NODE_CLASS_MAPPINGS[node_id]
    spec = cls.INPUT_TYPES()
    assert cls.CATEGORY == "LowVRAM LoRA" and cls.DESCRIPTION and callable(getattr(cls(), cls.FUNCTION))
    for name, entry in spec["required"].items():
        assert len(entry) == 2 and entry[1].get("tooltip"), f"{node_id}.{name} needs a tooltip"
        t = entry[0]
        assert t in ("INT", "FLOAT", "STRING", "BOOLEAN", "COMBO", "IMAGE") or t.startswith("LOWVRAM_")
    for t in cls.RETURN_TYPES:  # ours, or ComfyUI's own types its nodes take (Load LoRA Model, Plot Loss Graph, KSampler)
        assert t.startswith("LOWVRAM_") or t in ("IMAGE", "LORA_MODEL", "LOSS_MAP", "CONDITIONING")
    assert len(getattr(cls, "RETURN_NAMES", cls.RETURN_TYPES)) == len(cls.RETURN_TYPES)
    if cls.RETURN_TYPES:
        assert len(cls.OUTPUT_TOOLTIPS) == len(cls.RETURN_TYPES)


def test_importing_the_pack_does_not_import_torch():
    code = ("import sys, time; t = time.perf_counter(); import lowvram_lora; dt = time.perf_counter() - t; "
            "heavy = [m for m in ('torch', 'diffusers', 'transformers', 'peft') if m in sys.modules]; "
            "print(dt, heavy); assert not heavy, heavy; assert dt < 1.0, dt")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_relative_imports_only():
    import pathlib
    import re

    root = pathlib.Path(lowvram_lora.__file__).parent
    bad = []
    for sub in ("nodes", "engine", "host"):
        for f in (root / sub).rglob("*.py"):
            if f.name.startswith("test_"):  # a family's own tests beside its code are not package code
                continue
            for line in f.read_text().splitlines():
                if re.match(r"\s*(from|import)\s+(lowvram_lora|nodes|engine|host)\b", line):
                    bad.append(f"{f.relative_to(root)}: {line.strip()}")
    assert not bad, bad


def test_comfy_callback_drives_progress_and_interrupt(monkeypatch):
    from lowvram_lora.engine.callbacks import StepInfo
    from lowvram_lora.nodes.progress import ComfyCallback, make_callback

    bars, interrupted = [], {"flag": False}

    class Bar:
        def __init__(self, total):
            self.calls = []
            bars.append(self)

        def update_absolute(self, value, total=None, preview=None):
            self.calls.append((value, total))

    class Interrupt(Exception):
        pass

    def check():
        if interrupted["flag"]:
            raise Interrupt()

    cu = types.SimpleNamespace(ProgressBar=Bar)
    mm = types.SimpleNamespace(throw_exception_if_processing_interrupted=check)
    comfy = types.ModuleType("comfy")
    comfy.utils, comfy.model_management = cu, mm
    monkeypatch.setitem(sys.modules, "comfy", comfy)
    monkeypatch.setitem(sys.modules, "comfy.utils", cu)
    monkeypatch.setitem(sys.modules, "comfy.model_management", mm)
    cb = make_callback("7")
    assert isinstance(cb, ComfyCallback)
    cb.on_progress("encode images (vae)", 1, 3)
    cb.on_step(StepInfo(1, 10, 0.5, 1e-4, 1.0, 0.2, 3.1))
    cb.on_step(StepInfo(2, 10, 0.4, 1e-4, 1.0, 0.2, 3.1))
    assert bars[0].calls == [(1, 3)] and bars[1].calls == [(1, 10), (2, 10)]
    assert cb.should_stop() is False
    interrupted["flag"] = True
    with pytest.raises(Interrupt):
        cb.should_stop()


def test_save_path_never_escapes_output_and_counts_up(tmp_path):
    from lowvram_lora.nodes.save_lora import claim_output_paths

    first, curve = claim_output_paths(tmp_path, "loras/x")
    assert first == tmp_path / "loras" / "x_00001_.safetensors"
    assert curve == tmp_path / "loras" / "x_00001__loss.png"
    first.write_bytes(b"keep")
    assert claim_output_paths(tmp_path, "loras/x")[0].name == "x_00002_.safetensors"
    with pytest.raises(ValueError, match="inside the output folder"):
        claim_output_paths(tmp_path, "../../etc/x")


def test_pack_loads_the_way_comfyui_loads_custom_nodes(monkeypatch):
    """ComfyUI imports custom_nodes/<folder>/__init__.py under the folder's name (often with
    a hyphen) and has its own top-level ``nodes`` module: our relative imports must not care."""
    import importlib.util
    import pathlib

    root = pathlib.Path(lowvram_lora.__file__).parent
    fake_comfy_nodes = types.ModuleType("nodes")
    fake_comfy_nodes.NODE_CLASS_MAPPINGS = {"KSampler": object}
    monkeypatch.setitem(sys.modules, "nodes", fake_comfy_nodes)
    name = "lowvram-lora"
    spec = importlib.util.spec_from_file_location(name, root / "__init__.py",
                                                  submodule_search_locations=[str(root)])
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)
    spec.loader.exec_module(module)
    # ComfyUI takes NODE_CLASS_MAPPINGS over comfy_entrypoint: the V3 entry point only works without it.
    assert not hasattr(module, "NODE_CLASS_MAPPINGS") and callable(module.comfy_entrypoint)
    assert module.WEB_DIRECTORY == "./web" and (root / "web" / "lowvram_lora.js").exists()
    nodes = importlib.import_module(name + ".nodes")
    assert set(nodes.NODE_CLASS_MAPPINGS) == set(NODE_CLASS_MAPPINGS)
    for cls in nodes.NODE_CLASS_MAPPINGS.values():
        cls.INPUT_TYPES()  # ComfyUI calls this at start-up, with folder_paths absent here
    assert sys.modules["nodes"] is fake_comfy_nodes
    for key in [k for k in sys.modules if k.startswith(name + ".")]:
        monkeypatch.delitem(sys.modules, key)


def test_offload_node_maps_widget_sentinels_and_refuses_bad_combinations():
    from lowvram_lora.engine.errors import ConfigError
    from lowvram_lora.nodes.offload_config import LowVRAMOffloadConfig

    node = LowVRAMOffloadConfig
    (auto,) = node.execute().args
    assert auto.mode == "auto" and auto.resident_blocks is None and auto.prefetch_depth is None
    assert auto.activation_offload is None and auto.vram_budget_gb == 0.0
    (stream,) = node.execute(mode="stream", resident_blocks=3, prefetch_depth=1, activation_offload="on").args
    assert (stream.resident_blocks, stream.prefetch_depth, stream.activation_offload) == (3, 1, True)
    with pytest.raises(ConfigError, match="gradient_checkpointing"):
        node.execute(mode="stream", gradient_checkpointing=False)
    with pytest.raises(ConfigError, match="only apply to streaming"):
        node.execute(mode="resident", prefetch_depth=2)
    with pytest.raises(ConfigError, match="only applies to mode='auto'"):
        node.execute(mode="stream", vram_budget_gb=4)


def test_auto_trains_resident_on_cpu_and_stream_needs_cuda(tiny_pipeline, tiny_cache):
    import torch

    from lowvram_lora.engine.callbacks import TrainingCallback
    from lowvram_lora.engine.config import LoraSettings, ModelConfig, TrainConfig
    from lowvram_lora.engine.errors import ConfigError
    from lowvram_lora.engine.offload import OffloadConfig
    from lowvram_lora.engine.train import train_lora

    if torch.cuda.is_available():
        pytest.skip("CPU-only behaviour")
    logs = []

    class Log(TrainingCallback):
        def log(self, message):
            logs.append(message)

    mc = ModelConfig(transformer_path=str(tiny_pipeline))
    result = train_lora(mc, tiny_cache, LoraSettings(rank=2), TrainConfig(steps=2), Log(),
                        offload=OffloadConfig(mode="auto"))
    assert result.steps == 2 and any("stays resident" in m for m in logs)
    # reference: an explicitly resident run; auto's resident plan must train it bit for bit (tolerance 0)
    resident = train_lora(mc, tiny_cache, LoraSettings(rank=2), TrainConfig(steps=2),
                          offload=OffloadConfig(mode="resident"))
    assert result.loss_history == resident.loss_history
    assert all(torch.equal(result.state_dict[k], v) for k, v in resident.state_dict.items())
    with pytest.raises(ConfigError, match="CUDA"):
        train_lora(mc, tiny_cache, LoraSettings(rank=2), TrainConfig(steps=2), offload=OffloadConfig(mode="stream"))


def test_comfy_callback_prints_progress_to_the_console_at_an_interval(monkeypatch, capsys):
    """comfy run --wait users see the server console, not the websocket text (issue 9, item 5)."""
    from lowvram_lora.engine.callbacks import StepInfo
    from lowvram_lora.nodes import progress

    class Bar:
        def __init__(self, total):
            pass

        def update_absolute(self, value, total=None, preview=None):
            pass

    cb = progress.ComfyCallback(types.SimpleNamespace(ProgressBar=Bar), types.SimpleNamespace(), "4")
    clock = {"t": 100.0}
    monkeypatch.setattr(progress.time, "monotonic", lambda: clock["t"])
    for step in range(1, 101):
        clock["t"] += 1.0  # one second per step
        cb.on_step(StepInfo(step, 100, 0.5, 1e-4, 1.0, 1.0, 0.0))
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("[lowvram-lora] step ")]
    steps = [int(ln.split()[2].split("/")[0]) for ln in lines]
    assert steps[0] == 1 and steps[-1] == 100  # first and last always
    assert 6 <= len(steps) <= 9  # about every 15 s in between, not every step


def test_a_relative_dataset_path_is_found_in_comfyuis_input_folder_first(tmp_path, monkeypatch):
    """Issue 28: ``my_subject`` is ``input/my_subject`` (the Notes and README say so), then the working
    directory; when it is in neither, the error names both folders and where to put the images."""
    from lowvram_lora.engine.errors import DatasetError
    from lowvram_lora.nodes.cache_embeds import LowVRAMCacheTextEmbeds
    from lowvram_lora.nodes.paths import resolve_dataset_path

    comfy_input, cwd = tmp_path / "ComfyUI" / "input", tmp_path / "cwd"
    cwd.mkdir(parents=True)
    folder_paths = types.ModuleType("folder_paths")
    folder_paths.get_folder_paths = lambda kind: []
    folder_paths.get_input_directory = lambda: str(comfy_input)
    monkeypatch.setitem(sys.modules, "folder_paths", folder_paths)
    monkeypatch.chdir(cwd)

    with pytest.raises(DatasetError) as err:
        resolve_dataset_path("my_subject")
    msg = str(err.value)
    assert f"{comfy_input / 'my_subject'} (ComfyUI's input folder)" in msg
    assert f"{cwd / 'my_subject'} (the working directory)" in msg
    assert msg.index(str(comfy_input)) < msg.index(str(cwd))  # in the order tried
    assert f"Put the images (png/jpg/webp) with their .txt captions in {comfy_input / 'my_subject'}" in msg
    assert LowVRAMCacheTextEmbeds.fingerprint_inputs(dataset_path="my_subject") == "my_subject"  # no error before it runs

    (cwd / "my_subject").mkdir()
    assert resolve_dataset_path("my_subject") == (cwd / "my_subject").resolve()  # the working directory, second
    (comfy_input / "my_subject").mkdir(parents=True)
    assert resolve_dataset_path("my_subject") == (comfy_input / "my_subject").resolve()  # the input folder wins
    assert resolve_dataset_path(str(cwd / "my_subject")) == (cwd / "my_subject").resolve()  # absolute: as given
    with pytest.raises(DatasetError, match=r"nowhere \(as given\)\. Put the images"):
        resolve_dataset_path(str(tmp_path / "nowhere"))


def test_text_under_a_node_wraps_between_words_and_a_resume_sends_the_history(monkeypatch):
    """Issue 28: the frontends wrap node text anywhere ("6 i/mages") and clip it; lines are broken between
    words to the node's width, paths shortened (the console keeps them). A resume sends the losses before."""
    from lowvram_lora.engine.callbacks import StepInfo
    from lowvram_lora.nodes import progress

    text = progress.node_text("dataset cache adeb9291f72bced402bb5339: 6 images; text 7 built / 0 reused; "
                              "latents 6 built / 0 reused")
    assert text.splitlines() == ["dataset cache adeb9291f72bced402bb5339:", "6 images;", "text 7 built / 0 reused;",
                                 "latents 6 built / 0 reused"]
    sampled = progress.node_text("sampled 2 prompt(s) at step 10 in 9.2 s: /work/base/output/lowvram_samples/"
                                 "c852022aad69/samples_step0000010.png")
    assert sampled.splitlines() == ["sampled 2 prompt(s) at step 10 in 9.2 s:",
                                    "…/c852022aad69/samples_step0000010.png"]
    sent, events = [], []
    server = types.ModuleType("server")
    server.PromptServer = types.SimpleNamespace(instance=types.SimpleNamespace(
        send_progress_text=lambda text, node: sent.append(text), send_sync=lambda e, d: events.append((e, d))))
    monkeypatch.setitem(sys.modules, "server", server)

    class Bar:
        def __init__(self, total):
            pass

        def update_absolute(self, value, total=None, preview=None):
            pass

    cb = progress.ComfyCallback(types.SimpleNamespace(ProgressBar=Bar), types.SimpleNamespace(), "4")
    cb.on_resume(2, 10, [0.5, 0.25], [1e-4, 2e-4])
    cb.on_step(StepInfo(3, 10, 0.125, 2e-4, 1.0, 0.25, 0.0))
    assert events[0] == (progress.RESUME_EVENT, {"node": "4", "step": 2, "total": 10, "loss": [0.5, 0.25],
                                                 "lr": [1e-4, 2e-4]})
    assert events[1][0] == progress.PROGRESS_EVENT and events[1][1]["step"] == 3
    assert sent[-1] == "step 3/10: loss 0.1250\nlr 2.00e-04, 0.25 s/step"
    assert all(len(line) <= progress.NODE_TEXT_WIDTH for t in (text, sent[-1]) for line in t.splitlines())


@pytest.mark.parametrize("node_id, widget, config, field", [
    ("LowVRAMTrainLoRA", "steps", "TrainConfig", "steps"),
    ("LowVRAMTrainLoRA", "learning_rate", "TrainConfig", "learning_rate"),
    ("LowVRAMTrainLoRA", "training_seed", "TrainConfig", "seed"),
    ("LowVRAMTrainingOptions", "optimizer", "TrainConfig", "optimizer"),
    ("LowVRAMTrainingOptions", "save_every", "TrainConfig", "save_every"),
    ("LowVRAMTrainingOptions", "warmup_steps", "TrainConfig", "warmup_steps"),
    ("LowVRAMPreviewOptions", "sample_steps", "SamplingConfig", "steps"),
    ("LowVRAMTrainLoRA", "rank", "LoraSettings", "rank"),
    ("LowVRAMTrainLoRA", "alpha", "LoraSettings", "alpha"),
    ("LowVRAMCacheTextEmbeds", "dataset_path", "DataConfig", "path"),
    ("LowVRAMCacheTextEmbeds", "resolution", "DataConfig", "resolution"),
    ("LowVRAMCacheTextEmbeds", "flip", "DataConfig", "flip"),
    ("LowVRAMDatasetOptions", "mask_source", "DatasetOptions", "mask_source"),
    ("LowVRAMDatasetOptions", "validation_fraction", "DatasetOptions", "validation_fraction"),
    ("LowVRAMLossOptions", "unmasked_weight", "LossOptions", "unmasked_weight"),
    ("LowVRAMLossOptions", "validation_every", "LossOptions", "validation_every"),
])
def test_tooltips_are_the_config_fields_help(node_id, widget, config, field):
    """Each explanation is written once, in the config field's metadata; the node's tooltip starts with it."""
    from lowvram_lora.engine import config as cfg
    from lowvram_lora.engine.data.options import DatasetOptions
    from lowvram_lora.engine.train.loss_options import LossOptions

    from lowvram_lora.engine.sampling import SamplingConfig

    classes = {"DatasetOptions": DatasetOptions, "LossOptions": LossOptions, "SamplingConfig": SamplingConfig}
    want = cfg.field_help(classes.get(config) or getattr(cfg, config), field)
    inputs = NODE_CLASS_MAPPINGS[node_id].INPUT_TYPES()
    tooltip = {**inputs["required"], **inputs.get("optional", {})}[widget][1]["tooltip"]
    assert len(want) > 20 and tooltip.startswith(want)


def test_every_user_setting_of_the_configs_has_help():
    from dataclasses import fields

    from lowvram_lora.engine import config as cfg

    for config in (cfg.TrainConfig, cfg.LoraSettings, cfg.DataConfig):
        assert all(f.metadata.get("help") for f in fields(config)), config.__name__
    with pytest.raises(KeyError, match="TrainConfig has no field 'sed'"):
        cfg.field_help(cfg.TrainConfig, "sed")
