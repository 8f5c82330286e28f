"""train_lora: the LoRA training loop.

bf16 frozen base (fp32 on CPU), fp32 LoRA weights under autocast, AdamW,
constant or cosine schedule with warmup, gradient clipping and accumulation,
gradient checkpointing, and a callback that sees every step and may stop it.
Where the frozen weights live (all resident on one device, blocks streamed from
pinned host memory, or cut across two devices) is one ``Placement``
(engine/train/placement.py), chosen once. ``_train_lora`` reads as its phases, in
order; each is a function below.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from ..attention import training_attention
from ..caching import DatasetCache
from ..callbacks import StepInfo, TrainingCallback
from ..checkpoint import CheckpointIdentity, identify
from ..config import LoraSettings, ModelConfig, TrainConfig
from ..errors import ConfigError, StorageError, TrainingDivergedError
from ..families import get_family, predict_velocity
from ..families.specs import HELD_KEY, HELD_ON_KEY, held_weights
from ..models import load_transformer, resolve_dtype
from ..models.dtypes import release_device_memory
from ..models.inspect import ModelInfo
from ..offload import OffloadConfig
from ..offload.hostmem import process_memory
from .batching import bucket_batches, micro_generator
from .flow_matching import (draw_sigmas, loss_weights, mask_weights, noisy_latents_and_target, per_sample_mse,
                            sample_sigmas, weighted_mse)
from .grad_mode import autograd_enabled, autograd_safe_tensor, make_autograd_safe
from .ema import AdapterEma
from .lora_attach import adapter_parameters, lora_state_dict, skip_lora_input_cast
from .snapshots import Snapshots
from .optimizers import check_optimizer, make_optimizer
from .placement import MemoryOptions, Placement, choose_placement, training_device
from .resume import ResumeStore, RngSnapshot
from .step_timing import PhaseClock, StepTimer
from .step_timing import describe as describe_step
from ..lora_io.trained import TrainedLora


def _make_scheduler(optimizer, cfg: TrainConfig):
    from diffusers.optimization import get_scheduler

    name = "constant_with_warmup" if cfg.lr_scheduler == "constant" else "cosine"
    return get_scheduler(name, optimizer, num_warmup_steps=cfg.warmup_steps, num_training_steps=cfg.steps)


def _load_batch(dataset: DatasetCache, batch, device, dtype, rng: torch.Generator,
                caption_rng: torch.Generator | None = None):
    """(latents (B, C, ...), embeddings, pixel loss masks (B, H, W) uint8 or None without masked loss). With
    ``caption_rng``, each item's caption is drawn (dropout, shuffled orders: ``DatasetCache.caption_key``)."""
    latents, texts, masks = [], [], []
    for item in batch:
        flipped = dataset.flip and bool(torch.randint(0, 2, (1,), generator=rng).item())
        text_key = dataset.caption_key(item, caption_rng) if caption_rng is not None else None
        lat, emb = dataset.load_item(item, flipped, text_key)
        latents.append(autograd_safe_tensor(lat))
        texts.append({k: autograd_safe_tensor(v) for k, v in emb.items()})
        masks.append(dataset.load_mask(item, flipped))  # mirrored with its latent
    lat = torch.stack(latents).to(device, dtype)  # (B, C, ...)
    embeds = dataset.collate_text(texts)  # variable-length captions padded, with their masks
    embeds = {k: v.to(device, dtype) if v.is_floating_point() else v.to(device) for k, v in embeds.items()}
    return lat, embeds, (torch.stack(masks) if masks[0] is not None else None)


def train_lora(
    model_cfg: ModelConfig | ModelInfo,
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
    preview_partner: ModelConfig | ModelInfo | None = None,
    step_window: int | None = None,
    loss=None,
    log_dir=None,
) -> TrainedLora:
    """Train a LoRA on ``dataset`` and return its weights. ``model_cfg``: the Load node's ``ModelInfo``, whose
    checkpoint identity the run uses as it is (never identified again), or a ``ModelConfig`` (identified here,
    once). ``preloaded`` = (model,
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
    ``preview_partner``: for one expert of a mixture (Wan 2.2 A14B), the other expert's checkpoint (its Load node's
    ``ModelInfo``, or a ``ModelConfig``), which previews switch to at the boundary (engine/train/preview_partner.py);
    without it such an expert draws no samples.
    ``step_window``: steps per modulation window (engine/train/step_window.py: the family's per-step constants computed
    for that many steps drawn ahead; the losses are the same); None: the planner's choice; 0: off.
    ``loss`` (engine/train/loss_options.LossOptions): the unmasked area's weight (masked loss), validation on the
    dataset's held-out split; ``log_dir``: a folder for the run's CSV and TensorBoard logs (engine/train/run_log.py).

    Runs with autograd on even when called under ``torch.inference_mode()`` (ComfyUI
    runs every node that way); the returned weights are ordinary tensors."""
    identity = None
    if isinstance(model_cfg, ModelInfo):
        model_cfg, identity = model_cfg.config, model_cfg.checkpoint
    from .loss_options import LossOptions
    from .run_log import RunLog

    loss = loss or LossOptions()
    _check_loss_options(loss, dataset)
    cb = RunLog(callback or TrainingCallback(), log_dir, loss.tensorboard) if log_dir else callback
    try:
        with autograd_enabled():
            result = _train_lora(model_cfg, identity, dataset, lora, train, cb, preloaded, offload, resume, split,
                                 ranks, sampling, sample_dir, preview_partner, step_window, loss)
    finally:
        if log_dir:
            cb.close()
    if log_dir:  # Save LoRA copies the CSV beside the LoRA
        result.settings["logs"] = {"folder": str(log_dir), "csv": str(cb.csv_path),
                                   "tensorboard": cb.writer is not None}
    return result


