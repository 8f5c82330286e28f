"""train_lora: the LoRA training loop.

bf16 frozen base (fp32 on CPU), fp32 LoRA weights under autocast, AdamW,
constant or cosine schedule with warmup, gradient clipping and accumulation,
gradient checkpointing, and a callback that sees every step and may stop it.
Weights are all resident on one device, or, with an ``OffloadConfig`` that
streams, the transformer blocks stream from pinned host memory
(``engine/offload``): the model is loaded on the CPU, LoRA attached there, and
``apply_offload`` moves LoRA and the non-block modules to the GPU.
"""
from __future__ import annotations

import contextlib
import math
import time

import torch

from ..caching import DatasetCache
from ..callbacks import StepInfo, TrainingCallback
from ..checkpoint import identify
from ..config import LoraSettings, ModelConfig, TrainConfig
from ..errors import ConfigError, StorageError, TrainingDivergedError
from ..models import load_transformer, resolve_device, resolve_dtype
from ..models.dtypes import release_device_memory
from ..offload import OffloadConfig
from ..offload.streamer import cap_allocator
from .batching import bucket_batches, micro_generator
from .flow_matching import noisy_latents_and_target, sample_sigmas
from .grad_mode import autograd_enabled, autograd_safe_tensor, make_autograd_safe
from .lora_attach import attach_lora, detach_lora, lora_state_dict, skip_lora_input_cast
from .optimizers import check_optimizer, lora_bytes_per_param, make_optimizer
from .resume import ResumeStore, RngSnapshot
from .step_timing import StepTimer
from .step_timing import describe as describe_step
from ..lora_io.trained import TrainedLora


