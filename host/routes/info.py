"""Route group: what the editor asks about the server: the nodes (``/object_info``), the machine
(``/system_stats``), and the lists ComfyUI fills from its own models and blueprints (empty here)."""
from __future__ import annotations

import os
import sys

from aiohttp import web

from ..object_info import object_info
from ..serve_api import FEATURE_FLAGS, MIN_FRONTEND_VERSION, Routes

#: Routes whose answer never changes: ComfyUI fills them from its own models, embeddings and translations.
FIXED = (("/embeddings", []), ("/models", []), ("/experiment/models", []), ("/i18n", {}), ("/features", FEATURE_FLAGS),
         ("/models/{folder}", []),
         ("/global_subgraphs", {}),  # ComfyUI lists custom nodes' and its blueprints' subgraphs; we have none
         ("/global_subgraphs/{id}", None))  # ComfyUI's answer for an id it does not know


class InfoRoutes:
    def __init__(self, mappings, display):
        self.mappings, self.display = mappings, display

    def register(self, routes: Routes) -> None:
        routes.both("GET", "/object_info")(self.get_object_info)
        routes.both("GET", "/object_info/{node_class}")(self.get_one_node)
        routes.both("GET", "/system_stats")(self.system_stats)
        for path, value in FIXED:
            async def fixed(request, value=value):
                return web.json_response(value)
            routes.both("GET", path)(fixed)
        routes.both("POST", "/free")(self.free)

    async def get_object_info(self, request):
        return web.json_response(object_info(self.mappings, self.display))

    async def get_one_node(self, request):
        info = object_info(self.mappings, self.display)
        name = request.match_info["node_class"]
        return web.json_response({name: info[name]} if name in info else {})

    async def system_stats(self, request):
        return web.json_response(system_stats_reply())

    async def free(self, request):
        return web.Response(status=200)  # ComfyUI unloads its models here; the editor only needs the 200


def system_stats_reply() -> dict:
    """``/system_stats`` in ComfyUI's form: this process and its devices."""
    import torch

    from ...engine.version import VERSION

    devices = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(i)
            devices.append({"name": torch.cuda.get_device_name(i), "type": "cuda", "index": i, "vram_total": total,
                            "vram_free": free, "torch_vram_total": 0, "torch_vram_free": 0})
    else:
        devices.append({"name": "cpu", "type": "cpu", "index": None, "vram_total": 0, "vram_free": 0,
                        "torch_vram_total": 0, "torch_vram_free": 0})
    return {"system": {
        "os": os.name, "python_version": sys.version, "embedded_python": False,
        "comfyui_version": f"lowvram-lora {VERSION} (serve)", "pytorch_version": torch.__version__,
        "argv": sys.argv, "ram_total": 0, "ram_free": 0, "required_frontend_version": MIN_FRONTEND_VERSION,
        "installed_templates_version": None, "required_templates_version": None, "comfy_package_versions": []},
        "devices": devices}