def _train_lora(model_cfg, identity, dataset, lora, train, callback, preloaded, offload, resume, split, ranks,
                sampling, sample_dir, preview_partner=None, step_window=None, loss=None) -> TrainedLora:
    """The run as named phases; each is a function below, in this order."""
    from ..parallel.data_parallel import Ranks

    cb = callback or TrainingCallback()
    clock = PhaseClock()  # the start-up's phases and the end's, logged and in the result's settings
    device = training_device(train, split, ranks.stage if ranks is not None else None)
    dtype = resolve_dtype(model_cfg.dtype, device)
    _check_settings(train, offload, device)
    placement = choose_placement(offload, split, device, cb)
    placement.ranks = ranks
    if ranks is not None and ranks.stage is not None:
        from ..parallel.process_split import check_stage_run

        check_stage_run(sampling, dataset.validation_items, resume, loss)
    # What the process holds on each GPU before training (ComfyUI's other models): each budget's cap comes on top.
    held_before = {d: torch.cuda.memory_reserved(d) for d in placement.devices if d.type == "cuda"}
    run = _Run(cb=cb, ranks=ranks or Ranks(), dataset=dataset, train=train, resume=resume, placement=placement,
               dtype=dtype, held_before=held_before, loss=loss)
    placement.saves_state = resume is not None and resume.enabled
    placement.preservation = loss is not None and loss.preservation_weight > 0  # its passes in the step-time model
    placement.ema = bool(lora.adapter.ema_decay)  # the plan counts its copy, where the moments live
    if preview_partner is not None and sampling is not None and sampling.enabled and device.type == "cuda":
        _count_partner(placement, preview_partner, dtype)
    _load_model(run, model_cfg, identity, lora, preloaded)
    run.result, run.lora = _new_result(run, model_cfg, lora), lora
    _prepare_model(run)
    clock.mark("model")
    try:  # from the placement on, whatever happens, _finish takes the LoRA out and undoes every phase
        _mark_window(run, lora, step_window)
        _place(run, lora)
        clock.mark("placement")
        _prepare_compute(run)
        _make_optimizer(run)
        clock.mark("compute and optimizer")
        _prepare_data(run)
        _resume(run)
        _start_window(run, step_window)
        _make_sampler(run, sampling, sample_dir, preview_partner)
        _make_validator(run)
        clock.mark("data, window and previews")
        _report_startup(run, clock)
        _run_steps(run)
    finally:
        end = PhaseClock()
        bad = _finish(run, drop_model=preloaded is None)
        run.result.settings["finish_s"] = end.mark("finish")
    if bad:
        raise TrainingDivergedError(
            f"the LoRA weights became NaN/inf ({len(bad)} tensors, e.g. '{bad[0]}'); nothing was saved. "
            f"Lower learning_rate, keep max_grad_norm > 0, and check alpha")
    return run.result


def _report_startup(run: _Run, clock: PhaseClock) -> None:
    """The start-up's phases (before the first step) in the log and the result's settings."""
    run.cb.log(clock.describe("start-up"))
    run.result.settings["startup_s"] = {**clock.seconds, "total": clock.total()}


@dataclass
class _Run:
    """What the phases of one run share: the settings, the model and its placement, the progress so far.
    ``undo`` holds what each phase must take back, unwound last-in first-out by ``_finish``."""

    cb: TrainingCallback
    ranks: Any
    dataset: DatasetCache
    train: TrainConfig
    resume: ResumeStore | None
    placement: Placement
    dtype: torch.dtype
    held_before: dict  # bytes the process held on each GPU before training, the model's own not counted
    model: Any = None
    family: Any = None
    variant: str = ""
    result: TrainedLora | None = None
    lora: LoraSettings | None = None
    ema: Any = None  # AdapterEma (ema.py) when the adapter's ema_decay is set
    snapshots: Any = None  # Snapshots (snapshots.py) when snapshot_every is set, rank 0
    undo: contextlib.ExitStack = field(default_factory=contextlib.ExitStack)
    params: list = field(default_factory=list)
    named: list = field(default_factory=list)  # (name, LoRA parameter), in the order of ``params``
    memory: MemoryOptions = MemoryOptions(1, False, 0)
    compiled: Any = None
    optimizer: Any = None
    scheduler: Any = None
    batches: Any = None
    autocast: Any = field(default_factory=contextlib.nullcontext)
    first: int = 1  # the first step to run (after a resumed one)
    drawn: int = 0  # batches drawn so far (this rank's)
    snapshot: RngSnapshot | None = None  # the state a save would record (resume only)
    sampler: Any = None
    timer: StepTimer | None = None
    start: float = field(default_factory=time.perf_counter)
    sigma_range: tuple[float, float] = (0.0, 1.0)  # the noise levels this model trains on (family.schedule.train_sigma_range)
    window: Any = None  # the modulation window (step_window.StepWindow), or None
    loss: Any = None  # LossOptions (engine/train/loss_options.py)
    reg_batches: Any = None  # the regularization images' batch stream (Dataset Options' reg_folder), or None
    validator: Any = None  # the held-out split's loss (engine/train/validation.py), or None
    class_text: Any = None  # differential output preservation: the class prompt's embeddings (preservation.py)

    @property
    def device(self) -> torch.device:
        return self.placement.device


def _check_settings(train: TrainConfig, offload: OffloadConfig | None, device: torch.device) -> None:
    """Settings that cannot work together, refused before anything is loaded."""
    check_optimizer(train, device)
    if offload is not None and offload.optimizer_on_host and train.optimizer != "adamw":
        raise ConfigError(f"optimizer_on_host keeps AdamW's fp32 moments on the host; optimizer={train.optimizer!r} "
                          f"keeps its 8-bit moments on the GPU. Use one or the other")
    _check_int8_compute(offload, device)


def _check_loss_options(loss, dataset) -> None:
    """Validation asked for without a split to validate on, refused before anything loads."""
    if loss.validation_every > 0 and not dataset.validation_items:
        raise ConfigError(f"validation_every={loss.validation_every} but the dataset has no validation split; set "
                          f"validation_fraction or validation_folder on Dataset Options (Cache Text Embeds), or "
                          f"set validation_every to 0")
    if loss.preservation_weight > 0 and not dataset.preservation_text_key:
        raise ConfigError(f"preservation_weight={loss.preservation_weight:g} but the dataset cache has no class "
                          f"prompt; set preservation_prompt on Dataset Options (Cache Text Embeds), e.g. 'a photo of "
                          f"a woman', or set preservation_weight to 0")
    if loss.first_frame_p < 1:
        condition = get_family(dataset.family).first_frame(dataset.variant)
        if condition is None or not condition.held:
            raise ConfigError(f"first_frame_p={loss.first_frame_p:g} mixes image- and text-to-video clips, but the "
                              f"dataset cache ({dataset.family} {dataset.variant}) holds no first frame: cache it with "
                              f"a model that holds one (LTX-2 with Cache Text Embeds' image_to_video on), or set "
                              f"first_frame_p to 1")


def _make_validator(run: _Run) -> None:
    """The validation loss on the dataset's held-out split (rank 0 only), when it has one and it is not off."""
    if not run.dataset.validation_items or not run.ranks.is_main:
        return
    every = run.loss.validation_interval(run.train.steps)
    if not every:
        return
    from .validation import Validator

    run.validator = Validator(run.dataset, run.family, run.loss.validation_timesteps, run.train.seed,
                              run.train.guidance, run.loss.unmasked_weight, run.sigma_range)
    run.validator.every = every
    run.cb.log(f"validation: {len(run.validator.items)} held-out item(s) x {len(run.validator.sigmas)} fixed noise "
               f"levels every {every} steps")


def _validate(run: _Run, step: int) -> float | None:
    """The validation loss at ``step`` when due (every N steps and after the last), else None."""
    v = run.validator
    if v is None or not (step % v.every == 0 or step == run.train.steps):
        return None
    loss = v.run(run.model, run.device, run.dtype, run.autocast, step)
    run.result.settings["validation"] = v.record()
    return loss


