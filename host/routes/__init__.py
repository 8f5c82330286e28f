"""The HTTP and websocket API of ``lowvram-lora serve``, as route groups: each group is a class holding what its
handlers need (a folder, the node mappings, the prompt host), its handlers as methods, and ``register(routes)``
listing its paths. ``serve.build_app`` imports these only after ``require_editor`` found aiohttp.

- ``editor.py``: the editor's page and files, the websocket, our extensions and templates, ``/view``;
- ``userdata.py``: settings and the user's files (saved workflows);
- ``queue.py``: prompts, the queue, the history, interrupting, and ComfyUI 0.33's jobs API;
- ``info.py``: what the editor asks about the server (nodes, system, fixed lists).
"""
