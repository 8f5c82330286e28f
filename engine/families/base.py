"""What a model family is, as the engine sees it: one folder, one ``ModelFamily`` subclass.

A family lives in ``engine/families/<id>/``: its ``__init__.py`` defines ``FAMILY`` (an instance of a
``ModelFamily`` subclass); beside it sit its name map, block parts, shipped configs, tiny-model
fixtures and workflow templates. The registry finds the folders by itself, so adding a family touches
no file outside its folder.

The engine talks to families only through this class. Every member is declared here, typed, with a
default where one makes sense; what a family can do beyond the minimum is declared as data
(``int8_extra_linears``, ``block_parts``, ``chunked_recompute``), never probed with ``getattr``.

How the pieces flow:
- identity: ``diffusers_class_name`` (a diffusers folder), ``looks_like_single_file`` + ``param_table``
  (a single file with native names), ``variants`` + ``structural_keys`` (which shipped config it is);
- text: ``text_encoder_specs`` (kinds, templates, hidden layers, length policy) -> the dataset cache;
- latents: ``vae`` / ``vae_for(variant)`` (``VaeSpec``): pixels <-> what the transformer takes, N-D (images;
  video clips as (C, F', h, w), an image one frame);
- training: ``model_inputs`` + ``unpack_prediction`` under the family's ``prediction`` convention
  (the timestep it is given, the sign of its output) and its timestep shift;
- memory: ``block_lists`` (execution order), ``block_parts``, ``chunked_recompute``,
  ``activation_scale`` (``parts_activation_scale`` for blocks in parts), ``image_tokens``;
- LoRA: ``lora_targets`` (default modules), ``comfyui_lora_form`` (how ComfyUI's loader wants them).
"""
from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from importlib import import_module, resources
from typing import Any, Callable, ClassVar

import torch
from torch import nn

from .names import NativeParam

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
    kind: str  # a text-encoder kind (engine/caching/encoders/): "clip_pooled" | "t5" | "umt5" | "decoder_lm" | ...
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


# --- the prediction convention ---------------------------------------------------------------------


@dataclass(frozen=True)
class Prediction:
    """How a family's transformer is asked and what it answers (new-families-facts §0).

    Training noises ``x_sigma = (1 - sigma) x0 + sigma noise`` and regresses the velocity
    ``noise - x0`` everywhere; the family says how that maps onto its model:
    ``timestep``: what the model is given, ``sigma`` (Flux, Qwen-Image; the model scales by 1000
    inside), ``one_minus_sigma`` (Z-Image, Lumina 2) or ``sigma_x1000`` (Wan);
    ``sign``: +1 when the output is the velocity, -1 when it is ``x0 - noise`` (Z-Image, Lumina 2).
    """

    timestep: str = "sigma"
    sign: float = 1.0

    def model_timestep(self, sigmas: torch.Tensor) -> torch.Tensor:
        if self.timestep == "sigma":
            return sigmas
        if self.timestep == "one_minus_sigma":
            return 1.0 - sigmas
        if self.timestep == "sigma_x1000":
            return sigmas * 1000.0
        raise ValueError(f"unknown timestep convention {self.timestep!r}")


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


def sigma_schedule(steps: int, mu: float) -> list[float]:
    """The sampling sigmas of the families' pipelines (FlowMatchEulerDiscreteScheduler): ``linspace(1, 1/steps,
    steps)`` under the exponential time shift ``exp(mu) / (exp(mu) + 1/sigma - 1)``, then 0."""
    base = [1.0 - i * (1.0 - 1.0 / steps) / max(steps - 1, 1) for i in range(steps)] if steps > 1 else [1.0]
    return [math.exp(mu) / (math.exp(mu) + (1.0 / s - 1.0)) for s in base] + [0.0]


def static_shift_mu(shift: float) -> float:
    """A static shift s (sigma' = s sigma / (1 + (s - 1) sigma)) as the exponential shift's mu = ln s."""
    return math.log(shift)


# --- the family ------------------------------------------------------------------------------------


