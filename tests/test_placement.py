"""Placement (engine/train/placement.py): the resident / stream / split decision, taken once, and the exact
undo of a placement applied to a model (CPU)."""
import pytest
import torch

from lowvram_lora.engine.callbacks import TrainingCallback
from lowvram_lora.engine.config import LoraSettings, TrainConfig
from lowvram_lora.engine.errors import ConfigError
from lowvram_lora.engine.models import load_transformer
from lowvram_lora.engine.offload import OffloadConfig
from lowvram_lora.engine.parallel import ParallelConfig
from lowvram_lora.engine.train.placement import Resident, Split, Streamed, choose_placement

from helpers import model_inputs

CPU = torch.device("cpu")
SPLIT_CPU = ParallelConfig(mode="split", devices=("cpu", "cpu"), cut=2)
AUTO_CPU_LOG = "offload mode 'auto' on the CPU: every weight stays resident (streaming needs a CUDA GPU)"
SPLIT_AUTO_CPU_LOG = "offload mode 'auto' on the CPU: both parts of the split stay resident"


class Logs(TrainingCallback):
    def __init__(self):
        self.logs = []

    def log(self, message):
        self.logs.append(message)


@pytest.mark.parametrize("offload, split, kind, logs", [
    (None, None, Resident, []),
    (OffloadConfig(mode="resident"), None, Resident, []),
    (OffloadConfig(mode="auto"), None, Resident, [AUTO_CPU_LOG]),
    (None, SPLIT_CPU, Split, []),
    (OffloadConfig(mode="resident"), SPLIT_CPU, Split, []),
    (OffloadConfig(mode="auto", vram_budget_gb=4), SPLIT_CPU, Split, [SPLIT_AUTO_CPU_LOG]),
])
def test_choose_placement_on_the_cpu(offload, split, kind, logs):
    cb = Logs()
    placement = choose_placement(offload, split, CPU, cb)
    assert type(placement) is kind and cb.logs == logs
    assert placement.device == CPU
    if split is None:
        assert placement.offload is offload and placement.devices == (CPU,)
    else:  # split plans every part itself: auto on a CPU becomes resident, None a resident config
        assert placement.offload == OffloadConfig(mode="resident", gradient_checkpointing=True)
        assert placement.devices == (CPU, CPU)


def test_choose_placement_refuses_streaming_without_cuda():
    with pytest.raises(ConfigError, match=r"offload mode='stream' streams blocks to a CUDA GPU.*use mode='resident'"):
        choose_placement(OffloadConfig(mode="stream"), None, CPU)
    with pytest.raises(ConfigError, match=r"split device cpu is not a CUDA GPU; streaming needs one"):
        choose_placement(OffloadConfig(mode="stream"), SPLIT_CPU, CPU)
    if not torch.cuda.is_available():  # a CUDA device named on a machine without one: require_cuda's error
        with pytest.raises(ConfigError, match=r"no CUDA GPU found"):
            choose_placement(OffloadConfig(mode="auto"), None, torch.device("cuda"))


def test_memory_options_without_a_plan_come_from_offload_config():
    set_ = OffloadConfig(mode="resident", recompute_chunks=4, micro_batch_size=1, optimizer_on_host=True)
    opts = Resident(set_, CPU).memory_options()
    assert opts == (4, False, 1)  # host moments need a GPU to leave
    assert Resident(None, CPU).memory_options() == (1, False, 0)
    assert Resident(set_, CPU).pinned_gb == 0.0


def _snapshot(model):
    """Everything apply may change: tensors bit for bit, requires_grad, module types, checkpointing, a forward."""
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    grads = {n: p.requires_grad for n, p in model.named_parameters()}
    types = {n: type(m).__name__ for n, m in model.named_modules()}
    ckpt = {n: getattr(m, "gradient_checkpointing", None) for n, m in model.named_modules()}
    with torch.no_grad():
        out = model(**model_inputs(model))[0]
    return state, grads, types, ckpt, out


def _assert_same(before, after):
    state, grads, types, ckpt, out = before
    state2, grads2, types2, ckpt2, out2 = after
    assert state.keys() == state2.keys()
    for k, v in state.items():
        assert v.dtype == state2[k].dtype and v.device == state2[k].device
        assert torch.equal(v, state2[k]), k
    assert grads == grads2 and types == types2 and ckpt == ckpt2
    assert torch.equal(out, out2)


@pytest.mark.parametrize("placement", [
    lambda: Resident(None, CPU),
    lambda: Resident(OffloadConfig(mode="resident", gradient_checkpointing=False), CPU),
    lambda: choose_placement(OffloadConfig(mode="resident"), SPLIT_CPU, CPU),
], ids=["resident", "resident-no-checkpointing", "split"])
def test_apply_then_remove_leaves_the_model_exactly_as_before(tiny_pipeline, tiny_cache, placement):
    model, family, _, variant = load_transformer(tiny_pipeline, dtype=torch.float32)
    before = _snapshot(model)
    place = placement()
    params = place.apply(model, family, variant, tiny_cache, LoraSettings(rank=2), TrainConfig(steps=1), Logs())
    # it did something: LoRA is attached and trains (B starts at zero, so the forward is still the base's)
    assert params and all(p.requires_grad and p.dtype == torch.float32 for p in params)
    assert any("lora_A" in n for n, _ in model.named_parameters())
    assert model.is_gradient_checkpointing == place.checkpointing
    with torch.no_grad():
        params[-1].add_(0.5)  # a nonzero LoRA B: the forward changes while attached...
        assert not torch.equal(model(**model_inputs(model))[0], before[-1])
    place.remove()
    _assert_same(before, _snapshot(model))  # ...and is the base's again once removed
    place.remove()  # a second remove does nothing


def test_a_failed_apply_is_undone(tiny_pipeline, tiny_cache):
    """Split attaches LoRA before planning (each part's trainable elements are counted off the model): a
    refused plan must take it off again."""
    model, family, _, variant = load_transformer(tiny_pipeline, dtype=torch.float32)
    before = _snapshot(model)
    place = choose_placement(None, ParallelConfig(mode="split", devices=("cpu", "cpu"), cut=99), CPU)
    with pytest.raises(ConfigError, match="cut=99 must be between 1 and"):
        place.apply(model, family, variant, tiny_cache, LoraSettings(rank=2), TrainConfig(steps=1), Logs())
    _assert_same(before, _snapshot(model))


def test_a_refused_streaming_plan_leaves_the_model_untouched(tiny_pipeline, tiny_cache):
    """Streaming plans before touching the model (the budget is refused before LoRA is attached)."""
    model, family, _, variant = load_transformer(tiny_pipeline, dtype=torch.float32)
    before = _snapshot(model)
    place = Streamed(OffloadConfig(mode="auto", vram_budget_gb=0.001), torch.device("cuda"))
    with pytest.raises(ConfigError, match="vram_budget_gb=0.001 is below the smallest plan"):
        place.apply(model, family, variant, tiny_cache, LoraSettings(rank=2), TrainConfig(steps=1), Logs())
    _assert_same(before, _snapshot(model))
