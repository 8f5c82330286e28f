"""Shared tiny fixtures: built once per test session, offline, from configs."""
import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_pipeline(tmp_path_factory):
    from lowvram_lora.engine.testing import build_tiny_flux1_pipeline

    return build_tiny_flux1_pipeline(tmp_path_factory.mktemp("pipe") / "flux1-tiny")


@pytest.fixture(scope="session")
def tiny_single_file(tiny_pipeline, tmp_path_factory):
    from lowvram_lora.engine.testing import write_bfl_single_file

    return write_bfl_single_file(tiny_pipeline, tmp_path_factory.mktemp("single") / "flux1-tiny.safetensors")


@pytest.fixture
def tiny_dataset(tmp_path):
    from lowvram_lora.engine.testing import make_tiny_dataset

    return make_tiny_dataset(tmp_path / "data", count=4)


@pytest.fixture(scope="session")
def one_image_cache(tiny_pipeline, tmp_path_factory):
    """A cache of a single image: training on it repeats one batch, so the loss must fall."""
    from lowvram_lora.engine.caching import build_dataset_cache
    from lowvram_lora.engine.config import DataConfig, ModelConfig
    from lowvram_lora.engine.testing import make_tiny_dataset

    root = tmp_path_factory.mktemp("one")
    data = make_tiny_dataset(root / "data", count=1)
    return build_dataset_cache(ModelConfig(transformer_path=str(tiny_pipeline)),
                               DataConfig(path=str(data), resolution=128, bucket_step=32), root / "cache")


@pytest.fixture(scope="session")
def tiny_cache(tiny_pipeline, tmp_path_factory):
    """A built dataset cache (6 images, 3 buckets) for training tests."""
    from lowvram_lora.engine.caching import build_dataset_cache
    from lowvram_lora.engine.config import DataConfig, ModelConfig
    from lowvram_lora.engine.testing import make_tiny_dataset

    root = tmp_path_factory.mktemp("cached")
    data = make_tiny_dataset(root / "data", count=6)
    return build_dataset_cache(
        ModelConfig(transformer_path=str(tiny_pipeline)),
        DataConfig(path=str(data), resolution=128, bucket_step=32),
        root / "cache",
    )


@pytest.fixture
def models_with_empty_files(tmp_path):
    """Combos list what is on disk: make the files the shipped workflows name exist."""
    from lowvram_lora.nodes.paths import configure_standalone_dirs

    models = tmp_path / "models"
    (models / "diffusion_models").mkdir(parents=True)
    for name in ("flux1-dev.safetensors", "flux1-tiny.safetensors", "flux2_dev_fp8mixed.safetensors",
                 "flux-2-klein-base-4b.safetensors"):
        (models / "diffusion_models" / name).write_bytes(b"")
    (models / "text_encoders").mkdir(parents=True)
    (models / "vae").mkdir(parents=True)
    for name in ("clip_l.safetensors", "t5xxl_fp16.safetensors", "mistral_3_small_flux2_bf16.safetensors"):
        (models / "text_encoders" / name).write_bytes(b"")
    for name in ("ae.safetensors", "flux2-vae.safetensors"):
        (models / "vae" / name).write_bytes(b"")
    for name in ("FLUX.1-dev", "flux1-tiny", "FLUX.2-dev", "FLUX.2-klein-base-4B"):
        (models / "diffusers" / name).mkdir(parents=True)
        (models / "diffusers" / name / "model_index.json").write_text("{}")
    configure_standalone_dirs(str(models), str(tmp_path / "out"))
    return models


@pytest.fixture(scope="session")
def tiny_flux2(tmp_path_factory):
    """A tiny Flux.2 pipeline folder (Mistral3 text encoder, the Flux.2 VAE with BatchNorm)."""
    from lowvram_lora.engine.testing import build_tiny_flux2_pipeline

    return build_tiny_flux2_pipeline(tmp_path_factory.mktemp("f2") / "flux2-tiny")


@pytest.fixture(scope="session")
def tiny_flux2_cache(tiny_flux2, tmp_path_factory):
    """A one-image Flux.2 cache: training on it repeats one batch, so the loss must fall."""
    from lowvram_lora.engine.caching import build_dataset_cache
    from lowvram_lora.engine.config import DataConfig, ModelConfig
    from lowvram_lora.engine.testing import make_tiny_dataset

    root = tmp_path_factory.mktemp("f2cache")
    data = make_tiny_dataset(root / "data", count=1)
    return build_dataset_cache(ModelConfig(transformer_path=str(tiny_flux2)),
                               DataConfig(path=str(data), resolution=128, bucket_step=32), root / "cache")
