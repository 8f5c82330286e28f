"""The package's layers, checked from its source: every import points to its own layer or a lower one,
no modules import each other in a loop, imports inside the package are relative, engine/ never
imports ComfyUI, and no code probes an object for an attribute (``getattr(x, "name", ...)``, ``hasattr``)
except the library reflection listed in ``REFLECTION``: the project's own objects have the attributes their
types declare.

Nothing is imported: every .py of the package is parsed with ``ast``, and every import statement counts,
the ones inside functions too (a deferred import is still an arrow; deferring it only hides a cycle
until the day someone moves it up). Only imports under ``if TYPE_CHECKING:`` are left out: they never
run, so they cannot make a cycle or pull a higher layer in. Modules loaded by name through importlib
(the family registry finds its own folders that way) are not seen.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]  # the repository root is the package ``lowvram_lora``
PACKAGE = "lowvram_lora"

#: The layers, bottom first. A module may import its own layer or lower ones, never a higher one.
#: An entry ending in "/" is a folder (everything under it); an exact file wins over its folder.
#: Why this order: each layer is what the next one is made of.
#:  0 foundation  - errors, callbacks, configs, file writing: plain values every layer passes around.
#:  1 families    - what a model family is (names, shapes, loading); knows only the foundation, so every
#:                  format and the offloader can ask "which family?" without knowing how training runs.
#:  2 checkpoint  - reading checkpoint files, keyed by a family's name maps; a slab is one of its kinds (the
#:                  reader identifies and loads it), built from the others by the same reader.
#:  3 formats     - datasets, LoRA files, model loading: data on disk, built on the checkpoint reader.
#:  4 offload     - streaming a model's blocks through a small GPU; it moves weights, whatever their format.
#:  5 placement   - where the computation runs over several devices (split, data-parallel process group),
#:                  used by the training loop; it places blocks the offloader streams.
#:  6 caching, sampling, fixtures - encoders run over a dataset, images sampled from a (trained) model,
#:                  tiny test models: they run a model, so they sit on everything that loads and places it.
#:  7 train       - the training loop and what it needs (optimizers, resume states, LoRA attach).
#:  8 runs        - whole runs: reuse a finished one, or start and watch worker processes that each train.
#:  9 top         - the ComfyUI nodes, the headless host, the command line: they only call the engine.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("foundation", ("engine/__init__.py", "engine/errors.py", "engine/callbacks.py", "engine/version.py",
                    "engine/discovery.py", "engine/quiet.py", "engine/hashing.py", "engine/fileio.py", "engine/config.py",
                    "engine/plotting.py", "engine/attention.py")),
    ("families", ("engine/families/",)),
    ("checkpoint", ("engine/checkpoint/", "engine/slab/")),
    ("formats", ("engine/data/", "engine/lora_io/", "engine/models/")),
    ("offload", ("engine/offload/",)),
    ("placement", ("engine/parallel/",)),
    ("caching, sampling, fixtures", ("engine/caching/", "engine/sampling/", "engine/testing.py")),
    ("train", ("engine/train/",)),
    ("runs", ("engine/runs/",)),
    ("top", ("nodes/", "host/", "cli.py", "demo.py", "demo_models.py", "slab_cli.py", "__main__.py", "__init__.py")),
)

#: ComfyUI's own top-level modules: engine/ must run without ComfyUI (headless, under torchrun).
COMFYUI_MODULES = frozenset({"comfy", "comfy_extras", "comfy_execution", "comfy_api", "comfy_config",
                             "folder_paths", "node_helpers", "latent_preview", "nodes", "server", "execution"})

#: ``from . import __path__`` reads what the import system set on the package before any of its code ran:
#: no arrow to the package's code, so no cycle.
IMPORT_SYSTEM_NAMES = frozenset({"__path__", "__name__", "__file__", "__spec__", "__package__"})


def package_files() -> list[str]:
    """Every .py of the package, as a path relative to the root ('engine/offload/plan.py'): the root's own
    modules and those under the folders the wheel ships (``FOLDERS`` in setup.py, read, not imported;
    tests/, bench/ and a build/ folder are not the package)."""
    setup = ast.parse((ROOT / "setup.py").read_text(encoding="utf-8"))
    folders = next(ast.literal_eval(node.value) for node in setup.body if isinstance(node, ast.Assign)
                   and any(isinstance(t, ast.Name) and t.id == "FOLDERS" for t in node.targets))
    paths = [p for p in ROOT.glob("*.py") if p.name != "setup.py"]
    # Test modules beside the code they test (a family's test_family.py) are not package code.
    paths += [p for folder in folders for p in (ROOT / folder).rglob("*.py") if not p.name.startswith("test_")]
    return sorted(p.relative_to(ROOT).as_posix() for p in paths)


def layer_of(rel: str) -> int | None:
    """The layer of a file: its exact entry, else the deepest folder holding it; None when unlisted."""
    best, depth = None, -1
    for index, (_, entries) in enumerate(LAYERS):
        for entry in entries:
            if entry == rel:
                return index
            if entry.endswith("/") and rel.startswith(entry) and len(entry) > depth:
                best, depth = index, len(entry)
    return best


def _under_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST):
    """Every import statement, at any depth, except those under ``if TYPE_CHECKING:``."""
    stack = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        children = list(ast.iter_child_nodes(node))
        if isinstance(node, ast.If) and _under_type_checking(node):
            children = node.orelse  # the body never runs
        stack.extend(children)


def _module_file(parts: list[str], files: set[str]) -> str | None:
    """The file of a dotted module inside the package ('engine.offload' -> 'engine/offload/__init__.py')."""
    stem = "/".join(parts)
    for candidate in (f"{stem}.py", f"{stem}/__init__.py" if stem else "__init__.py"):
        if candidate in files:
            return candidate
    return None


def _package_parts(rel: str) -> list[str]:
    """The dotted package a file's relative imports start from (its folder, for __init__.py too)."""
    return list(Path(rel).parent.parts)


