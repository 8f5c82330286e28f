"""engine/attention.py: training leaves cuDNN's SDPA out (its backward fails under gradient checkpointing on the
H100), a forward without backward (sampling, also inside a training step's scope) may use it again, and both scopes
restore what they found. The flags are torch's global switches, set without a GPU; the GPU test samples through
both and compares (tests/test_sampling.py)."""
import pytest
import torch

from lowvram_lora.engine.attention import forward_attention, training_attention

CUDA = torch.device("cuda")


def flags():
    b = torch.backends.cuda
    return b.cudnn_sdp_enabled(), b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(), b.math_sdp_enabled()


def test_sampling_inside_training_uses_every_backend_and_restores():
    before = flags()
    with training_attention(CUDA):
        assert flags() == (False, True, True, True)
        with forward_attention(CUDA):
            assert flags() == (True, True, True, True)
        assert flags() == (False, True, True, True)
    assert flags() == before


def test_cpu_changes_nothing():
    before = flags()
    with training_attention(torch.device("cpu")), forward_attention(torch.device("cpu")):
        assert flags() == before


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_sampling_attention_equals_training_attention_on_gpu():
    """A Flux-shaped attention (24 heads of 128, 2 rows) under the sampling scope (cuDNN first where torch prefers
    it) gives what the training scope's flash kernel gives, to bf16 rounding."""
    import torch.nn.functional as F

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 24, 1536, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
    with torch.no_grad():
        with training_attention(CUDA):
            ref = F.scaled_dot_product_attention(q, k, v)
            with forward_attention(CUDA):
                out = F.scaled_dot_product_attention(q, k, v)
    torch.testing.assert_close(out.float(), ref.float(), rtol=2e-2, atol=2e-2)
