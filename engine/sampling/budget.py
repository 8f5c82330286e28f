"""How many rows one sampling forward may carry so that sampling stays at or below the training peak."""
from __future__ import annotations


#: A no-grad forward's working set through one block, in B*T*D activation units (the planner's unit, scaled by the
#: family's ``working_set_scale`` as the training one is). Measured on the H100 (bench/results.jsonl, bench_sampling
#: row of 2026-11-24T04:11, Flux.1-dev 1024², one prompt, auto at 8 GB): the sampling peak 4.78 GB was 1.92 GB under
#: the training peak 6.70, whose predicted activations were 2.47 GB (91.2 units of 28.3 MB - 0.11 GB), so everything
#: sampling adds, the tiled VAE decode included, was at most 0.55 GB = 19.5 units. Rounded up; the plan's training
#: working set (recompute + backward) is 34.2 units.
SAMPLE_FORWARD_UNITS = 20.0


def rows_per_forward(plans, workload, family, variant: str, width: int, height: int, frames: int = 1,
                     micro_batch: int = 0, extra_bytes: int = 0) -> int:
    """The most rows (prompts and guidance branches) one sampling forward may carry so that sampling stays at or
    below the training peak the plan predicts.

    Sampling holds what training holds apart from its activations: the same weights (resident blocks, the ring of
    streamed ones) and the LoRA with its optimizer state. Training's peak keeps ``max(activations, optimizer
    temporaries)`` above those (``plan.breakdown``); a forward of R rows of T_s tokens needs
    ``R * SAMPLE_FORWARD_UNITS * scale`` units of T_s*D activations plus the fitted intercept, and the ring may be
    fuller during a forward than at the training peak (without activation offload that peak comes at the turn to
    the backward), so the difference is taken off. R is the largest count that fits, at least 1 (one row per forward
    is today's path: never more than training needs, as the sampler's docstring says). Without a plan (resident
    weights) the activations are not predicted: R rows may carry at most the tokens of one training micro-batch
    (a no-grad forward holds less than the recompute and backward of as many tokens; ``micro_batch``: samples per
    training forward, 0 = the whole batch). Several plans (a split):
    each part's bound, the smallest. ``extra_bytes``: what else sampling holds on the GPU (a mixture's partner
    expert while it streams: ``PreviewPartner.rows_bytes``), taken off the room of every plan."""
    from ..offload.plan import MOMENT_BYTES_PER_PARAM, OPTIMIZER_BYTES_PER_PARAM, TRANSIENT_BYTES

    memory = family.memory
    tokens = memory.image_tokens(width, height, variant) * memory.latent_frames(frames) + workload.text_tokens
    if workload.reference_tokens:
        # An edit prompt's control images join its image tokens; the training item's (the largest) stand in for
        # the sample prompt's, which are encoded at the same reference area.
        tokens += workload.image_tokens
    if not plans:
        micro = min(workload.batch, micro_batch or workload.batch)
        return max(1, (micro * workload.tokens) // tokens)
    rows = []
    for plan in plans:
        fp = plan.footprint
        moments = MOMENT_BYTES_PER_PARAM if plan.optimizer_on_host else 0  # as build_plan counts them
        room = max(plan.breakdown["activations"], fp.trainable_params * (OPTIMIZER_BYTES_PER_PARAM + moments))
        ring_at_peak = plan.breakdown["weights"] - fp.other_bytes - sum(fp.block_bytes[i] for i in plan.resident)
        room -= max(0, plan.ring_bytes - ring_at_peak) + TRANSIENT_BYTES + extra_bytes
        per_row = SAMPLE_FORWARD_UNITS * fp.working_set_scale(plan.split_blocks) * tokens * fp.hidden_size \
            * fp.act_bytes_per_elem
        rows.append(max(1, int(room // per_row)))
    return min(rows)