def _count_partner(placement, partner_cfg, dtype) -> None:
    """The preview partner's host bytes into the RAM plan (it is pinned while previews sample). A partner that cannot
    be read is refused with its own message when previews start (preview_partner.py); here it only goes uncounted."""
    from .preview_partner import host_bytes

    try:
        placement.host_extra["preview partner"] = host_bytes(partner_cfg, dtype)
    except (ConfigError, OSError):
        placement.host_extra.pop("preview partner", None)


def _load_model(run: _Run, model_cfg, identity: CheckpointIdentity | None, lora, preloaded) -> None:
    """The preloaded (model, family, variant), or the checkpoint's, loaded after the dataset cache and the
    plan are checked against its header. ``identity``: the Load node's, used as it is; without one (a
    ``ModelConfig`` was given) the checkpoint is identified here, once."""
    if preloaded is None:
        ident = identity if identity is not None else identify(model_cfg.transformer_path, model_cfg.family)
        run.dataset.check_fits(ident.family, ident.config)
        run.placement.plan_before_loading(ident, model_cfg.family, run.dataset, lora, run.train, run.dtype)
        run.model, run.family, _, run.variant = load_transformer(ident, model_cfg.family, run.dtype)
        run.placement.model_is_own = True
    else:
        run.model, run.family, run.variant = preloaded
    run.sigma_range = run.family.schedule.train_sigma_range(run.variant)
    if run.sigma_range != (0.0, 1.0):
        run.cb.log(f"{run.variant}: an expert of a mixture, trained on its own noise levels only: sigma in "
                   f"[{run.sigma_range[0]:g}, {run.sigma_range[1]:g}]")
    from itertools import chain

    for device in run.held_before:  # the model's own tensors already there count in the plan, not as held
        index = device.index if device.index is not None else torch.cuda.current_device()
        own = sum(t.numel() * t.element_size() for t in chain(run.model.parameters(), run.model.buffers())
                  if t.is_cuda and t.get_device() == index)
        run.held_before[device] = max(0, run.held_before[device] - own)


def _new_result(run: _Run, model_cfg, lora: LoraSettings) -> TrainedLora:
    """The result, empty until steps are recorded: what was trained, from what, with which settings."""
    offload = run.placement.offload
    return TrainedLora(
        state_dict={}, rank=lora.rank, alpha=lora.alpha, family=run.family.id, variant=run.variant, steps=0,
        requested_steps=run.train.steps, dataset_hash=run.dataset.dataset_hash,
        base_model=str(model_cfg.transformer_path),
        adapter=lora.adapter.type, settings={"lora": asdict(lora), "train": vars(run.train),
                  **({"offload": vars(offload)} if offload is not None else {})},
        model_config={k: v for k, v in dict(run.model.config).items() if not k.startswith("_")},
    )


def _prepare_model(run: _Run) -> None:
    """An ordinary (autograd-safe) model, its slab layers' matmul path, the dataset checked against it."""
    if make_autograd_safe(run.model):  # built under inference mode (e.g. by an earlier ComfyUI node)
        run.cb.log("the base model was created under torch.inference_mode(); training on an ordinary copy")
    _apply_int8_compute(run.model, run.placement.offload, run.device, run.cb)
    run.dataset.check_fits(run.family, dict(run.model.config))  # slabs and preloaded models: checked once loaded


def _place(run: _Run, lora: LoraSettings) -> None:
    """LoRA attached and the weights placed (resident, streamed or split); undone in ``_finish``."""
    run.params = run.placement.apply(run.model, run.family, run.variant, run.dataset, lora, run.train, run.cb)
    run.undo.callback(run.placement.remove)


def _mark_window(run: _Run, lora: LoraSettings, step_window: int | None) -> None:
    """The family's per-step-constant modules flagged before the weights are placed, so blocks stream without them
    (engine/train/step_window.py). With Dual-GPU Split each part's flagged modules live and run on its GPU
    (``StepWindow``'s ``devices``), so each part streams its blocks without their modulation."""
    from .step_window import mark

    if step_window == 0 or run.family.memory.step_constants is None:
        return
    if run.loss.preservation_weight > 0:  # the class prompt's forwards would need constants of their own
        run.cb.log("modulation window: off (differential output preservation runs a second prompt per step)")
        return
    why_not = run.placement.window_blocker(run.train)
    if why_not:
        run.cb.log(f"modulation window: off ({why_not})")
        return
    targets = lora.target_modules or run.family.lora.target_modules(run.model)
    chosen = mark(run.model, run.family, list(targets), run.cb.log)
    if chosen is not None:
        run.window = chosen
        run.undo.callback(chosen.unmark)
        if run.device.type == "cuda":  # their weights wait in pinned host memory (step_window.StepWindow): in the RAM plan
            from ..offload.host import frozen_bytes
            from ..offload.window import HOST_KEY

            run.placement.host_extra[HOST_KEY] = sum(frozen_bytes(m) for _, m in chosen.all())


def _start_window(run: _Run, step_window: int | None) -> None:
    """The window over the flagged modules (their weights held in pinned host memory where placement left them on
    the host), K from the planner (engine/offload/window.py) unless ``step_window`` says it; undone in ``_finish``."""
    from ..offload.window import window_steps
    from .step_window import StepWindow

    if run.window is None:
        return
    run.window.drop(run.placement.remote_modules())  # a process split: the other process runs those
    release_map = None
    if run.placement.window_from_file:  # host RAM is short: the weights stay in the slab's map (Streamed.plan)
        from ..slab.source import slab_source_of

        source = slab_source_of(run.model)
        release_map = source.release if source is not None else None
    window = StepWindow(run.model, run.family, run.window, run.device, run.autocast, release_map=release_map,
                        devices=run.placement.module_devices())  # Dual-GPU Split: each part's own GPU
    run.window = window
    run.undo.callback(window.remove)
    plans = run.placement.plans()
    plan = plans[0] if plans else None
    per_step = window.vector_bytes_per_call_row(run.dtype) * run.train.batch_size * run.train.gradient_accumulation
    copied = window.held_bytes
    if window.mapped_bytes and plan is not None and plan.machine is not None and plan.machine.disk_bytes_per_s:
        # read from the disk at worst: as many link bytes as take the same time
        copied += int(window.mapped_bytes * plan.machine.link_bytes_per_s / plan.machine.disk_bytes_per_s)
    window.steps = step_window or window_steps(per_step, copied, plan)
    run.result.settings["step_window"] = {"steps": window.steps, "modules": len(window.chosen.modules) + 1,
                                          "excluded": window.chosen.excluded, "held_gb": round(window.held_bytes / 1e9, 3),
                                          "held_bytes": window.held_bytes, "mapped_bytes": window.mapped_bytes}
    where = []
    if window.held_bytes:
        where.append(f"{window.held_bytes / 1e9:.2f} GB of their weights in pinned host memory")
    if window.mapped_bytes:
        where.append(f"{window.mapped_bytes / 1e9:.2f} GB read from the slab file's map (host RAM is short)")
    run.cb.log(f"modulation window: {len(window.chosen.modules)} modules and {window.chosen.source[0]} computed once "
               f"per {window.steps} steps" + (f", {', '.join(where)}, copied in once per window" if where else ""))


