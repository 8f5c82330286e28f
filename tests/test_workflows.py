"""Shipped workflows: valid in both formats, twins agree, the demo runs end to end."""
import argparse
import json

import pytest

from lowvram_lora.host.run_command import run_workflow_command
from lowvram_lora.host.templates import SHIPPED, TRY_TEMPLATES, WORKFLOWS_DIR, build, build_try
from lowvram_lora.host.workflow import WorkflowError, load_workflow, to_api_graph
from lowvram_lora.nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS
from lowvram_lora.nodes.paths import configure_standalone_dirs

NAMES = sorted(SHIPPED)


@pytest.mark.parametrize("name", sorted(TRY_TEMPLATES))
def test_train_and_try_files_match_the_builder_and_feed_comfyuis_nodes(name):
    """The train-and-try graph: the shipped files are the builder's; Train LoRA's lora_model (output 3) feeds
    ComfyUI's Load LoRA Model, whose model comes from ComfyUI's Load Diffusion Model on the training checkpoint."""
    ui, api = build_try(name)
    assert json.loads((WORKFLOWS_DIR / f"{name}.json").read_text()) == ui, "run python -m lowvram_lora.host.templates"
    assert json.loads((WORKFLOWS_DIR / "api" / f"{name}.json").read_text()) == api
    train = next(k for k, n in api.items() if n["class_type"] == "LowVRAMTrainLoRA")
    load = next(n for n in api.values() if n["class_type"] == "LowVRAMLoadQuantizedSlab")
    apply = next(n for n in api.values() if n["class_type"] == "LoraModelLoader")
    assert apply["inputs"]["lora"] == [train, 3]
    assert api[apply["inputs"]["model"][0]]["inputs"]["unet_name"] == load["inputs"]["checkpoint"]
    sampler = next(n for n in api.values() if n["class_type"] == "KSampler")
    assert sampler["inputs"]["model"] == [next(k for k, n in api.items() if n is apply), 0]
    assert {n["class_type"] for n in api.values()} >= {"VAEDecode", "PreviewImage", "LowVRAMSamplePromptConditioning"}


@pytest.mark.parametrize("name", NAMES)
def test_shipped_files_match_the_builder(name):
    ui, api = build(name, NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS)
    assert json.loads((WORKFLOWS_DIR / f"{name}.json").read_text()) == ui, "run python -m lowvram_lora.host.templates"
    assert json.loads((WORKFLOWS_DIR / "api" / f"{name}.json").read_text()) == api
    assert (WORKFLOWS_DIR / f"{name}.jpg").stat().st_size > 1000


@pytest.mark.parametrize("name", NAMES)
def test_ui_and_api_twins_convert_to_the_same_valid_graph(name, models_with_empty_files):
    ui = load_workflow(WORKFLOWS_DIR / f"{name}.json")
    api = load_workflow(WORKFLOWS_DIR / "api" / f"{name}.json")
    g_ui = to_api_graph(ui, NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS)
    g_api = to_api_graph(api, NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS)
    strip = lambda g: {k: {"class_type": v["class_type"], "inputs": v["inputs"]} for k, v in g.items()}
    assert strip(g_ui) == strip(g_api)
    assert {v["class_type"] for v in g_ui.values()} <= set(NODE_CLASS_MAPPINGS)
    assert any(n["type"] == "Note" for n in ui["nodes"])  # explains the files, skipped when run


def test_missing_model_file_is_named(tmp_path):
    configure_standalone_dirs(str(tmp_path / "empty"), str(tmp_path / "out"))
    with pytest.raises(WorkflowError) as e:
        to_api_graph(load_workflow(WORKFLOWS_DIR / "flux1_dev_lora.json"), NODE_CLASS_MAPPINGS)
    assert "checkpoint" in str(e.value) and "flux1-dev.safetensors" in str(e.value)


def _args(workflow, models, out, overrides=()):
    return argparse.Namespace(workflow=str(workflow), overrides=list(overrides), models_dir=str(models),
                              output_dir=str(out), no_progress=True, traceback=True)


