"""Shared tiny fixtures: built once per test session, offline, from configs."""
import os

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

import gc  # noqa: E402

import pytest  # noqa: E402


class _FreezeBeforeEachTest:
    """Before each test: collect, then move every object still alive (imported modules, fixtures of a wider scope)
    to the collector's permanent generation. The engine collects garbage after each model it drops
    (``release_device_memory``), and with torch, diffusers and transformers imported a full collection walks
    about a million objects (0.2-0.5 s each time, thousands of times a suite, plus Python's own full collections);
    frozen objects are not walked again, and the collection here walks only what the last test left. A test's own
    objects are made after the freeze, so any garbage a test waits for is still collected. What a frozen object
    of a wider-scoped fixture leaves in a reference cycle at its teardown stays until the session ends (tiny
    models: a few MB at most). ``-p no:lowvram-gc-freeze`` turns it off."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_runtest_setup(self, item):
        gc.collect()
        gc.freeze()


def pytest_collection_modifyitems(config, items):
    """Tests marked ``slow`` (pyproject's markers: opt-in) run only when asked for by ``-m`` naming them."""
    if "slow" in (config.getoption("markexpr") or ""):
        return
    skip = pytest.mark.skip(reason="slow: opt-in, run with -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def pytest_configure(config):
    # A plugin, not a conftest hook, so the family folders' tests (engine/families/*/) are covered too.
    config.pluginmanager.register(_FreezeBeforeEachTest(), "lowvram-gc-freeze")


@pytest.fixture(scope="session")
def tiny_pipeline(tmp_path_factory):
    from lowvram_lora.engine.testing import build_tiny_flux1_pipeline

    return build_tiny_flux1_pipeline(tmp_path_factory.mktemp("pipe") / "flux1-tiny")


@pytest.fixture(scope="session")
def tiny_single_file(tiny_pipeline, tmp_path_factory):
    from lowvram_lora.engine.testing import write_bfl_single_file

    return write_bfl_single_file(tiny_pipeline, tmp_path_factory.mktemp("single") / "flux1-tiny.safetensors")


@pytest.fixture(scope="session")
def tiny_family_pipeline(tmp_path_factory):
    """family id -> its tiny pipeline folder (``fixtures.build_tiny_pipeline``, seed 0), built once per session for
    every test that only reads it."""
    from lowvram_lora.engine.testing import build_tiny_pipeline

    built = {}

    def get(family_id):
        if family_id not in built:
            built[family_id] = build_tiny_pipeline(family_id, tmp_path_factory.mktemp(f"pipe-{family_id}") / "pipe")
        return built[family_id]
    return get


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


def _one_captioned_image(folder):
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (64, 64), (200, 40, 40)).save(folder / "a.png")
    (folder / "a.txt").write_text("a red square")


@pytest.fixture
def models_with_empty_files(tmp_path):
    """Combos list what is on disk: make the files every family's shipped templates name exist."""
    from lowvram_lora.engine.families import families, family_templates
    from lowvram_lora.nodes.paths import configure_standalone_dirs

    models = tmp_path / "models"
    for folder in ("diffusion_models", "text_encoders", "vae", "diffusers"):
        (models / folder).mkdir(parents=True)
    for family in families().values():
        for t in family_templates(family):
            for load in [t.load] + [c.get("load", {}) for c in t.chains]:  # every chain's model (A14B experts)
                if "checkpoint" in load:
                    (models / "diffusion_models" / load["checkpoint"]).write_bytes(b"")
            for key in ("text_encoder_1", "text_encoder_2"):
                if key in t.cache:
                    (models / "text_encoders" / t.cache[key]).write_bytes(b"")
            if "vae_file" in t.cache:
                (models / "vae" / t.cache["vae_file"]).write_bytes(b"")
            choice = t.cache.get("text_encoders", "")
            if choice.startswith("diffusers/"):
                (models / choice).mkdir(parents=True, exist_ok=True)
                (models / choice / "model_index.json").write_text("{}")
            for cache in [t.cache] + [c.get("cache", {}) for c in t.chains]:
                if cache.get("dataset_path"):  # Cache Text Embeds checks its dataset when the graph is queued
                    _one_captioned_image(tmp_path / "input" / cache["dataset_path"])
                for part in filter(None, cache.get("control_folder", "").split(";")):  # an edit dataset's controls
                    (tmp_path / "input" / part.strip()).mkdir(parents=True, exist_ok=True)
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