def _fill_window(run: _Run) -> None:
    """The next window: the next K steps' batches (or the steps left) drawn from the stream in order, and the
    per-step constants of every call they make (engine/train/step_window.py)."""
    train = run.train
    steps = max(1, min(run.window.steps, train.steps - run.result.steps))
    first = run.drawn
    draws = [(_next_batch(run, first + j), first + j) for j in range(steps * train.gradient_accumulation)]

    def calls_of(draw) -> list[dict]:
        (batch, _), index = draw
        at = run.ranks.global_micro_index(index)
        gen = micro_generator(train.seed, at)
        latents, embeds, _ = _load_batch(run.dataset, batch, run.device, run.dtype, gen, _caption_generator(run, at))
        sigmas, noise, _ = _draw_noise(run.family, latents, train, gen, run.sigma_range, run.loss)
        noisy, _ = noisy_latents_and_target(latents, noise, sigmas)
        with run.autocast:
            return [run.family.model_inputs(run.model, noisy[p], {k: v[p] for k, v in embeds.items()}, sigmas[p],
                                            train.guidance) for p in _pieces(latents.shape[0], run.memory.micro_batch)]

    run.window.fill(draws, calls_of)


def _prepare_compute(run: _Run) -> None:
    """Finer recompute and compiled blocks, as the plan or Offload Config say; undone in ``_finish``."""
    from ..offload.recompute import install_chunked_recompute

    run.memory = run.placement.memory_options()
    chunks = run.memory.recompute_chunks
    run.undo.callback(install_chunked_recompute(run.model, run.family, chunks).remove)
    if chunks > 1:
        run.cb.log(f"finer recompute: token-wise block parts in {chunks} checkpointed chunks")
    run.compiled = _compile_blocks(run.model, run.family, run.placement, run.train, run.cb)
    run.undo.callback(run.compiled.remove)


def _make_optimizer(run: _Run) -> None:
    """The optimizer (AdamW moments on the host when the plan or Offload Config say) and its schedule."""
    run.optimizer = make_optimizer(run.params, run.train, run.memory.optimizer_on_host)
    run.scheduler = _make_scheduler(run.optimizer, run.train)
    run.named = adapter_parameters(run.model)  # the order of ``params``
    if run.lora.adapter.ema_decay:  # its averages are saved and restored with the weights (resume)
        run.ema = AdapterEma(run.named, run.lora.adapter.ema_decay, on_host=run.memory.optimizer_on_host)
        run.named = run.named + run.ema.named


def _prepare_data(run: _Run) -> None:
    """The batch stream (every rank builds the same seed-determined stream and takes its share, all of it in
    one process), autocast, and the devices' peak counters reset."""
    train, device = run.train, run.device
    # One batch holds one shape: the same bucket, for clips the same frame count, for edit pairs the same control
    # image sizes (CachedItem.batch_key).
    run.batches = run.ranks.shard(bucket_batches(run.dataset.training_items(), train.batch_size, train.seed,
                                                 lambda it: it.batch_key()))
    if run.loss.preservation_weight > 0:  # the class prompt's embeddings, loaded once
        run.class_text = {k: v.to(device, run.dtype) if v.is_floating_point() else v.to(device)
                          for k, v in run.dataset.load_text(run.dataset.preservation_text_key).items()}
        run.result.settings["preservation"] = {"prompt": run.dataset.preservation_prompt,
                                               "weight": run.loss.preservation_weight}
        run.cb.log(f"differential output preservation: the base model's answer on '{run.dataset.preservation_prompt}' "
                   f"is the adapter's target there, weight {run.loss.preservation_weight:g}")
    if run.dataset.reg_items and run.loss.reg_ratio > 0:  # a stream of their own, interleaved by ``LossOptions.is_reg``
        if run.ranks.distributed:
            raise ConfigError("regularization images are not built for data-parallel training yet; clear reg_folder "
                              "or train on one GPU (or split mode)")
        run.reg_batches = bucket_batches(run.dataset.reg_items, train.batch_size, train.seed + 1,
                                         lambda it: it.batch_key())
        run.cb.log(f"regularization: {len(run.dataset.reg_items)} image(s), {run.loss.reg_ratio:g} of the "
                   f"micro-batches, loss weight {run.loss.prior_loss_weight:g}")
    if device.type == "cuda" and run.dtype != torch.float32:
        run.autocast = torch.autocast("cuda", dtype=run.dtype)
        skip_lora_input_cast(run.model)
    if device.type == "cuda":
        for d in run.placement.devices:
            torch.cuda.reset_peak_memory_stats(d)


def _resume(run: _Run) -> None:
    """Continue from the run's latest saved state, when there is one: weights, optimizer, schedule, the data
    order (a pure function of the seed) and the histories."""
    if run.resume is None:
        return
    run.undo.callback(_end_saves, run)  # no background save outlives the run
    loaded = run.resume.load_latest()
    if loaded is not None:
        loaded.apply(run.named, run.optimizer, run.scheduler)
        for index in range(loaded.batches_drawn):  # the data order is a pure function of the seed
            _next_batch(run, index)
        run.first, run.drawn, run.result.steps = loaded.step + 1, loaded.batches_drawn, loaded.step
        run.result.loss_history[:] = loaded.info["loss_history"]
        run.result.lr_history[:] = loaded.info["lr_history"]
        run.cb.log(f"resuming from step {loaded.step}/{run.train.steps} (state saved in '{loaded.path.parent}')")
        # the node's chart goes on from the steps before, not empty
        run.cb.on_resume(loaded.step, run.train.steps, list(run.result.loss_history), list(run.result.lr_history))
    run.snapshot = RngSnapshot.take(run.first - 1, run.drawn)


def _make_sampler(run: _Run, sampling, sample_dir, preview_partner=None) -> None:
    """Samples of the dataset's prompts at checkpoints (rank 0 only); an expert of a mixture samples with its
    partner expert (``preview_partner``) or not at all."""
    if sampling is not None and sampling.enabled and run.ranks.is_main:
        from ..sampling import Sampler, preview_blocker

        wanted = run.family.schedule.preview_partner(run.variant)
        partner = None
        if wanted is not None and preview_partner is not None:
            from .preview_partner import PreviewPartner

            partner = PreviewPartner(preview_partner, run.family, run.variant, run.device, run.dtype,
                                     run.placement.offload, run.cb)
            run.undo.callback(partner.close)  # its kept host copies (pinned) go with the run
            run.cb.log(f"previews switch to {partner.variant} (base weights, no LoRA; CFG {partner.guidance:g}) "
                       f"{'above' if partner.high else 'below'} sigma {partner.boundary}, as the family's pipeline")
        else:
            if preview_partner is not None:
                run.cb.log(f"preview_partner is ignored: {run.variant} denoises the whole path alone")
            blocker = preview_blocker(run.variant, run.sigma_range, wanted)
            if blocker is not None:  # never silently wrong samples: say why there are none
                run.cb.log(blocker)
                return
        run.sampler = Sampler(sampling, run.dataset, run.family, run.model, run.device, run.dtype, sample_dir, run.cb,
                              max_rows=_sampling_rows(run, sampling, partner), partner=partner)
        if run.resume is not None and run.resume.enabled:  # the columns drawn before a stop, kept with the state
            run.sampler.keep_columns(run.resume.folder / "samples", upto=run.first - 1)


