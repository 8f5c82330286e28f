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
from dataclasses import dataclass, field
from importlib import import_module, resources
from typing import Any, Callable, ClassVar

import torch
from torch import nn

from .names import NativeParam
from .specs import LoraForm, MemoryProfile, NoiseSchedule

# --- text ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class PromptTemplate:
    """How captions become token ids for one text encoder, exactly as the family's pipeline does it.

    ``plain``: ``prefix`` + the caption + ``suffix``, tokenized (Lumina 2's system prompt + " <Prompt Start> ";
    Qwen-Image's chat turns written out as text, as its pipeline's ``prompt_template_encode`` does).
    ``chat``: the tokenizer's chat template over one user turn (``system`` adds a system turn;
    ``enable_thinking`` is passed to the template when not None; ``generation_prompt`` appends the
    assistant prompt). ``structured``: content as ``[{"type": "text", ...}]`` parts tokenized by the
    template itself, as Mistral's processor does for Flux2Pipeline; otherwise the template renders text,
    which the tokenizer then tokenizes (Qwen3 in Flux2KleinPipeline and ZImagePipeline).
    """

    style: str = "plain"  # "plain" | "chat"
    system: str | None = None
    structured: bool = False
    enable_thinking: bool | None = None
    generation_prompt: bool = True
    prefix: str = ""
    suffix: str = ""  # plain style: text after the caption
    drop: str = ""  # a substring removed from captions first (Flux.2 removes "[IMG]")

    def tokenize(self, tokenizer, prompts: list[str], max_length: int, pad_to_max: bool = True):
        """(input_ids, attention_mask), (B, L): padded to ``max_length`` (or to the longest prompt when not
        ``pad_to_max``), truncated at ``max_length``."""
        prompts = [p.replace(self.drop, "") if self.drop else p for p in prompts]
        pad = dict(padding="max_length" if pad_to_max else "longest", truncation=True, max_length=max_length,
                   return_tensors="pt")
        if self.style == "plain":
            out = tokenizer([self.prefix + p + self.suffix for p in prompts], **pad)
            return out["input_ids"], out["attention_mask"]
        if self.style != "chat":
            raise ValueError(f"unknown prompt template style {self.style!r}")
        wrap = (lambda s: [{"type": "text", "text": s}]) if self.structured else (lambda s: s)
        chats = [([{"role": "system", "content": wrap(self.system)}] if self.system is not None else [])
                 + [{"role": "user", "content": wrap(self.prefix + p)}] for p in prompts]
        extra = {} if self.enable_thinking is None else {"enable_thinking": self.enable_thinking}
        if self.structured:
            out = tokenizer.apply_chat_template(chats, add_generation_prompt=self.generation_prompt, tokenize=True,
                                                return_dict=True, **pad, **extra)
            return out["input_ids"], out["attention_mask"]
        texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=self.generation_prompt,
                                               **extra) for c in chats]
        out = tokenizer(texts, **pad)
        return out["input_ids"], out["attention_mask"]


