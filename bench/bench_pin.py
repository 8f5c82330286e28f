"""How fast host memory is page-locked, by the ways the engine could do it (one GPU):

    python3 bench/bench_pin.py --gb 16 --piece-gb 0.34 --threads 1 4 16 --out bench/results.jsonl

Why: an offloaded run pins all its host buffers before its first step (Wan 2.2 A14B at 832x480x81, 8 GB: 14.1 GB of
blocks and 40.9 GB of activation buffers, 31-40 s of its start-up on 2x H200, 2026-11-28). Modes, each on
``--gb`` GB in pieces of ``--piece-gb`` (an activation buffer per block is about 0.34 GB there):

- ``register``: ``torch.empty`` then ``cudaHostRegister`` (the engine before bench_pin: the driver faults the pages
  in, in one thread);
- ``zero-register-tN``: the same with the pages faulted in first by ``zero_`` on N torch threads;
- ``engine-tN``: the engine's own ``engine/offload/host._register`` on N torch threads;
- ``cuda-host-alloc``: ``torch.empty(pin_memory=True)`` (torch's pinned allocator, for reference).

Each row: seconds and GB/s to pin, and a host->GPU copy from the pinned pieces (GB/s: a pinned buffer copies at the
link's speed, a pageable one at a fraction; the check that the pages really are locked), the process's host RAM
after (RSS) and the bytes pinned. Everything is freed between modes.
"""
from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

GB = 1e9


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gb", type=float, default=16.0, help="host memory pinned per mode")
    p.add_argument("--piece-gb", type=float, default=0.34, help="size of each buffer")
    p.add_argument("--threads", type=int, nargs="+", default=[1, 4, 16], help="torch CPU threads for the "
                   "modes that fault the pages in first")
    p.add_argument("--modes", nargs="+", default=["register", "zero-register", "engine", "cuda-host-alloc"])
    p.add_argument("--out", default="bench/results.jsonl")
    p.add_argument("--note", default="")
    return p.parse_args(argv)


def _register(t: torch.Tensor) -> None:
    err = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), t.numel(), 0))
    if err:
        raise RuntimeError(f"cudaHostRegister failed: cudaError {err}")


def _pin(mode: str, sizes: list[int]) -> tuple[list[torch.Tensor], bool]:
    """The pieces, pinned the mode's way; whether they must be unregistered."""
    if mode == "cuda-host-alloc":
        return [torch.empty(n, dtype=torch.uint8, pin_memory=True) for n in sizes], False
    if mode == "engine":
        from lowvram_lora.engine.offload.host import _register as engine_register

        out = [torch.empty(n, dtype=torch.uint8) for n in sizes]
        for t in out:
            assert engine_register(t)
        return out, True
    out = [torch.empty(n, dtype=torch.uint8) for n in sizes]
    for t in out:
        if mode == "zero-register":
            t.zero_()
        _register(t)
    return out, True


def _copy_gbps(pieces: list[torch.Tensor], device: torch.device) -> float:
    """host->GPU GB/s from the first pieces (up to 4 GB), each copied to one device buffer."""
    use, total = [], 0
    for t in pieces:
        if total >= 4 * GB:
            break
        use.append(t)
        total += t.numel()
    dst = torch.empty(max(t.numel() for t in use), dtype=torch.uint8, device=device)
    dst[: use[0].numel()].copy_(use[0], non_blocking=True)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for t in use:
        dst[: t.numel()].copy_(t, non_blocking=True)
    torch.cuda.synchronize(device)
    return total / GB / (time.perf_counter() - start)


def main(argv=None) -> int:
    from lowvram_lora.engine.offload.hostmem import process_memory
    from train_bench import _command, _gpu_name, _versions, new_run_id, row_emitter

    args = parse_args(argv)
    device = torch.device("cuda:0")
    torch.cuda.init()
    piece = int(args.piece_gb * GB)
    sizes = [piece] * max(1, int(args.gb * GB) // piece)
    emit = row_emitter(Path(args.out), {"run_id": new_run_id(), "bench": "pin", "gpu": _gpu_name(device),
                                        **_versions(), "command": _command(), "note": args.note})
    default_threads = torch.get_num_threads()
    runs = []
    for mode in args.modes:
        for n in (args.threads if mode in ("zero-register", "engine") else [default_threads]):
            runs.append((mode, n))
    for mode, n in runs:
        torch.set_num_threads(n)
        gc.collect()
        base = process_memory()
        start = time.perf_counter()
        pieces, registered = _pin(mode, sizes)
        pin_s = time.perf_counter() - start
        after = process_memory()
        total = sum(sizes)
        gbps = _copy_gbps(pieces, device)
        if registered:
            for t in pieces:
                torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
        del pieces
        gc.collect()
        torch._C._host_emptyCache()  # cuda-host-alloc's pages go back, not into torch's pinned cache
        torch.cuda.synchronize(device)
        name = mode if mode in ("register", "cuda-host-alloc") else f"{mode}-t{n}"
        emit({"mode": name, "threads": n, "pinned_gb": round(total / GB, 3), "pieces": len(sizes),
              "pin_s": round(pin_s, 3), "pin_gbps": round(total / GB / pin_s, 3), "copy_gbps": round(gbps, 2),
              "host_rss_gb": round(after.rss / GB, 3), "host_rss_added_gb": round((after.rss - base.rss) / GB, 3),
              "pinned_host_gb": round(total / GB, 3), "peak_alloc_gb": round(
                  torch.cuda.max_memory_allocated(device) / GB, 3)})
    torch.set_num_threads(default_threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