def _sampling_rows(run: _Run, sampling, partner=None) -> int:
    """Rows per sampling forward (prompts and guidance branches batched, each streamed block copied in once per
    denoising step) that keep sampling at or below the training peak of this run's plan (sampling.rows_per_forward)."""
    from ..offload.footprint import workload_for
    from ..sampling import rows_per_forward

    workload = workload_for(run.dataset, run.family, run.variant, run.train.batch_size)
    frames = sampling.frames if run.family.video else 1
    rows = rows_per_forward(run.placement.plans(), workload, run.family, run.variant, sampling.resolution,
                            sampling.resolution, frames, run.placement.memory_options().micro_batch,
                            extra_bytes=partner.rows_bytes() if partner is not None else 0)
    run.cb.log(f"sampling runs at most {rows} row(s) (prompts x guidance branches) per forward: at or below the "
               f"training peak")
    return rows


def _run_steps(run: _Run) -> None:
    """The step loop, under the attention backends and the allocator cap; then the ranks' agreement and the
    devices' peaks. A CUDA out-of-memory error is raised again with what to change."""
    train, result, sampler = run.train, run.result, run.sampler
    run.timer = StepTimer(run.device)
    run.start = time.perf_counter()
    run.model.train()
    try:
        with training_attention(run.device), run.placement.cap_allocator(run.held_before, run.cb):
            before = run.first - 1  # 0: the base model; else the resumed step, when its samples were cut short
            if sampler is not None and sampler.due(before, train.steps) and not sampler.has(before):
                _take_samples_or_save(run, before)
            for step in range(run.first, train.steps + 1):
                if not _run_step(run, step):
                    break
            _report_saves(run, wait=True)  # the last periodic save is complete before the run is
        if run.ranks.distributed:
            _check_ranks_agree(run)
        run.placement.record_peaks(result.settings)
    except torch.cuda.OutOfMemoryError as exc:
        raise run.placement.out_of_memory(exc, run.family) from exc


def _run_step(run: _Run, step: int) -> bool:
    """One optimizer step and what follows it (records, saves, samples); False when training stops here."""
    train, cb, result = run.train, run.cb, run.result
    t0 = time.perf_counter()
    run.timer.start()
    loss_sum = _accumulate(run)
    if loss_sum is None:  # the partial step is dropped; the finished steps are kept
        run.optimizer.zero_grad(set_to_none=True)
        result.interrupted = True
        cb.log(f"stopped during step {step}/{train.steps} on request; keeping {step - 1} steps")
        return False
    run.timer.mark("backward")
    loss_sum, grad_norm = _optimizer_step(run, step, loss_sum)
    if run.device.type == "cuda":
        for d in run.placement.devices:
            torch.cuda.synchronize(d)
    breakdown = run.timer.finish(run.placement.end_step(step, cb))
    if step == run.first + 1:  # the first step warms up (and compiles); the second is typical
        cb.log(describe_step(breakdown, gpu=run.device.type == "cuda"))
    validation = _validate(run, step)  # in this step's time: its cost shows in s/step
    _record_step(run, step, loss_sum, grad_norm, t0, breakdown, validation)
    if run.lora.adapter.snapshot_every and run.ranks.is_main and step % run.lora.adapter.snapshot_every == 0:
        run.snapshots = run.snapshots or Snapshots(run.lora, run.family.id)
        written = run.snapshots.write(result, _adapter_state(run), step, _adapter_state(run, ema=True))
        cb.log(f"snapshot of step {step}: {', '.join(repr(str(p)) for p in written)}")
    if step == run.first and run.compiled.graphs():
        result.settings["compile"] = {"first_step_s": round(breakdown["wall"], 2)}
        cb.log(f"{run.compiled.describe()}; the first step took {breakdown['wall']:.1f} s with compiling")
    if run.sampler is not None and run.sampler.due(step, train.steps):
        _take_samples_or_save(run, step)
    if step < train.steps and _stop_requested(run):  # never after the last: keep a finished run
        result.interrupted = True
        cb.log(f"stopped at step {step}/{train.steps} on request")
        return False
    return True


def _accumulate(run: _Run) -> float | None:
    """Forward and backward of each micro-batch of the step; the summed loss, or None when stopped between
    micro-batches."""
    train = run.train
    loss_sum = 0.0
    pipeline = run.placement.pipeline()
    # A pipelined split whose pipeline spans accumulated batches (SplitPlan.batches_per_pipeline): their pieces are
    # gathered and run together. Not with preservation, whose extra passes run piece by piece.
    span = pipeline.batches if pipeline is not None and run.class_text is None else 1
    group: list = []  # (the batch's jobs, its weight, its window calls) waiting for the pipeline to fill
    for micro in range(train.gradient_accumulation):
        # Noise, timesteps and flips are keyed by the global micro-batch index (batching.py).
        index = run.ranks.global_micro_index(run.drawn)
        gen = micro_generator(train.seed, index)
        captions = _caption_generator(run, index)
        t_data = time.perf_counter()
        calls = None
        if run.window is not None:  # drawn ahead with the window's per-step constants (the same batch, same index)
            if not run.window.queue:
                _fill_window(run)
            ((batch, weight), drawn), calls = run.window.next()
            assert drawn == run.drawn, (drawn, run.drawn)
        else:
            batch, weight = _next_batch(run, run.drawn)
        reg = run.reg_batches is not None and run.loss.is_reg(run.drawn)  # the draw _next_batch made
        run.drawn += 1
        latents, embeds, masks = _load_batch(run.dataset, batch, run.device, run.dtype, gen, captions)
        weights = None if masks is None else \
            mask_weights(masks, latents.shape[2:], run.loss.unmasked_weight).to(run.device)  # (B, [F_lat,] h, w)
        run.timer.add_data(time.perf_counter() - t_data)
        preserve = None
        if run.class_text is not None and not reg:  # the dataset's batches (reg images preserve on their own)
            from .preservation import class_embeds

            preserve = (class_embeds(run.class_text, embeds), run.loss.preservation_weight)
        if span > 1:
            group.append((_batch_jobs(run.model, run.family, latents, embeds, train, gen, run.autocast,
                                      weight / train.gradient_accumulation, run.memory.micro_batch, run.sigma_range,
                                      weights, run.loss), weight, calls))
            if len(group) < span:
                continue
            losses = _pipelined([g[0] for g in group], None if run.window is None else
                                [c for g in group for c in g[2]], run.window, pipeline)
            loss_sum += sum(g[1] * loss for g, loss in zip(group, losses))
            group = []
        else:
            loss_sum += weight * _micro_step(run.model, run.family, latents, embeds, train, gen, run.autocast,
                                             weight / train.gradient_accumulation, run.memory.micro_batch,
                                             run.sigma_range, weights, run.loss, window=run.window, calls=calls,
                                             preserve=preserve, pipeline=pipeline)
        # Between micro-steps too: with long accumulation, Stop must not wait a whole step.
        if micro < train.gradient_accumulation - 1 and _stop_requested(run):
            return None
    return loss_sum


