"""Sample Prompt Conditioning: a sample prompt Cache Text Embeds already encoded, as ComfyUI's CONDITIONING.

So the trained LoRA can be tried in the same graph (ComfyUI's Load LoRA Model on a MODEL from its own loader, then
KSampler) without loading the text encoders a second time: with T5-XXL that is 9 GB of RAM saved; for the demo's
tiny encoders, which ComfyUI's loaders cannot read (their widths are fixed), it is the only way.
"""
from __future__ import annotations

from . import schema as io
from .load_model import CATEGORY

DESCRIPTION = (
    "One of Cache Text Embeds' sample_prompts as CONDITIONING for ComfyUI's KSampler: the embeddings cached with "
    "the captions, so the text encoders are not loaded again. Pair it with ComfyUI's Load LoRA Model (Train LoRA's "
    "lora_model on a MODEL from Load Diffusion Model) to try the LoRA in this graph. For a negative prompt use "
    "ConditioningZeroOut on this output (Flux.1 samples with cfg 1, which ignores it)."
)


def prompt_conditioning(dataset, index: int) -> list:
    """ComfyUI's CONDITIONING ``[[tensor (1, tokens, width), {options}]]`` of sample prompt ``index`` (1-based),
    laid out as its text encoders' ``comfy_slot`` says; the family's embedded guidance goes in as ``guidance``."""
    from ..engine.errors import ConfigError
    from ..engine.families import get_family

    family = get_family(dataset.family)
    prompts = dataset.sample_prompts
    slots = {spec.cache_key: spec.comfy_slot for spec in family.text_encoder_specs(dataset.variant)}
    if not slots or None in slots.values():
        raise ConfigError(f"Sample Prompt Conditioning does not know how ComfyUI's {family.display_name} model takes "
                          f"its text yet; use ComfyUI's own text encoder loader and CLIP Text Encode instead")
    if not prompts:
        raise ConfigError("the dataset has no sample prompts: write them in Cache Text Embeds' sample_prompts, one "
                          "per line")
    if not 1 <= index <= len(prompts):
        raise ConfigError(f"prompt={index}: the dataset has {len(prompts)} sample prompt(s); pick 1 to {len(prompts)}")
    text = dataset.load_text(prompts[index - 1][1])  # a batch of one
    cond, options = None, {}
    for name, slot in slots.items():
        if slot:
            options[slot] = text[name].float()
        else:
            cond = text[name].float()
    guidance = family.guidance(dataset.variant)
    if guidance.mode == "embedded":
        options["guidance"] = float(guidance.scale)
    return [[cond, options]]


class LowVRAMSamplePromptConditioning(io.Node):
    @classmethod
    def define_schema(cls) -> io.Schema:
        return io.Schema(
            node_id="LowVRAMSamplePromptConditioning", display_name="Sample Prompt Conditioning", category=CATEGORY,
            description=DESCRIPTION,
            outputs=[io.Output("CONDITIONING", "conditioning", "The prompt's cached embeddings, for KSampler.")],
            inputs=[
                io.Custom("LOWVRAM_DATASET", "dataset", tooltip="The cached dataset from Cache Text Embeds."),
                io.Int("prompt", default=1, min=1, max=1000,
                       tooltip="Which line of Cache Text Embeds' sample_prompts (1 = the first), as written there "
                               "(the trigger word in front)."),
            ],
        )

    @classmethod
    def execute(cls, dataset, prompt: int = 1) -> io.NodeOutput:
        return io.NodeOutput(prompt_conditioning(dataset, int(prompt)))
