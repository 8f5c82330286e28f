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
