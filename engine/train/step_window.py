"""The modulation window: per-step constants computed once for K steps drawn ahead.

AdaLN modulation and the time / guidance / pooled-text embedders read only the timestep, the guidance and the
pooled text (the family declares them: ``MemoryProfile.step_constants``, engine/families/specs/step_constants.py).
None of them is trained, so their outputs are constants of a step: the forward and the checkpointed recompute read
the same values, and nothing needs their weights in the backward. Flux.1's modulation is 27% of its block bytes
(bench/NOTES.md, "Why 1.00x at 2.5 GB is out of reach"); streamed, those bytes crossed the link twice per step.

How a window runs:
- ``mark`` (before the weights are placed): the declared modules that no LoRA targets are flagged
  (``STEP_CONSTANT``), so the block streamer, the outer-module holder and the footprint leave their weights out. A
  declared module that a LoRA targets is not constant: it stays in its block and runs as before (logged). A LoRA on
  the embedder itself makes every vector trainable: the window is off (logged).
- ``StepWindow`` (after placement): the flagged modules' weights, where placement left them on the host, go to one
  pinned buffer per module; each module's forward is swapped for one that returns the output stored for the current
  call (``OUT``), or runs the module (its weights copied in for the call) when none is stored: previews and the
  window's own pass.
- ``fill`` (when the queue is empty): the loop draws the next K steps' batches from the same streams in the same
  order (the noise, timesteps and flips are pure functions of the global micro-batch index: batching.py), and gives,
  for each call of the model those steps will make, its forward's arguments. The forward runs up to the source
  module (the time embedding) and stops there (``_Probed``); then each flagged module's weights come to the GPU once
  and it runs on every call's vector in turn (the rows each forward would give it: the same matmul shapes, so the
  outputs are bit for bit the forward's own), and the outputs stay on the GPU.
- ``call`` (around one forward + backward): the flagged modules return that call's outputs; the checkpointed
  recompute reads them again. They carry no gradient, as the modules' own outputs did not.

A resume starts a fresh window at its step; the queue is never saved (the batches it drew are drawn again).
"""
from __future__ import annotations

import contextlib
import types
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
from torch import nn

from ..offload.host import STEP_CONSTANT, HostBlock, MappedBlock

#: The module attribute holding the output stored for the current call (None: run the module).
OUT = "_lowvram_window_out"
#: The module attribute holding its pinned host copy (a ``HostBlock``) while the window holds it.
HELD = "_lowvram_window_host"
#: The module attribute holding the forward it had before the window (None: its class's).
_PREVIOUS = "_lowvram_window_previous_forward"
#: The module attribute saying its held weights are on the GPU now (copied in by an enclosing use).
_BOUND = "_lowvram_window_bound"
#: The module attribute holding (the calls' outputs, which call a use belongs to, its name) while ``served``.
_SERVED = "_lowvram_window_served"


@dataclass
class WindowModules:
    """What ``mark`` flagged: the source (``(name, module)``), the modules it feeds (``(name, module, form)``), and
    the declared names left out because a LoRA targets them."""

    source: tuple[str, nn.Module]
    modules: list[tuple[str, nn.Module, str]]
    excluded: list[str] = field(default_factory=list)

    def all(self) -> list[tuple[str, nn.Module]]:
        return [self.source] + [(n, m) for n, m, _ in self.modules]

    def unmark(self) -> None:
        for _, m in self.all():
            m.__dict__.pop(STEP_CONSTANT, None)

    def drop(self, module_ids: set[int]) -> None:
        """Unflag the modules ``module_ids`` names (a process split's other part: this process never runs them)."""
        for _, m, _ in self.modules:
            if id(m) in module_ids:
                m.__dict__.pop(STEP_CONSTANT, None)
        self.modules = [entry for entry in self.modules if id(entry[1]) not in module_ids]


def mark(model: nn.Module, family, lora_targets: list[str], log: Callable[[str], None]) -> Optional[WindowModules]:
    """Flag the family's per-step-constant modules that ``lora_targets`` (peft's target names) leave alone; None when
    the family declares none, the model cannot use the window, or a LoRA is on the embedder."""
    spec = family.memory.step_constants
    if spec is None:
        return None
    why = spec.unsupported(dict(model.config))
    if why is not None:
        log(f"modulation window: off ({why})")
        return None
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    config = LoraConfig(target_modules=lora_targets)
    targeted = [n for n, _ in model.named_modules() if n and check_target_module_exists(config, n)]

    def trained(name: str) -> bool:  # the module, or a module inside it, gets a LoRA
        return any(t == name or t.startswith(name + ".") for t in targeted)

    named = dict(model.named_modules())
    if spec.source not in named:
        raise RuntimeError(f"{family.display_name}: step_constants.source {spec.source!r} is not a module of the model")
    if trained(spec.source):
        log(f"modulation window: off (a LoRA targets {spec.source}, so the time embedding and all the modulation it "
            f"feeds are trained, not constants of the step)")
        return None
    declared = spec.resolve(model)
    kept = [(n, m, f) for n, m, f in declared if not trained(n)]
    chosen = WindowModules((spec.source, named[spec.source]), kept, [n for n, _, _ in declared if trained(n)])
    if chosen.excluded:
        log(f"modulation window: {len(chosen.excluded)} modulation module(s) carry a LoRA (e.g. {chosen.excluded[0]}); "
            f"they are not constants of the step, so they stay in their blocks and run every step")
    for _, m in chosen.all():
        m.__dict__[STEP_CONSTANT] = True
    return chosen


