"""V3 nodes: one schema (nodes/schema.py) run by our executor as ComfyUI runs V3 nodes, and turned into
ComfyUI's own ``io.ComfyNode`` classes (nodes/v3.py).

The CPU tests need no ComfyUI. The last test runs the adapter against ComfyUI's real ``comfy_api`` and
``execution.py`` in ComfyUI's own environment, when ``LOWVRAM_COMFYUI_DIR`` points at a ComfyUI checkout.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lowvram_lora.host.executor import execute_graph
from lowvram_lora.host.workflow import WorkflowError, validate_graph
from lowvram_lora.nodes import NODE_CLASS_MAPPINGS, schema as io
from lowvram_lora.nodes.progress import ComfyCallback
from lowvram_lora.engine.callbacks import StepInfo

SEEN: list = []


class Source(io.Node):
    @classmethod
    def define_schema(cls):
        return io.Schema(node_id="Source", display_name="Source", category="t", hidden=["unique_id", "prompt"],
                         inputs=[io.Int("n", default=2, min=0, max=10, tooltip="n")],
                         outputs=[io.Output("NUM", "num", "a number")])

    @classmethod
    async def execute(cls, n):  # async, as V3 allows: the executor awaits it
        SEEN.append(("Source", cls.hidden.unique_id, sorted(cls.hidden.prompt)))
        return io.NodeOutput(n * 10)


class Sink(io.Node):
    @classmethod
    def define_schema(cls):
        return io.Schema(node_id="Sink", category="t", is_output_node=True,
                         inputs=[io.Custom("NUM", "num", tooltip="x"), io.String("label", default="a", tooltip="l")])

    @classmethod
    def validate_inputs(cls, label=None, **_):
        SEEN.append(("validate", cls.hidden.unique_id))
        return True if label != "bad" else "label must not be 'bad'"

    @classmethod
    def execute(cls, num, label):
        return io.NodeOutput(ui={"text": [f"{label}={num}"]})


MAPPINGS = {"Source": Source, "Sink": Sink}


def _graph(label="x"):
    return {"1": {"class_type": "Source", "inputs": {"n": 4}},
            "2": {"class_type": "Sink", "inputs": {"num": ["1", 0], "label": label}}}


def test_executor_runs_v3_nodes_as_comfyui_does():
    SEEN.clear()
    results = execute_graph(_graph(), MAPPINGS, progress=False)
    # hidden values on the class clone (not arguments), async execute awaited, NodeOutput unwrapped with its ui
    assert SEEN == [("validate", "2"), ("Source", "1", ["1", "2"]), ]
    assert results["1"] == (40,) and results["2"] == () and results.ui == {"2": {"text": ["x=40"]}}
    assert Source.hidden.unique_id is None  # the clone held it, the class did not
    with pytest.raises(WorkflowError, match="label must not be 'bad'"):
        validate_graph(_graph("bad"), MAPPINGS)


def test_v1_face_of_a_schema_is_comfyuis():
    """What ComfyUI's _ComfyNodeBaseInternal derives from a schema: INPUT_TYPES with hidden kinds,
    RETURN_TYPES / NAMES / OUTPUT_TOOLTIPS, OUTPUT_NODE, FUNCTION by whether execute is async."""
    assert Source.INPUT_TYPES() == {"required": {"n": ("INT", {"tooltip": "n", "default": 2, "min": 0, "max": 10})},
                                    "hidden": {"unique_id": ("UNIQUE_ID",), "prompt": ("PROMPT",)}}
    assert Sink.INPUT_TYPES()["hidden"] == {"prompt": ("PROMPT",), "extra_pnginfo": ("EXTRA_PNGINFO",)}
    assert Sink.INPUT_TYPES()["required"]["label"] == ("STRING", {"tooltip": "l", "default": "a", "multiline": False})
    assert (Source.RETURN_TYPES, Source.RETURN_NAMES, Source.OUTPUT_TOOLTIPS) == (("NUM",), ("num",), ("a number",))
    assert (Source.FUNCTION, Sink.FUNCTION) == ("EXECUTE_NORMALIZED_ASYNC", "EXECUTE_NORMALIZED")
    assert Sink.OUTPUT_NODE is True and Source.OUTPUT_NODE is False
    with pytest.raises(ValueError, match="unique"):
        io.Schema("X", inputs=[io.Int("a"), io.Int("a")]).validate()


def test_pack_nodes_keep_their_widget_order_and_defaults():
    """Saved graphs (UI format) hold widget values by position: the order and defaults of the classic
    nodes (the last release's INPUT_TYPES) are kept, so templates and users' files load unchanged."""
    order = {n: cls.INPUT_TYPES()["required"] for n, cls in NODE_CLASS_MAPPINGS.items()}
    assert list(order["LowVRAMSaveLoRA"]) == ["lora", "filename_prefix", "format", "dtype"]
    # Offload Config shows what people set on most runs; the planner's own choices moved to Offload Tuning (a file
    # saved before reads by the old order: nodes/offload_config.py LEGACY_WIDGETS, tests/test_offload_tuning.py).
    assert list(order["LowVRAMOffloadConfig"]) == ["mode", "compile", "vram_budget_gb", "ram_budget_gb"]
    assert list(order["LowVRAMOffloadTuning"]) == [
        "resident_blocks", "prefetch_depth", "activation_offload", "gradient_checkpointing", "max_pinned_fraction",
        "int8_compute", "recompute_chunks", "optimizer_on_host", "micro_batch_size", "activation_memory_budget",
        "outer_on_host", "disk_blocks", "allocator_margin_gb"]  # new inputs go last
    # Train LoRA shows the settings people change; the rest moved to Training Options and Preview Options (a file
    # saved before reads by the old order: nodes/train_lora.py LEGACY_WIDGETS, tests/test_train_lora_options.py).
    assert list(order["LowVRAMTrainLoRA"]) == ["model", "dataset", "offload", "steps", "learning_rate", "rank",
                                               "alpha", "batch_size", "training_seed", "sample_every",
                                               "sample_frames"]
    assert list(NODE_CLASS_MAPPINGS["LowVRAMTrainLoRA"].INPUT_TYPES()["optional"])[-2:] == [
        "training_options", "preview_options"]
    assert list(NODE_CLASS_MAPPINGS["LowVRAMCacheTextEmbeds"].INPUT_TYPES()["optional"]) == [
        "video_frames", "video_fps", "video_window", "windows_per_clip", "control_folder", "image_to_video", "options",
        "images"]
    assert order["LowVRAMTrainLoRA"]["learning_rate"][1]["round"] is False  # kept: no rounding of 1e-4


def _offload_graph(node_id: str, **values) -> dict:
    """Offload Config with every widget at its default except ``values`` (our validation wants them all)."""
    spec = NODE_CLASS_MAPPINGS["LowVRAMOffloadConfig"].INPUT_TYPES()["required"]
    return {node_id: {"class_type": "LowVRAMOffloadConfig",
                      "inputs": {name: s[1]["default"] for name, s in spec.items()} | values}}


def test_offload_node_runs_the_same_through_the_executor_and_directly():
    graph = _offload_graph("1", mode="resident")
    (cfg,) = execute_graph(graph, NODE_CLASS_MAPPINGS, progress=False)["1"]
    assert cfg == NODE_CLASS_MAPPINGS["LowVRAMOffloadConfig"].execute(mode="resident").args[0]


def test_comfy_callback_uses_v3_set_progress_with_the_sample_grid():
    from PIL import Image

    calls = []
    cb = ComfyCallback(None, None, node_id="5")
    cb._set_progress = lambda v, m, node_id, preview_image, ignore_size_limit: calls.append(
        (v, m, node_id, preview_image and preview_image.size))
    cb.progress_interval_s = 3600  # only first, last, and previews pass
    cb._send_event = lambda *a: None
    cb.on_sample(0, Image.new("RGB", (2048, 512)), None)  # before the first step: shown at 0/1
    for step in (1, 2, 3):
        cb.on_step(StepInfo(step=step, total_steps=3, loss=1.0, lr=1e-4, grad_norm=1.0, seconds_per_step=0.1,
                             peak_vram_gb=0.0))
    cb.on_sample(3, Image.new("RGB", (300, 200)), None)
    assert calls == [(0, 1, "5", (1024, 256)), (1, 3, "5", None), (3, 3, "5", None), (3, 3, "5", (300, 200))]


COMFY_DIR = os.environ.get("LOWVRAM_COMFYUI_DIR")

_IN_COMFY = r'''
import asyncio, json, sys
sys.path.insert(0, sys.argv[1])
from comfy.cli_args import args
args.cpu = True  # as main.py --cpu
import execution
from comfy_api.latest import io
from lowvram_lora.nodes import NODES
from lowvram_lora.nodes.v3 import comfy_extension
import lowvram_lora

ext = asyncio.run(lowvram_lora.comfy_entrypoint())
classes = asyncio.run(ext.get_node_list())
out = {"info": {}, "ours": {}}
for ours, cls in zip(NODES, classes):
    assert issubclass(cls, io.ComfyNode) and cls.GET_SCHEMA().node_id == ours.__name__
    out["info"][ours.__name__] = cls.GET_NODE_INFO_V1()
    out["ours"][ours.__name__] = ours.GET_NODE_INFO_V1()

async def run(cls, inputs, func, uid):
    data, _, v3 = execution.get_input_data(inputs, cls, uid)
    return await execution._async_map_node_over_list("p", uid, cls, data, func, v3_data=v3)

by_id = {c.GET_SCHEMA().node_id: c for c in classes}
off = by_id["LowVRAMOffloadConfig"]
res = asyncio.run(run(off, {"mode": "resident", "compile": "off"}, off.FUNCTION, "3"))
out["offload"] = repr(res[0].result[0])
save = by_id["LowVRAMSaveLoRA"]
out["validate"] = asyncio.run(run(save, {"filename_prefix": "../../escape"}, "validate_inputs", "5"))
import inspect
out["argspec"] = {k: [inspect.getfullargspec(c.validate_inputs).args, inspect.getfullargspec(c.validate_inputs).varkw]
                  for k, c in by_id.items() if "validate_inputs" in vars(c)}
print("JSON" + json.dumps(out, default=str))
'''


@pytest.mark.skipif(not COMFY_DIR, reason="set LOWVRAM_COMFYUI_DIR to a real ComfyUI to run this")
def test_adapter_in_real_comfyui_matches_our_schema_and_executor(tmp_path):
    """In ComfyUI's own environment: comfy_entrypoint's io.ComfyNode classes describe themselves exactly as our
    headless /object_info does, and ComfyUI's executor (get_input_data + _async_map_node_over_list) gives the
    same Offload Config and the same validate_inputs message as our executor."""
    comfy = Path(COMFY_DIR).resolve()
    python = Path(os.environ.get("LOWVRAM_COMFYUI_PYTHON", comfy / "venv" / "bin" / "python"))
    import lowvram_lora

    pp = tmp_path / "pp"
    pp.mkdir()
    (pp / "lowvram_lora").symlink_to(Path(lowvram_lora.__file__).parent)
    done = subprocess.run([str(python), "-c", _IN_COMFY, str(comfy)], capture_output=True, text=True, cwd=comfy,
                          env=dict(os.environ, PYTHONPATH=str(pp), HF_HUB_OFFLINE="1"), timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.split("JSON", 1)[1])
    for node_id, info in out["info"].items():
        assert info == out["ours"][node_id], node_id
    graph = _offload_graph("3", mode="resident", compile="off")
    (cfg,) = execute_graph(graph, NODE_CLASS_MAPPINGS, progress=False)["3"]
    assert out["offload"] == repr(cfg)
    message = out["validate"][0]
    assert isinstance(message, str) and "must stay inside the output folder" in message
    # ComfyUI's argspec of each hook: the node's own inputs, no **kwargs (which would switch off ComfyUI's range
    # checks of every input and file a failed check once per input).
    assert out["argspec"]["LowVRAMCacheTextEmbeds"] == [["cls", "dataset_path", "control_folder", "default_caption",
                                                         "images"], None]
    assert out["argspec"]["LowVRAMSaveLoRA"][1] is None
    with pytest.raises(WorkflowError, match="must stay inside the output folder"):
        from lowvram_lora.host.workflow import _call_validate_inputs, _where

        node = {"class_type": "LowVRAMSaveLoRA", "inputs": {"filename_prefix": "../../escape"}}
        _call_validate_inputs(NODE_CLASS_MAPPINGS["LowVRAMSaveLoRA"], node, _where("5", node))
