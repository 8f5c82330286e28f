"""Previews sampled as one batch per denoising step (engine/sampling.sample_prompts) against each prompt sampled
alone, on every registered family's tiny model: prompts of different text lengths (padded, with their masks) and,
where the family has a guidance rule with classifier-free guidance, both branches in the same forward. And the
count that makes batching worth it: with the blocks streamed (the real hooks and scheduler, synchronous CPU copies),
every block runs once per denoising step for all prompts and branches."""
from __future__ import annotations

import pytest
import torch

from lowvram_lora.engine.caching.encoders import encoder_kind
from lowvram_lora.engine.families import Guidance, families, get_family
from lowvram_lora.engine.families.tiny import tiny_transformer
from lowvram_lora.engine.sampling import batch_rows, merge_embeds, sample_latents, sample_prompts

FAMILIES = sorted(families())
CPU = torch.device("cpu")
#: fp32 on the CPU: a batched matmul may sum in another order than a single row's; four Euler steps keep that
#: well inside this.
TOL = dict(rtol=1e-4, atol=1e-4)


def prompt_embeds(model, family, length: int, seed: int) -> dict[str, torch.Tensor]:
    """A random cached prompt as ``DatasetCache.load_text`` gives it (a batch of one; a variable-length encoder's
    states at the prompt's own length with an all-ones mask; a padded encoder's at its fixed length)."""
    g = torch.Generator().manual_seed(seed)
    specs = {s.cache_key: s for s in family.text_encoder_specs(family.tiny_variant)}
    out = {}
    for key, width in family.text_widths(dict(model.config)).items():
        spec = specs[key]
        if encoder_kind(spec.kind).output == "pooled":
            out[key] = torch.randn(1, width, generator=g)
        elif spec.length == "variable":
            out[key] = torch.randn(1, length, width, generator=g)
            out[spec.mask_key] = torch.ones(1, length, dtype=torch.long)
        else:  # padded to the encoder's length (shortened here: a tiny model), zeros after the caption for umT5
            states = torch.randn(1, 24, width, generator=g)
            if spec.length == "zero_padded":
                states[:, length:] = 0
            out[key] = states
    return out


def cfg_rule(family) -> Guidance:
    """The family's classifier-free guidance rule if one of its variants has one (the tiny variant may sample
    without), else a standard one: batching both branches is tested on every family."""
    for variant in family.variants:
        rule = family.guidance(variant)
        if rule.mode == "cfg":
            return rule
    return Guidance(mode="cfg", scale=3.0, formula="standard")


@pytest.fixture(scope="module")
def tiny_models():
    built = {}

    def get(family_id):
        if family_id not in built:
            family = get_family(family_id)
            built[family_id] = (tiny_transformer(family, seed=3).eval(), family)
        return built[family_id]
    return get


@pytest.mark.parametrize("family_id", FAMILIES)
def test_batched_previews_equal_each_prompt_alone(family_id, tiny_models):
    model, family = tiny_models(family_id)
    prompts = [prompt_embeds(model, family, length, seed) for length, seed in ((9, 1), (5, 2), (13, 3))]
    negative = prompt_embeds(model, family, 3, 4)
    width, height, steps = 32, 48, 4
    for rule, guidance in ((family.guidance(family.tiny_variant), 3.5), (cfg_rule(family), 4.0)):
        negatives = [negative] * len(prompts) if rule.mode == "cfg" else None
        alone = [sample_latents(model, family, p, width, height, steps, 5, guidance, CPU, torch.float32, rule=rule,
                                negative=negatives[0] if negatives else None) for p in prompts]
        together = sample_prompts(model, family, prompts, width, height, steps, 5, guidance, CPU, torch.float32,
                                  rule=rule, negatives=negatives)
        one_row = sample_prompts(model, family, prompts, width, height, steps, 5, guidance, CPU, torch.float32,
                                 rule=rule, negatives=negatives, max_rows=1)
        # Two rows at most: 3 prompts as 2 + 1 forwards, 6 rows (with guidance) as 2 + 2 + 2 (batch_rows' even split).
        two_rows = sample_prompts(model, family, prompts, width, height, steps, 5, guidance, CPU, torch.float32,
                                  rule=rule, negatives=negatives, max_rows=2)
        for a, b, c, d in zip(alone, together, one_row, two_rows):
            assert b.shape == a.shape == c.shape == d.shape
            torch.testing.assert_close(b, a, **TOL)
            torch.testing.assert_close(c, a, **TOL)
            torch.testing.assert_close(d, a, **TOL)
        assert (together[0] - together[1]).abs().max() > 1e-3  # the prompts do differ (no broadcast of one row)


