"""engine/offload/host._register on the CPU: what it does before the driver page-locks a buffer (its GPU test is
tests/test_offload_gpu.py::test_a_registered_buffer_is_page_locked_and_copies_exactly)."""
import torch

from lowvram_lora.engine.offload import host


class _Cudart:
    """cudaHostRegister as the driver sees it: the buffer's bytes at that moment."""

    def __init__(self, result: int = 0):
        self.seen, self.result = [], result

    def cudaHostRegister(self, ptr, size, flags):
        self.seen.append((ptr, size, flags, self.buffer.clone()))
        return self.result


def _register_with(monkeypatch, threads: int, result: int = 0):
    cudart = _Cudart(result)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    t = cudart.buffer = torch.full((1 << 16,), 7, dtype=torch.uint8)  # "fresh" memory stands for untouched pages
    return t, cudart


def test_the_pages_are_faulted_in_by_torch_threads_before_the_driver_locks_them(monkeypatch):
    t, cudart = _register_with(monkeypatch, threads=8)
    assert host._register(t)
    ptr, size, flags, at_register = cudart.seen[0]
    assert (ptr, size, flags) == (t.data_ptr(), t.numel(), 0)
    assert int(at_register.count_nonzero()) == 0  # every page written before cudaHostRegister


def test_in_one_thread_the_driver_faults_them_in_itself(monkeypatch):
    t, cudart = _register_with(monkeypatch, threads=1)
    assert host._register(t)
    assert bool((cudart.seen[0][3] == 7).all())  # untouched: no extra pass in one thread


def test_a_refused_registration_says_what_to_do(monkeypatch):
    import pytest

    t, _ = _register_with(monkeypatch, threads=4, result=2)
    with pytest.raises(RuntimeError, match="keep more blocks resident or free host RAM"):
        host._register(t)


def test_without_cuda_nothing_is_registered():
    assert torch.cuda.is_available() or host._register(torch.empty(16, dtype=torch.uint8)) is False


def test_a_pinned_buffer_registers_exactly_its_bytes_and_lets_go_with_its_owner(monkeypatch):
    """PinnedBuffer: the driver is asked for numel x itemsize bytes (torch's pinned allocator would round 0.34 GB up to
    0.54 GB), the tensor has the asked dtype and length, and the registration is undone when the owner goes."""
    import gc

    class Driver:
        def __init__(self):
            self.registered, self.unregistered = [], []

        def cudaHostRegister(self, ptr, size, flags):
            self.registered.append((ptr, size))
            return 0

        def cudaHostUnregister(self, ptr):
            self.unregistered.append(ptr)

    driver = Driver()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: driver)
    owner = host.PinnedBuffer(1000, torch.float32)
    view = owner.tensor[10:20]
    assert owner.pinned and owner.tensor.dtype == torch.float32 and owner.tensor.numel() == 1000
    assert driver.registered == [(owner.tensor.data_ptr(), 4000)]
    ptr = owner.tensor.data_ptr()
    del owner
    gc.collect()
    assert driver.unregistered == [ptr]
    view.fill_(1.0)  # a view outlives the registration: still valid (pageable) memory
    assert host.PinnedBuffer(8, torch.uint8, pin=False).pinned is False and len(driver.registered) == 1


def test_a_dropped_host_flat_waits_for_its_last_copies_before_its_buffers_go(monkeypatch):
    """HostFlat's finalizer synchronizes its last copy-out events before its PinnedBuffers unregister (a run that ends
    in an error drops it with no other wait)."""
    import gc

    from lowvram_lora.engine.offload import host as host_module
    from lowvram_lora.engine.train.host_flat import HostFlat

    order = []

    class Event:
        def synchronize(self):
            order.append("wait")

    monkeypatch.setattr(host_module, "_unregister", lambda buffer: order.append("unregister"))
    flat = HostFlat([torch.ones(4)])
    flat._done[torch.device("cpu")] = Event()
    flat._pinned[torch.device("cpu")].pinned = True
    import weakref

    weakref.finalize(flat._pinned[torch.device("cpu")], host_module._unregister, None)
    del flat
    gc.collect()
    assert order == ["wait", "unregister"]