class _Probed(Exception):
    """Raised after the source module's forward: the window has the call's vector, the rest of the forward is not
    needed."""

    def __init__(self, output: Any):
        super().__init__()
        self.output = output


@torch.compiler.disable
def _run_module(module: nn.Module, args: tuple, kwargs: dict) -> Any:
    """The module's own forward, its weights copied in from its pinned host copy for the call when the window holds
    them (previews, the window's pass). Eager: never inside a compiled block's graph."""
    previous = module.__dict__.get(_PREVIOUS)
    forward = previous if previous is not None else types.MethodType(type(module).forward, module)
    with _weights_on_gpu(module):
        return forward(*args, **kwargs)


def _windowed_forward(self: nn.Module, *args, **kwargs):
    # Traced by dynamo inside compiled blocks: the stored output is a tensor attribute (a graph input, guarded on its
    # shape and dtype, not its identity), so new windows and other blocks of the class reuse the graph.
    out = self._lowvram_window_out  # OUT: always set while this forward is installed
    if out is not None:
        return out
    return _run_module(self, args, kwargs)


@contextlib.contextmanager
def _weights_on_gpu(module: nn.Module):
    host: Optional[HostBlock | MappedBlock] = module.__dict__.get(HELD)
    if host is None or module.__dict__.get(_BOUND):  # resident, or already copied in by an enclosing use
        yield
        return
    device = module.__dict__["_lowvram_window_device"]
    gpu = torch.empty(host.nbytes, dtype=torch.uint8, device=device)
    host.copy_to(gpu)  # on the compute stream: ordered with the work that reads it
    pacer = module.__dict__.get("_lowvram_window_pacer")
    if pacer is not None:  # benches: LOWVRAM_EMULATE_LINK_GBPS paces these copies as the streamer's
        pacer.after_copy(host.nbytes)
    host.bind(gpu)
    module.__dict__[_BOUND] = True
    try:
        yield
    finally:
        module.__dict__[_BOUND] = False
        host.bind_host()  # the GPU buffer returns to the allocator after the kernels queued on its stream