def _attention_backends(device: torch.device):
    """cuDNN's SDPA backward fails under gradient checkpointing on torch 2.11 + H100
    (illegal memory access): train with flash / memory-efficient / math only. Scoped
    to training rather than a process-wide flag."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def _make_scheduler(optimizer, cfg: TrainConfig):
    from diffusers.optimization import get_scheduler

    name = "constant_with_warmup" if cfg.lr_scheduler == "constant" else "cosine"
    return get_scheduler(name, optimizer, num_warmup_steps=cfg.warmup_steps, num_training_steps=cfg.steps)


def _load_batch(dataset: DatasetCache, batch, device, dtype, rng: torch.Generator):
    latents, texts = [], []
    for item in batch:
        flipped = dataset.flip and bool(torch.randint(0, 2, (1,), generator=rng).item())
        lat, emb = dataset.load_item(item, flipped)
        latents.append(autograd_safe_tensor(lat))
        texts.append({k: autograd_safe_tensor(v) for k, v in emb.items()})
    lat = torch.stack(latents).to(device, dtype)  # (B, C, ...)
    embeds = dataset.collate_text(texts)  # variable-length captions padded, with their masks
    return lat, {k: v.to(device, dtype) if v.is_floating_point() else v.to(device) for k, v in embeds.items()}


def train_lora(
    model_cfg: ModelConfig,
    dataset: DatasetCache,
    lora: LoraSettings,
    train: TrainConfig,
    callback: TrainingCallback | None = None,
    preloaded: tuple | None = None,
    offload: OffloadConfig | None = None,
    resume: ResumeStore | None = None,
    split=None,
    ranks=None,
    sampling=None,
    sample_dir=None,
) -> TrainedLora:
    """Train a LoRA on ``dataset`` and return its weights. ``preloaded`` = (model,
    family, variant) skips loading (benchmarks build a random full-size model).
    ``offload``: None or mode='resident' keeps every weight on the device (as before);
    'stream' / 'auto' stream blocks through the GPU (CUDA only). A preloaded model is
    left where it was found. ``resume`` (engine/train/resume.py) continues from the run's
    latest saved state, saves one every ``save_every`` steps and when stopped.
    ``split`` (engine/parallel/config.ParallelConfig, mode 'split'): the blocks are cut across two
    devices, each part planned and streamed per ``offload`` within its own budget.
    ``ranks`` (engine/parallel/data_parallel.Ranks): this process is one rank of data-parallel
    training: it takes its share of the batches and averages LoRA gradients with the others; only
    rank 0 saves training states.
    ``sampling`` (engine/sampling.SamplingConfig): sample the dataset's sample prompts at checkpoints,
    grids written to ``sample_dir`` (rank 0 only); the time is kept out of the step times.

    Runs with autograd on even when called under ``torch.inference_mode()`` (ComfyUI
    runs every node that way); the returned weights are ordinary tensors."""
    with autograd_enabled():
        return _train_lora(model_cfg, dataset, lora, train, callback, preloaded, offload, resume, split, ranks,
                           sampling, sample_dir)


def _train_lora(model_cfg, dataset, lora, train, callback, preloaded, offload, resume, split, ranks, sampling,
                sample_dir) -> TrainedLora:
    from ..parallel.data_parallel import Ranks

    cb = callback or TrainingCallback()
    ranks = ranks or Ranks()
    device = torch.device(split.devices[0]) if split is not None else resolve_device(train.device)
    dtype = resolve_dtype(model_cfg.dtype, device)
    check_optimizer(train, device)
    if offload is not None and offload.optimizer_on_host and train.optimizer != "adamw":
        raise ConfigError(f"optimizer_on_host keeps AdamW's fp32 moments on the host; optimizer={train.optimizer!r} "
                          f"keeps its 8-bit moments on the GPU. Use one or the other")
    _check_int8_compute(offload, device)
    # What the process holds on the GPU before training (ComfyUI's other models): the budget cap comes on top.
    held_before = torch.cuda.memory_reserved(device) if device.type == "cuda" else 0
    streaming = offload is not None and offload.streams
    if split is not None:
        from ..parallel.split import check_split_devices

        check_split_devices(split, offload)
        offload = offload or OffloadConfig(mode="resident")
        if offload.mode == "auto" and device.type != "cuda":
            cb.log("offload mode 'auto' on the CPU: both parts of the split stay resident")
            offload = OffloadConfig(mode="resident", gradient_checkpointing=True)
        streaming = False  # each part is placed (and streamed) by engine/parallel/split.py
    if streaming and offload.mode == "auto" and device.type != "cuda":
        # auto means "choose for me": on a CPU the only choice is resident (an explicit
        # mode='stream' still gets require_cuda's error below).
        cb.log("offload mode 'auto' on the CPU: every weight stays resident (streaming needs a CUDA GPU)")
        streaming = False
    # Checkpointing is a memory setting: it lives in OffloadConfig only (on by default).
    checkpointing = offload.gradient_checkpointing if offload is not None else True
    if streaming:
        from ..offload.streamer import require_cuda

        require_cuda(offload, device)
    if preloaded is None:
        # Identified once (memoized per file state: the Load node's identity is this one); the cache and
        # the plan are checked against it before minutes of loading.
        ident = identify(model_cfg.transformer_path, model_cfg.family)
        if ident.family is not None:
            dataset.check_fits(ident.family, ident.config)
        if streaming:
            _check_plan_before_loading(ident, model_cfg.family, dataset, lora, train, offload, device, dtype)
        model, family, _, variant = load_transformer(ident, model_cfg.family, dtype)
    else:
        model, family, variant = preloaded
    if device.type == "cuda":  # the model's own tensors already there count in the plan, not as held
        from itertools import chain

        index = device.index if device.index is not None else torch.cuda.current_device()
        held_before -= sum(t.numel() * t.element_size() for t in chain(model.parameters(), model.buffers())
                           if t.is_cuda and t.get_device() == index)
        held_before = max(0, held_before)
    if make_autograd_safe(model):  # built under inference mode (e.g. by an earlier ComfyUI node)
        cb.log("the base model was created under torch.inference_mode(); training on an ordinary copy")
    _apply_int8_compute(model, offload, device, cb)
    dataset.check_fits(family, dict(model.config))  # slabs and preloaded models: checked once loaded
    handle = None
    if split is not None:
        handle, params = _place_split(model, family, variant, dataset, lora, train, offload, split, cb)
    elif streaming:
        from ..offload.footprint import lora_param_count, measure_footprint
        from ..offload.streamer import apply_offload

        # Plan before touching the model: a refused plan leaves a preloaded model as it was.
        fp = measure_footprint(model, family, f"{family.display_name} ({variant})",
                               trainable_params=lora_param_count(model, family, lora))
        plan = _plan(fp, family, variant, dataset, train, offload, device)
        model.enable_gradient_checkpointing()
        params = attach_lora(model, family, lora, train.seed)  # fp32, wherever the blocks are (CPU)
        try:
            handle = apply_offload(model, family, offload, device, cb, plan=plan)
        except BaseException:
            detach_lora(model)
            model.disable_gradient_checkpointing()
            raise
    else:
        model.to(device)
        if checkpointing:
            model.enable_gradient_checkpointing()
        params = attach_lora(model, family, lora, train.seed)
        model.to(device)
    from ..offload.recompute import install_chunked_recompute

    chunks, host_moments, micro_batch = _memory_options(handle, offload, split, device)
    recompute = install_chunked_recompute(model, family, chunks)  # undone in the finally below
    if chunks > 1:
        cb.log(f"finer recompute: token-wise block parts in {chunks} checkpointed chunks")
    compiled = _compile_blocks(model, family, offload, train, device, split, cb, handle)  # undone in the finally
    optimizer = make_optimizer(params, train, host_moments)
    scheduler = _make_scheduler(optimizer, train)

    # Every rank builds the same seed-determined stream and takes its share (all of it in one process).
    batches = ranks.shard(bucket_batches(dataset.training_items(), train.batch_size, train.seed,
                                         lambda it: it.bucket))
    use_autocast = device.type == "cuda" and dtype != torch.float32
    autocast = torch.autocast("cuda", dtype=dtype) if use_autocast else contextlib.nullcontext()
    if use_autocast:
        skip_lora_input_cast(model)
    devices = handle.devices if split is not None else (device,)
    if device.type == "cuda":
        for d in devices:
            torch.cuda.reset_peak_memory_stats(d)

    result = TrainedLora(
        state_dict={}, rank=lora.rank, alpha=lora.alpha, family=family.id, variant=variant, steps=0,
        requested_steps=train.steps, dataset_hash=dataset.dataset_hash, base_model=str(model_cfg.transformer_path),
        settings={"lora": vars(lora), "train": vars(train),
                  **({"offload": vars(offload)} if offload is not None else {})},
        model_config={k: v for k, v in dict(model.config).items() if not k.startswith("_")},
    )
    named = [(n, p) for n, p in model.named_parameters() if "lora_" in n]  # the order of ``params``
    first, drawn, snapshot = 1, 0, None
    if resume is not None:
        loaded = resume.load_latest()
        if loaded is not None:
            loaded.apply(named, optimizer, scheduler)
            for _ in range(loaded.batches_drawn):  # the data order is a pure function of the seed
                next(batches)
            first, drawn, result.steps = loaded.step + 1, loaded.batches_drawn, loaded.step
            result.loss_history[:] = loaded.info["loss_history"]
            result.lr_history[:] = loaded.info["lr_history"]
            cb.log(f"resuming from step {loaded.step}/{train.steps} (state saved in '{loaded.path.parent}')")
        snapshot = RngSnapshot.take(first - 1, drawn)

    def save_state(periodic: bool = False) -> None:
        if resume is None or snapshot is None or snapshot.step == 0 or not ranks.is_main:
            return
        _check_finite_weights(named, snapshot.step)
        try:
            path = resume.save(named, optimizer, scheduler, snapshot, result.loss_history, result.lr_history)
        except StorageError as exc:
            if not periodic:
                raise
            cb.log(f"warning: the periodic training state was not saved ({exc}); training goes on")
            return
        if path is not None:
            cb.log(f"training state at step {snapshot.step}/{train.steps} saved in '{path.parent}'")

    def stop_requested() -> bool:
        try:
            stop = cb.should_stop()
        except BaseException:  # ComfyUI's Cancel, Ctrl-C in the headless runner: keep the progress
            save_state()
            raise
        stop = ranks.any(stop, device)  # every rank stops at the same point, or the collectives hang
        if stop:
            save_state()
        return stop

    sampler = None
    if sampling is not None and sampling.enabled and ranks.is_main:
        from ..sampling import Sampler

        sampler = Sampler(sampling, dataset, family, model, device, dtype, sample_dir, cb)
    pinned_gb = (sum(p.pinned_host_bytes for p in getattr(handle.plan, "plans", (handle.plan,))) / 1e9
                 if handle is not None else 0.0)
    timer = StepTimer(device)
    start = time.perf_counter()
    model.train()
    try:
        with _attention_backends(device), cap_allocator(handle if split is None else None, offload, device,
                                                        held_before, cb):
            if sampler is not None and first == 1 and sampler.due(0, train.steps):
                _take_samples(sampler, 0, autocast, result)  # the base model, before any step
            for step in range(first, train.steps + 1):
                t0 = time.perf_counter()
                timer.start()
                loss_sum, stopped = 0.0, False
                for micro in range(train.gradient_accumulation):
                    # Noise, timesteps and flips are keyed by the global micro-batch index (batching.py).
                    gen = micro_generator(train.seed, ranks.global_micro_index(drawn))
                    drawn += 1
                    t_data = time.perf_counter()
                    latents, embeds = _load_batch(dataset, next(batches), device, dtype, gen)
                    timer.add_data(time.perf_counter() - t_data)
                    loss_sum += _micro_step(model, family, latents, embeds, train, gen, autocast,
                                            1.0 / train.gradient_accumulation, micro_batch)
                    # Between micro-steps too: with long accumulation, Stop must not wait a whole step.
                    if micro < train.gradient_accumulation - 1 and stop_requested():
                        stopped = True
                        break
                if stopped:  # the partial step is dropped; the finished steps are kept
                    optimizer.zero_grad(set_to_none=True)
                    result.interrupted = True
                    cb.log(f"stopped during step {step}/{train.steps} on request; keeping {step - 1} steps")
                    break
                timer.mark("backward")
                ranks.average_gradients(params)  # data parallel: every rank takes the same step
                loss_sum = ranks.mean(loss_sum, device)
                grad_norm = _clip(params, train.max_grad_norm)
                if not (math.isfinite(loss_sum) and math.isfinite(grad_norm)):
                    raise TrainingDivergedError(
                        f"training diverged at step {step}/{train.steps}: the loss is {loss_sum / train.gradient_accumulation} "
                        f"and the gradient norm {grad_norm}. Nothing was saved. Lower learning_rate, keep "
                        f"max_grad_norm > 0, and check alpha and the dataset cache"
                        + (f"; the state of step {resume.last_saved_step} is kept" if resume and resume.last_saved_step else ""))
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                timer.mark("optimizer")
                if device.type == "cuda":
                    for d in devices:
                        torch.cuda.synchronize(d)
                if handle is not None:
                    handle.end_step()
                    if step <= 2:  # step 2: steady state, the AdamW moments exist during backward
                        cb.log(handle.peak_report(step))
                stalls = getattr(handle, "step_stall_s", None)
                breakdown = timer.finish(stalls[-1] if stalls else 0.0)
                if step == first + 1:  # the first step warms up (and compiles); the second is typical
                    cb.log(describe_step(breakdown))
                result.loss_history.append(loss_sum / train.gradient_accumulation)
                result.lr_history.append(scheduler.get_last_lr()[0])
                result.steps = step
                peak = _peak_gb(devices)
                result.peak_vram_gb = peak
                if resume is not None:
                    snapshot = RngSnapshot.take(step, drawn)
                    if resume.due(step, train.steps):
                        save_state(periodic=True)
                try:  # ComfyUI's progress hook raises its interrupt here too: keep this step
                    cb.on_step(StepInfo(step, train.steps, result.loss_history[-1], result.lr_history[-1],
                                        grad_norm, time.perf_counter() - t0, peak, pinned_gb,
                                        sampler.seconds if sampler is not None else 0.0, breakdown))
                except BaseException:
                    if step < train.steps:
                        save_state()
                    raise
                if step == first and compiled.graphs():
                    result.settings["compile"] = {"first_step_s": round(breakdown["wall"], 2)}
                    cb.log(f"{compiled.describe()}; the first step took {breakdown['wall']:.1f} s with compiling")
                if sampler is not None and sampler.due(step, train.steps):
                    _take_samples(sampler, step, autocast, result)
                if step < train.steps and stop_requested():  # never after the last: keep a finished run
                    result.interrupted = True
                    cb.log(f"stopped at step {step}/{train.steps} on request")
                    break
        if ranks.distributed:
            # Every rank must hold the same weights (same averaged gradients, same steps): recorded, and checked.
            sums = ranks.gather(float(sum(p.detach().double().sum().item() for p in params)), device)
            result.settings["data_parallel"] = {"world_size": ranks.world_size, "weight_checksums": sums,
                                                "peak_vram_gb": ranks.gather(result.peak_vram_gb, device)}
            if max(sums) - min(sums) > 1e-6 * max(1.0, max(abs(v) for v in sums)):
                cb.log(f"warning: the ranks' LoRA weights differ (checksums {sums}); rank 0's are returned")
        if split is not None:
            result.settings["split_peak_vram_gb"] = [
                round(torch.cuda.max_memory_allocated(d) / 1e9, 3) if d.type == "cuda" else 0.0 for d in devices]
    except torch.cuda.OutOfMemoryError as exc:
        if handle is not None:
            raise torch.cuda.OutOfMemoryError(
                f"CUDA out of memory while training {family.display_name} with block streaming on "
                f"{', '.join(str(d) for d in devices)}: "
                f"{exc}\n{handle.plan.describe()}\nLower vram_budget_gb (more blocks stream), turn activation "
                f"offload on, use prefetch_depth=1, or lower the resolution or batch size. Under an auto budget the "
                f"allocator is held to the budget: other programs on the GPU do not count, but fragmentation "
                f"does; raise the budget by 0.5 GB if the plan's prediction was close to it."
            ) from exc
        raise torch.cuda.OutOfMemoryError(
            f"CUDA out of memory while training {family.display_name} resident on {device}: {exc}. "
            f"Lower the resolution or batch size, keep gradient checkpointing on, or use block streaming."
        ) from exc
    finally:
        result.seconds = time.perf_counter() - start
        result.state_dict = lora_state_dict(model) if result.steps else {}
        bad = [k for k, v in result.state_dict.items() if not torch.isfinite(v).all()]
        if bad:  # never hand on (or save, or cache) a LoRA with NaN/inf weights
            result.state_dict, result.interrupted = {}, True
        if compiled.graphs():
            result.settings.setdefault("compile", {})["graphs"] = compiled.graphs()
        compiled.remove()
        recompute.remove()
        if handle is not None:
            result.settings["offload_plan"] = handle.plan.summary()
            result.settings["offload_stats"] = handle.stats()
            handle.remove()  # frozen tensors back where they were (streamed blocks: pinned host memory)
        # Leave a preloaded model as we found it (benchmarks train it again); drop one we loaded.
        detach_lora(model)
        if checkpointing:
            model.disable_gradient_checkpointing()
        model.eval()
        del optimizer, scheduler, params
        if preloaded is None:
            del model
        release_device_memory(device)
    if bad:
        raise TrainingDivergedError(
            f"the LoRA weights became NaN/inf ({len(bad)} tensors, e.g. '{bad[0]}'); nothing was saved. "
            f"Lower learning_rate, keep max_grad_norm > 0, and check alpha")
    return result


def _take_samples(sampler, step: int, autocast, result: TrainedLora) -> None:
    _, path = sampler.run(step, autocast)
    if path is not None:
        result.sample_grids.append(str(path))
    result.sample_seconds = sampler.seconds
    result.settings["sampling"] = {"images": sampler.images, "seconds": round(sampler.seconds, 3),
                                   "peak_vram_gb": round(sampler.peak_vram_gb, 3)}


def _peak_gb(devices) -> float:
    """The highest max-allocated of the devices training uses (0 on the CPU)."""
    return max((torch.cuda.max_memory_allocated(d) / 1e9 for d in devices if d.type == "cuda"), default=0.0)


def _place_split(model, family, variant, dataset, lora, train, offload, split, cb):
    """Split mode: plan the cut from each device's budget, attach LoRA, place and stream both parts."""
    from ..offload.footprint import measure_footprint, workload_for
    from ..offload.host import physical_ram_bytes
    from ..parallel.split import apply_split, plan_split, split_budgets, trainable_per_block

    model.enable_gradient_checkpointing()
    params = attach_lora(model, family, lora, train.seed)  # fp32, on the CPU: placed with their blocks below
    try:
        fp = measure_footprint(model, family, f"{family.display_name} ({variant})")
        fp.lora_bytes_per_param = lora_bytes_per_param(train)
        per_block, outside = trainable_per_block(model, family)
        plan = plan_split(fp, per_block, outside, workload_for(dataset, family, variant, train.batch_size), offload,
                          tuple(torch.device(d) for d in split.devices), split_budgets(split, offload),
                          cut=None if split.cut == -1 else split.cut, host_ram_bytes=physical_ram_bytes())
        return apply_split(model, family, plan, offload, cb), params
    except BaseException:
        detach_lora(model)
        model.disable_gradient_checkpointing()
        raise