def _assert_trained_the_right_thing(models, output, pipeline, family_id, lora_path, bound, check_loss=True):
    """What a workflow run trained, against independent references:
    - the base model it trained on (the slab it built, else the file it loaded) gives the forward of diffusers'
      own model read from the pipeline folder, within ``bound`` (relative L2 of the output: int8 slab of an fp8
      file 0.06, of a bf16 file 5e-3, a lossless file 1e-5);
    - the saved LoRA, merged into that reference, fits the cached training image better than the reference
      alone (flow-matching loss at fixed noise and timesteps)."""
    import torch
    from helpers import block_inputs, eval_flow_loss, merged

    from lowvram_lora.engine.caching.cache import open_dataset_cache
    from lowvram_lora.engine.families import get_family
    from lowvram_lora.engine.lora_io import load_lora
    from lowvram_lora.engine.models import load_transformer
    from lowvram_lora.engine.slab import load_slab_transformer

    family = get_family(family_id)
    ref = family.transformer_class().from_pretrained(pipeline / "transformer", use_safetensors=True,
                                                     torch_dtype=torch.float32, local_files_only=True)
    slabs = sorted((models / "slabs").glob("*.slab.safetensors"))
    if slabs:
        assert len(slabs) == 1
        trained_on = load_slab_transformer(slabs[0], torch.float32)[0]
    else:
        trained_on = load_transformer(next((models / "diffusion_models").glob("*.safetensors")),
                                      dtype=torch.float32)[0]
    with torch.no_grad():
        want = ref(**block_inputs(ref, family))[0]
        got = trained_on(**block_inputs(trained_on, family))[0]
    rel = ((got - want).norm() / want.norm()).item()
    assert rel < bound, f"the model trained on is {rel:.4f} away from the reference (bound {bound})"
    if not check_loss:
        return
    cache = open_dataset_cache(next((output / "lowvram_cache").rglob("datasets/*.json")))
    lora = load_lora(lora_path)
    before = eval_flow_loss(ref, family, cache)
    after = eval_flow_loss(merged(ref, lora.state_dict, 1.0), family, cache)
    assert after < before, f"the trained LoRA did not lower the loss: {before:.5f} -> {after:.5f}"


def test_demo_workflow_runs_end_to_end_and_reruns_without_training(tmp_path, capsys):
    from lowvram_lora.demo import ensure_demo_assets
    from lowvram_lora.engine.lora_io import load_lora

    assets = ensure_demo_assets(tmp_path / "demo", trained=False)
    # No dataset_path override: the template runs as shipped after `demo --prepare-only` (issue 9 item 1).
    args = _args(WORKFLOWS_DIR / "demo_tiny_lora.json", assets["models"], tmp_path / "out", ["4.steps=6"])
    code = run_workflow_command(args, NODE_CLASS_MAPPINGS, configure_dirs=configure_standalone_dirs)
    out = capsys.readouterr().out
    assert code == 0, out
    saved = sorted((tmp_path / "out" / "loras").glob("demo_tiny_lora_*_.safetensors"))
    assert len(saved) == 1 and saved[0].with_name(saved[0].stem + "_loss.png").exists()
    assert str(saved[0]) in out
    lora = load_lora(saved[0])
    assert lora.format == "comfyui" and lora.metadata["lowvram_lora.steps"] == "6"
    _assert_trained_the_right_thing(assets["models"], tmp_path / "out", assets["pipeline"], "flux1", saved[0],
                                    bound=1e-5)

    # Same inputs again: the finished run is reused (no retraining), a new file is written beside.
    code = run_workflow_command(args, NODE_CLASS_MAPPINGS, configure_dirs=configure_standalone_dirs)
    assert code == 0 and "reusing the finished run" in capsys.readouterr().out
    assert len(sorted((tmp_path / "out" / "loras").glob("*.safetensors"))) == 2

    # A changed input trains again.
    args.overrides.append("4.training_seed=1")
    assert run_workflow_command(args, NODE_CLASS_MAPPINGS, configure_dirs=configure_standalone_dirs) == 0
    assert "reusing" not in capsys.readouterr().out