@dataclass(frozen=True)
class TextEncoderSpec:
    """One text encoder of a pipeline and what we keep from it.

    ``kind`` says what the encoder is, so a single file can be matched to it by its tensor names:
    ``clip_pooled`` (CLIP-L, its pooled vector), ``t5`` (T5-XXL encoder, every token), ``umt5``
    (UMT5-XXL: T5's names, its own tokenizer), ``decoder_lm`` (a decoder LLM run layer-major:
    Mistral3, Qwen3, Gemma-2; ``hidden_layers`` say which hidden states are kept, concatenated per token).
    ``length``: ``padded`` = every caption padded to ``max_length`` and the padding kept (the model was
    trained attending to it: T5, Flux.2's LLMs); ``variable`` = each caption kept at its own length, a
    batch padded with a mask (Z-Image, Lumina 2, Qwen-Image); ``zero_padded`` = padded to ``max_length``, the
    encoder run with the attention mask and the padding rows set to zero (the model attends to them as zeros:
    Wan's umT5, which WanPipeline trims to each caption's length and re-pads with zeros).
    ``final_norm``: the last kept hidden state goes through the decoder's final norm (``hidden_states[-1]``
    as transformers returns it: Qwen-Image); otherwise every kept state is a raw layer output.
    ``drop_tokens``: template tokens cut from the front of each caption's states (Qwen-Image's 34 system-turn
    tokens); ``max_length`` counts the tokens kept, the tokenizer is given ``drop_tokens`` more.
    """

    subfolder: str  # "text_encoder_2"
    tokenizer_subfolder: str  # "tokenizer_2"
    kind: str  # "clip_pooled" | "t5" | "umt5" | "decoder_lm"
    max_length: int
    cache_key: str  # name of the tensor in the cache ("pooled_prompt_embeds")
    hidden_layers: tuple[int, ...] = ()  # decoder_lm: k = the output of k decoder layers (0 = embeddings)
    length: str = "padded"  # "padded" | "variable" | "zero_padded"
    template: PromptTemplate = PromptTemplate()
    #: How the empty negative prompt of classifier-free guidance is tokenized (None: like captions). Lumina 2's
    #: pipeline puts its system prompt before captions only.
    negative_template: PromptTemplate | None = None
    architecture: str = ""  # decoder_lm: shipped config of the real encoder (configs/text/<name>.json)
    final_norm: bool = False
    drop_tokens: int = 0
    #: The tokenizer folder ComfyUI bundles for this encoder (``comfy/text_encoders/<name>``): inside ComfyUI a
    #: single file without a companion tokenizer folder uses it. Only where its files tokenize exactly as the
    #: pipeline does (Qwen-Image's plain template needs no chat template).
    comfyui_tokenizer: str = ""
    #: The prompt carries the sample's control images through the encoder's vision tower (Qwen-Image-Edit): such a
    #: caption is encoded with its images by the family's own multimodal encoder, not by text alone.
    control_images: bool = False

    @property
    def output(self) -> str:
        """What one caption becomes: one vector, one per token, or stacked hidden states per token."""
        return {"clip_pooled": "pooled", "t5": "sequence", "umt5": "sequence", "decoder_lm": "stacked"}[self.kind]

    @property
    def mask_key(self) -> str:
        """Name of the batch's attention mask for a ``variable`` encoder (1 = a real token)."""
        return f"{self.cache_key}_mask"


# --- latents ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VaeSpec:
    """The family's VAE and how its latents become the transformer's input.

    The default is diffusers' ``AutoencoderKL`` with ``(z - shift_factor) * scaling_factor``, as Flux.1,
    Z-Image and Lumina 2 use it (the same Flux AE). A family with another normalisation subclasses it.
    ``single_file_config``: the shipped diffusers config folder (``configs/vae/<name>``) for a single VAE
    file such as ComfyUI's ``ae.safetensors``."""

    class_name: str = "AutoencoderKL"
    single_file_config: str = "flux1"

    def to_model(self, vae, mean: torch.Tensor) -> torch.Tensor:
        """VAE latent mean -> what the transformer takes."""
        shift = getattr(vae.config, "shift_factor", None) or 0.0
        return (mean - shift) * vae.config.scaling_factor

    def to_vae(self, vae, latents: torch.Tensor) -> torch.Tensor:
        """The inverse of ``to_model``: what ``vae.decode`` takes."""
        shift = getattr(vae.config, "shift_factor", None) or 0.0
        return latents / vae.config.scaling_factor + shift

    def encode(self, vae, pixels: torch.Tensor) -> torch.Tensor:
        """Pixels (B, 3, H, W) in [-1, 1] -> the transformer's latents; the distribution's mean (a
        deterministic cache)."""
        return self.to_model(vae, vae.encode(pixels).latent_dist.mean)

    def decode(self, vae, latents: torch.Tensor) -> torch.Tensor:
        """The transformer's latents -> pixels (B, 3, H, W) in about [-1, 1]."""
        return vae.decode(self.to_vae(vae, latents), return_dict=False)[0]

    def load_file(self, path, dtype: torch.dtype, read, companion):
        """The VAE from one single file with BFL/LDM names (ComfyUI's ``ae.safetensors``), through diffusers'
        ``from_single_file`` with the config of ``companion`` (a folder beside the file) or the shipped one.
        ``read(path)``: the file's decoded tensors (the checkpoint reader; unused here, diffusers reads it)."""
        import diffusers

        from ..errors import ModelLoadError

        cls = getattr(diffusers, self.class_name)
        try:
            if (companion / "config.json").exists():
                return cls.from_single_file(str(path), config=str(companion), torch_dtype=dtype, local_files_only=True)
            with resources.as_file(resources.files(__package__).joinpath("configs", "vae", self.single_file_config)) as cfg:
                return cls.from_single_file(str(path), config=str(cfg), torch_dtype=dtype, local_files_only=True)
        except (OSError, ValueError, KeyError, RuntimeError) as exc:
            raise ModelLoadError(f"'{path}' is not a {self.class_name} file this loader reads ({exc}); it expects "
                                 f"BFL/LDM names (encoder.down.0.block.0...), as ae.safetensors has") from exc