def _check_finite_weights(named, step: int) -> None:
    bad = [n for n, p in named if not torch.isfinite(p).all()]
    if bad:
        raise TrainingDivergedError(
            f"the LoRA weights became NaN/inf by step {step} ({len(bad)} tensors, e.g. '{bad[0]}'); nothing was "
            f"saved. Lower learning_rate, keep max_grad_norm > 0, and check alpha")


def _check_plan_before_loading(ident, family_id, dataset, lora, train, offload, device, dtype) -> None:
    """Make the plan from the checkpoint's header alone, so an impossible budget (or too much pinned
    host memory) is refused before minutes of loading."""
    from ..offload.footprint import footprint_before_loading

    fp, family, variant = footprint_before_loading(ident, dtype, lora, family_id)
    _plan(fp, family, variant, dataset, train, offload, device)


def _plan(fp, family, variant, dataset, train: TrainConfig, offload: OffloadConfig, device: torch.device):
    """The one place training asks for an offload plan (from the header before loading, and from the
    loaded model): the dataset's largest bucket, the optimizer's bytes per LoRA weight, the budget."""
    from ..offload.footprint import workload_for
    from ..offload.host import physical_ram_bytes
    from ..offload.plan import make_plan
    from ..offload.streamer import resolve_budget_bytes

    fp.lora_bytes_per_param = lora_bytes_per_param(train)
    if train.optimizer != "adamw":  # host-held moments are AdamW's fp32 ones: auto must not count on them
        from dataclasses import replace

        offload = replace(offload, optimizer_on_host=False)
    return make_plan(fp, workload_for(dataset, family, variant, train.batch_size), offload,
                     resolve_budget_bytes(offload, device), physical_ram_bytes(),
                     compiled=_compiles(offload, train, device, None)[0])


