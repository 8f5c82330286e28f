"""The disk tier (engine/offload/disk.py) on the GPU machine: the slab disk's read rate (O_DIRECT, page cache cold
and warm), then training of one mid-size Flux.1 slab with every streamed block in pinned RAM against most of them
read from disk at each load (at the disk's own rate, and paced to an emulated NVMe), each mode in its own process:
s/step, peak VRAM, host RSS (anonymous = pinned + heap, file = mapped slab pages) and pinned bytes, disk bytes and
disk wait per step. Rows go to bench/results.jsonl (``--out``).

    source bench/gpu_env.sh && python3 bench/bench_disk_tier.py --root /tmp/disk_bench --out $OUT/disk.jsonl
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SHAPE = {"num_layers": 1, "num_single_layers": 8}  # Flux.1-dev widths (3072), fewer blocks: a 1.5 GB slab


def proc_status() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem", "VmHWM"):
                out[key] = round(int(rest.split()[0]) * 1024 / 1e9, 3)
    return out


def build(root: Path) -> Path:
    from lowvram_lora.engine.families import get_family
    from lowvram_lora.engine.slab import build_slab
    from lowvram_lora.engine.slab.testing import write_random_checkpoint

    slab = root / "mid.slab.safetensors"
    if slab.exists():
        return slab
    import torch

    from lowvram_lora.engine.slab import testing

    def gpu_random(name, shape, dtype, seed=0, std=0.02):  # the CPU generator takes a minute for 1.5B weights
        g = torch.Generator(device="cuda").manual_seed(testing._seed(name, seed))
        return (torch.randn(shape, generator=g, device="cuda") * std).to(dtype).cpu()

    testing.random_tensor = gpu_random
    family = get_family("flux1")
    cfg = dict(family.load_config("flux1-dev"), **SHAPE)
    t0 = time.perf_counter()
    ckpt = write_random_checkpoint(root / "ckpt", "flux1", config=cfg, layout="diffusers")
    build_slab(ckpt, slab, progress=False)
    print(f"built {slab} ({slab.stat().st_size / 1e9:.2f} GB) in {time.perf_counter() - t0:.1f} s", flush=True)
    for f in (root / "ckpt").iterdir():
        f.unlink()
    return slab


def rates(slab: Path) -> dict:
    from lowvram_lora.engine.offload.disk import filesystem_of, probe_disk_bytes_per_s

    direct, used = probe_disk_bytes_per_s(slab, 1 << 30, direct=True)
    cold, _ = probe_disk_bytes_per_s(slab, 1 << 30, direct=False)
    with open(slab, "rb", buffering=0) as f:  # warm: the whole file into the page cache, then timed again
        buf = bytearray(16 << 20)
        for _ in range(2):
            t0, n = time.perf_counter(), 0
            f.seek(0)
            while True:
                got = f.readinto(buf)
                if not got:
                    break
                n += got
            warm = n / (time.perf_counter() - t0)
    if hasattr(os, "posix_fadvise"):
        fd = os.open(slab, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    dev, fs = filesystem_of(slab)
    return {"o_direct_gbps": round(direct / 1e9, 2) if used else None, "page_cache_cold_gbps": round(cold / 1e9, 2),
            "page_cache_warm_1thread_gbps": round(warm / 1e9, 2), "device": dev, "filesystem": fs}


def train_one(slab: Path, disk: int, steps: int, side: int) -> dict:
    """One mode, in this process: returns its row."""
    import torch

    from lowvram_lora.engine.attention import training_attention
    from lowvram_lora.engine.config import LoraSettings
    from lowvram_lora.engine.families import get_family
    from lowvram_lora.engine.offload import OffloadConfig, Workload, build_plan
    from lowvram_lora.engine.offload.disk import disk_rate_for
    from lowvram_lora.engine.offload.plan import with_disk_blocks
    from lowvram_lora.engine.offload.footprint import measure_footprint
    from lowvram_lora.engine.offload.plan import with_step_time
    from lowvram_lora.engine.offload.link import resolve_machine
    from lowvram_lora.engine.offload.streamer import apply_offload
    from lowvram_lora.engine.slab import load_slab_transformer
    from lowvram_lora.engine.train.lora_attach import attach_lora

    family, dev = get_family("flux1"), torch.device("cuda")
    before = proc_status()
    model = load_slab_transformer(slab, torch.bfloat16, verify="quick")[0]
    loaded = proc_status()
    model.enable_gradient_checkpointing()
    params = attach_lora(model, family, LoraSettings(rank=16, alpha=16), seed=0)
    cfg = model.config
    tokens, text = (side // 16) ** 2, 256
    plan = build_plan(measure_footprint(model, family), Workload(1, tokens, text), (), 2, False)
    with_disk_blocks(plan, plan.streamed[len(plan.streamed) - disk:] if disk else [])
    with_step_time(plan, resolve_machine(dev))
    logs = []

    class CB:
        def on_progress(self, *a):
            pass

        def log(self, m):
            logs.append(m)
            print(m, flush=True)

    handle = apply_offload(model, family, OffloadConfig(mode="stream"), dev, CB(), plan=plan)
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    g = torch.Generator().manual_seed(0)
    lat = torch.randn(1, cfg.in_channels // 4, side // 8, side // 8, generator=g).to(dev, torch.bfloat16)
    emb = {"prompt_embeds": torch.randn(1, text, cfg.joint_attention_dim, generator=g).to(dev, torch.bfloat16),
           "pooled_prompt_embeds": torch.randn(1, cfg.pooled_projection_dim, generator=g).to(dev, torch.bfloat16)}
    target = torch.randn(1, tokens, cfg.in_channels, generator=g).to(dev)
    torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    model.train()
    with training_attention(dev), torch.autocast("cuda", dtype=torch.bfloat16):
        for _ in range(steps):
            t0 = time.perf_counter()
            inp = family.model_inputs(model, lat, emb, torch.tensor([0.5], device=dev), 1.0)
            loss = torch.nn.functional.mse_loss(model(**inp)[0].float(), target)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            handle.end_step()  # synchronises
            times.append(time.perf_counter() - t0)
            losses.append(loss.item())
    trained = proc_status()
    stats = handle.stats()
    pinned = sum(hb.nbytes for hb in handle._hosts.values() if getattr(hb, "pinned", False)) + (
        handle.disk.nbytes if handle.disk is not None else 0)
    row = {
        "disk_blocks": len(plan.disk_blocks), "streamed_blocks": len(plan.streamed), "staging_slots": plan.staging_slots,
        "s_per_step": round(statistics.median(times[2:]), 4), "step_times": [round(t, 4) for t in times],
        "losses": [round(x, 6) for x in losses],
        "peak_vram_gb": round(torch.cuda.max_memory_allocated() / 1e9, 3),
        "pinned_gb_measured": round(pinned / 1e9, 3), "pinned_gb_plan": round(plan.pinned_host_bytes / 1e9, 3),
        "rss_before_load": before, "rss_after_load": loaded, "rss_after_steps": trained,
        "host_ram_gb_measured": trained["RssAnon"], "disk_gb_per_step_plan": round(plan.disk_bytes_per_step / 1e9, 3),
        "step_disk_gb": [round(b / 1e9, 3) for b in stats.get("step_disk_bytes", [])],
        "step_disk_wait_s": stats.get("step_disk_wait_s", []), "step_copy_stall_s": stats["step_stall_s"],
        "disk_stats": {k: v for k, v in stats.items() if k.startswith(("disk_", "staging"))},
        "link_gbps": round(plan.machine.link_bytes_per_s / 1e9, 2),
        "disk_rate_gbps": round(disk_rate_for(slab) / 1e9, 2) if disk else None,
        "emulated_disk_gbps": os.environ.get("LOWVRAM_EMULATE_DISK_GBPS") or None,
        "log": [m for m in logs if "disk" in m or "warning" in m],
    }
    handle.remove()
    return row


def cpu_rss(root: Path, disk: int) -> None:
    """Host RSS of RAM streaming against the disk tier on the CPU (synchronous copies stand in for CUDA), each in its
    own process, on a smaller slab built with the CPU generator: what the loader's map, the host copies and the
    staging ring cost, without a GPU."""
    if disk < 0:
        import torch

        from lowvram_lora.engine.families import get_family
        from lowvram_lora.engine.slab import build_slab
        from lowvram_lora.engine.slab.testing import write_random_checkpoint

        family = get_family("flux1")
        slab = root / "small.slab.safetensors"
        if not slab.exists():
            cfg = dict(family.load_config("flux1-dev"), num_layers=2, num_single_layers=6, num_attention_heads=8,
                       attention_head_dim=128)
            build_slab(write_random_checkpoint(root / "ckpt_small", "flux1", config=cfg, layout="diffusers"), slab,
                       progress=False)
        for count in (0, 6):
            proc = subprocess.run([sys.executable, __file__, "--root", str(root), "--cpu-rss", str(count)],
                                  capture_output=True, text=True)
            print(proc.stdout.strip() or proc.stderr[-3000:], flush=True)
        return
    import torch

    from lowvram_lora.engine.families import get_family
    from lowvram_lora.engine.offload import OffloadConfig, Workload, build_plan
    from lowvram_lora.engine.offload.disk import with_disk_blocks
    from lowvram_lora.engine.offload.footprint import measure_footprint
    from lowvram_lora.engine.offload.streamer import InlineCopyEngine, apply_offload
    from lowvram_lora.engine.slab import load_slab_transformer

    family, slab = get_family("flux1"), root / "small.slab.safetensors"
    model = load_slab_transformer(slab, torch.bfloat16, verify="quick")[0]
    model.enable_gradient_checkpointing()
    loaded = proc_status()
    plan = build_plan(measure_footprint(model, family), Workload(1, 1024, 64), (), 1, False)
    with_disk_blocks(plan, plan.streamed[len(plan.streamed) - disk:] if disk else [], 2)
    handle = apply_offload(model, family, OffloadConfig(mode="stream"), torch.device("cpu"), plan=plan,
                           _engine_factory=InlineCopyEngine)
    print("CPU_RSS " + json.dumps({"slab_gb": round(slab.stat().st_size / 1e9, 3), "disk_blocks": disk,
                                   "blocks": len(plan.streamed), "after_load": loaded, "after_apply": proc_status(),
                                   "map_released_gb": round(handle.map_released / 1e9, 3),
                                   "host_copies_gb": round(plan.pinned_host_bytes / 1e9, 3)}), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", type=Path, default=Path("/tmp/disk_bench"))
    ap.add_argument("--out", type=Path, default=Path("bench/results.jsonl"))
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--side", type=int, default=1024)
    ap.add_argument("--disk", type=int, default=7, help="blocks read from disk (of 9)")
    ap.add_argument("--emulate", default="3.5", help="also run the disk mode paced to this many GB/s ('' to skip)")
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)  # child: "disk_count"
    ap.add_argument("--cpu-rss", type=int, default=None, help="-1: host RSS of RAM vs disk streaming on the CPU")
    args = ap.parse_args()
    if args.cpu_rss is not None:
        args.root.mkdir(parents=True, exist_ok=True)
        cpu_rss(args.root, args.cpu_rss)
        return
    if args.one:
        print("CHILD " + json.dumps(train_one(args.root / "mid.slab.safetensors", int(args.one), args.steps,
                                              args.side)), flush=True)
        return
    import torch

    args.root.mkdir(parents=True, exist_ok=True)
    slab = build(args.root)
    disk_rates = rates(slab)
    print("RATES", json.dumps(disk_rates), flush=True)
    base = {"bench": "disk_tier", "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "model": f"flux1-dev widths, {SHAPE}, int8 slab {slab.stat().st_size / 1e9:.2f} GB",
            "resolution": f"{args.side}x{args.side}", "rates": disk_rates,
            "command": " ".join(sys.argv)}
    modes = [("ram", 0, None), ("disk", args.disk, None)] + ([("disk", args.disk, args.emulate)] if args.emulate else [])
    with args.out.open("a") as out:
        for name, count, emulate in modes:
            env = dict(os.environ, PYTHONUNBUFFERED="1")
            env.pop("LOWVRAM_EMULATE_DISK_GBPS", None)
            if emulate:
                env["LOWVRAM_EMULATE_DISK_GBPS"] = emulate
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, __file__, "--root", str(args.root), "--steps", str(args.steps),
                                   "--side", str(args.side), "--one", str(count)], env=env, capture_output=True,
                                  text=True)
            child = [l for l in proc.stdout.splitlines() if l.startswith("CHILD ")]
            if proc.returncode or not child:
                print(proc.stdout[-3000:], proc.stderr[-5000:], flush=True)
                continue
            row = {"date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **base, "mode": name,
                   **json.loads(child[0][6:]), "wall_s": round(time.perf_counter() - t0, 1)}
            out.write(json.dumps(row) + "\n")
            out.flush()
            print("ROW", json.dumps({k: v for k, v in row.items() if k not in ("step_times", "losses", "command",
                                                                              "rates", "log")}), flush=True)
            print("\n".join(row["log"]), flush=True)


if __name__ == "__main__":
    main()