# --- sampling ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Guidance:
    """How a variant samples: ``embedded`` (a guidance embedding: Flux.1-dev, Flux.2-dev; one forward),
    ``cfg`` (classifier-free guidance: a second forward on the empty prompt), or ``none`` (distilled
    models without either: Flux.1-schnell, Z-Image Turbo).
    ``formula`` for cfg: ``standard`` = neg + g (pos - neg); ``z_image`` = pos + g (pos - neg) (its
    pipeline's form: g = 0 is no guidance). ``renormalize``: rescale the guided prediction to the
    conditional one's norm, over ``last_axis`` of (B, C, H, W) as Lumina 2's ``cfg_normalization`` does, or
    per ``patch_tokens`` (each 2x2 patch's channels: a packed token, as QwenImagePipeline's true CFG does)."""

    mode: str = "none"  # "none" | "embedded" | "cfg"
    scale: float = 0.0  # the pipeline's default (the family's templates set Train LoRA's sample_guidance to it)
    steps: int = 20  # preview steps that suffice for this variant (the templates' sample_steps)
    formula: str = "standard"
    renormalize: str = ""  # "" | "last_axis" | "patch_tokens"

    def combine(self, pos: torch.Tensor, neg: torch.Tensor, scale: float) -> torch.Tensor:
        if self.formula == "z_image":
            out = pos + scale * (pos - neg)
        else:
            out = neg + scale * (pos - neg)
        if self.renormalize == "last_axis":  # Lumina2Pipeline: torch.norm over the last axis of (B, C, H, W)
            out = out * (torch.norm(pos, dim=-1, keepdim=True) / torch.norm(out, dim=-1, keepdim=True))
        elif self.renormalize == "patch_tokens":
            out = out * (_patch_token_norm(pos) / _patch_token_norm(out))
        elif self.renormalize:
            raise ValueError(f"unknown guidance renormalisation {self.renormalize!r}")
        return out