def _apply_int8_compute(model, offload: OffloadConfig | None, device: torch.device, cb) -> None:
    """Set the slab layers' matmul path (engine/slab/w8a8.py) from the offload config."""
    from ..slab.int8_linear import set_int8_compute

    mode = offload.int8_compute if offload is not None else "dequant"
    count = set_int8_compute(model, mode)
    if mode != "dequant":
        if count == 0:
            cb.log(f"int8_compute={mode!r} applies to int8 slabs only; this model is not a slab, so it has no effect")
        else:
            cb.log(f"int8_compute={mode!r}: {count} slab layers multiply {'fp8 x fp8' if mode == 'fp8' else 'int8 x int8'}")


def _check_int8_compute(offload: OffloadConfig | None, device: torch.device) -> None:
    mode = offload.int8_compute if offload is not None else "dequant"
    if mode == "dequant":
        return
    if device.type != "cuda":
        raise ConfigError(
            f"int8_compute={mode!r} multiplies on CUDA {'fp8' if mode == 'fp8' else 'int8'} tensor cores; training "
            f"runs on {device}. Use int8_compute='dequant' (the CPU path)")
    if mode == "fp8":
        from ..slab.w8a8 import fp8_support_error

        why = fp8_support_error(device.index if device.index is not None else torch.cuda.current_device())
        if why is not None:
            raise ConfigError(f"int8_compute='fp8': {why}. Use int8_compute='dequant'")


