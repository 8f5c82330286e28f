"""What the editor shows of our errors (issue 43, finding 4): ComfyUI names a failed node's exception by
``module.qualname``, and it imports a custom-node folder as a module named by the folder's path, so our messages
came under "/home/.../custom_nodes/lowvram-lora.engine.errors.DatasetError". Our classes are named by the package
wherever they were imported from."""
from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

PACK = Path(__file__).resolve().parents[1]


def test_errors_are_named_by_the_package_when_comfyui_imports_the_pack_by_its_path():
    name = str(PACK).replace(".", "_x_")  # ComfyUI 0.33 nodes.py load_custom_node, for a folder
    spec = importlib.util.spec_from_file_location(name, PACK / "__init__.py", submodule_search_locations=[str(PACK)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        errors = importlib.import_module(name + ".engine.errors")
        video = importlib.import_module(name + ".engine.data.video")
        files = importlib.import_module(name + ".engine.checkpoint.files")
        for cls, full in ((errors.DatasetError, "lowvram_lora.engine.errors.DatasetError"),
                          (errors.LowVRAMError, "lowvram_lora.engine.errors.LowVRAMError"),
                          (video.ClipError, "lowvram_lora.engine.data.video.ClipError"),
                          (files.UnreadableSafetensors, "lowvram_lora.engine.checkpoint.files.UnreadableSafetensors")):
            assert f"{cls.__module__}.{cls.__qualname__}" == full  # ComfyUI's execution.full_type_name
            assert "/" not in cls.__module__
    finally:
        for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
            del sys.modules[key]


def test_inside_comfyui_a_fixable_error_opens_the_errors_panel_with_our_sentence():
    """The editor's Errors panel opens with "<exception type>: <message>", the type as ComfyUI's
    execution.full_type_name gives it: a pack error reads "lowvram-lora: <sentence>", the engine's error its cause;
    any other exception passes unchanged."""
    import traceback
    import types

    from lowvram_lora.engine.errors import DatasetError
    from lowvram_lora.nodes import schema as io_schema
    from lowvram_lora.nodes.v3 import to_comfy_node

    def full_type_name(klass):  # ComfyUI 0.33 execution.py
        module = klass.__module__
        return klass.__qualname__ if module == "builtins" else module + "." + klass.__qualname__

    class Failing(io_schema.Node):
        error: Exception = DatasetError("dataset_path 'x' is not a folder; set it to a folder of images")

        @classmethod
        def execute(cls):
            raise cls.error

    fake_io = types.SimpleNamespace(ComfyNode=type("ComfyNode", (), {"hidden": None}), NodeOutput=tuple)
    comfy_cls = to_comfy_node(Failing, fake_io)
    try:
        comfy_cls.execute()
    except Exception as exc:  # noqa: BLE001 (what ComfyUI catches)
        caught = exc
    assert f"{full_type_name(type(caught))}: {caught}" == (
        "lowvram-lora: dataset_path 'x' is not a folder; set it to a folder of images")
    assert caught.__cause__ is Failing.error
    assert traceback.format_exception_only(caught)[-1].startswith("lowvram-lora: dataset_path 'x'")
    Failing.error = RuntimeError("a bug")
    try:
        comfy_cls.execute()
    except Exception as exc:  # noqa: BLE001
        assert exc is Failing.error
