"""Previews of one expert of a mixture (Wan 2.2 A14B): the other expert that takes its side of the path
(``PartnerExpert``), and why an expert alone is not previewed (``preview_blocker``)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PartnerExpert:
    """The other expert of a mixture, for previews of one expert (``NoiseSchedule.preview_partner``): ``model`` (frozen
    base weights, no LoRA) denoises the steps on its side of ``boundary`` (sigma >= boundary when ``high``, below
    when not) with its own guidance scale ``guidance``; the trained model denoises the rest."""

    model: object
    boundary: float
    high: bool
    guidance: float

    def takes(self, sigma: float) -> bool:
        """Whether this step is the partner's. WanPipeline compares the scheduler's timestep (1000 sigma) with
        ``boundary_ratio * 1000``; the same comparison on sigma."""
        return (sigma >= self.boundary) == self.high


#: The tooltip of Train LoRA's ``preview_partner`` input.
PREVIEW_PARTNER_HELP = (
    "Wan 2.2 T2V-A14B: the other expert's Load Quantized Slab, so samples of this expert's LoRA can be drawn. A "
    "preview needs both experts: the high-noise one denoises sigma >= 0.875, the low-noise one below (as "
    "WanPipeline and ComfyUI's own Wan 2.2 workflow switch). The partner runs with its base weights (no LoRA) and "
    "its own CFG scale (high 4, low 3); it streams only while sampling and never stays in VRAM. Unconnected: no "
    "samples for an A14B expert. With Dual-GPU Split mode 'experts' the partner is trained too, at the same time on "
    "the second GPU. Other models ignore it."
)


def preview_blocker(variant: str, sigma_range: tuple[float, float], partner: tuple[str, float] | None = None
                    ) -> str | None:
    """Why a model cannot be previewed alone, or None. An expert of a mixture (Wan 2.2 A14B: the high-noise expert
    denoises sigma >= 0.875, the low-noise one below) only takes part of the path from noise to a clip: sampled alone
    it gives noise or mush that says nothing about the LoRA, so without its partner (``partner``: the family's
    ``preview_partner``, the other expert and the boundary) no samples are drawn (never silently wrong ones)."""
    lo, hi = sigma_range
    if (lo, hi) == (0.0, 1.0):
        return None
    other = f"the {partner[0]} file" if partner else "the other expert"
    return (f"sampling is off for this run: {variant} is one expert of a mixture and denoises only sigma in "
            f"[{lo}, {hi}]; a preview needs both experts (the other one switches in at the boundary), and previews "
            f"of an expert alone are not images or clips a user can judge. To draw samples, connect the Load "
            f"Quantized Slab of {other} to Train LoRA's preview_partner input (the Wan 2.2 T2V template wires it); "
            f"or judge the LoRA by loading both experts' LoRAs in ComfyUI's own Wan 2.2 workflow")
