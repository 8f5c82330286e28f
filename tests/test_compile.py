"""Compiled blocks (engine/train/compile.py), CPU: the wiring with the aot_eager backend (dynamo's graph
capture and the autograd split, without code generation). Speed is measured on the GPU (bench_w8a8.py)."""
import threading
import time

import pytest
import torch

from lowvram_lora.engine.config import LoraSettings, ModelConfig, TrainConfig
from lowvram_lora.engine.errors import ConfigError
from lowvram_lora.engine.models import load_transformer
from lowvram_lora.engine.offload import OffloadConfig
from lowvram_lora.engine.offload.recompute import install_chunked_recompute
from lowvram_lora.engine.train import compile as compile_mod
from lowvram_lora.engine.train import train_lora
from lowvram_lora.engine.train.lora_attach import attach_lora, detach_lora

from helpers import LogRecorder, block_inputs


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("family_id,chunks", [("flux1", 1), ("flux2", 1), ("flux1", 2), ("flux2", 2)])
def test_compiled_blocks_match_eager_and_keep_hooks(tiny_pipeline, tiny_flux2, family_id, chunks):
    model, family, _, _ = load_transformer(tiny_pipeline if family_id == "flux1" else tiny_flux2, dtype=torch.float32)
    params = attach_lora(model, family, LoraSettings(rank=4), 0)
    with torch.no_grad():
        for p in params:
            p.normal_(0, 0.05)
    model.enable_gradient_checkpointing()
    undo = install_chunked_recompute(model, family, chunks)
    inputs = block_inputs(model, family)
    ref = model(**inputs)[0]
    ref_grads = torch.autograd.grad(ref.square().mean(), params)

    calls = []
    blocks = [b for blocks in family.memory.block_lists_of(model) for b in blocks]
    hook = blocks[0].register_forward_pre_hook(lambda m, a: calls.append(1))  # a streamer's pre-hook
    handle = compile_mod.compile_blocks(model, family, 1.0, backend="aot_eager")
    out = model(**inputs)[0]
    grads = torch.autograd.grad(out.square().mean(), params)
    assert calls, "the block's pre-hook did not run around the compiled forward"
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)
    # one compile per block class, not per block (the tiny models have several blocks of each class)
    assert len(blocks) > len({type(b) for b in blocks})
    assert 0 < handle.graphs() <= 4 * len({type(b) for b in blocks}) * (2 if chunks > 1 else 1)
    handle.remove()
    hook.remove()
    undo.remove()
    assert not any("forward" in vars(m) for m in model.modules())  # every forward is the class's again
    detach_lora(model)


