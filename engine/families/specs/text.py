"""How captions become what the transformer reads: ``PromptTemplate`` (the pipeline's prompt format) and
``TextEncoderSpec`` (one text encoder of a pipeline and what the dataset cache keeps from it). A family's
``text_encoder_specs(variant)`` lists them; ``engine/caching/`` runs them."""
from __future__ import annotations

from dataclasses import dataclass


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
    Wan's umT5, which WanPipeline trims to each caption's length and re-pads with zeros); ``windowed`` = each caption
    right-padded to its length rounded up to ``pad_multiple`` (at most ``max_length``), the padding kept at position
    id 1 (the model attends to it: FLUX.3's ``Flux3TextEncoderStep``); captions of different windows are different
    shapes, batched only with their own window.
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
    length: str = "padded"  # "padded" | "variable" | "zero_padded" | "windowed"
    pad_multiple: int = 0  # windowed: the window is a multiple of this many tokens
    template: PromptTemplate = PromptTemplate()
    #: Where ComfyUI's CONDITIONING for the family's model carries this encoder's cached tensor: "" (the conditioning
    #: tensor itself), a key of its options dict ("pooled_output"), or None: not known to match ComfyUI's model, so
    #: Sample Prompt Conditioning refuses it (set once a real-ComfyUI run has sampled from it).
    comfy_slot: str | None = None
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
