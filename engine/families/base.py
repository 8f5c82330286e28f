"""What a model family is, as the engine sees it: one folder, one ``ModelFamily`` subclass.

A family lives in ``engine/families/<id>/``: its ``__init__.py`` defines ``FAMILY`` (an instance of a
``ModelFamily`` subclass); beside it sit its name map, block parts, shipped configs, tiny-model
fixtures (``fixtures.py``) and workflow templates (``templates.py``). The registry finds the folders and
those modules by their names, so adding a family touches no file outside its folder.

The engine talks to families only through this class and its specs. The class is a small core (identity,
text, latents, the forward); every other concern is a spec, a frozen dataclass in its own file under
``engine/families/specs/`` that the family declares (a subclass of its own where it needs code), as the text
encoders (``TextEncoderSpec``), the VAE (``VaeSpec``) and guidance (``Guidance``) are. Nothing is probed with
``getattr``. A new capability is a new spec or handler file, not another member here.

How the pieces flow:
- identity: ``diffusers_class_name`` (a diffusers folder), ``looks_like_single_file`` + ``param_table``
  (a single file with native names), ``variants`` + ``structural_keys`` (which shipped config it is);
- text: ``text_encoder_specs`` (kinds, templates, hidden layers, length policy) -> the dataset cache;
- latents: ``vae_for(variant)`` (``VaeSpec``): pixels <-> what the transformer takes, N-D (images;
  video clips as (C, F', h, w), an image one frame);
- the forward: ``model_inputs`` + ``unpack_prediction`` (``predict_velocity`` below puts them together);
- ``schedule`` (``NoiseSchedule``): the prediction convention (the timestep the model is given, the sign of its
  output), the training and sampling shifts, sigmas and ranges;
- ``memory`` (``MemoryProfile``): block lists (execution order), blocks in parts, chunked recompute, the
  activation scales, the rows each Linear multiplies, the planner's token counts;
- ``lora`` (``LoraForm``): default targets, the form ComfyUI's loader wants, the file's architecture name.
"""
from __future__ import annotations

import json
from abc import ABC, abstractmethod
from importlib import import_module, resources
from typing import Any, ClassVar

import torch
from torch import nn

from .names import NativeParam
from .specs import ControlImages, FirstFrameCondition, Guidance, LoraForm, MemoryProfile, NoiseSchedule, TextEncoderSpec, VaeSpec


