"""transformers' "`CLIPImageProcessor` requires torchvision (not installed); falling back to ..." notices,
printed on every run by diffusers' Flux imports when torchvision is absent, are dropped (issue 28)."""
import logging
import subprocess
import sys

import lowvram_lora.engine  # noqa: F401  (installs the filters)

LOGGER = "transformers.utils.import_utils"


def test_the_torchvision_fallback_notice_is_dropped_and_other_messages_kept(caplog):
    caplog.set_level(logging.WARNING)
    for name in ("CLIPImageProcessor", "SiglipImageProcessor"):
        logging.getLogger(LOGGER).warning(
            f"`{name}` requires torchvision (not installed); falling back to `{name}Pil` for backward "
            f"compatibility. Install torchvision to use the default backend, or import `{name}Pil` directly "
            "to silence this warning.")
    logging.getLogger(LOGGER).warning("something else transformers wants us to know")
    assert [r.getMessage() for r in caplog.records] == ["something else transformers wants us to know"]


def test_importing_diffusers_flux_code_prints_no_torchvision_notice():
    """The imports that printed it: diffusers' Flux pipeline module and its IP-adapter loader."""
    code = ("import lowvram_lora.engine; import diffusers.pipelines.flux.pipeline_flux; "
            "import diffusers.loaders.ip_adapter; from diffusers import FluxPipeline")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "requires torchvision" not in out.stderr + out.stdout, out.stderr


def test_without_our_filter_the_notice_is_printed():
    """Guards the test above: torchvision is absent here, so the same imports alone do print it."""
    import importlib.util

    if importlib.util.find_spec("torchvision") is not None:
        return  # with torchvision installed transformers has nothing to say
    code = "import diffusers.pipelines.flux.pipeline_flux"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "requires torchvision" in out.stderr + out.stdout
