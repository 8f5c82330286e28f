"""How many steps the modulation window draws ahead (engine/train/step_window.py): the planner's choice of K.

Each window copies the weights it holds (AdaLN modulation and the time embedders, Flux.1-dev: 3.2 GB int8) to the
GPU once and keeps K steps' outputs there (Flux.1-dev at 1024², batch 1: 2.1 MB a step). Without the window those
weights cross the link twice a step (forward and recompute), so a window of K steps moves 1/(2K) of them per step:
the larger K, the less copied, for K x the vectors' VRAM and K steps of batches drawn ahead (host memory). K is the
smallest count whose window copy costs at most ``COPY_SHARE`` of the steps it serves, within the VRAM the plan
leaves free and ``MAX_STEPS``.
"""
from __future__ import annotations

import math
from typing import Callable, Optional

from ..errors import ConfigError

#: The name of the window's held weights among a plan's host bytes (``host_extra``; engine/train/loop.py).
HOST_KEY = "modulation window"

#: The window's one copy may cost this share of the steps it serves (1%: within the step time's run-to-run spread).
COPY_SHARE = 0.01
#: At most this many steps ahead: beyond it the saving is < 0.2% of the weights' bytes and the batches drawn
#: ahead only grow.
MAX_STEPS = 32
#: Steps ahead when nothing is copied (resident weights: the window saves the recompute's modulation only).
RESIDENT_STEPS = 8


def window_steps(vector_bytes_per_step: int, held_bytes: int, plan=None) -> int:
    """K for a window whose outputs take ``vector_bytes_per_step`` of VRAM per step and whose held weights
    (``held_bytes``, 0 when resident) are copied once per window; ``plan`` (engine/offload/plan.Plan, None when
    resident) gives the link, the predicted step time and the VRAM left under the budget."""
    if plan is None or held_bytes == 0:
        k = RESIDENT_STEPS
    else:
        link = plan.machine.link_bytes_per_s if plan.machine is not None else None
        step_s = plan.step_time.seconds if plan.step_time is not None else None
        k = MAX_STEPS if not (link and step_s) else math.ceil(held_bytes / link / (COPY_SHARE * step_s))
    headroom = _headroom(plan)
    if headroom is not None and vector_bytes_per_step > 0:
        k = min(k, headroom // vector_bytes_per_step)
    return max(1, min(MAX_STEPS, int(k)))


def _headroom(plan) -> Optional[int]:
    """VRAM the plan leaves under its budget beyond the margin it keeps for the allocator (None: no budget): the
    vectors are not in its predicted peak, and the margin is the allocator's fragmentation, not free room."""
    if plan is None or plan.budget_bytes is None:
        return None
    return max(0, plan.budget_bytes - plan.predicted_peak_bytes - plan.margin_bytes)


def place_window_weights(planned: Callable[[dict], "Plan"], host_extra: dict, may_map: bool) -> tuple["Plan", bool]:
    """(plan, whether the window's weights stay in the slab file's map). ``planned(host_extra)`` makes the plan;
    ``host_extra[HOST_KEY]`` is what the window would hold in pinned host memory. ``may_map``: the model is a slab on
    a disk of known rate and host RAM is budgeted. The window copies its weights to the GPU once per window, a disk
    tier block at every load, so where holding the window's weights would put blocks on disk (or not fit at all),
    they stay in the file's map (read once per window, engine/offload/host.py MappedBlock) and the RAM holds blocks."""
    window = host_extra.get(HOST_KEY, 0)
    if not (window and may_map):
        return planned(host_extra), False
    try:
        held = planned(host_extra)
    except ConfigError:
        held = None
    if held is not None and not held.disk_blocks:
        return held, False
    mapped = planned({k: v for k, v in host_extra.items() if k != HOST_KEY})
    if held is not None and held.disk_bytes_per_step <= mapped.disk_bytes_per_step:
        return held, False
    mapped.ram_note = ((mapped.ram_note + "; ") if mapped.ram_note else "") + (
        f"the modulation window's {window / 1e9:.1f} GB of weights stay in the slab file's map, read once per window, "
        f"so that RAM holds streamed blocks")
    return mapped, True
