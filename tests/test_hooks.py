"""engine/offload/hooks.py: named hooks on one registry per module, exact undo; the block streamer's hook on it."""
import pytest
import torch
from torch import nn

from lowvram_lora.engine.offload.hooks import ATTRIBUTE, HookRegistry, ModelHook


class AddToInput(ModelHook):
    def __init__(self, value, log):
        self.value, self.log = value, log

    def pre_forward(self, module, args, kwargs):
        self.log.append(("pre", self.value))
        return (args[0] + self.value,), kwargs


class ScaleOutput(ModelHook):
    def __init__(self, value, log):
        self.value, self.log = value, log

    def post_forward(self, module, output):
        self.log.append(("post", self.value))
        return output * self.value


def _torch_hooks(m: nn.Module) -> tuple[int, int]:
    return len(m._forward_pre_hooks), len(m._forward_hooks)


def test_hooks_run_in_order_and_remove_exactly():
    torch.manual_seed(0)
    lin = nn.Linear(4, 3)
    x = torch.randn(2, 4)
    plain = lin(x)
    before = dict(vars(lin))
    log = []
    reg = HookRegistry.of(lin)
    assert HookRegistry.of(lin) is reg and HookRegistry.find(lin) is reg
    reg.register("a", AddToInput(1.0, log))
    reg.register("b", AddToInput(2.0, log))
    reg.register("s", ScaleOutput(3.0, log))
    assert _torch_hooks(lin) == (1, 1)  # one dispatcher each, however many hooks
    torch.testing.assert_close(lin(x), lin.forward(x + 3.0) * 3.0, rtol=0, atol=0)
    assert log == [("pre", 1.0), ("pre", 2.0), ("post", 3.0)]
    with pytest.raises(ValueError, match="already has a hook named 'a'"):
        reg.register("a", AddToInput(5.0, log))
    reg.remove("s")
    assert _torch_hooks(lin) == (1, 0)  # no post hook left: its dispatcher goes
    reg.remove("a")
    reg.remove("b")
    with pytest.raises(KeyError, match="no hook named 'b'"):
        reg.remove("b")
    # exactly as before: no torch hooks, no registry attribute, the same forward
    assert _torch_hooks(lin) == (0, 0) and ATTRIBUTE not in vars(lin) and HookRegistry.find(lin) is None
    assert vars(lin).keys() == before.keys()
    assert torch.equal(lin(x), plain)
    assert ATTRIBUTE not in lin.state_dict()


def test_pre_hooks_fire_again_in_a_checkpointed_recompute():
    """Block streaming relies on it: the weights must be made ready when backward recomputes the block."""
    lin = nn.Linear(4, 4)
    log = []
    HookRegistry.of(lin).register("count", AddToInput(0.0, log))
    x = torch.randn(2, 4, requires_grad=True)
    torch.utils.checkpoint.checkpoint(lin, x, use_reentrant=False).sum().backward()
    assert [e for e in log if e[0] == "pre"] == [("pre", 0.0), ("pre", 0.0)]
    HookRegistry.of(lin).remove("count")


def test_streaming_twice_on_one_model_is_refused_and_remove_leaves_no_hook():
    """The block streamer's per-unit hook lives on the registry: a second apply without remove() is an
    error naming the hook (not two schedulers silently fighting over the slots), and remove() leaves
    every block without a hook or registry."""
    from lowvram_lora.engine.offload import OffloadConfig, Workload
    from lowvram_lora.engine.offload.footprint import named_blocks
    from lowvram_lora.engine.offload.streamer import STREAM_HOOK, InlineCopyEngine, apply_offload

    from test_offload_streaming import FAMILY, lora_model

    model, _ = lora_model(1, 1)
    cfg = OffloadConfig(mode="stream", prefetch_depth=1)
    handle = apply_offload(model, FAMILY, cfg, torch.device("cpu"), workload=Workload(1, 16, 7),
                           _engine_factory=InlineCopyEngine)
    blocks = [b for _, b in named_blocks(model, FAMILY)]
    assert all(HookRegistry.find(b).get(STREAM_HOOK) is not None for b in blocks)
    with pytest.raises(ValueError, match="already has a hook named 'block_streaming'"):
        apply_offload(model, FAMILY, cfg, torch.device("cpu"), workload=Workload(1, 16, 7),
                      _engine_factory=InlineCopyEngine)
    handle.remove()
    assert all(HookRegistry.find(m) is None and not m._forward_pre_hooks for m in model.modules())
