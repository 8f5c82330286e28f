"""Finer recompute (token chunks) and the plan arithmetic that uses it; CPU."""
import pytest
import torch

from lowvram_lora.engine.config import LoraSettings, ModelConfig, TrainConfig
from lowvram_lora.engine.models import load_transformer
from lowvram_lora.engine.offload import OffloadConfig
from lowvram_lora.engine.offload.plan import HEADROOM_BYTES, GB, ModelFootprint, Workload, make_plan
from lowvram_lora.engine.families.recompute import run_in_token_chunks
from lowvram_lora.engine.offload.recompute import install_chunked_recompute
from lowvram_lora.engine.train import train_lora
from lowvram_lora.engine.train.lora_attach import attach_lora, detach_lora

from helpers import LogRecorder, block_inputs



def test_chunks_give_the_same_values_and_gradients():
    lin = torch.nn.Linear(8, 8)
    x = torch.randn(2, 10, 8, requires_grad=True)
    whole = torch.nn.functional.gelu(lin(x)).sum()
    gw = torch.autograd.grad(whole, [x, lin.weight])
    chunked = run_in_token_chunks(lambda h: torch.nn.functional.gelu(lin(h)), x, chunks=3).sum()
    gc = torch.autograd.grad(chunked, [x, lin.weight])
    torch.testing.assert_close(chunked, whole)
    for a, b in zip(gc, gw):
        torch.testing.assert_close(a, b)
    with torch.no_grad():  # no autograd: one plain call
        torch.testing.assert_close(run_in_token_chunks(lambda h: h * 2, x, chunks=3), x * 2, rtol=0, atol=0)


@pytest.mark.parametrize("family_id", ["flux1", "flux2"])
def test_chunked_blocks_match_whole_blocks(tiny_pipeline, tiny_flux2, family_id):
    pipe = tiny_pipeline if family_id == "flux1" else tiny_flux2
    model, family, _, _ = load_transformer(pipe, dtype=torch.float32)
    params = attach_lora(model, family, LoraSettings(rank=4), 0)
    with torch.no_grad():
        for p in params:
            p.normal_(0, 0.05)
    model.enable_gradient_checkpointing()
    from lowvram_lora.engine.caching import build_dataset_cache  # noqa: F401  (family inputs below)

    inputs = block_inputs(model, family)
    ref = model(**inputs)[0]
    ref_grads = torch.autograd.grad(ref.square().mean(), params)
    undo = install_chunked_recompute(model, family, 4)
    out = model(**inputs)[0]
    grads = torch.autograd.grad(out.square().mean(), params)
    undo.remove()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
    assert not any("forward" in vars(m) for m in model.modules())  # undone
    detach_lora(model)


@pytest.mark.parametrize("family_id", ["flux1", "flux2"])
def test_training_with_chunks_equals_whole_blocks(request, family_id):
    pipe, cache = (("tiny_pipeline", "tiny_cache") if family_id == "flux1" else ("tiny_flux2", "tiny_flux2_cache"))
    tiny_pipeline, tiny_cache = request.getfixturevalue(pipe), request.getfixturevalue(cache)
    cfg = ModelConfig(transformer_path=str(tiny_pipeline))
    lora, train = LoraSettings(rank=4), TrainConfig(steps=3, learning_rate=2e-3, seed=1)
    whole = train_lora(cfg, tiny_cache, lora, train, offload=OffloadConfig(mode="resident"))
    cb = LogRecorder()
    chunked = train_lora(cfg, tiny_cache, lora, train, cb, offload=OffloadConfig(mode="resident", recompute_chunks=4))
    assert any("4 checkpointed chunks" in m for m in cb.logs)
    for k, v in whole.state_dict.items():
        torch.testing.assert_close(chunked.state_dict[k], v, rtol=1e-4, atol=1e-6)


def _flux1_dev(bf16=True):
    """Flux.1-dev's real block sizes (bf16): 19 double blocks of 0.68 GB (streamed as parts of 0.38 and 0.30 GB
    with activation offload), 38 single of 0.28 GB."""
    return ModelFootprint(name="flux1-dev", block_names=[f"b{i}" for i in range(57)],
                          block_bytes=[679_700_000] * 19 + [283_200_000] * 38, other_bytes=160_000_000,
                          trainable_params=46_700_000, hidden_size=3072,
                          unit_bytes=[[377_300_000, 302_400_000]] * 19 + [None] * 38)


