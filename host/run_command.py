"""``lowvram-lora run WORKFLOW.json``: run a ComfyUI workflow headless, with no ComfyUI installed.

Kept apart from ``cli.py`` so the command can be wired in with two calls:
``add_run_parser(subparsers)`` and ``run_workflow_command(args, NODE_CLASS_MAPPINGS,
configure_dirs=...)``. Expected failures (a bad workflow, a node that raised) print
one message to stderr and exit 1, because users of a headless runner act on the
message, not on a traceback; ``--traceback`` shows it when debugging.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Mapping

from .executor import ExecutionResults, NodeExecutionError, execute_graph
from .workflow import WorkflowError, load_workflow, to_api_graph

DEFAULT_MODELS_DIR = "./models"
DEFAULT_OUTPUT_DIR = "./output"
EXIT_OK, EXIT_FAILED, EXIT_INTERRUPTED = 0, 1, 130

#: ``configure_dirs(models_dir, output_dir)``: tells the nodes where models live and
#: where outputs go (absolute paths), as ComfyUI's ``folder_paths`` would.
ConfigureDirs = Callable[[str, str], None]


def add_run_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register the ``run`` subcommand on an ``add_subparsers()`` object and return its parser."""
    parser = subparsers.add_parser(
        "run",
        help="run a ComfyUI workflow JSON (UI or API format) without ComfyUI",
        description="Run a ComfyUI workflow (UI or API format) with this pack's nodes, without ComfyUI.",
    )
    parser.add_argument("workflow", metavar="WORKFLOW.json",
                        help="workflow file saved from ComfyUI, or a shipped template's name (e.g. demo_tiny_lora)")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="ID.INPUT=VALUE",
        help="override a widget value, e.g. --set 5.steps=200 --set 5.learning_rate=1e-4 "
        "(ID is a node id or a unique node title; repeatable)",
    )
    parser.add_argument("--models-dir", default=DEFAULT_MODELS_DIR,
                        help=f"where model files are looked up (default {DEFAULT_MODELS_DIR})")
    parser.add_argument("--output-dir", default=DEFAULT_OUTPUT_DIR,
                        help=f"where outputs are written (default {DEFAULT_OUTPUT_DIR})")
    parser.add_argument("--no-progress", action="store_true", help="do not show progress bars")
    parser.add_argument("--traceback", action="store_true", help="print the full traceback on errors")
    return parser


def _absolute(path: str) -> str:
    return str(Path(path).expanduser().resolve())


def _short(value: Any, limit: int = 200) -> str:
    """A ui dict entry as one line, cut so long loss histories do not flood the terminal."""
    text = json.dumps(value, default=str)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _print_summary(results: ExecutionResults, graph: Mapping[str, dict], seconds: float) -> None:
    print(f"done: {len(results.order)} node(s) in {seconds:.1f} s")
    for node_id, ui in results.ui.items():
        title = (graph[node_id].get("_meta") or {}).get("title") or graph[node_id]["class_type"]
        print(f"  node {node_id} ({title}): {_short(ui)}")


def _report(exc: BaseException, show_traceback: bool) -> None:
    if show_traceback:
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    print(f"error: {exc}", file=sys.stderr)


def _models_dir_hint(models_dir: str) -> str:
    """Where model files were looked up, and what was (not) there."""
    root = Path(models_dir)
    layout = "laid out like ComfyUI's models/ (diffusion_models/, diffusers/, ...)"
    if not root.is_dir():
        return f"note: the models folder '{root}' does not exist; pass --models-dir DIR, a folder {layout}"
    if not any(root.iterdir()):
        return f"note: the models folder '{root}' is empty; put the model files there, {layout}, or pass --models-dir"
    found = ", ".join(sorted(p.name + "/" for p in root.iterdir() if p.is_dir())) or "no sub-folders"
    return f"note: model files are looked up in '{root}' ({found}); it must be {layout}"