class ModelFamily(ABC):
    """Base of every family; a family folder subclasses it and sets ``FAMILY`` in its ``__init__``.

    The core: identity, text, latents and the forward. Everything else a family declares is a spec
    (``engine/families/specs/``): ``memory``, ``schedule``, ``lora``; fixtures and templates are modules of the
    folder, found by the registry (``registry.family_fixtures``, ``registry.family_templates``)."""

    # identity
    id: ClassVar[str]
    display_name: ClassVar[str]
    variants: ClassVar[dict[str, str]]  # variant id -> shipped config file in the folder's configs/
    diffusers_class_name: ClassVar[str]
    #: Config keys that tell the variants apart (a diffusers config or a slab manifest is matched on them).
    structural_keys: ClassVar[tuple[str, ...]]
    #: The tiny random variant the fixtures build (tests, the demo).
    tiny_variant: ClassVar[str]
    #: What users have on disk, for the nodes' tooltips (written once here, collected over the registry):
    #: ``checkpoint`` (models/diffusion_models), ``pipeline`` (a diffusers folder's parts), ``single_files``
    #: (models/text_encoders and models/vae).
    file_help: ClassVar[dict[str, str]] = {}
    #: Native tensors real files carry that the model does not use (not in ``param_table``): ignored on reading
    #: (a name ending in "." ignores every tensor under that prefix).
    unused_native_keys: ClassVar[tuple[str, ...]] = ()

    #: The model trains on clips (5-D latents): Cache Text Embeds reads the dataset folder's clips by its video
    #: settings (images count as one-frame clips). Image families read images only.
    video: ClassVar[bool] = False

    # specs (engine/families/specs/)
    memory: ClassVar[MemoryProfile]
    schedule: ClassVar[NoiseSchedule]
    lora: ClassVar[LoraForm]

    # --- identity --------------------------------------------------------------------------------

    def transformer_class(self) -> type[nn.Module]:
        import diffusers

        return getattr(diffusers, self.diffusers_class_name)

    def load_config(self, variant: str) -> dict[str, Any]:
        """A variant's shipped transformer config (no hub access, ever)."""
        return load_package_json(type(self).__module__, "configs", self.variants[variant])

    def variant_for_config(self, config: dict[str, Any]) -> str:
        """The shipped variant whose structural keys ``config`` has, else ``custom``."""
        for variant in self.variants:
            shipped = self.load_config(variant)
            if all(shipped.get(k) == config.get(k) for k in self.structural_keys):
                return variant
        return "custom"

    def variant_from_name(self, variant: str, name: str, keys: frozenset[str] | set[str] = frozenset()) -> str:
        """Variants that no shape tells apart (Z-Image Turbo and Base) told apart by the file or folder ``name``,
        and for a single file by its (prefix-stripped) tensor ``keys``, unused ones included (ComfyUI marks
        Qwen-Image-Edit-2511 with a flag tensor). The default keeps the variant the config matched. When the answer
        differs from the shape-matched variant, a file is built with that variant's shipped config."""
        return variant

    @abstractmethod
    def looks_like_single_file(self, keys: set[str]) -> bool:
        """Whether a single file's (prefix-stripped) tensor names are this family's native names."""

    @abstractmethod
    def param_table(self, config: dict[str, Any]) -> list[NativeParam]:
        """Every parameter of a native single file and where it lives in diffusers (``names.py``)."""

    # --- text ------------------------------------------------------------------------------------

    @abstractmethod
    def text_encoder_specs(self, variant: str) -> tuple[TextEncoderSpec, ...]:
        """The variant's text encoders, in the order the cache runs them; a sequence encoder's ``max_length`` is
        the variant's default (``default_max_sequence_length``)."""

    @abstractmethod
    def text_widths(self, config: dict[str, Any]) -> dict[str, int]:
        """Width of each cached embedding the transformer takes (a cache is checked against it)."""

    # --- latents ---------------------------------------------------------------------------------

    def vae_for(self, variant: str | None) -> VaeSpec:
        """The VAE of ``variant`` (None or ``custom``: the family's default). The default: the Flux.1 AE
        (``VaeSpec()``); a family with another VAE, or VAEs per variant (Wan 2.2 TI2V-5B), overrides it."""
        return VaeSpec()

    @abstractmethod
    def latent_shape(self, model: nn.Module, width: int, height: int, frames: int = 1) -> tuple[int, ...]:
        """The cached latent's shape (without batch) for a width x height image, or a clip of ``frames`` frames
        (video families; image families refuse ``frames`` > 1 with ``image_only``)."""

    # --- the forward -----------------------------------------------------------------------------

    @abstractmethod
    def model_inputs(self, model: nn.Module, latents: torch.Tensor, embeds: dict[str, torch.Tensor],
                     sigmas: torch.Tensor, guidance: float) -> dict[str, Any]:
        """Keyword arguments of the transformer's forward on noisy latents (B, ...) at noise levels
        ``sigmas`` (B,); ``embeds`` holds the cached embeddings and, for variable-length encoders,
        their masks (``TextEncoderSpec.mask_key``), and any other per-sample conditioning the family caches as
        tensors with a batch axis (Qwen-Image-Edit's control latents, under keys the family documents).
        Timesteps follow ``self.schedule.prediction``."""

    @abstractmethod
    def unpack_prediction(self, output: Any, latents: torch.Tensor) -> torch.Tensor:
        """The forward's raw output (``return_dict=False``) in the latents' shape, sign as the model gives it."""

    def control_images(self, variant: str) -> ControlImages | None:
        """How an edit ``variant`` takes control images (its text spec then has ``control_images``); None for a model
        that takes none."""
        return None

    def first_frame(self, variant: str) -> FirstFrameCondition | None:
        """How an image-to-video ``variant`` is conditioned on each clip's first frame (the cache keeps it per clip
        window, previews take a dataset clip's first frame); None for a model that takes none."""
        return None

    def guidance(self, variant: str) -> Guidance:
        """How ``variant`` samples previews."""
        return Guidance()

    def __repr__(self) -> str:
        return f"<family {self.id}>"