def _patch_token_norm(x: torch.Tensor) -> torch.Tensor:
    """The L2 norm of each 2x2 patch over all channels of (B, C, H, W), broadcast back to every element: the
    norm of each packed token (``torch.norm(tokens, dim=-1)`` in the pipelines that pack 2x2)."""
    b, c, h, w = x.shape
    sq = x.reshape(b, c, h // 2, 2, w // 2, 2).pow(2).sum(dim=(1, 3, 5), keepdim=True).sqrt()
    return sq.expand(b, c, h // 2, 2, w // 2, 2).reshape(b, c, h, w)


@dataclass(frozen=True)
class ControlImages:
    """How an edit model of a family takes control images (``ModelFamily.control_images``), bound to one variant:
    the family folder's own code, so the cache (``engine/caching/edit_cache.py``) needs no family's name.
    ``max_count``: control images per target (None: any number); ``ident``: what changes their encoding (it goes
    into the cache keys); ``size(width, height)``: a control image's size at the reference-latent area (what
    decides its latent's shape, hence which items share a batch); ``encode_prompts(captions, images, processor,
    parts, drop, dtype)``: each caption with its control images through the vision-language encoder (``parts`` from
    ``engine/caching/vl_text.py``) -> one (L_i, D) tensor per caption; ``encode_latents(vae, images)``: one target's
    control images -> {embedding name: (1, ...) tensor} as ``model_inputs`` takes them."""

    max_count: int | None
    ident: tuple
    size: Callable[[int, int], tuple[int, int]]
    encode_prompts: Callable[..., list]
    encode_latents: Callable[..., dict]


@dataclass(frozen=True)
class TrainingTemplate:
    """A shipped workflow of the family: the five-node training graph (Load, Cache, Offload, Train, Save;
    ``host/templates.py`` lays it out) with these widget values, a note for the user, and optionally a
    Dual-GPU Split node. A family lists its own in ``<folder>/templates.py`` as ``TEMPLATES``."""

    name: str  # the workflow's file name (example_workflows/<name>.json)
    load: dict[str, Any]
    cache: dict[str, Any]
    offload: dict[str, Any]
    train: dict[str, Any]
    save: dict[str, Any]
    note: str
    split: dict[str, Any] | None = None
    note_pos: tuple[int, int] = (40, 420)
    #: file name -> the download URL ComfyUI's own templates give for that file (Comfy-Org's repackaged files on
    #: Hugging Face); the editor's Missing Models dialog offers it. Only files the widgets above name.
    downloads: dict[str, str] = field(default_factory=dict)
    #: Further training chains in the same graph, each laid out below the one before: a dict of sections
    #: (``load``, ``cache``, ``offload``, ``train``, ``save``) whose values update this template's own (Wan 2.2
    #: A14B: one chain per expert file, each saving its own LoRA). The Dual-GPU Split (``split``) joins the first.
    #: A chain's ``label`` (a string) ends its nodes' titles, as ``label`` does the first chain's.
    chains: tuple[dict[str, Any], ...] = ()
    label: str = ""
    #: Links between chains: ``(chain, Train LoRA input, source chain)`` feeds that input of the chain's Train LoRA
    #: from the source chain's Load Quantized Slab (chain 0 is this template's own). Wan 2.2 A14B: each expert's
    #: ``preview_partner`` is the other chain's model, so previews switch expert at the boundary.
    chain_links: tuple[tuple[int, str, int], ...] = ()


# --- the family ------------------------------------------------------------------------------------


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
    #: Native tensors real files carry that the model does not use (not in ``param_table``): ignored on reading.
    unused_native_keys: ClassVar[tuple[str, ...]] = ()

    #: The model trains on clips (5-D latents): Cache Text Embeds reads the dataset folder's clips by its video
    #: settings (images count as one-frame clips). Image families read images only.
    video: ClassVar[bool] = False

    # specs (engine/families/specs/)
    memory: ClassVar[MemoryProfile]
    schedule: ClassVar[NoiseSchedule] = NoiseSchedule()
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

    def guidance(self, variant: str) -> Guidance:
        """How ``variant`` samples previews."""
        return Guidance()

    def __repr__(self) -> str:
        return f"<family {self.id}>"


def predict_velocity(family: ModelFamily, model: nn.Module, noisy: torch.Tensor, embeds: dict[str, torch.Tensor],
                     sigmas: torch.Tensor, guidance: float) -> torch.Tensor:
    """The model's velocity (noise - x0) at ``sigmas`` in the latents' shape, whatever its convention (the timestep
    it is given, the sign of its output: ``family.schedule.prediction``): the one place training and sampling call
    the model."""
    velocity = family.unpack_prediction(model(**family.model_inputs(model, noisy, embeds, sigmas, guidance))[0], noisy)
    return velocity if family.schedule.prediction.sign > 0 else -velocity


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