def _compiles(offload: OffloadConfig | None, train: TrainConfig, device: torch.device, split) -> tuple[bool, str]:
    """(whether the blocks will be compiled, why not when auto says no): decided before planning, since
    compiled blocks change what the plan needs (engine/offload/plan.py)."""
    from .compile import why_not_auto

    mode = offload.compile if offload is not None else "auto"
    if mode == "auto":
        why_not = why_not_auto(device, train.steps, split is not None)
        return why_not is None, why_not or ""
    return mode == "blocks", ""


def _compile_blocks(model, family, offload: OffloadConfig | None, train: TrainConfig, device: torch.device,
                    split, cb, handle=None):
    """torch.compile of the blocks' forwards when Offload Config asks for it, or auto finds it pays
    (engine/train/compile.py), at the plan's activation-memory budget (auto may have lowered it)."""
    from .compile import NoCompile, compile_blocks

    on, why_not = _compiles(offload, train, device, split)
    if not on:
        if why_not and device.type == "cuda":
            cb.log(f"compile auto: off ({why_not})")
        return NoCompile()
    cb.log("compile='blocks': each block type compiles on its first use (the first step takes longer)")
    budget = offload.activation_memory_budget if offload is not None else 1.0
    if handle is not None and split is None:
        budget = handle.plan.activation_memory_budget
    return compile_blocks(model, family, budget)


