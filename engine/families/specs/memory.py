"""``MemoryProfile``: what the planner and the step-time model need to know about a family's transformer.

The block lists it streams (in execution order), which rows each block Linear multiplies (the FLOP count), how
big a block's recompute + backward working set is against Flux.1's (the planner's constants are Flux.1 fits), which
large Linears outside the blocks are int8 in a slab, and the family's own block surgery: blocks in parts, token-wise
parts in checkpointed chunks, every block checkpointed. Read by ``engine/offload/footprint.py`` (the footprint),
``engine/offload/recompute.py`` and ``units.py`` (installed for a run), ``engine/slab/layout.py`` (what a slab
quantizes) and ``engine/sampling/`` (preview batching).

Data is declared in fields; a family whose blocks need code (parts, chunking) subclasses it in its folder, as a
``VaeSpec`` is subclassed, and overrides the methods below.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from torch import nn

from .step_constants import StepConstants


@dataclass(frozen=True)
class TokenModulation:
    """What a per-token timestep costs a transformer whose AdaLN modulation is computed from the timestep (an
    image-to-video variant that holds its first frames clean at timestep 0: ``FirstFrameCondition.held``). With one
    timestep per sample the modulation is one row per sample; per token it is one row per token, in hidden-width rows
    (B x tokens x D elements each) of the activation dtype:

    - ``held_rows``: made once per forward outside the blocks and held by every checkpointed block until the last
      block's backward (LTX-2: the time embedding's modulation ``temb``);
    - ``block_rows``: made by one block while it runs its forward, recompute and backward (LTX-2: the block's
      ``scale_shift_table + temb`` and the ``1 + scale`` factors its backward keeps);
    - ``input_rows``: of ``held_rows``, the rows handed to every block as an input (activation offload copies a
      block's inputs to the host and back: these rows go with every offloaded block's)."""

    held_rows: float
    block_rows: float
    input_rows: float = 0.0


@dataclass(frozen=True)
class MemoryProfile:
    """The planner's and the step-time model's knobs of one family (see the module doc)."""

    #: Block-list module names of the transformer (a list inside a ModuleDict too), in the order the forward runs them (``block_lists_of``). Slab
    #: block names, streaming order and compile units follow it.
    block_lists: tuple[str, ...]
    #: Linears outside the blocks that are large enough to be int8 in a slab (Flux.2's global modulation). Each runs
    #: once per forward on frozen inputs, so streaming may also hold them in pinned host memory between runs
    #: (``OffloadConfig.outer_on_host``, engine/offload/outer.py).
    int8_extra_linears: tuple[str, ...] = ()
    # Which rows each block Linear multiplies (``linear_tokens``; the step-time model's FLOPs). Block lists that run
    # on one kind of tokens ({list name: "image" | "text"}: a refiner, Wan's video-only sequence); Linears (name
    # prefixes within a block) fed by the time embedding alone (AdaLN modulation: one row per sample); Linears that
    # run on the text tokens; Linears that run on the audio tokens (a joint audio-video block's audio stream: LTX-2;
    # ``audio_tokens`` says how many); block lists whose blocks are dual-stream (their other Linears run on the image
    # tokens).
    block_list_tokens: dict[str, str] = field(default_factory=dict)
    modulation_linears: tuple[str, ...] = ()
    text_linears: tuple[str, ...] = ()
    audio_linears: tuple[str, ...] = ()
    dual_stream_lists: tuple[str, ...] = ()
    #: A block's recompute + backward working set against Flux.1's at the same tokens x width (the planner's
    #: constants are Flux.1 fits). Fitted on GPU rows per family.
    activation_scale: float = 1.0
    #: The same when its blocks stream in parts (``block_parts``, used with activation offload): the largest part's
    #: working set against Flux.1's block at the same tokens x width. None: ``activation_scale`` (Flux.1's and
    #: Flux.2's constants were fitted with their blocks in parts already).
    parts_activation_scale: float | None = None
    #: The same when the token-wise parts recompute in chunks (``recompute_chunks`` > 1): the chunked block's working
    #: set against Flux.1's chunked line, where the family's chunking changes its largest block more than Flux.1's
    #: does (Flux.2: its single blocks chunk their fused MLP half). None: ``activation_scale``.
    chunked_activation_scale: float | None = None
    #: Compiled blocks at an activation-memory budget below 1, in token chunks: the working set against the family's
    #: own eager chunked one, for a family where the compile saves nothing. None: Flux.1's compiled line
    #: (``COMPILED_CHUNKED_UNITS_*``, where the partitioner's recompute of pointwise ops saves memory) times the
    #: scales above.
    compiled_activation_scale: float | None = None
    #: The largest part of a block in parts holds token-wise parts that recompute in chunks, so chunks shrink the
    #: parts' working set. False: it holds none (Wan: its self-attention part, once the fp32 norms and residuals run in
    #: token slices), so blocks in parts hold ``parts_activation_scale`` x the unchunked line at any number of chunks.
    parts_chunked: bool = True
    #: The caching allocator's unusable holes when capped at the budget, in units of the step's largest activation
    #: tensor (``Plan.largest_tensor_bytes``): the plan keeps this many of it free, or 0.5 GB where that is more
    #: (engine/offload/plan.py ``allocator_margin``). Measured per family (Flux.1, Wan); 0: the 0.5 GB alone (Flux.2-dev
    #: and Qwen-Image trained in it under the cap, 2026-11-27; unmeasured families stay there until a capped row says
    #: more).
    fragmentation: float = 0.0
    #: The same while its blocks stream in parts (``block_parts``), where the parts' own arithmetic makes other
    #: requests than the whole block's (Wan: no fp32 copy of the sequence, ``fp32_chunks.py``). None: ``fragmentation``.
    parts_fragmentation: float | None = None
    #: ``install_chunked_recompute`` does something (token-wise parts in checkpointed chunks).
    chunked_recompute: bool = False
    #: Config keys whose product is the transformer's width (``hidden_size``): heads x head dim by default.
    width_keys: tuple[str, ...] = ("num_attention_heads", "attention_head_dim")
    #: Pixels per image token along each side (/8 VAE, 2x2 patches: 16), and the multiple the transformer pads each
    #: image's tokens to (Z-Image: 32; 1: none). ``image_tokens`` counts with them.
    token_pixels: int = 16
    token_multiple: int = 1
    #: Frames per latent frame of a causal video VAE after the first (Wan: 4); None for image families.
    temporal_compression: int | None = None
    #: Previews may run several prompts (and both classifier-free guidance branches) as one batch per denoising
    #: step (engine/sampling/), so a streamed block is copied in once per step, not once per prompt: the
    #: family's ``model_inputs`` takes a batch of captions of different lengths (padded, with their masks) and
    #: gives each row the output it gives that row alone. False: every row is its own forward (give the reason).
    batched_sampling: bool = True
    #: The modules whose output is a constant of the training step (AdaLN modulation, the time / guidance / pooled-text
    #: embedders): the modulation window computes them for K steps in one pass and blocks stream without them
    #: (``step_constants.py``, engine/train/step_window.py). None: the family has none.
    step_constants: StepConstants | None = None

    # --- the workload ----------------------------------------------------------------------------------

    def token_modulation(self, config: dict) -> TokenModulation | None:
        """The modulation's growth with a per-token timestep (``TokenModulation``), for a model with ``config``; None:
        the family never takes one, or its modulation does not grow with it. The planner counts it where the
        variant's first-frame condition holds frames (engine/offload/footprint.py ``workload_for``)."""
        return None

    def hidden_size(self, config: dict) -> int:
        """The transformer's width (the planner sizes activations with it): the product of ``width_keys``."""
        return int(math.prod(config[k] for k in self.width_keys))

    def image_tokens(self, width: int, height: int, variant: str = "") -> int:
        """Image tokens of a width x height image, or of one latent frame (the planner's workload), padded as the
        transformer pads them. ``variant``: for families whose variants differ (Wan 2.2 TI2V-5B's 16x VAE)."""
        tokens = (width // self.token_pixels) * (height // self.token_pixels)
        return tokens + (-tokens) % self.token_multiple

    def latent_frames(self, frames: int) -> int:
        """Latent frames of a clip of ``frames`` frames (the planner's workload): the first frame alone, then one per
        ``temporal_compression``; 1 for image families."""
        if self.temporal_compression is None:
            return 1
        return (max(1, frames) - 1) // self.temporal_compression + 1

    def audio_tokens(self, latent_frames: int) -> int:
        """Audio tokens per sample beside a clip of ``latent_frames`` (the rows ``audio_linears`` multiply): 0 for a
        family without an audio stream."""
        return 0

    # --- blocks and the rows their Linears multiply ------------------------------------------------------

    def block_lists_of(self, model: nn.Module) -> list[nn.ModuleList]:
        """The transformer's block lists (``block_lists``), in the order the forward runs them."""
        return [model.get_submodule(name) for name in self.block_lists]  # nested: FLUX.3's ``mode_blocks.image``

    def block_tokens(self, block: str) -> str:
        """Which tokens a block runs on, by its name in ``named_blocks`` (``"layers.0"``): its list's entry in
        ``block_list_tokens``, else ``"all"`` (the image and text tokens as one sequence). The step-time model counts
        each block's FLOPs with it (engine/offload/steptime.py)."""
        return self.block_list_tokens.get(block.rpartition(".")[0], "all")

    def linear_tokens(self, block: str, linear: str) -> str:
        """Which rows a frozen Linear of a block multiplies, by the block's name and the Linear's within it
        (``"attn.add_q_proj"``): ``"vector"`` (``modulation_linears``: one row per sample), ``"text"``
        (``text_linears``), ``"audio"`` (``audio_linears``), ``"image"`` (any other Linear of a
        ``dual_stream_lists`` block), else the block's tokens. Checked against torch's FLOP counter for every family
        (tests/test_step_flops.py)."""
        if linear.startswith(self.modulation_linears):
            return "vector"
        if linear.startswith(self.text_linears):
            return "text"
        if linear.startswith(self.audio_linears):
            return "audio"
        if block.rpartition(".")[0] in self.dual_stream_lists:
            return "image"
        return self.block_tokens(block)

    # --- the family's block surgery (a subclass in the family folder overrides these) -------------------

    def block_parts(self, block: nn.Module) -> list[tuple[str, nn.Module]] | None:
        """A block that streams as several parts (``engine/offload/units.py``), or None for whole."""
        return None

    def install_chunked_recompute(self, model: nn.Module, chunks: int, undo) -> None:
        """Token-wise parts in ``chunks`` checkpointed chunks (when ``chunked_recompute``), with the tools in
        ``engine/families/recompute.py``; ``undo`` records every swapped forward."""

    def checkpoint_every_block(self, model: nn.Module, undo) -> None:
        """Make the model's forward run every block of ``block_lists`` through its checkpoint function while
        training (``undo.set_forward`` swaps, undone after). Block streaming needs it: a block's weights come
        back for its backward only through its recompute. The default: the model already does (diffusers'
        Flux, Z-Image); Lumina 2 leaves its refiners out."""
