"""``lowvram-lora slab ...``: build and check slabs (int8, or int4 with ``--bits 4``) from the command line.

    lowvram-lora slab build models/diffusion_models/flux1-dev.safetensors -o models/slabs/
    lowvram-lora slab build models/diffusion_models/flux1-dev.safetensors -o models/slabs/ --bits 4
    lowvram-lora slab verify models/slabs/flux1-dev-3f2a9c1b0d4e.slab.safetensors --full

cli.py wires it in: ``add_slab_parser(subparsers)`` and, for ``args.command == "slab"``,
``return run_slab_command(args)``.
"""
from __future__ import annotations

import argparse
import sys


def add_slab_parser(subparsers) -> None:
    slab = subparsers.add_parser("slab", help="build or check a slab (a checkpoint quantized once for training: int8, or int4)")
    sub = slab.add_subparsers(dest="slab_command", required=True)
    build = sub.add_parser(
        "build", help="quantize a checkpoint into a slab (streams tensor by tensor; RAM stays small)",
        description="CHECKPOINT: a single .safetensors file with BFL names (bf16/fp16/fp32/fp8, as in "
                    "ComfyUI's models/diffusion_models/) or a diffusers folder (pipeline or transformer/).",
    )
    build.add_argument("checkpoint", help="single-file checkpoint or diffusers folder")
    build.add_argument("-o", "--output", required=True,
                       help="slab file (*.slab.safetensors) or a folder to put it in, named after the checkpoint")
    build.add_argument("--family", default="auto", help="model family id (default: detect from the files)")
    build.add_argument("--bits", type=int, default=8, choices=(8, 4),
                       help="8 (default): int8 rows, ~0.9%% weight error, 1 byte per weight. 4: int4 groups of 64 "
                            "(fp16 scale and min each), ~8%% weight error, 0.56 byte per weight: half the host RAM "
                            "and bytes streamed of int8 (docs/int4.md has the quality table)")
    build.add_argument("--quiet", action="store_true", help="no progress bar")
    build.add_argument("--force", action="store_true",
                       help="replace an existing file at the output path (never the source checkpoint)")
    verify = sub.add_parser("verify", help="check a slab against its manifest")
    verify.add_argument("slab", help="the .slab.safetensors file")
    verify.add_argument("--full", action="store_true",
                        help="re-hash every tensor even if the file is unchanged since its last full check")


def run_slab_command(args: argparse.Namespace) -> int:
    from .engine.errors import LowVRAMError

    try:
        if args.slab_command == "build":
            return _build(args)
        if args.slab_command == "verify":
            return _verify(args)
    except LowVRAMError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"error: unknown slab command {args.slab_command!r}; choose build or verify", file=sys.stderr)
    return 2


def _build(args) -> int:
    import time

    from .engine.slab import build_slab, manifest_path_for, verify_slab

    start = time.perf_counter()
    path = build_slab(args.checkpoint, args.output, family=args.family, progress=not args.quiet,
                      overwrite=args.force, bits=args.bits)
    summary = verify_slab(path)["summary"]
    print(f"slab: {path}\nmanifest: {manifest_path_for(path)}\n"
          f"{summary['bytes'] / 1e9:.2f} GB, {summary['quantized_linears']} int{args.bits} Linears, "
          f"quantization error (relative Frobenius) mean {summary['mean_rel_error']:.4%}, "
          f"max {summary['max_rel_error']:.4%}; {time.perf_counter() - start:.1f} s")
    return 0


def _verify(args) -> int:
    import time

    from .engine.slab import verify_slab
    from .engine.slab.load import last_check

    already = not args.full and last_check(args.slab) == "full"
    start = time.perf_counter()
    manifest = verify_slab(args.slab, "full" if args.full else "changed")
    how = ("size and header checked; every tensor hash matched at its last full check and the file is unchanged "
           "since (size, mtime, inode); --full re-hashes" if already
           else f"every tensor hash checked in {time.perf_counter() - start:.1f} s")
    print(f"ok: {args.slab} ({manifest['family']} {manifest['variant']}, {how})")
    return 0
