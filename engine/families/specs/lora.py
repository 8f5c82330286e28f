"""``LoraForm``: which modules of a family get a LoRA, and the form its saved file takes.

``targets`` are the default modules (per block list, relative to a block); ``comfyui_form`` is how ComfyUI's loader
takes the family's LoRAs (``engine/lora_io/formats.py`` writes it); ``architecture`` is the
``modelspec.architecture`` written into the saved file's metadata (``engine/lora_io/files.py``), so a tool that
reads the file knows what it is for. A family that leaves some target out (a module whose output nothing reads)
subclasses it and overrides ``target_modules``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from torch import nn

#: The forms ``engine/lora_io/formats.py`` writes: ``diffusers_names`` (``transformer.<diffusers module>``, mapped by
#: ComfyUI into its fused tensors) or ``native_fused`` (``diffusion_model.<native module>``, parts of a fused native
#: Linear joined as one block-diagonal LoRA: Lumina 2's qkv, Wan's native names) or ``native_names``
#: (``diffusion_model.<native module>.lora_A/lora_B.weight``, scale folded in, no ``.alpha``: a model without fused
#: Linears whose diffusers LoRA loader converts native names and refuses ``.alpha`` tensors: FLUX.3).
COMFYUI_FORMS = ("diffusers_names", "native_fused", "native_names")


@dataclass(frozen=True)
class LoraForm:
    """The family's default LoRA targets and the form of its saved file (see the module doc)."""

    #: Block-list attribute -> module names (relative to a block) that get a LoRA by default.
    targets: dict[str, tuple[str, ...]]
    #: ``modelspec.architecture`` of the saved file (``<family>/lora`` unless the family's files have a known name).
    architecture: str
    #: How ComfyUI's loader takes this family's LoRAs (``COMFYUI_FORMS``).
    comfyui_form: str = "diffusers_names"
    #: Variants whose files carry another ``modelspec.architecture`` (Flux.1 dev and schnell: the names the SAI
    #: model spec gives them).
    variant_architectures: dict[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.comfyui_form not in COMFYUI_FORMS:
            raise ValueError(f"LoraForm comfyui_form={self.comfyui_form!r}; known forms: {', '.join(COMFYUI_FORMS)}")

    def architecture_of(self, variant: str) -> str:
        """The ``modelspec.architecture`` a LoRA trained on ``variant`` is saved with."""
        return self.variant_architectures.get(variant, self.architecture)

    def target_modules(self, model: nn.Module) -> list[str]:
        """Full module names of the default LoRA targets: ``targets`` in every block of each list."""
        return [f"{name}.{i}.{t}" for name, targets in self.targets.items()
                for i in range(len(model.get_submodule(name))) for t in targets]