def _next_batch(run: _Run, index: int) -> tuple[list, float]:
    """Micro-batch ``index``'s items and its loss weight: the regularization images' next batch (weighted by
    prior_loss_weight) where ``LossOptions.is_reg`` says, else the dataset's."""
    if run.reg_batches is not None and run.loss.is_reg(index):
        return next(run.reg_batches), run.loss.prior_loss_weight
    return next(run.batches), 1.0


_CAPTION_STREAM = 0x5DEECE66D  # any constant: the caption draws' generator differs from the noise's


def _caption_generator(run: _Run, index: int) -> torch.Generator | None:
    """Global micro-batch ``index``'s caption draws (dropout, shuffled orders), when the dataset's captions vary:
    a stream of their own, so noise and timesteps stay those of the same run without them."""
    return micro_generator(run.train.seed ^ _CAPTION_STREAM, index) if run.dataset.captions_vary else None


def _optimizer_step(run: _Run, step: int, loss_sum: float) -> tuple[float, float]:
    """Gradients averaged across ranks, clipped and checked, then the step: (loss sum over ranks, grad norm)."""
    train, resume = run.train, run.resume
    run.ranks.average_gradients(run.params)  # data parallel: every rank takes the same step
    loss_sum = run.ranks.mean(loss_sum, run.device)
    grad_norm = run.ranks.clip(run.params, train.max_grad_norm)  # a process split: the global norm
    if not (math.isfinite(loss_sum) and math.isfinite(grad_norm)):
        raise TrainingDivergedError(
            f"training diverged at step {step}/{train.steps}: the loss is {loss_sum / train.gradient_accumulation} "
            f"and the gradient norm {grad_norm}. Nothing was saved. Lower learning_rate, keep "
            f"max_grad_norm > 0, and check alpha and the dataset cache"
            + (f"; the state of step {resume.last_saved_step} is kept" if resume and resume.last_saved_step else ""))
    run.optimizer.step()
    run.ranks.after_step(run.params)  # a process split: each part's LoRA to the other process
    if run.ema is not None:
        run.ema.update()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    run.timer.mark("optimizer")
    return loss_sum, grad_norm


def _record_step(run: _Run, step: int, loss_sum: float, grad_norm: float, t0: float, breakdown,
                 validation: float | None = None) -> None:
    """The step into the result, a periodic save when due, and the callback's ``on_step`` (its time since
    ``t0`` counts the save)."""
    train, result = run.train, run.result
    result.loss_history.append(loss_sum / train.gradient_accumulation)
    result.lr_history.append(run.scheduler.get_last_lr()[0])
    result.steps = step
    peak = _peak_gb(run.placement.devices)
    result.peak_vram_gb = peak
    if run.resume is not None:
        _report_saves(run)  # a background save that ended since: said, its error raised here
        run.snapshot = RngSnapshot.take(step, run.drawn)
        if run.resume.due(step, train.steps):
            _save_state(run, periodic=True)
    try:  # ComfyUI's progress hook raises its interrupt here too: keep this step
        run.cb.on_step(StepInfo(step, train.steps, result.loss_history[-1], result.lr_history[-1],
                                grad_norm, time.perf_counter() - t0, peak, run.placement.pinned_gb,
                                run.sampler.seconds if run.sampler is not None else 0.0, breakdown,
                                host_ram_gb=round(process_memory().unreclaimable / 1e9, 2),
                                predicted_host_gb=run.placement.predicted_host_gb, validation_loss=validation))
    except BaseException:
        if step < train.steps:
            _save_state(run)
        raise


def _adapter_state(run: _Run, ema: bool = False) -> dict:
    """The adapter's weights as saved (lora_attach.lora_state_dict); ``ema``: their EMA ({} when off)."""
    if not ema:
        return lora_state_dict(run.model, run.lora)
    if run.ema is None:
        return {}
    with run.ema.swapped():
        return lora_state_dict(run.model, run.lora)


def _save_state(run: _Run, periodic: bool = False) -> None:
    """Save the training state of the last finished step (rank 0, resume only). A periodic save is copied to
    host memory here and written on the store's writer thread (its outcome is said at a later step boundary;
    one that fails for want of storage is a warning). A final one (a stop) is complete when this returns, and
    a failure raises."""
    if run.resume is None or run.snapshot is None or run.snapshot.step == 0 or not run.ranks.is_main:
        return
    _check_finite_weights(run.named, run.snapshot.step)
    # One save at a time: a background save still being written when the next is due (or a stop comes) is
    # waited for here, and said, before this one is copied (its host copy is reused; states land in order).
    # Before a stop's own save its error is only said: that save supersedes it (and raises if it fails too).
    _report_saves(run, wait=True, raise_errors=periodic)
    state = (run.named, run.optimizer, run.scheduler, run.snapshot, run.result.loss_history, run.result.lr_history)
    if periodic:
        run.resume.save_in_background(*state)
        return
    path = run.resume.save(*state)
    if path is not None:
        run.cb.log(f"training state at step {run.snapshot.step}/{run.train.steps} saved in '{path.parent}'")


def _report_saves(run: _Run, wait: bool = False, raise_errors: bool = True) -> None:
    """On the training thread, what became of the background saves that ended (``wait``: the one in flight
    too): saved; a warning when storage ran out (training goes on, the previous state is kept); any other
    error on the writer is raised here (``raise_errors=False``: said as a warning)."""
    if run.resume is None:
        return
    for outcome in run.resume.finished(wait):
        error = outcome.error
        if error is None:
            if outcome.path is not None:
                run.cb.log(f"training state at step {outcome.step}/{run.train.steps} saved in "
                           f"'{outcome.path.parent}'")
        elif isinstance(error, StorageError):
            run.cb.log(f"warning: the periodic training state was not saved ({error}); training goes on")
        elif raise_errors:
            raise error
        else:
            run.cb.log(f"warning: the periodic training state of step {outcome.step} was not saved: writing it "
                       f"failed ({type(error).__name__}: {error})")


def _end_saves(run: _Run) -> None:
    """However the run ends (an exception included): a background save in flight completes before train_lora
    returns, and is said, never raised (an exception may be on its way out)."""
    _report_saves(run, wait=True, raise_errors=False)
    run.resume.close()