def test_demo_workflow_api_twin_runs(tmp_path):
    from lowvram_lora.demo import ensure_demo_assets

    assets = ensure_demo_assets(tmp_path / "demo", trained=False)
    args = _args(WORKFLOWS_DIR / "api" / "demo_tiny_lora.json", assets["models"], tmp_path / "out",
                 [f"2.dataset_path={assets['dataset']}", "4.steps=2", "4.warmup_steps=0", "5.format=diffusers"])
    assert run_workflow_command(args, NODE_CLASS_MAPPINGS, configure_dirs=configure_standalone_dirs) == 0
    saved = list((tmp_path / "out" / "loras").glob("*.safetensors"))
    assert len(saved) == 1
    # diffusers format: the file loads through diffusers' own adapter loader and changes the output
    _assert_diffusers_file_loads_in_diffusers(assets["pipeline"], saved[0])


def _assert_diffusers_file_loads_in_diffusers(pipeline, path):
    """A LoRA saved in diffusers format, read by diffusers' ``load_lora_adapter``, gives the same output as the
    reference model with our own merge of the file's weights (relative L2 of the output below 1e-4)."""
    import torch
    from helpers import block_inputs, merged

    from lowvram_lora.engine.families import get_family
    from lowvram_lora.engine.lora_io import load_lora

    family = get_family("flux1")
    load = lambda: family.transformer_class().from_pretrained(pipeline / "transformer", use_safetensors=True,
                                                              torch_dtype=torch.float32, local_files_only=True)
    ref, with_adapter = load(), load()
    with_adapter.load_lora_adapter(str(path), adapter_name="lowvram", prefix="transformer")
    ours = merged(ref, load_lora(path).state_dict, 1.0)
    with torch.no_grad():
        a = with_adapter(**block_inputs(with_adapter, family))[0]
        b = ours(**block_inputs(ours, family))[0]
        base = ref(**block_inputs(ref, family))[0]
    assert ((a - b).norm() / b.norm()).item() < 1e-4
    assert ((b - base).norm() / base.norm()).item() > 1e-6, "the LoRA changed nothing"


def test_node_error_names_node_and_fix(tmp_path, capsys):
    from lowvram_lora.demo import ensure_demo_assets

    assets = ensure_demo_assets(tmp_path / "demo", trained=False)
    args = _args(WORKFLOWS_DIR / "demo_tiny_lora.json", assets["models"], tmp_path / "out",
                 [f"2.dataset_path={tmp_path / 'no_such_folder'}"])
    args.traceback = False
    assert run_workflow_command(args, NODE_CLASS_MAPPINGS, configure_dirs=configure_standalone_dirs) == 1
    err = capsys.readouterr().err
    assert "Cache Text Embeds" in err and "no_such_folder" in err


@pytest.mark.parametrize("mutate, match", [
    (lambda ui: ui["nodes"][0].__setitem__("type", "NoSuchNode"), "NoSuchNode"),
    (lambda ui: ui["links"].pop(0), "model"),
    (lambda ui: ui["nodes"][3]["widgets_values"].__setitem__(0, "many"), "steps"),
    (lambda ui: ui["links"][0].__setitem__(1, 77), "77"),
])
def test_bad_workflows_fail_with_named_message(tmp_path, models_with_empty_files, mutate, match, capsys):
    ui = json.loads((WORKFLOWS_DIR / "demo_tiny_lora.json").read_text())
    mutate(ui)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(ui))
    args = _args(path, models_with_empty_files, tmp_path / "out")
    args.traceback = False
    assert run_workflow_command(args, NODE_CLASS_MAPPINGS, configure_dirs=configure_standalone_dirs) == 1
    assert match.lower() in capsys.readouterr().err.lower()