def predict_velocity(family: ModelFamily, model: nn.Module, noisy: torch.Tensor, embeds: dict[str, torch.Tensor],
                     sigmas: torch.Tensor, guidance: float, joint_output: int | None = None):
    """The model's velocity (noise - x0) at ``sigmas`` in the latents' shape, whatever its convention (the timestep
    it is given, the sign of its output: ``family.schedule.prediction``): the one place training and sampling call
    the model. ``joint_output``: also return that output of the forward, a joint model's other stream's velocity
    under the same sign (``JointStream``): ``(velocity, stream velocity)``."""
    out = model(**family.model_inputs(model, noisy, embeds, sigmas, guidance))
    sign = 1.0 if family.schedule.prediction.sign > 0 else -1.0
    velocity = family.unpack_prediction(out[0], noisy)
    velocity = velocity if sign > 0 else -velocity
    return velocity if joint_output is None else (velocity, sign * out[joint_output])


def default_max_sequence_length(family: ModelFamily, variant: str) -> int:
    """Tokens of the variant's sequence encoder (the longest one) by default: its spec's ``max_length``."""
    return max(s.max_length for s in family.text_encoder_specs(variant) if s.kind != "clip_pooled")


def image_only(family: ModelFamily, frames: int) -> None:
    """The check of an image family's ``latent_shape``: one frame only."""
    if frames != 1:
        from ..errors import ConfigError

        raise ConfigError(f"{family.display_name} is an image model; it takes one frame, not {frames}")


def family_package(family: ModelFamily) -> str:
    """The dotted name of the family's folder (``lowvram_lora.engine.families.flux1``)."""
    return _folder(type(family).__module__)


def _folder(module: str) -> str:
    return module if hasattr(import_module(module), "__path__") else module.rpartition(".")[0]


def load_package_json(module: str, *path: str) -> Any:
    """A JSON file shipped inside a package (``module``'s folder, or the folder of a package module)."""
    ref = resources.files(_folder(module))
    for part in path:
        ref = ref.joinpath(part)
    return json.loads(ref.read_text())


def text_architecture_config(family: ModelFamily | None, name: str):
    """The shipped config file (a ``Traversable``) of text-encoder architecture ``name`` (``qwen3-4b``): the
    family folder's ``configs/text/<name>.json`` first, then the shared ``engine/families/configs/text/``."""
    if family is not None:
        own = resources.files(family_package(family)).joinpath("configs", "text", f"{name}.json")
        if own.is_file():
            return own
    shared = resources.files(__package__).joinpath("configs", "text", f"{name}.json")
    if not shared.is_file():
        raise FileNotFoundError(f"no shipped config for text encoder architecture {name!r}")
    return shared


def shared_config(*path: str) -> dict[str, Any]:
    """A config shipped in ``engine/families/configs/`` (text encoders, VAEs shared by several families)."""
    return load_package_json(__package__, "configs", *path)


def meta_model(family: ModelFamily, config: dict[str, Any]) -> nn.Module:
    """The family's transformer built on the meta device (no memory): the one place models are made
    without weights, for shape checks, footprints and loading by assignment."""
    from accelerate import init_empty_weights

    with init_empty_weights():
        return family.transformer_class().from_config(config)