def find_workflow(given: str) -> Path:
    """The file ``lowvram-lora run WORKFLOW`` means: the path as given if it exists; else a shipped template by
    name (``demo_tiny_lora``, ``demo_tiny_lora.json``, ``api/demo_tiny_lora``), so an installed package runs its
    templates from anywhere; else a path into the old ``workflows/`` folder, found where the templates moved
    (``example_workflows/``, ComfyUI's folder for a pack's templates) with a note saying so."""
    path = Path(given).expanduser()
    if path.exists():
        return path
    from .templates import OLD_WORKFLOWS_DIRNAME, SHIPPED, WORKFLOWS_DIR

    name = given if given.endswith(".json") else given + ".json"
    if name in {f"{prefix}{n}.json" for n in SHIPPED for prefix in ("", "api/")}:
        return WORKFLOWS_DIR / name
    parts = path.parts
    if OLD_WORKFLOWS_DIRNAME in parts:
        rest = parts[len(parts) - parts[::-1].index(OLD_WORKFLOWS_DIRNAME):]
        moved = WORKFLOWS_DIR.joinpath(*rest) if rest else None
        if moved is not None and moved.is_file():
            rel = "/".join(rest)
            print(f"note: the templates moved from {OLD_WORKFLOWS_DIRNAME}/ to {WORKFLOWS_DIR.name}/; running "
                  f"{moved} (name it as {WORKFLOWS_DIR.name}/{rel}, or just {rel.removesuffix('.json')})",
                  file=sys.stderr)
            return moved
    raise WorkflowError(f"cannot read workflow {given}: no such file. Fix: check the path, or name a shipped "
                        f"template (lowvram-lora run demo_tiny_lora): {', '.join(SHIPPED)}")


def _prepare(args: argparse.Namespace, node_class_mappings: Mapping[str, type],
             display_names: Mapping[str, str] | None) -> dict[str, dict]:
    """Load, convert, apply ``--set`` overrides, then validate (so an override can repair the file)."""
    workflow = load_workflow(find_workflow(args.workflow))
    return to_api_graph(workflow, node_class_mappings, display_names, overrides=getattr(args, "overrides", None) or [])


@contextlib.contextmanager
def _graceful_ctrl_c():
    """The first Ctrl-C asks the engine to stop after the current step (it saves a resumable
    state, then unwinds with KeyboardInterrupt); a second one stops at once, as usual."""
    from ..engine.callbacks import CTRL_C

    def on_sigint(signum, frame):
        if CTRL_C.requested:
            raise KeyboardInterrupt
        CTRL_C.request()
        print("\nCtrl-C: stopping after the current step and saving the training state "
              "(press Ctrl-C again to stop at once)", file=sys.stderr, flush=True)

    CTRL_C.reset()
    try:
        previous = signal.signal(signal.SIGINT, on_sigint)
    except ValueError:  # not the main thread: leave Ctrl-C as it is
        previous = None
    try:
        yield
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
        CTRL_C.reset()


def run_workflow_command(
    args: argparse.Namespace,
    node_class_mappings: Mapping[str, type],
    configure_dirs: ConfigureDirs | None = None,
    display_names: Mapping[str, str] | None = None,
) -> int:
    """Run the workflow named by ``args``; returns the exit code (0 ok, 1 failed, 130 interrupted).

    ``configure_dirs`` is called with the absolute models and output folders before
    the workflow is validated (combo inputs list files from them); ``display_names`` (``NODE_DISPLAY_NAME_MAPPINGS``) titles
    nodes saved without a title.
    """
    show_traceback = bool(getattr(args, "traceback", False))
    try:
        # Folders first: combo inputs list the files found there, and validation checks them.
        if configure_dirs is not None:
            configure_dirs(_absolute(getattr(args, "models_dir", DEFAULT_MODELS_DIR)),
                           _absolute(getattr(args, "output_dir", DEFAULT_OUTPUT_DIR)))
        graph = _prepare(args, node_class_mappings, display_names)
        start = time.perf_counter()
        with _graceful_ctrl_c():
            results = execute_graph(graph, node_class_mappings, progress=not getattr(args, "no_progress", False))
    except KeyboardInterrupt:
        print("interrupted: nothing finished is lost (caches are written atomically; if training had "
              "started, its progress up to the last finished step is saved under the output folder's "
              "lowvram_cache/resume/); run the same command again to resume", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (WorkflowError, NodeExecutionError) as exc:
        _report(exc, show_traceback)
        if isinstance(exc, WorkflowError) and exc.missing_choice and configure_dirs is not None:
            print(_models_dir_hint(_absolute(getattr(args, "models_dir", DEFAULT_MODELS_DIR))), file=sys.stderr)
        return EXIT_FAILED
    _print_summary(results, graph, time.perf_counter() - start)
    return EXIT_OK


__all__ = ["add_run_parser", "run_workflow_command", "find_workflow", "DEFAULT_MODELS_DIR", "DEFAULT_OUTPUT_DIR"]