def arrows(files: list[str], sources: dict[str, str] | None = None):
    """(file, line, imported file) for every import of a package module in ``files``, and a list of problems
    found on the way (absolute self-imports, ComfyUI in engine/, relative imports that lead nowhere).
    ``sources`` stands in for the text of some files (the checks' own test)."""
    fileset = set(package_files())
    found, problems = [], []
    for rel in files:
        text = (sources or {}).get(rel)
        tree = ast.parse(text if text is not None else (ROOT / rel).read_text(encoding="utf-8"), filename=rel)
        for node in sorted(_imports(tree), key=lambda n: (n.lineno, n.col_offset)):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif node.level == 0:
                names = [node.module or ""]
            else:
                names = []
            for name in names:  # absolute imports: only the two rules below concern them
                top = name.split(".")[0]
                if top == PACKAGE:
                    problems.append(f"{rel}:{node.lineno} imports {name} absolutely; inside the package every "
                                    f"import is relative (from .x import y), so the package works under any "
                                    f"folder name (ComfyUI imports it as custom_nodes/<folder>)")
                if rel.startswith("engine/") and top in COMFYUI_MODULES:
                    problems.append(f"{rel}:{node.lineno} imports {name} (ComfyUI) from engine/; the engine runs "
                                    f"without ComfyUI: move this to nodes/ or pass the value in")
            if not isinstance(node, ast.ImportFrom) or node.level == 0:
                continue
            base = _package_parts(rel)
            if node.level - 1 > len(base):
                problems.append(f"{rel}:{node.lineno} has a relative import that climbs above the package")
                continue
            base = base[:len(base) - (node.level - 1)]
            target = base + (node.module.split(".") if node.module else [])
            module = _module_file(target, fileset)
            if module is None:
                problems.append(f"{rel}:{node.lineno} imports {'.' * node.level}{node.module or ''}, "
                                f"which is no module of the package")
                continue
            for alias in node.names:  # `from . import x`: x is a submodule, or a name of the package
                if alias.name in IMPORT_SYSTEM_NAMES:
                    continue
                sub = _module_file(target + [alias.name], fileset) if alias.name != "*" else None
                found.append((rel, node.lineno, sub or module))
    return found, problems


def upward(found) -> list[str]:
    out = []
    for rel, line, target in sorted(found):
        here, there = layer_of(rel), layer_of(target)
        if here is not None and there is not None and there > here:
            out.append(f"{rel}:{line} imports {target} (layer {there} {LAYERS[there][0]}) "
                       f"from layer {here} {LAYERS[here][0]}")
    return out