def _stop_requested(run: _Run) -> bool:
    """The callback's stop request, agreed by every rank (they stop at the same point, or the collectives
    hang); the state is saved when stopping."""
    try:
        stop = run.cb.should_stop()
    except BaseException:  # ComfyUI's Cancel, Ctrl-C in the headless runner: keep the progress
        _save_state(run)
        raise
    stop = run.ranks.any(stop, run.device)  # every rank stops at the same point, or the collectives hang
    if stop:
        _save_state(run)
    return stop


def _check_ranks_agree(run: _Run) -> None:
    """Every rank must hold the same weights (same averaged gradients, same steps): recorded, and checked."""
    ranks, device, result = run.ranks, run.device, run.result
    sums = ranks.gather(float(sum(p.detach().double().sum().item() for p in run.params)), device)
    result.settings[ranks.kind] = {"world_size": ranks.world_size, "weight_checksums": sums,
                                        "peak_vram_gb": ranks.gather(result.peak_vram_gb, device)}
    if max(sums) - min(sums) > 1e-6 * max(1.0, max(abs(v) for v in sums)):
        run.cb.log(f"warning: the ranks' LoRA weights differ (checksums {sums}); rank 0's are returned")


def _finish(run: _Run, drop_model: bool) -> list[str]:
    """Whatever happened: the LoRA's weights into the result (none with NaN/inf: their names are returned),
    the plan and compile reports, then every phase undone (compiled blocks, recompute, placement), so a
    preloaded model is left as found (benchmarks train it again); one we loaded is dropped."""
    result, model = run.result, run.model
    result.seconds = time.perf_counter() - run.start
    result.state_dict = _adapter_state(run) if result.steps else {}
    result.ema_state_dict = _adapter_state(run, ema=True) if result.steps else {}
    result.snapshots = [str(p) for p in run.snapshots.paths] if run.snapshots is not None else []
    bad = [k for k, v in result.state_dict.items() if not torch.isfinite(v).all()]
    bad += [f"ema/{k}" for k, v in result.ema_state_dict.items() if not torch.isfinite(v).all()]
    if bad:  # never hand on (or save, or cache) a LoRA with NaN/inf weights
        result.state_dict, result.ema_state_dict, result.interrupted = {}, {}, True
    if run.compiled is not None and run.compiled.graphs():
        result.settings.setdefault("compile", {})["graphs"] = run.compiled.graphs()
    run.placement.report(result.settings)
    run.undo.close()
    model.eval()
    # Drop every reference to the model and the LoRA, so the memory below is given back.
    run.optimizer = run.scheduler = run.sampler = run.compiled = None
    run.params, run.named = [], []
    if drop_model:
        run.model = model = None
    release_device_memory(run.device)
    return bad


def _take_samples_or_save(run: _Run, step: int) -> None:
    """Samples at ``step``. A stop raised while they are drawn (ComfyUI's Cancel, from its progress hook or
    the sampler's polls; Ctrl-C) saves the state of the finished step first, as a stop between steps does:
    the re-queue resumes from ``step`` and draws the samples cut short (after the last step too: the re-queue
    then only samples, instead of training the whole run again)."""
    ema = run.ema is not None and run.lora.adapter.ema_previews  # LoRA Adapter's choice: the EMA weights draw
    try:
        with run.ema.applied() if ema else contextlib.nullcontext():
            _take_samples(run.sampler, step, run.autocast, run.result)
    except BaseException:
        _save_state(run)
        raise


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


def _check_finite_weights(named, step: int) -> None:
    """One flag per device, read once (a periodic save's path: a sync per tensor cost ~20 ms per save on the
    GPU); the names of the bad tensors only when there are some."""
    by_device: dict[torch.device, list[torch.Tensor]] = {}
    for _, p in named:
        by_device.setdefault(p.device, []).append(torch.isfinite(p).all())
    if all(bool(torch.stack(flags).all()) for flags in by_device.values()):
        return
    bad = [n for n, p in named if not torch.isfinite(p).all()]
    if bad:
        raise TrainingDivergedError(
            f"the LoRA weights became NaN/inf by step {step} ({len(bad)} tensors, e.g. '{bad[0]}'); nothing was "
            f"saved. Lower learning_rate, keep max_grad_norm > 0, and check alpha")


def _apply_int8_compute(model, offload: OffloadConfig | None, device: torch.device, cb) -> None:
    """Set the slab layers' matmul path (engine/slab/w8a8.py) from the offload config."""
    from ..slab.int8_linear import set_int8_compute

    mode = offload.int8_compute if offload is not None else "dequant"
    count = set_int8_compute(model, mode)
    if mode != "dequant":
        if count == 0:
            cb.log(f"int8_compute={mode!r} applies to int8 slabs only; this model is not an int8 slab (bf16, or an "
                   f"int4 slab, whose layers always dequantize), so it has no effect")
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


def _compile_blocks(model, family, placement: Placement, train: TrainConfig, cb):
    """torch.compile of the blocks' forwards when Offload Config asks for it, or auto finds it pays
    (engine/train/compile.py), at the plan's activation-memory budget (auto may have lowered it)."""
    from .compile import NoCompile, compile_blocks

    on, why_not = placement.compiles(train)
    if not on:
        if why_not and placement.device.type == "cuda":
            cb.log(f"compile auto: off ({why_not})")
        return NoCompile()
    cb.log("compile='blocks': each block type compiles on its first use (the first step takes longer)")
    return compile_blocks(model, family, placement.compile_budget())