class StepWindow:
    """The flagged modules of one run, their pinned host copies, the queue of drawn micro-batches and their outputs."""

    def __init__(self, model: nn.Module, family, chosen: WindowModules, device: torch.device, autocast, steps: int = 0,
                 release_map: Optional[Callable[[list], int]] = None,
                 devices: Optional[dict[int, torch.device]] = None):
        self.model, self.chosen, self.device, self.autocast = model, chosen, device, autocast
        self.spec = family.memory.step_constants
        self.config = dict(model.config)
        self.steps = steps  # K: steps drawn ahead per window (set by the caller from the planner's choice)
        self.queue: deque = deque()
        self.windows = 0  # windows computed so far
        self.held_bytes = 0  # weights held in pinned host memory
        self.mapped_bytes = 0  # weights left in the slab file's map (``release_map``: host RAM is short)
        pacer = None
        if device.type == "cuda":
            from ..offload.link import pacer_for

            pacer = pacer_for(device)
        # Dual-GPU Split (``devices``: id(module) -> its part's device): a flagged module inside a block lives, runs and
        # keeps its outputs on that block's GPU, so each part's blocks read their own modulation where they run.
        self.devices = devices or {}
        for name, module in chosen.all():
            module.__dict__["_lowvram_window_device"] = self.devices.get(id(module), device)
            module.__dict__["_lowvram_window_pacer"] = pacer
            if device.type == "cuda":
                # One pinned copy, wherever placement left the weights: a streamed block's or an outer module's on
                # the host, a resident block's on the GPU (moved out: the plan's footprint leaves every flagged
                # weight out of VRAM, engine/offload/footprint.py, so a resident plan must not find them there).
                # Where the plan spends host RAM on blocks instead (Streamed.window_from_file), the weights still in
                # the slab's map stay there and are read from it once per window (offload/host.py MappedBlock).
                if release_map is not None and all(t.device.type == "cpu" for t in _frozen(module)):
                    host = MappedBlock(module, name, release_map)
                    self.mapped_bytes += host.nbytes
                else:
                    host, _ = HostBlock.for_block(module, name, pin=True)
                    self.held_bytes += host.nbytes
                module.__dict__[HELD] = host
            module.__dict__[OUT] = None
            module.__dict__[_PREVIOUS] = module.__dict__.get("forward")
            module.forward = types.MethodType(_windowed_forward, module)

    def vector_bytes_per_call_row(self, dtype: torch.dtype) -> int:
        """VRAM one sample of one call keeps (every flagged Linear's output row): the planner's K."""
        width = sum(m.out_features for _, m, _ in self.chosen.modules if isinstance(m, nn.Linear))
        return width * torch.empty((), dtype=dtype).element_size()

    def remove(self) -> None:
        """Forwards back, flags off; held weights stay bound to their pinned host copies (as streamed blocks do)."""
        self.queue.clear()
        for _, module in self.chosen.all():
            previous = module.__dict__.pop(_PREVIOUS, None)
            if previous is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = previous
            for key in (OUT, HELD, _BOUND, "_lowvram_window_device", "_lowvram_window_pacer"):
                module.__dict__.pop(key, None)
        self.chosen.unmark()

    # --- the window's pass -------------------------------------------------------------------------------

    def fill(self, draws: list, calls_of: Callable[[Any], list[dict]]) -> None:
        """Compute the outputs of every call of ``draws`` (the loop's drawn micro-batches, in order) and queue them.
        ``calls_of(draw)``: the forward's keyword arguments of each call that micro-batch makes."""
        per_draw: list[list[dict[str, torch.Tensor]]] = []
        source_name = self.chosen.source[0]
        with torch.no_grad(), self.autocast, _weights_on_gpu(self.chosen.source[1]):
            for draw in draws:
                per_draw.append([{source_name: self._probe(kwargs)} for kwargs in calls_of(draw)])
        calls = [c for cs in per_draw for c in cs]
        for name, module, form in self.chosen.modules:
            # The weights come over once for the whole window; the module then runs call by call, on the rows the
            # forward would give it (the same matmul shapes), so each output is bit for bit the forward's own.
            with torch.no_grad(), self.autocast, _weights_on_gpu(module):
                run = _original(module)
                where = module.__dict__["_lowvram_window_device"]
                for c in calls:
                    c[name] = run(self.spec.module_input(name, form, self.spec.vector(c[source_name]).to(where),
                                                         self.config))
        self.queue.extend(zip(draws, per_draw))
        self.windows += 1

    def _probe(self, kwargs: dict) -> torch.Tensor:
        """The source's output for a forward with ``kwargs``: the model's forward up to the source (no model-level
        hooks: the block streamer does not start a pass)."""
        hook = self.chosen.source[1].register_forward_hook(_stop)
        try:
            type(self.model).forward(self.model, **kwargs)
        except _Probed as probed:
            return probed.output
        finally:
            hook.remove()
        raise RuntimeError(f"the forward never ran {self.chosen.source[0]} (step_constants.source)")

    # --- one call ------------------------------------------------------------------------------------------

    def next(self) -> tuple[Any, list[dict]]:
        """The next drawn micro-batch and its calls' outputs (``fill`` first when the queue is empty)."""
        return self.queue.popleft()

    @contextlib.contextmanager
    def call(self, outputs: Optional[dict[str, torch.Tensor]]) -> Iterator[None]:
        """Within it, the flagged modules return ``outputs`` (one call's): its forward and its backward's recompute."""
        if outputs is None:
            yield
            return
        for name, module in self.chosen.all():
            module.__dict__[OUT] = outputs[name]
        try:
            yield
        finally:
            for _, module in self.chosen.all():
                module.__dict__[OUT] = None


    @contextlib.contextmanager
    def served(self, calls: list[dict[str, torch.Tensor]], which: Callable[[nn.Module], Optional[int]]):
        """Within it, a flagged module returns ``calls[which(module)]``'s output (None: it runs): for a pipelined split,
        whose micro-batches run on several threads at once (engine/parallel/pipeline.py ``micro_index`` says which one
        a call belongs to, in its forward and in its recompute), where ``call``'s one output per module cannot serve."""
        names = {id(m): n for n, m in self.chosen.all()}
        for _, module in self.chosen.all():
            module.__dict__[_SERVED] = (calls, which, names[id(module)])
            module.forward = types.MethodType(_served_forward, module)
        try:
            yield
        finally:
            for _, module in self.chosen.all():
                module.__dict__.pop(_SERVED, None)
                module.forward = types.MethodType(_windowed_forward, module)


def _served_forward(self: nn.Module, *args, **kwargs):
    calls, which, name = self.__dict__[_SERVED]
    k = which(self)
    if k is None:
        return _run_module(self, args, kwargs)
    return calls[k][name]


def _stop(module, args, output):
    raise _Probed(output)


def _original(module: nn.Module) -> Callable:
    previous = module.__dict__.get(_PREVIOUS)
    return previous if previous is not None else types.MethodType(type(module).forward, module)


def _frozen(module: nn.Module) -> list[torch.Tensor]:
    return [t for t in list(module.parameters()) + list(module.buffers()) if not t.requires_grad]

