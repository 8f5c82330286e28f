"""Known-harmless import warnings are dropped; everything else from those loggers still shows."""
import logging

import lowvram_lora.engine  # noqa: F401  (installs the filters)


def test_known_warnings_are_dropped_and_others_kept(caplog):
    caplog.set_level(logging.WARNING)
    logging.getLogger("torch.utils._pytree").warning(
        "%s is an Enum subclass and is now natively supported by torch.compile as an opaque value type.", "<enum X>")
    logging.getLogger("diffusers.quantizers.torchao.torchao_quantizer").warning(
        "Unable to import `torchao` Tensor objects. This may affect loading checkpoints serialized with `torchao`")
    logging.getLogger("torch.utils._pytree").warning("something new and important")
    messages = [r.getMessage() for r in caplog.records]
    assert messages == ["something new and important"]


def test_importing_the_engine_and_diffusers_prints_no_known_noise(capfd):
    import subprocess
    import sys

    code = ("import lowvram_lora.engine.train.loop, lowvram_lora.engine.slab, diffusers, torchao; "
            "from diffusers import FluxTransformer2DModel")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    for noise in ("is an Enum subclass", "Unable to import `torchao`", "register_constant"):
        assert noise not in out.stderr + out.stdout
