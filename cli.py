"""Command line: ``lowvram-lora demo`` (and ``python -m lowvram_lora ...``)."""
from __future__ import annotations

import argparse
import os
import sys


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lowvram-lora", description="Low-VRAM LoRA training for Flux.")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("demo", help="train a LoRA on a tiny Flux.1 model on CPU (about a minute)")
    demo.add_argument("--dir", default="demo_output", help="where the tiny model, data and outputs go")
    demo.add_argument("--steps", type=int, default=30)
    return parser


def main(argv: list[str] | None = None) -> int:
    # We never reach a hub: every model comes from local files.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    args = _build_parser().parse_args(argv)
    try:
        if args.command == "demo":
            from .demo import run_demo

            run_demo(args.dir, args.steps)
            return 0
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # user-facing errors: one clear line, no traceback
        from .engine.errors import LowVRAMError

        if isinstance(exc, LowVRAMError):
            print(f"error: {exc}", file=sys.stderr)
            return 1
        raise
    return 0