def test_demo_workflow_trains_on_an_int8_slab_built_once(tmp_path, capsys):
    from lowvram_lora.demo import ensure_demo_assets

    assets = ensure_demo_assets(tmp_path / "demo", trained=False)
    args = _args(WORKFLOWS_DIR / "demo_tiny_lora.json", assets["models"], tmp_path / "out",
                 [f"2.dataset_path={assets['dataset']}", "1.precision=int8 slab", "4.steps=4", "4.warmup_steps=0"])
    assert run_workflow_command(args, NODE_CLASS_MAPPINGS, configure_dirs=configure_standalone_dirs) == 0
    slabs = list((assets["models"] / "slabs").glob("*.slab.safetensors"))
    assert len(slabs) == 1
    saved = sorted((tmp_path / "out" / "loras").glob("*.safetensors"))
    # int8 of an fp32 file: the forward within 2% of the reference
    _assert_trained_the_right_thing(assets["models"], tmp_path / "out", assets["pipeline"], "flux1", saved[0],
                                    bound=0.02, check_loss=False)
    built_at = slabs[0].stat().st_mtime_ns
    out = capsys.readouterr().out
    assert "int8 slab" in out
    args.overrides.append("4.training_seed=3")  # train again (new seed), the slab is reused as is
    assert run_workflow_command(args, NODE_CLASS_MAPPINGS, configure_dirs=configure_standalone_dirs) == 0
    assert slabs[0].stat().st_mtime_ns == built_at
    assert len(list((tmp_path / "out" / "loras").glob("*.safetensors"))) == 2