def _draw_noise(family, latents, cfg: TrainConfig, gen: torch.Generator, sigma_range: tuple[float, float],
                loss_opts=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(sigmas, noise, per-sample loss weights or None) of one batch, drawn from its generator after the batch's
    flips: the one place they are drawn (the modulation window draws them ahead from the same generator,
    step_window.py). The noise levels and their weights: ``_draw_levels``."""
    sigmas, level_weights = _draw_levels(family, latents, cfg, gen, sigma_range, loss_opts)
    noise = torch.randn(latents.shape, generator=gen).to(latents.device, latents.dtype)
    return sigmas.to(latents.device), noise, level_weights


def _mixed_first_frames(embeds: dict, gen: torch.Generator, loss_opts) -> dict:
    """``embeds`` with which samples hold their first frame (``HELD_ON_KEY``) where ``LossOptions.first_frame_p`` < 1
    mixes image- and text-to-video clips: each sample with probability p, from the batch's generator after its noise
    (so the noise is a p = 1 run's, and a run at 1 draws nothing: its losses are unchanged)."""
    p = loss_opts.first_frame_p if loss_opts is not None else 1.0
    if p >= 1.0 or HELD_KEY not in embeds:
        return embeds
    on = (torch.rand(embeds[HELD_KEY].shape[0], generator=gen) < p).float()
    return {**embeds, HELD_ON_KEY: on}


def _pieces(b: int, micro_batch: int) -> list[slice]:
    """The rows of a batch of ``b`` each forward runs (``micro_batch`` at a time; 0: all)."""
    step = micro_batch if 0 < micro_batch < b else b
    return [slice(start, min(b, start + step)) for start in range(0, b, step)]


def _micro_step(model, family, latents, embeds, cfg: TrainConfig, gen: torch.Generator, autocast,
                scale: float, micro_batch: int = 0, sigma_range: tuple[float, float] = (0.0, 1.0),
                weights: torch.Tensor | None = None, loss_opts=None, window=None,
                calls: list | None = None, preserve: tuple | None = None, pipeline=None) -> float:
    """Forward and backward of one batch; returns its loss. The noise and timesteps are drawn for the whole
    batch; with ``micro_batch`` the batch then runs that many samples at a time, each piece's loss weighted
    by its share, so the accumulated gradient is the whole batch's (activations are one piece's). ``weights``
    (B, h, w): masked loss's latent-grid weights (``flow_matching.weighted_mse``). ``loss_opts`` (LossOptions): the
    noise-level sampler and loss weighting, the family's own by default. ``calls``: the modulation window's outputs
    for each piece (``window.call`` serves them through its forward and backward). ``preserve``: (the class prompt's
    embeddings for the batch, their weight): differential output preservation's loss is added (preservation.py).
    ``pipeline``: a pipelined split's runner (engine/parallel/pipeline.py): the pieces flow through its two GPUs at
    once (not with preservation, whose extra passes run piece by piece)."""
    jobs = _batch_jobs(model, family, latents, embeds, cfg, gen, autocast, scale, micro_batch, sigma_range, weights,
                       loss_opts)
    pieces, shares, piece_loss = jobs.pieces, jobs.shares, jobs.piece_loss
    if pipeline is not None and len(pieces) >= pipeline.min_pieces and preserve is None:
        return _pipelined([jobs], calls, window, pipeline)[0]
    total = 0.0
    noisy, sigmas = jobs.noisy, jobs.sigmas
    for i, (piece, share) in enumerate(zip(pieces, shares)):
        with window.call(calls[i]) if calls is not None else contextlib.nullcontext():
            loss = piece_loss(piece, autocast)
            (loss * (share * scale)).backward()
        if preserve is not None:  # its own forwards after the piece's backward: the peak stays one forward's
            from .preservation import preservation_loss

            kept = preservation_loss(family, model, noisy[piece], {k: v[piece] for k, v in preserve[0].items()},
                                     sigmas[piece], cfg.guidance, autocast) * preserve[1]
            (kept * (share * scale)).backward()
            loss = loss + kept.detach()
        total += loss.item() * share
    return total


@dataclass
class _BatchJobs:
    """One batch's noise drawn and its pieces' losses ready to run (``_batch_jobs``)."""

    pieces: list
    shares: list
    piece_loss: Callable  # (piece, autocast) -> the piece's loss
    scale: float  # the batch's weight in the step's gradient
    autocast: Any
    noisy: Any = None  # the noised latents and their sigmas (preservation's passes reuse them)
    sigmas: Any = None


def _batch_jobs(model, family, latents, embeds, cfg: TrainConfig, gen, autocast, scale: float, micro_batch: int,
                sigma_range, weights, loss_opts) -> _BatchJobs:
    """Draw a batch's noise and timesteps (the batch's generator, as always) and say how each of its pieces'
    losses is computed: the work ``_micro_step`` runs piece by piece, or a pipelined split runs at once."""
    b = latents.shape[0]
    sigmas, noise, level_weights = _draw_noise(family, latents, cfg, gen, sigma_range, loss_opts)
    noisy, target = noisy_latents_and_target(latents, noise, sigmas)
    embeds = _mixed_first_frames(embeds, gen, loss_opts)
    weights = held_weights(embeds, latents, weights)  # an image-to-video model's held first frame: out of the loss
    pieces = _pieces(b, micro_batch)

    def piece_loss(piece, autocast):
        with autocast:
            pred = predict_velocity(family, model, noisy[piece], {k: v[piece] for k, v in embeds.items()},
                                    sigmas[piece], cfg.guidance)
        if level_weights is not None:  # per-sample weights of the noise levels (and the masks, if any)
            per = per_sample_mse(pred, target[piece], None if weights is None else weights[piece])
            return (per * level_weights[piece].to(per.device)).mean()
        if weights is None:
            return torch.nn.functional.mse_loss(pred.float(), target[piece].float())
        return weighted_mse(pred, target[piece], weights[piece])

    return _BatchJobs(pieces, [(p.stop - p.start) / b for p in pieces], piece_loss, scale, autocast, noisy, sigmas)


def _pipelined(batches: list[_BatchJobs], calls: list | None, window, pipeline) -> list[float]:
    """Every piece of ``batches`` through a pipelined split's two GPUs in one 1F1B run (engine/parallel/pipeline.py):
    one batch's pieces, or those of the accumulated batches one pipeline spans (their gradients add up as they would
    one batch after the other). ``calls``: the modulation window's outputs for each piece, in the same order. Returns
    each batch's loss (its pieces' losses weighted by their shares)."""
    from ..parallel.pipeline import autocast_copy

    def job(batch: _BatchJobs, piece, share):
        def run():
            loss = batch.piece_loss(piece, autocast_copy(batch.autocast))
            return loss * (share * batch.scale), loss
        return run

    jobs = [job(b, p, share) for b in batches for p, share in zip(b.pieces, b.shares)]
    with window.served(calls, pipeline.micro_index) if calls is not None else contextlib.nullcontext():
        losses = pipeline.run(jobs)
    out, first = [], 0
    for b in batches:
        out.append(sum(loss.item() * share for loss, share in zip(losses[first:first + len(b.pieces)], b.shares)))
        first += len(b.pieces)
    return out


def _draw_levels(family, latents, cfg: TrainConfig, gen, sigma_range, loss_opts):
    """(sigmas (B,), per-sample loss weights (B,) or None): the family's draw (TrainConfig's timestep_mean,
    timestep_std, shift_timesteps, as before) unless Loss & Validation Options choose another sampler or weighting
    (engine/train/flow_matching.py)."""
    schedule = family.schedule
    sampler, default = loss_opts.sampler(schedule) if loss_opts is not None else (schedule.train_sampling, True)
    b = latents.shape[0]
    if default:
        mean, std, shifted = cfg.timestep_mean, cfg.timestep_std, cfg.shift_timesteps
    else:
        mean, std, shifted = loss_opts.logit_mean, loss_opts.logit_std, True
    mu = schedule.train_shift_mu(latents) if sampler == "shift" and shifted else None
    if sampler == "shift":
        sigmas = sample_sigmas(b, gen, mean, std, mu, *sigma_range)
    else:
        sigmas = draw_sigmas(sampler, b, gen, mean, std, loss_opts.sigmoid_scale if loss_opts else 1.0, None,
                             *sigma_range)
    scheme = loss_opts.weighting(schedule) if loss_opts is not None else schedule.loss_weighting
    return sigmas, loss_weights(scheme, sigmas, loss_opts.snr_gamma if loss_opts is not None else 5.0)