def _memory_options(handle, offload: OffloadConfig | None, split, device: torch.device) -> tuple[int, bool, int]:
    """(token chunks for the recompute, AdamW moments on the host, samples per forward: 0 = all): from the
    plan when blocks stream (auto may have chosen them), else as set in Offload Config. Host moments need a
    GPU to leave."""
    if handle is not None:
        plans = handle.plan.plans if split is not None else (handle.plan,)
        chunks, host = max(p.recompute_chunks for p in plans), any(p.optimizer_on_host for p in plans)
        micro = min(p.micro_batch or 0 for p in plans)
    elif offload is not None:
        chunks, host, micro = offload.recompute_chunks or 1, bool(offload.optimizer_on_host), 0
        micro = offload.micro_batch_size or 0
    else:
        chunks, host, micro = 1, False, 0
    return chunks, host and device.type == "cuda", micro


def _micro_step(model, family, latents, embeds, cfg: TrainConfig, gen: torch.Generator, autocast,
                scale: float, micro_batch: int = 0) -> float:
    """Forward and backward of one batch; returns its loss. The noise and timesteps are drawn for the whole
    batch; with ``micro_batch`` the batch then runs that many samples at a time, each piece's loss weighted
    by its share, so the accumulated gradient is the whole batch's (activations are one piece's)."""
    b = latents.shape[0]
    mu = family.train_shift_mu(latents) if cfg.shift_timesteps else None
    sigmas = sample_sigmas(b, gen, cfg.timestep_mean, cfg.timestep_std, mu).to(latents.device)
    noise = torch.randn(latents.shape, generator=gen).to(latents.device, latents.dtype)
    noisy, target = noisy_latents_and_target(latents, noise, sigmas)
    step = micro_batch if 0 < micro_batch < b else b
    total = 0.0
    for start in range(0, b, step):
        piece = slice(start, min(b, start + step))
        with autocast:
            pred = family.predict_velocity(model, noisy[piece], {k: v[piece] for k, v in embeds.items()},
                                           sigmas[piece], cfg.guidance)
        loss = torch.nn.functional.mse_loss(pred.float(), target[piece].float())
        share = (piece.stop - piece.start) / b
        (loss * (share * scale)).backward()
        total += loss.item() * share
    return total


def _clip(params, max_norm: float) -> float:
    if max_norm and max_norm > 0:
        return float(torch.nn.utils.clip_grad_norm_(params, max_norm))
    norms = [p.grad.norm().to("cpu") for p in params if p.grad is not None]  # split: grads on two devices
    return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0