class ModelFamily(ABC):
    """Base of every family; a family folder subclasses it and sets ``FAMILY`` in its ``__init__``."""

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

    # conventions
    prediction: ClassVar[Prediction] = Prediction()
    vae: ClassVar[VaeSpec] = VaeSpec()

    #: The model trains on clips (5-D latents): Cache Text Embeds reads the dataset folder's clips by its video
    #: settings (images count as one-frame clips). Image families read images only.
    video: ClassVar[bool] = False

    # memory engine
    #: Linears outside the blocks that are large enough to be int8 in a slab (Flux.2's global modulation). Each runs
    #: once per forward on frozen inputs, so streaming may also hold them in pinned host memory between runs
    #: (``OffloadConfig.outer_on_host``, engine/offload/outer.py).
    int8_extra_linears: ClassVar[tuple[str, ...]] = ()
    # Which rows each block Linear multiplies (``linear_tokens``; the step-time model's FLOPs). Block lists that run
    # on one kind of tokens ({list name: "image" | "text"}: a refiner, Wan's video-only sequence); Linears (name
    # prefixes within a block) fed by the time embedding alone (AdaLN modulation: one row per sample); Linears that
    # run on the text tokens; block lists whose blocks are dual-stream (their other Linears run on the image tokens).
    block_list_tokens: ClassVar[dict[str, str]] = {}
    modulation_linears: ClassVar[tuple[str, ...]] = ()
    text_linears: ClassVar[tuple[str, ...]] = ()
    dual_stream_lists: ClassVar[tuple[str, ...]] = ()
    #: A block's recompute + backward working set against Flux.1's at the same tokens x width (the
    #: planner's constants are Flux.1 fits). Fitted on GPU rows per family.
    activation_scale: ClassVar[float] = 1.0
    #: The same when its blocks stream in parts (``block_parts``, used with activation offload): the largest part's
    #: working set against Flux.1's block at the same tokens x width. None: ``activation_scale`` (Flux.1's and
    #: Flux.2's constants were fitted with their blocks in parts already).
    parts_activation_scale: ClassVar[float | None] = None
    #: ``install_chunked_recompute`` does something (token-wise parts in checkpointed chunks).
    chunked_recompute: ClassVar[bool] = False

    # sampling
    #: Previews may run several prompts (and both classifier-free guidance branches) as one batch per denoising
    #: step (engine/sampling.py), so a streamed block is copied in once per step, not once per prompt: the
    #: family's ``model_inputs`` takes a batch of captions of different lengths (padded, with their masks) and
    #: gives each row the output it gives that row alone. False: every row is its own forward (give the reason).
    batched_sampling: ClassVar[bool] = True

    # LoRA
    #: Block-list attribute -> module names (relative to a block) that get a LoRA by default.
    lora_targets: ClassVar[dict[str, tuple[str, ...]]]
    #: How ComfyUI's loader takes this family's LoRAs: ``diffusers_names`` (``transformer.<diffusers module>``,
    #: mapped by ComfyUI into its fused tensors) or ``native_fused`` (``diffusion_model.<native module>``,
    #: parts of a fused native Linear joined as one block-diagonal LoRA: Lumina 2's qkv).
    comfyui_lora_form: ClassVar[str] = "diffusers_names"

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

    def variant_from_name(self, variant: str, name: str) -> str:
        """Variants that no shape tells apart (Z-Image Turbo and Base) told apart by the file or folder
        ``name``; the default keeps the variant the config matched."""
        return variant

    def variant_from_file(self, variant: str, name: str, keys: set[str]) -> str:
        """A single file's variant from its name and its (prefix-stripped) tensor ``keys``, unused ones included
        (ComfyUI marks Qwen-Image-Edit-2511 with a flag tensor); the default asks ``variant_from_name``. When the
        answer differs from the shape-matched variant, the file is built with that variant's shipped config."""
        return self.variant_from_name(variant, name)

    @abstractmethod
    def looks_like_single_file(self, keys: set[str]) -> bool:
        """Whether a single file's (prefix-stripped) tensor names are this family's native names."""

    @abstractmethod
    def param_table(self, config: dict[str, Any]) -> list[NativeParam]:
        """Every parameter of a native single file and where it lives in diffusers (``names.py``)."""

    # --- text ------------------------------------------------------------------------------------

    @abstractmethod
    def text_encoder_specs(self, variant: str) -> tuple[TextEncoderSpec, ...]:
        """The variant's text encoders, in the order the cache runs them."""

    def default_max_sequence_length(self, variant: str) -> int:
        """Tokens of the sequence encoder (the longest one) by default."""
        return max(s.max_length for s in self.text_encoder_specs(variant) if s.kind != "clip_pooled")

    @abstractmethod
    def text_widths(self, config: dict[str, Any]) -> dict[str, int]:
        """Width of each cached embedding the transformer takes (a cache is checked against it)."""

    # --- latents ---------------------------------------------------------------------------------

    @abstractmethod
    def latent_shape(self, model: nn.Module, width: int, height: int, frames: int = 1) -> tuple[int, ...]:
        """The cached latent's shape (without batch) for a width x height image, or a clip of ``frames`` frames
        (video families; image families refuse ``frames`` > 1 with ``image_only``)."""

    def image_only(self, frames: int) -> None:
        """The check of an image family's ``latent_shape``: one frame only."""
        if frames != 1:
            from ..errors import ConfigError

            raise ConfigError(f"{self.display_name} is an image model; it takes one frame, not {frames}")

    def vae_for(self, variant: str | None) -> VaeSpec:
        """The VAE of ``variant`` (None or ``custom``: the family's default ``vae``). Families whose variants use
        different VAEs (Wan 2.2 TI2V-5B) override it."""
        return self.vae

    def hidden_size(self, config: dict[str, Any]) -> int:
        """The transformer's width (the planner sizes activations with it)."""
        return int(config["num_attention_heads"] * config["attention_head_dim"])

    def image_tokens(self, width: int, height: int, variant: str = "") -> int:
        """Image tokens of a width x height image, or of one latent frame (the planner's workload): /8 VAE, 2x2
        patches. ``variant``: for families whose variants differ (Wan 2.2 TI2V-5B's 16x VAE)."""
        return (width // 16) * (height // 16)

    # --- training --------------------------------------------------------------------------------

    @abstractmethod
    def model_inputs(self, model: nn.Module, latents: torch.Tensor, embeds: dict[str, torch.Tensor],
                     sigmas: torch.Tensor, guidance: float) -> dict[str, Any]:
        """Keyword arguments of the transformer's forward on noisy latents (B, ...) at noise levels
        ``sigmas`` (B,); ``embeds`` holds the cached embeddings and, for variable-length encoders,
        their masks (``TextEncoderSpec.mask_key``), and any other per-sample conditioning the family caches as
        tensors with a batch axis (Qwen-Image-Edit's control latents, under keys the family documents).
        Timesteps follow ``self.prediction``."""

    @abstractmethod
    def unpack_prediction(self, output: Any, latents: torch.Tensor) -> torch.Tensor:
        """The forward's raw output (``return_dict=False``) in the latents' shape, sign as the model gives it."""

    def predict_velocity(self, model: nn.Module, noisy: torch.Tensor, embeds: dict[str, torch.Tensor],
                         sigmas: torch.Tensor, guidance: float) -> torch.Tensor:
        """The model's velocity (noise - x0) at ``sigmas`` in the latents' shape, whatever its convention (the
        timestep it is given, the sign of its output): the one place training and sampling call the model."""
        velocity = self.unpack_prediction(model(**self.model_inputs(model, noisy, embeds, sigmas, guidance))[0], noisy)
        return velocity if self.prediction.sign > 0 else -velocity

    @abstractmethod
    def train_shift_mu(self, latents: torch.Tensor) -> float:
        """The exponential timestep shift training samples with (``flow_matching.sample_sigmas``)."""

    def train_sigma_range(self, variant: str) -> tuple[float, float]:
        """The noise levels (after the shift) training draws from, ``(lo, hi)``: the whole ``(0, 1)`` for a
        model that denoises everything; one expert of a mixture (Wan 2.2 A14B's high- and low-noise models)
        only ever sees its own range when sampling, so it trains on that range alone."""
        return (0.0, 1.0)

    def preview_partner(self, variant: str) -> tuple[str, float] | None:
        """For one expert of a mixture: ``(the other expert's variant, the boundary sigma)``; None for a model that
        denoises the whole path alone. A preview then samples with both (``engine/sampling.py``): sigma >= boundary
        through the high-noise expert, below it through the low-noise one, each with its own guidance scale
        (``guidance``), as the family's pipeline does."""
        return None

    def latent_frames(self, frames: int) -> int:
        """Latent frames of a clip of ``frames`` frames (the planner's workload); 1 for image families."""
        return 1

    def sample_shift_mu(self, latents: torch.Tensor, steps: int) -> float:
        """The shift the family's pipeline samples with at ``steps`` steps."""
        return self.train_shift_mu(latents)

    def sample_sigmas(self, latents: torch.Tensor, steps: int) -> list[float]:
        """The ``steps`` + 1 noise levels previews step through (the last is 0), as the family's pipeline
        schedules them; by default ``sigma_schedule`` under ``sample_shift_mu``."""
        return sigma_schedule(steps, self.sample_shift_mu(latents, steps))

    def control_images(self, variant: str) -> ControlImages | None:
        """How an edit ``variant`` takes control images (its text spec then has ``control_images``); None for a model
        that takes none."""
        return None

    def guidance(self, variant: str) -> Guidance:
        """How ``variant`` samples previews."""
        return Guidance()

    # --- memory engine ---------------------------------------------------------------------------

    def block_lists(self, model: nn.Module) -> list[nn.ModuleList]:
        """The transformer's block lists, in the order the forward runs them."""
        return [getattr(model, name) for name in self.lora_targets]

    def block_tokens(self, block: str) -> str:
        """Which tokens a block runs on, by its name in ``named_blocks`` (``"layers.0"``): its list's entry in
        ``block_list_tokens``, else ``"all"`` (the image and text tokens as one sequence). The step-time model counts
        each block's FLOPs with it (engine/offload/steptime.py)."""
        return self.block_list_tokens.get(block.rpartition(".")[0], "all")

    def linear_tokens(self, block: str, linear: str) -> str:
        """Which rows a frozen Linear of a block multiplies, by the block's name and the Linear's within it
        (``"attn.add_q_proj"``): ``"vector"`` (``modulation_linears``: one row per sample), ``"text"``
        (``text_linears``), ``"image"`` (any other Linear of a ``dual_stream_lists`` block), else the block's
        tokens. Checked against torch's FLOP counter for every family (tests/test_step_flops.py)."""
        if linear.startswith(self.modulation_linears):
            return "vector"
        if linear.startswith(self.text_linears):
            return "text"
        if block.rpartition(".")[0] in self.dual_stream_lists:
            return "image"
        return self.block_tokens(block)

    def block_parts(self, block: nn.Module) -> list[tuple[str, nn.Module]] | None:
        """A block that streams as several parts (``engine/offload/units.py``), or None for whole."""
        return None

    def install_chunked_recompute(self, model: nn.Module, chunks: int, undo) -> None:
        """Token-wise parts in ``chunks`` checkpointed chunks (when ``chunked_recompute``)."""

    def checkpoint_every_block(self, model: nn.Module, undo) -> None:
        """Make the model's forward run every block of ``block_lists`` through its checkpoint function while
        training (``undo.set_forward`` swaps, undone after). Block streaming needs it: a block's weights come
        back for its backward only through its recompute. The default: the model already does (diffusers'
        Flux, Z-Image); Lumina 2 leaves its refiners out."""

    # --- LoRA ------------------------------------------------------------------------------------

    def lora_target_modules(self, model: nn.Module) -> list[str]:
        """Full module names of the default LoRA targets: ``lora_targets`` in every block of each list."""
        return [f"{name}.{i}.{t}" for name, targets in self.lora_targets.items()
                for i in range(len(getattr(model, name))) for t in targets]

    # --- fixtures and templates ------------------------------------------------------------------

    def fixtures(self):
        """The folder's ``fixtures`` module: ``build_tiny_pipeline(folder, seed=0) -> Path`` and
        ``write_single_file(pipeline, out_file) -> Path`` (tests and the demo; never downloads)."""
        return import_module(".fixtures", family_package(self))

    def templates(self) -> list[TrainingTemplate]:
        """The folder's shipped workflows (``templates.py``'s ``TEMPLATES``; none if it has no such module)."""
        import importlib.util

        name = f"{family_package(self)}.templates"
        return list(import_module(name).TEMPLATES) if importlib.util.find_spec(name) else []

    def __repr__(self) -> str:
        return f"<family {self.id}>"


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