def test_rows_are_merged_with_masks_and_split_by_shape():
    a = {"prompt_embeds": torch.ones(1, 2, 4), "prompt_embeds_mask": torch.ones(1, 2, dtype=torch.long),
         "control_latents_0": torch.zeros(1, 16, 4, 4)}
    b = {"prompt_embeds": 2 * torch.ones(1, 3, 4), "prompt_embeds_mask": torch.ones(1, 3, dtype=torch.long),
         "control_latents_0": torch.zeros(1, 16, 4, 4)}
    c = dict(b, control_latents_0=torch.zeros(1, 16, 8, 4))  # another control size: its own forward
    merged = merge_embeds([a, b])
    assert merged["prompt_embeds"].shape == (2, 3, 4) and merged["prompt_embeds"][0, 2].abs().sum() == 0
    assert merged["prompt_embeds_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]
    forwards = batch_rows([a, c, b], None)
    assert [idx for idx, _ in forwards] == [[0, 2], [1]]
    assert [idx for idx, _ in batch_rows([a, b, b], 2)] == [[0, 1], [2]]
    # As even as the bound allows: a streamed forward costs its copies whatever its rows.
    assert [idx for idx, _ in batch_rows([a, a, a, a], 3)] == [[0, 1], [2, 3]]
    assert [idx for idx, _ in batch_rows([a] * 5, 3)] == [[0, 1, 2], [3, 4]]
    assert [idx for idx, _ in batch_rows([a] * 7, 3)] == [[0, 1, 2], [3, 4], [5, 6]]


@pytest.mark.parametrize("family_id", ["flux1", "z_image"])
def test_streamed_previews_visit_each_block_once_per_step(family_id, tiny_models):
    """Two prompts with classifier-free guidance (four rows), blocks streamed with the real scheduler and
    synchronous copies: each block's forward runs once per denoising step (not four times) and each streamed block
    is copied in once per step; the latents equal the resident model's."""
    import copy

    from lowvram_lora.engine.offload import OffloadConfig, Workload, build_plan
    from lowvram_lora.engine.offload.footprint import measure_footprint, named_blocks
    from lowvram_lora.engine.offload.streamer import InlineCopyEngine, apply_offload

    ref, family = tiny_models(family_id)
    model = copy.deepcopy(ref)
    model.enable_gradient_checkpointing()
    prompts = [prompt_embeds(model, family, length, seed) for length, seed in ((9, 1), (5, 2))]
    negatives = [prompt_embeds(model, family, 3, 4)] * 2
    rule = cfg_rule(family)
    want = sample_prompts(ref, family, prompts, 32, 32, 3, 5, 4.0, CPU, torch.float32, rule=rule, negatives=negatives)
    plan = build_plan(measure_footprint(model, family), Workload(1, 64, 16), (), 1, False)
    handle = apply_offload(model, family, OffloadConfig(mode="stream"), CPU, plan=plan, _engine_factory=InlineCopyEngine)
    blocks = named_blocks(model, family)
    visits = {name: 0 for name, _ in blocks}
    hooks = [b.register_forward_pre_hook(lambda m, a, name=name: visits.__setitem__(name, visits[name] + 1))
             for name, b in blocks]
    per_step: list[tuple[dict, int]] = []

    def poll():  # before every Euler step: what the step before did
        loads = sum(1 for e in handle.engine.log if e[0] == "load")
        per_step.append((dict(visits), loads))

    try:
        model.eval()
        got = sample_prompts(model, family, prompts, 32, 32, 3, 5, 4.0, CPU, torch.float32, rule=rule,
                             negatives=negatives, poll=poll)
        poll()
    finally:
        for h in hooks:
            h.remove()
        handle.remove()
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, **TOL)
    assert len(per_step) == 4 and len(plan.streamed) == len(blocks) > 2
    for (before, loads_before), (after, loads_after) in zip(per_step, per_step[1:]):
        assert all(after[n] - before[n] == 1 for n in visits), (before, after)  # once per step for 4 rows
        assert loads_after - loads_before <= len(blocks)  # each streamed block copied in at most once per step


def test_rows_per_forward_keeps_sampling_at_or_below_the_training_peak():
    """The bound on Flux.1-dev's real sizes (a meta model, LoRA r16 counted): the predicted sampling activations of
    the chosen rows fit in what the training peak keeps for activations, one more row does not; a smaller preview
    carries more rows; without a plan, at most one training micro-batch's tokens."""
    from lowvram_lora.engine.families import meta_model
    from lowvram_lora.engine.offload import Workload, build_plan
    from lowvram_lora.engine.offload.footprint import measure_footprint
    from lowvram_lora.engine.offload.plan import GB, TRANSIENT_BYTES
    from lowvram_lora.engine.sampling import SAMPLE_FORWARD_UNITS, rows_per_forward

    family = get_family("flux1")
    fp = measure_footprint(meta_model(family, family.load_config("flux1-dev")), family, trainable_params=18_677_760)
    wl = Workload(1, 4096, 512, "1024x1024")
    for act in (True, False):
        plan = build_plan(fp, wl, (), 2, act)
        for res in (1024, 512):
            rows = rows_per_forward([plan], wl, family, "flux1-dev", res, res)
            tokens = (res // 16) ** 2 + 512
            unit = tokens * fp.hidden_size * 2 * SAMPLE_FORWARD_UNITS * fp.working_set_scale(act)
            ring_at_peak = plan.breakdown["weights"] - fp.other_bytes
            room = plan.breakdown["activations"] - (plan.ring_bytes - ring_at_peak) - TRANSIENT_BYTES
            assert rows * unit <= room < (rows + 1) * unit or rows == 1, (act, res, rows, room / GB)
    offloaded = build_plan(fp, wl, (), 2, True)
    kept = build_plan(fp, wl, (), 2, False)
    assert rows_per_forward([offloaded], wl, family, "flux1-dev", 1024, 1024) == 2  # 36 units of room, 20 a row
    assert rows_per_forward([kept], wl, family, "flux1-dev", 1024, 1024) >= 4  # every block's inputs kept: 91
    assert rows_per_forward([offloaded], wl, family, "flux1-dev", 512, 512) >= 5
    assert rows_per_forward((), wl, family, "flux1-dev", 512, 512) == 3  # 4608 tokens of training, 1536 a row
    assert rows_per_forward((), Workload(4, 4096, 512), family, "flux1-dev", 512, 512, micro_batch=2) == 6
    assert rows_per_forward((), wl, family, "flux1-dev", 1024, 1024) == 1