def _forward_at(model, family, side: int) -> torch.Tensor:
    """The tiny Flux.1's output, without gradients, for side x side latents drawn from ``side`` as the seed."""
    cfg = model.config
    g = torch.Generator().manual_seed(side)
    lat = torch.randn(1, cfg.in_channels // 4, side, side, generator=g)
    emb = {"prompt_embeds": torch.randn(1, 7, cfg.joint_attention_dim, generator=g),
           "pooled_prompt_embeds": torch.randn(1, cfg.pooled_projection_dim, generator=g)}
    with torch.no_grad():
        return model(**family.model_inputs(model, lat, emb, torch.tensor([0.5]), 1.0))[0]


def test_a_new_token_count_compiles_once_more_then_is_reused(tiny_pipeline):
    model, family, _, _ = load_transformer(tiny_pipeline, dtype=torch.float32)
    params = attach_lora(model, family, LoraSettings(rank=4), 0)
    with torch.no_grad():
        for p in params:
            p.normal_(0, 0.05)  # a LoRA that changes the output, so a graph that drops it would show

    def forward(side):
        return _forward_at(model, family, side)

    eager = {side: forward(side) for side in (16, 20, 24, 12)}  # reference: the same model, not compiled
    handle = compile_mod.compile_blocks(model, family, 1.0, backend="aot_eager")

    def run(side):
        # every bucket's compiled output equals eager's (fp32, tolerance rtol 1e-5 / atol 1e-6: reassociation only)
        torch.testing.assert_close(forward(side), eager[side], rtol=1e-5, atol=1e-6, msg=f"{side}x{side} latents")
        return handle.graphs()

    first = run(16)
    second = run(20)  # a second bucket: recompiled with a dynamic token count
    assert run(24) == second and run(12) == second  # later buckets reuse it
    assert first < second
    handle.remove()
    detach_lora(model)


def test_a_compile_on_one_thread_never_meets_a_compiled_call_on_another(tiny_pipeline):
    """The pipelined split calls compiled blocks from one thread per micro-batch. While one thread compiles, torch.fx's
    process-wide tracing flag is set, and a compiled call finishing on another thread then failed ("Detected that you
    are using FX to symbolically trace a dynamo-optimized function": Flux.1-dev's split on CUDA, session 17). Here the
    backend holds that flag for up to a second while another thread keeps calling the compiled
    blocks: none of those calls may finish inside the compile, none may fail, and the outputs are eager's. Without
    the lock, calls finished inside it (tried)."""
    model, family, _, _ = load_transformer(tiny_pipeline, dtype=torch.float32)

    def forward(side):
        return _forward_at(model, family, side)

    eager = {side: forward(side) for side in (16, 24)}
    finished, during, errors, armed, stop = [], [], [], threading.Event(), threading.Event()

    def hold_the_flag():
        # What a backend tracing with make_fx sets: torch.fx's process-wide tracing flag (set here directly, not by
        # torch.fx.symbolic_trace, whose patch of nn.Module.__call__ would reach the other thread's eager modules too).
        fx = torch.fx._symbolic_trace
        was, fx._is_fx_tracing_flag = fx._is_fx_tracing_flag, True
        try:
            time.sleep(0.05)  # a call that left the lock just before this compile took it has run its hook by now
            n, deadline = len(finished), time.monotonic() + 1.0
            while len(finished) == n and time.monotonic() < deadline:
                time.sleep(0.005)
            during.append(len(finished) - n)
        finally:
            fx._is_fx_tracing_flag = was

    def backend(gm, example_inputs):
        if armed.is_set():
            hold_the_flag()
        return gm.forward

    blocks = [b for blocks in family.memory.block_lists_of(model) for b in blocks]
    hooks = [b.register_forward_hook(lambda m, a, o: finished.append(1)) for b in blocks]  # after the call returns
    handle = compile_mod.compile_blocks(model, family, 1.0, backend=backend)
    torch.testing.assert_close(forward(16), eager[16], rtol=1e-5, atol=1e-6)  # compiled, the flag not held

    def other_thread():
        try:
            while not stop.is_set():
                torch.testing.assert_close(forward(16), eager[16], rtol=1e-5, atol=1e-6)
        except Exception as e:  # noqa: BLE001 - the test reports it
            errors.append(e)

    t = threading.Thread(target=other_thread)
    t.start()
    while len(finished) < 2 * len(blocks):  # the other thread is calling compiled blocks
        time.sleep(0.005)
    armed.set()
    try:
        torch.testing.assert_close(forward(24), eager[24], rtol=1e-5, atol=1e-6)  # a new token count recompiles
    finally:
        stop.set()
        t.join()
    handle.remove()
    for h in hooks:
        h.remove()
    assert not errors, errors
    assert during and all(n == 0 for n in during), during  # each compile ran with no other compiled call finishing


def test_dropout_stays_out_of_compiled_blocks(tiny_pipeline):
    model, family, _, _ = load_transformer(tiny_pipeline, dtype=torch.float32)
    attach_lora(model, family, LoraSettings(rank=4, dropout=0.1), 0)
    handle = compile_mod.compile_blocks(model, family, 1.0, backend="aot_eager")
    drops = [m for m in model.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0]
    assert drops and all("forward" in vars(m) for m in drops)
    handle.remove()
    assert not any("forward" in vars(m) for m in drops)
    detach_lora(model)


def test_train_lora_with_compiled_blocks_trains_like_eager(tiny_pipeline, one_image_cache, monkeypatch):
    monkeypatch.setattr(compile_mod, "DEFAULT_BACKEND", "aot_eager")
    cb = LogRecorder()

    def run(offload):
        return train_lora(ModelConfig(transformer_path=str(tiny_pipeline)), one_image_cache, LoraSettings(rank=4),
                          TrainConfig(steps=3, device="cpu", learning_rate=1e-3), cb, offload=offload)

    eager = run(OffloadConfig(mode="resident"))
    with torch.inference_mode():  # as ComfyUI runs every node
        compiled = run(OffloadConfig(mode="resident", compile="blocks", activation_memory_budget=0.5))
    assert compiled.settings["compile"]["graphs"] > 0
    assert any("compiled blocks" in m and "first step took" in m for m in cb.logs)
    for a, b in zip(compiled.loss_history, eager.loss_history):
        assert a == pytest.approx(b, rel=1e-3)
    for k, v in eager.state_dict.items():
        torch.testing.assert_close(compiled.state_dict[k], v, rtol=1e-3, atol=1e-5)
    assert torch._functorch.config.activation_memory_budget == 1.0  # put back


def test_compile_settings_are_checked():
    with pytest.raises(ConfigError, match="not one of auto, off, blocks"):
        OffloadConfig(compile="yes")
    with pytest.raises(ConfigError, match=r"must be in \(0, 1\]"):
        OffloadConfig(compile="blocks", activation_memory_budget=float("nan"))
    with pytest.raises(ConfigError, match="compiled blocks only"):
        OffloadConfig(compile="off", activation_memory_budget=0.5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_inductor_compiled_training_matches_eager_on_gpu(tiny_pipeline, one_image_cache):
    """The real backend, in fp32 so that a wrong gradient is not hidden in bf16 noise: a compiled run's
    losses and learned weights match eager. (bf16 on Flux.1-dev: bench/RESULTS.md's loss curves.)"""
    def run(**kw):
        return train_lora(ModelConfig(transformer_path=str(tiny_pipeline), dtype="fp32"), one_image_cache,
                          LoraSettings(rank=4),
                          TrainConfig(steps=4, device="cuda", learning_rate=1e-3),
                          offload=OffloadConfig(mode="resident", **kw))

    eager = run()
    for budget in (1.0, 0.5):
        compiled = run(compile="blocks", activation_memory_budget=budget)
        assert compiled.settings["compile"]["graphs"] > 0
        assert compiled.loss_history == pytest.approx(eager.loss_history, rel=1e-3), (budget, compiled.loss_history,
                                                                                     eager.loss_history)
        # lora_B starts at zero, so its value is what training learned: compare that, relative to its size
        for k, v in eager.state_dict.items():
            if "lora_B" in k:
                err = float((compiled.state_dict[k].float() - v.float()).norm() / v.float().norm().clamp_min(1e-12))
                assert err < 1e-2, (budget, k, err)


def test_compile_auto_stays_eager_where_it_would_not_pay(tiny_pipeline, one_image_cache):
    from lowvram_lora.engine.train.compile import AUTO_MIN_STEPS

    result = train_lora(ModelConfig(transformer_path=str(tiny_pipeline)), one_image_cache, LoraSettings(rank=4),
                        TrainConfig(steps=2, device="cpu"), offload=OffloadConfig())  # compile='auto' by default
    assert OffloadConfig().compile == "auto" and AUTO_MIN_STEPS > 2
    assert "compile" not in result.settings  # nothing was compiled on the CPU
    # and it trained exactly as an explicit eager run: same losses and LoRA weights, bit for bit (tolerance 0)
    eager = train_lora(ModelConfig(transformer_path=str(tiny_pipeline)), one_image_cache, LoraSettings(rank=4),
                       TrainConfig(steps=2, device="cpu"), offload=OffloadConfig(compile="off"))
    assert result.loss_history == eager.loss_history
    for k, v in eager.state_dict.items():
        assert torch.equal(result.state_dict[k], v), k


def test_compile_auto_decision(monkeypatch):
    from lowvram_lora.engine.train.compile import AUTO_MIN_STEPS, why_not_auto

    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(compile_mod, "triton_available", lambda: True)
    assert why_not_auto(cuda, AUTO_MIN_STEPS, split=False) is None
    assert "steps" in why_not_auto(cuda, AUTO_MIN_STEPS - 1, split=False)
    assert "Split" in why_not_auto(cuda, 1000, split=True)
    assert "CUDA" in why_not_auto(torch.device("cpu"), 1000, split=False)
    monkeypatch.setattr(compile_mod, "triton_available", lambda: False)
    assert "Triton" in why_not_auto(cuda, 1000, split=False)
