"""The engine's block checkpoint (engine/offload/block_checkpoint.py) against autograd without checkpointing and
against torch's own checkpoint: the same losses and LoRA gradients on every family's tiny model, gradients for a
tensor handed in a tuple and for a block whose inputs need none, dropout replayed, and what it saves on the host."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.utils.checkpoint
from helpers import flow_steps, tiny_lora_transformer
from lowvram_lora.engine.families import families
from lowvram_lora.engine.offload.block_checkpoint import checkpoint
from torch import nn

FAMILIES = sorted(families())


def _torch_checkpoint(block, *args):
    return torch.utils.checkpoint.checkpoint(block.__call__, *args, use_reentrant=False)


@pytest.mark.parametrize("family_id", FAMILIES)
def test_block_checkpoint_trains_like_no_checkpoint_and_torchs(family_id):
    """Two micro-steps of the flow loss: the block checkpoint's losses and LoRA gradients equal those without any
    checkpoint and those of torch's non-reentrant checkpoint (diffusers' default), rtol 1e-5 (fp32 CPU: the same
    operations, recomputed)."""
    model, _, family = tiny_lora_transformer(family_id)
    plain, theirs = copy.deepcopy(model), copy.deepcopy(model)
    plain.disable_gradient_checkpointing()
    theirs.enable_gradient_checkpointing(gradient_checkpointing_func=_torch_checkpoint)
    model.enable_gradient_checkpointing(gradient_checkpointing_func=checkpoint)
    calls = []
    model._gradient_checkpointing_func = lambda block, *args: calls.append(1) or checkpoint(block, *args)
    got, g = flow_steps(model, family)
    assert calls, "the model never called its checkpoint function"
    for ref in (plain, theirs):
        want, g_ref = flow_steps(ref, family)
        assert got == pytest.approx(want, rel=1e-6)
        assert g.keys() == g_ref.keys() and g
        for name in g_ref:
            torch.testing.assert_close(g[name], g_ref[name], rtol=1e-5, atol=1e-7, msg=name)


class _Block(nn.Module):
    """A block taking the token states and a (scale, shift) pair, as Flux.2's blocks take their modulation."""

    def __init__(self, p: float = 0.0):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.drop = nn.Dropout(p)

    def forward(self, x, mod):
        scale, shift = mod
        return self.drop(self.lin(x) * (1 + scale) + shift)


class _Model(nn.Module):
    """A trained modulation layer outside two blocks that share its output (Flux.2 with LoRA on the modulation)."""

    def __init__(self, p: float = 0.0):
        super().__init__()
        self.modulation = nn.Linear(8, 16)
        self.blocks = nn.ModuleList([_Block(p), _Block(p)])

    def forward(self, x, t, fn=None):
        mod = tuple(self.modulation(t).chunk(2))
        for block in self.blocks:
            x = fn(block, x, mod) if fn is not None else block(x, mod)
        return x


def _train(fn, x_grad: bool, p: float = 0.0, seed: int = 0, modulation: bool = True):
    """(output, the gradients of x where it needs one and of every trained weight) of one backward; ``modulation``:
    the modulation layer is trained."""
    torch.manual_seed(0)
    model = _Model(p).train()
    model.modulation.requires_grad_(modulation)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 8, generator=g).requires_grad_(x_grad)
    t = torch.randn(8, generator=g)
    torch.manual_seed(seed)
    out = model(x, t, fn)
    out.square().sum().backward()
    return out.detach(), ([x.grad] if x_grad else []) + [p.grad for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize("x_grad, modulation", [(True, True), (False, True), (False, False)])
def test_shared_tensors_in_a_tuple_and_inputs_that_need_no_gradient(x_grad, modulation):
    """Two blocks share a (scale, shift) pair that a trained layer made, and (``x_grad`` False, the first block's
    case) the token states need no gradient, nor (``modulation`` False) anything handed in: every gradient, the
    shared layer's and each block's, equals autograd's without checkpointing (rtol 1e-6). torch's reentrant
    checkpoint cannot: its backward inside the second block's goes through the shared layer's graph a second time.
    The reason the engine has its own."""
    want, want_grads = _train(None, x_grad, modulation=modulation)
    got, got_grads = _train(checkpoint, x_grad, modulation=modulation)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert len(got_grads) == len(want_grads)
    for a, b in zip(got_grads, want_grads):
        assert a is not None and b is not None
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    if x_grad and modulation:
        with pytest.raises(RuntimeError, match="backward through the graph a second time"):
            _train(lambda b, *a: torch.utils.checkpoint.checkpoint(b, *a, use_reentrant=True), x_grad)


def test_dropout_is_replayed_in_the_recompute():
    """Blocks with dropout: the recompute draws the forward's masks (the RNG state is replayed), so the output and
    the gradients equal autograd's without checkpointing from the same seed (rtol 1e-6)."""
    want, want_grads = _train(None, True, p=0.5, seed=5)
    got, got_grads = _train(checkpoint, True, p=0.5, seed=5)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=0)
    assert (got == 0).any()  # dropout did drop
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def _block_inputs():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 8, generator=g).requires_grad_(True)
    return x, (torch.randn(8, generator=g).requires_grad_(True), torch.randn(8, generator=g))