def test_auto_escalates_to_host_moments_then_chunks_then_a_lower_compiled_budget():
    fp = _flux1_dev()
    wl2048, wl1024 = Workload(1, 16384, 512, "2048x2048"), Workload(1, 4096, 512, "1024x1024")
    roomy = make_plan(fp, wl2048, OffloadConfig(mode="auto", vram_budget_gb=12), 12 * GB)
    assert roomy.recompute_chunks == 1 and not roomy.optimizer_on_host
    host = make_plan(fp, wl1024, OffloadConfig(mode="auto", vram_budget_gb=3), 3 * GB)
    assert host.optimizer_on_host and host.recompute_chunks == 1  # the cheaper escalation first
    tight = make_plan(fp, wl2048, OffloadConfig(mode="auto", vram_budget_gb=5), 5 * GB)
    assert tight.recompute_chunks == 5 and tight.optimizer_on_host  # one chunk per 4096 tokens
    assert tight.activation_memory_budget == 1.0 and tight.predicted_peak_bytes + HEADROOM_BYTES <= 5 * GB
    # 2048² in 4 GB: only with compiled blocks, whose activation-memory budget auto lowers as its last step
    with pytest.raises(Exception, match=r"below the smallest plan .* at least 4.8 GB.*compiled blocks"):
        make_plan(fp, wl2048, OffloadConfig(mode="auto", vram_budget_gb=4), 4 * GB)
    compiled = make_plan(fp, wl2048, OffloadConfig(mode="auto", vram_budget_gb=4), 4 * GB, compiled=True)
    assert (compiled.recompute_chunks, compiled.optimizer_on_host, compiled.activation_memory_budget) == (5, True, 0.5)
    assert compiled.predicted_peak_bytes + HEADROOM_BYTES <= 4 * GB and "budget 0.5" in compiled.describe()
    # a budget the user lowered is kept (auto only lowers the default of 1)
    kept = make_plan(fp, wl2048, OffloadConfig(mode="auto", vram_budget_gb=4.5, compile="blocks",
                                               activation_memory_budget=0.7), int(4.5 * GB), compiled=True)
    assert kept.activation_memory_budget == 0.7
    explicit = make_plan(fp, wl1024, OffloadConfig(mode="stream", prefetch_depth=1, activation_offload=True,
                                                   recompute_chunks=8, optimizer_on_host=True), None)
    plain = make_plan(fp, wl1024, OffloadConfig(mode="stream", prefetch_depth=1, activation_offload=True), None)
    assert explicit.breakdown["lora+adam"] == plain.breakdown["lora+adam"] - 8 * fp.trainable_params
    assert explicit.breakdown["activations"] < plain.breakdown["activations"]
    assert "8 token chunks" in explicit.describe() and "moments on the host" in explicit.describe()
    assert explicit.summary()["recompute_chunks"] == 8


def test_bad_settings():
    with pytest.raises(Exception, match="recompute_chunks=0"):
        OffloadConfig(recompute_chunks=0)


def test_a_batch_run_in_pieces_trains_as_the_whole_batch(tiny_pipeline, tmp_path):
    from lowvram_lora.engine.caching import build_dataset_cache
    from lowvram_lora.engine.config import DataConfig
    from lowvram_lora.engine.testing import make_tiny_dataset

    cfg = ModelConfig(transformer_path=str(tiny_pipeline))
    data = make_tiny_dataset(tmp_path / "data", count=4, sizes=((128, 128),))
    cache = build_dataset_cache(cfg, DataConfig(path=str(data), resolution=128, bucket_step=32), tmp_path / "cache")
    lora, train = LoraSettings(rank=4), TrainConfig(steps=3, learning_rate=2e-3, seed=1, batch_size=4)
    whole = train_lora(cfg, cache, lora, train, offload=OffloadConfig(mode="resident"))
    pieces = train_lora(cfg, cache, lora, train, offload=OffloadConfig(mode="resident", micro_batch_size=1))
    assert pieces.loss_history == pytest.approx(whole.loss_history, rel=1e-5)
    for k, v in whole.state_dict.items():  # float summation order only (AdamW scales tiny gradients up)
        torch.testing.assert_close(pieces.state_dict[k], v, rtol=1e-3, atol=2e-5)


def test_auto_runs_a_large_batch_in_pieces_before_chunking():
    fp = _flux1_dev()
    b1 = make_plan(fp, Workload(1, 16384, 512), OffloadConfig(mode="auto", vram_budget_gb=7), 7 * GB)
    b2 = make_plan(fp, Workload(2, 16384, 512), OffloadConfig(mode="auto", vram_budget_gb=7), 7 * GB)
    assert b2.micro_batch == 1 and b2.predicted_peak_bytes == b1.predicted_peak_bytes
    assert "1 sample(s) at a time" in b2.describe() and b2.summary()["micro_batch"] == 1