def test_python_dash_m_run_exit_codes(tmp_path):
    """The real entry point, in a subprocess: a bad workflow exits 1 with one clear line."""
    import subprocess
    import sys

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"1": {"class_type": "NoSuchNode", "inputs": {}}}))
    out = subprocess.run([sys.executable, "-m", "lowvram_lora", "run", str(bad), "--models-dir", str(tmp_path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 1 and "NoSuchNode" in out.stderr and "Traceback" not in out.stderr
    help_out = subprocess.run([sys.executable, "-m", "lowvram_lora", "--help"], capture_output=True, text=True)
    assert help_out.returncode == 0 and all(c in help_out.stdout for c in ("run", "demo", "slab"))


@pytest.mark.parametrize("name", sorted(SHIPPED))
def test_shipped_graphs_have_no_overlapping_boxes(name):
    """Issue 9 item 3: the demo's Note hid three Offload Config widgets. Boxes include title bars."""
    import json

    from lowvram_lora.host.templates import TITLE_H

    nodes = json.loads((WORKFLOWS_DIR / f"{name}.json").read_text())["nodes"]
    boxes = [(n["pos"][0], n["pos"][1] - TITLE_H, n["pos"][0] + n["size"][0], n["pos"][1] + n["size"][1])
             for n in nodes]
    for i, a in enumerate(boxes):
        for b in boxes[i + 1:]:
            assert not (a[0] < b[2] and b[0] < a[2] and a[1] < b[3] and b[1] < a[3]), (a, b)


def _flux2_dev_files(tmp_path, tiny_flux2):
    """A ComfyUI-style models folder for the Flux.2-dev templates, the tiny Flux.2 under the real file names."""
    import shutil

    from lowvram_lora.engine.testing import make_tiny_dataset, write_flux2_single_file

    from lowvram_lora.engine.testing import write_comfy_mistral_file, write_flux2_text_and_vae_files

    root = tmp_path / "root"
    # The Mistral file as ComfyUI ships it (model.* names, tekken tokenizer embedded), 16 wide: three stacked
    # hidden states give the tiny transformer's joint width of 48.
    write_comfy_mistral_file(root / "models" / "text_encoders" / "mistral_3_small_flux2_bf16.safetensors")
    write_flux2_single_file(tiny_flux2, root / "models" / "diffusion_models" / "flux2_dev_fp8mixed.safetensors",
                            comfy_fp8=True)
    vae = write_flux2_text_and_vae_files(tiny_flux2, tmp_path / "vae_files")["vae"]
    (root / "models" / "vae").mkdir(parents=True)
    shutil.copy(vae, root / "models" / "vae" / "flux2-vae.safetensors")
    shutil.copytree(vae.with_suffix(""), root / "models" / "vae" / "flux2-vae")  # the tiny VAE's config
    make_tiny_dataset(root / "input" / "my_subject", count=1)
    return root


@pytest.mark.parametrize("workflow, overrides", [
    ("flux2_dev_lora", []),
    # Dual-GPU Split on the CPU: both parts resident, the same graph otherwise.
    ("flux2_dev_dual_gpu", ["7.devices=cpu,cpu"]),
])
def test_flux2_dev_workflows_train_on_the_reference_weights(tmp_path, tiny_flux2, capsys, workflow, overrides):
    """The shipped Flux.2-dev graphs as a ComfyUI user has them (fp8-mixed transformer, the Mistral text-encoder
    file with its embedded tokenizer, the VAE file; int8 slab, auto), on a tiny Flux.2 under the real names:
    only sizes, steps and devices are overridden. The slab holds the reference weights within fp8 + int8 error
    and the LoRA lowers the loss."""
    from lowvram_lora.engine.lora_io import load_lora

    root = _flux2_dev_files(tmp_path, tiny_flux2)
    args = _args(WORKFLOWS_DIR / f"{workflow}.json", root / "models", root / "output",
                 ["2.resolution=128", "4.steps=10", "4.learning_rate=0.01", *overrides])
    code = run_workflow_command(args, NODE_CLASS_MAPPINGS, configure_dirs=configure_standalone_dirs)
    out = capsys.readouterr().out
    assert code == 0, out
    saved = sorted((root / "output" / "loras").glob(f"{workflow}_*_.safetensors"))
    assert len(saved) == 1
    lora = load_lora(saved[0])
    assert lora.metadata["lowvram_lora.family"] == "flux2" and lora.metadata["lowvram_lora.steps"] == "10"
    _assert_trained_the_right_thing(root / "models", root / "output", tiny_flux2, "flux2", saved[0], bound=0.06)


def test_flux1_dev_workflow_runs_from_comfyui_single_files(tmp_path, tiny_pipeline, tiny_single_file, capsys):
    """The shipped Flux.1-dev graph as ComfyUI users' files have it (transformer, clip_l, t5xxl, ae as single
    files; no diffusers folder), on the tiny Flux.1 under the real names: only sizes and steps overridden."""
    import shutil

    from lowvram_lora.engine.testing import make_tiny_dataset, write_flux1_single_files

    root = tmp_path / "root"
    (root / "models" / "diffusion_models").mkdir(parents=True)
    shutil.copy(tiny_single_file, root / "models" / "diffusion_models" / "flux1-dev.safetensors")
    files = write_flux1_single_files(tiny_pipeline, tmp_path / "written")
    te, vae = root / "models" / "text_encoders", root / "models" / "vae"
    te.mkdir(parents=True)
    vae.mkdir(parents=True)
    for kind, name in (("clip_l", "clip_l"), ("t5xxl", "t5xxl_fp16")):  # the names ComfyUI users have
        shutil.copy(files[kind], te / f"{name}.safetensors")
        shutil.copytree(files[kind].with_suffix(""), te / name)  # companion folder: tiny config + tokenizer
    shutil.copy(files["vae"], vae / "ae.safetensors")
    shutil.copytree(files["vae"].with_suffix(""), vae / "ae")
    make_tiny_dataset(root / "input" / "my_subject", count=1)
    args = _args(WORKFLOWS_DIR / "flux1_dev_lora.json", root / "models", root / "output",
                 ["2.resolution=128", "4.steps=10", "4.warmup_steps=0", "4.learning_rate=0.01"])
    code = run_workflow_command(args, NODE_CLASS_MAPPINGS, configure_dirs=configure_standalone_dirs)
    out = capsys.readouterr().out
    assert code == 0, out
    saved = sorted((root / "output" / "loras").glob("flux1_dev_lora_*_.safetensors"))
    assert len(saved) == 1
    # The template trains an int8 slab built from the file (0.09% of the output measured; per-row int8 of a bf16 file)
    _assert_trained_the_right_thing(root / "models", root / "output", tiny_pipeline, "flux1", saved[0], bound=5e-3)