def cycles(found) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan), plus modules that import
    themselves; each is listed sorted."""
    graph: dict[str, set[str]] = {}
    for rel, _, target in found:
        graph.setdefault(rel, set()).add(target)
        graph.setdefault(target, set())
    index, low, on_stack, stack, out = {}, {}, set(), [], []

    def visit(v: str) -> None:  # recursion depth is bounded by the package's ~150 modules
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph[v]:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _cycle_edges(component: list[str], found) -> list[str]:
    inside = set(component)
    return sorted({f"{rel}:{line} -> {target}" for rel, line, target in found if rel in inside and target in inside})


def test_every_file_has_a_layer():
    files = package_files()
    assert "engine/train/loop.py" in files and "nodes/__init__.py" in files  # the walk found the package
    unlisted = [rel for rel in files if layer_of(rel) is None]
    assert not unlisted, "files without a layer; add them to LAYERS in tests/test_layering.py:\n" + "\n".join(unlisted)


def test_no_absolute_self_import_no_comfyui_in_engine():
    _, problems = arrows(package_files())
    if problems:
        pytest.fail("\n".join(problems), pytrace=False)


def test_no_import_points_up_a_layer():
    found, _ = arrows(package_files())
    assert found, "no imports found: the parser reads nothing"
    bad = upward(found)
    if bad:
        pytest.fail(f"{len(bad)} import(s) point up a layer (the layers are LAYERS in tests/test_layering.py; "
                    f"move the code down, or pass the value in):\n" + "\n".join(bad), pytrace=False)


def test_no_import_cycle():
    found, _ = arrows(package_files())
    loops = cycles(found)
    if loops:
        pytest.fail(f"{len(loops)} import cycle(s):\n" + "\n".join(
            f"  {' <-> '.join(c)}:\n    " + "\n    ".join(_cycle_edges(c, found)) for c in loops), pytrace=False)


def test_the_checks_can_fail():
    """The checker itself: a made-up upward arrow, a cycle and a relative import are all seen."""
    fake = [("engine/offload/plan.py", 3, "engine/train/loop.py"), ("engine/train/loop.py", 5, "engine/offload/plan.py")]
    assert upward(fake) == ["engine/offload/plan.py:3 imports engine/train/loop.py (layer 7 train) "
                            "from layer 4 offload"]
    assert cycles(fake) == [["engine/offload/plan.py", "engine/train/loop.py"]]
    found, _ = arrows(["engine/train/__init__.py"])
    assert ("engine/train/__init__.py", 2, "engine/train/loop.py") in found
    source = ("import lowvram_lora.engine\n"
              "def f():\n    from ...nodes import paths\n    import comfy.sd\n    from . import errors, __path__\n"
              "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..train import loop\n")
    found, problems = arrows(["engine/offload/plan.py"], {"engine/offload/plan.py": source})
    # `errors` is no submodule of engine/offload: the arrow goes to the package; __path__ and the
    # TYPE_CHECKING import draw none
    assert sorted(found) == [("engine/offload/plan.py", 3, "nodes/paths.py"),
                             ("engine/offload/plan.py", 5, "engine/offload/__init__.py")]
    assert sorted(p.split(" ")[0] for p in problems) == ["engine/offload/plan.py:1", "engine/offload/plan.py:4"]
    assert layer_of("engine/parallel/split.py") == 5 and layer_of("engine/errors.py") == 0


# --- no duck-typing of the project's own objects ----------------------------------------------------------------

#: The attribute probes allowed, by attribute name: reflection on objects the project does not define, whose
#: attributes vary by version, subclass or input. Every other ``getattr(x, "name", default)`` / ``hasattr(x, "name")``
#: is a probe of the project's own objects, which have the attributes their types declare: give the object the
#: attribute (a default on its class), or an explicit type to ``isinstance``.
REFLECTION: dict[str, str] = {
    **dict.fromkeys(("text_config", "vision_config", "tokenizer", "rotary_emb", "embed_scale"),
                    "transformers configs, processors and models: which parts a model has varies by architecture"),
    **dict.fromkeys(("shift_factor", "tile_sample_min_size", "gradient_checkpointing"),
                    "diffusers models and their configs: varies by class"),
    **dict.fromkeys(("peft_config", "cast_input_dtype_enabled"), "peft's layers and models, by version"),
    **dict.fromkeys(("rotation", "n_frames"), "PyAV frames and PIL images, by format"),
    "errno": "an OSError's number (other exceptions have none)",
    **dict.fromkeys(("O_DIRECT", "posix_fadvise"), "the os module: O_DIRECT and fadvise exist on Linux only"),
    **dict.fromkeys(("__path__", "__func__"), "Python's own: a package's path, a bound method's function"),
    **dict.fromkeys(("get_folder_paths", "unload_all_models", "soft_empty_cache"),
                    "ComfyUI's modules, which differ between its versions (nodes/ only)"),
    "models_dir": "ComfyUI's folder_paths module (by version); an argparse Namespace (as below)",
    **dict.fromkeys((
        "INPUT_IS_LIST", "OUTPUT_IS_LIST", "HAS_INTERMEDIATE_OUTPUT", "DEPRECATED", "EXPERIMENTAL", "DEV_ONLY",
        "API_NODE", "SEARCH_ALIASES", "ESSENTIALS_CATEGORY", "VALIDATE_INPUTS", "GET_NODE_INFO_V1", "RETURN_NAMES",
        "RETURN_TYPES", "DESCRIPTION", "RELATIVE_PYTHON_MODULE", "OUTPUT_NODE", "CATEGORY", "OUTPUT_TOOLTIPS",
        "PREPARE_CLASS_CLONE", "define_schema", "expand", "block_execution", "args", "ui", "unique_id"),
        "ComfyUI's node protocol: optional attributes of node classes, their outputs and hidden values, read as "
        "ComfyUI reads them (its classes and ours)"),
    **dict.fromkeys(("overrides", "traceback", "output_dir", "no_progress"),
                    "an argparse Namespace: the run command is also called with the options of other parsers"),
    "_lowvram_host_block": "offload/host.py keeps a block's HostBlock on the torch module it copies",
}


def _string_constants(tree: ast.Module) -> dict[str, str]:
    return {t.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
            for t in node.targets if isinstance(t, ast.Name)}


def attribute_probes(files: list[str], sources: dict[str, str] | None = None) -> list[tuple[str, int, str]]:
    """(file, line, attribute) of every ``getattr(x, name, ...)`` / ``hasattr(x, name)`` whose name is a string
    literal, or a module constant holding one. A computed name (``getattr(self, f.name)`` over a dataclass's
    fields, ``getattr(torch, dtype)``) is reflection over a table, not a probe."""
    out = []
    for rel in files:
        text = (sources or {}).get(rel)
        tree = ast.parse(text if text is not None else (ROOT / rel).read_text(encoding="utf-8"), filename=rel)
        constants = _string_constants(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("getattr", "hasattr") and len(node.args) >= 2):
                continue
            arg = node.args[1]
            name = arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else \
                constants.get(arg.id) if isinstance(arg, ast.Name) else None
            if name is not None:
                out.append((rel, node.lineno, name))
    return sorted(out)


def test_no_attribute_probes_of_the_projects_own_objects():
    probes = attribute_probes(package_files())
    assert any(name == "_lowvram_host_block" for _, _, name in probes)  # the walk sees host.py's probe (a constant)
    bad = [f"{rel}:{line} probes .{name}" for rel, line, name in probes if name not in REFLECTION]
    if bad:
        pytest.fail(f"{len(bad)} attribute probe(s) of the project's own objects; give the object the attribute "
                    f"(a default on its class) or test its type with isinstance, or, for library reflection, add the "
                    f"name to REFLECTION in tests/test_layering.py with the reason:\n" + "\n".join(bad),
                    pytrace=False)


def test_the_probe_check_can_fail():
    source = ("HOOK = 'constant_outputs'\n"
              "def f(block, cfg, spec):\n"
              "    a = getattr(block, HOOK, None)\n    b = hasattr(cfg, 'text_config')\n"
              "    c = getattr(spec, 'pacer', None)\n    d = getattr(spec, spec.name)\n")
    probes = attribute_probes(["engine/offload/plan.py"], {"engine/offload/plan.py": source})
    assert probes == [("engine/offload/plan.py", 3, "constant_outputs"), ("engine/offload/plan.py", 4, "text_config"),
                      ("engine/offload/plan.py", 5, "pacer")]
    assert [name for _, _, name in probes if name not in REFLECTION] == ["constant_outputs", "pacer"]