def test_without_grad_it_is_the_plain_call():
    block = _Block()
    x, mod = _block_inputs()
    with torch.no_grad():
        out = checkpoint(block, x, mod)
        want = block(x, mod)
    assert out.grad_fn is None
    torch.testing.assert_close(out, want, rtol=0, atol=0)


def test_the_forward_records_no_graph_inside_the_block():
    """What makes it cheaper on the host than torch's non-reentrant checkpoint: the forward runs the block without
    recording (one node for the whole block), where torch's records every operation and hooks every saved tensor.
    Counted: the autograd nodes reachable from the block's output."""
    def nodes(out) -> int:
        seen, stack = set(), [out.grad_fn]
        while stack:
            n = stack.pop()
            if n is None or n in seen:
                continue
            seen.add(n)
            stack.extend(f for f, _ in n.next_functions)
        return len(seen)

    block = _Block()
    x, mod = _block_inputs()
    ours = nodes(checkpoint(block, x, mod))
    theirs = nodes(_torch_checkpoint(block, x, mod))
    # ours: the Function and the accumulators of x and scale; torch's: every operation's too
    assert ours == 3 and theirs > 2 * ours


class _Wide(nn.Module):
    """A block with an MLP and a modulation of its own (the shape of a transformer block's memory)."""

    def __init__(self, d: int = 64):
        super().__init__()
        self.a, self.b, self.mod = nn.Linear(d, 4 * d), nn.Linear(4 * d, d), nn.Linear(d, 2 * d)

    def forward(self, x, temb):
        s, g = self.mod(temb).chunk(2, -1)
        return x + g * self.b(torch.nn.functional.gelu(self.a(x * (1 + s))))


def _peak_and_calls(fn, trained: list[int], blocks: int = 6):
    """(peak live bytes, block forward calls, the trained weights' gradients) of one step through ``blocks`` wide
    blocks, of which ``trained`` train their first Linear, every block through ``fn``."""
    from lowvram_lora.engine.testing import LiveBytes

    torch.manual_seed(0)
    model = nn.ModuleList([_Wide() for _ in range(blocks)]).requires_grad_(False)
    for i in trained:
        model[i].a.requires_grad_(True)
    calls = []
    for b in model:
        b.register_forward_pre_hook(lambda *_: calls.append(1))
    x, temb = torch.randn(1, 512, 64), torch.randn(1, 1, 64)
    with LiveBytes() as live:
        h = x
        for b in model:
            h = fn(b, h, temb)
        h.square().mean().backward()
    return live.peak, len(calls), [model[i].a.weight.grad for i in trained]


@pytest.mark.parametrize("trained", [[0, 1, 2, 3, 4, 5], [4, 5]])
def test_memory_and_recompute_match_torchs_checkpoint(trained):
    """Every block trained, or only the last two (LoRA on some blocks): the peak of live tensors (measured with
    LiveBytes, exact bytes) is no higher than under torch's non-reentrant checkpoint, the blocks before the first
    trained one are neither kept nor recomputed (the same count of block calls), and the gradients are torch's
    (rtol 1e-6)."""
    peak_ref, calls_ref, g_ref = _peak_and_calls(_torch_checkpoint, trained)
    peak, calls, g = _peak_and_calls(checkpoint, trained)
    assert peak <= peak_ref, (peak, peak_ref)
    assert calls == calls_ref == 6 + 6 - trained[0]
    for a, b in zip(g, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)


def test_an_input_changed_in_place_before_the_backward_is_refused():
    """The recompute would read the changed values and give a wrong gradient without a word; it is refused, naming
    the input and the fix (torch's own checkpoint refuses it as well)."""
    block = _Block()
    x, mod = _block_inputs()
    out = checkpoint(block, x, mod)
    mod[1].mul_(2)
    with pytest.raises(RuntimeError, match="changed in place between the block's forward and its backward"):
        out.sum().backward()


def test_an_output_nobody_uses_sends_no_gradient_back():
    """As with torch's checkpoint: an input that only an unused output depends on gets no gradient (not zeros)."""
    class TwoOut(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x, y):
            return self.a(x), self.b(y)

    x, y = torch.randn(2, 8, requires_grad=True), torch.randn(2, 8, requires_grad=True)
    used, _unused = checkpoint(TwoOut(), x, y)
    used.sum().backward()
    assert x.grad is not None and y.grad is None


def test_torch_before_2_7_backpropagates_from_the_outputs(monkeypatch):
    """Where ``torch.autograd.backward`` takes no gradient edges (torch < 2.7, which the package still allows), the
    recompute backpropagates from the outputs themselves: the same gradients (rtol 1e-6)."""
    from lowvram_lora.engine.offload import block_checkpoint

    _, want = _train(checkpoint, True)
    monkeypatch.setattr(block_checkpoint, "BACKWARD_FROM_EDGES", False)
    monkeypatch.setattr(block_checkpoint, "get_gradient_edge", None)  # never called on that path
    _, got = _train(checkpoint, True)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)
