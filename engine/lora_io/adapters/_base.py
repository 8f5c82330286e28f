"""What an adapter type handler provides (one subclass per file in this folder).

State form: peft's names on the diffusers model, ``<module>.<suffix>`` with the handler's ``suffixes``
(``transformer_blocks.0.attn.to_q.hada_w1_a``), fp32. ``fold`` puts alpha/rank into the weights, so the file is read
at scale 1 by every loader; ``comfyui`` gives the keys ComfyUI's ``comfy/weight_adapter/`` reads for one module
(with an explicit ``alpha`` that means scale 1); ``join`` makes one ComfyUI adapter of the parts of a fused native
Linear (Lumina 2's qkv), exactly, or refuses with the reason.
"""
from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from ...errors import LoraFormatError

#: (row offset, rows, that part's folded module state or None when the part has no adapter)
Part = tuple[int, int, "dict[str, torch.Tensor] | None"]


class AdapterType(ABC):
    name: str = ""
    #: The suffixes of one module's tensors in the (peft-named) state dict.
    suffixes: tuple[str, ...] = ()
    #: Whether diffusers' load_lora_adapter reads this type (a "diffusers" file is offered only then).
    diffusers_loads: bool = False
    #: The suffixes a diffusers file holds (all of ``suffixes`` unless a type keeps a ComfyUI-only tensor).
    diffusers_suffixes: tuple[str, ...] = ()

    #: Whether ``join`` can write the parts of a fused native Linear as one adapter (LoKr cannot).
    joins_fused: bool = True

    def check_targets(self, family, config: dict, targets: list[str]) -> None:
        """Refuse, before training, targets whose saved ComfyUI form this type cannot write."""
        if self.joins_fused or family.lora.comfyui_form != "native_fused":
            return
        from ..formats import _fused_layout
        from ...errors import ConfigError

        layout = _fused_layout(family.param_table(config))
        fused = [t for t in targets if t in layout and len(layout[t][1]) > 1]
        if fused:
            raise ConfigError(
                f"{self.name} cannot be saved for {family.display_name}: ComfyUI holds '{fused[0]}' inside the fused "
                f"Linear '{layout[fused[0]][0]}', and a Kronecker product of stacked parts is not one; choose lora, "
                f"loha or dora for this family")

    # --- attaching -------------------------------------------------------------------------------------------------
    @abstractmethod
    def peft_config(self, settings, targets: list[str]):
        """The peft config that attaches this type with ``settings`` (a LoraSettings) to ``targets``."""
        ...

    @abstractmethod
    def param_count(self, in_features: int, out_features: int, settings) -> int:
        """Trainable elements this type adds to one Linear (for the memory plan, before attaching)."""
        ...

    def export(self, model, state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
        """Anything the saved file needs beyond peft's state (DoRA: ComfyUI's dora_scale, from the base weights)."""
        return state

    # --- the state -------------------------------------------------------------------------------------------------
    def owns(self, key: str) -> bool:
        return any(key.endswith("." + s) for s in self.suffixes)

    def modules(self, state: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
        """{module: {suffix: tensor}} of ``state``."""
        out: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in state.items():
            for suffix in self.suffixes:
                if key.endswith("." + suffix):
                    out.setdefault(key[: -len(suffix) - 1], {})[suffix] = value
                    break
        return dict(sorted(out.items()))

    @abstractmethod
    def rank_of(self, module_state: dict[str, torch.Tensor]) -> int:
        ...

    @abstractmethod
    def fold(self, module_state: dict[str, torch.Tensor], scale: float) -> dict[str, torch.Tensor]:
        """The same adapter with ``scale`` (alpha/rank) inside its weights: it then means the same at scale 1."""
        ...

    def diffusers(self, module_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """{suffix: tensor} of one module in a diffusers file (peft's names)."""
        keep = self.diffusers_suffixes or self.suffixes
        return {k: v for k, v in module_state.items() if k in keep}

    # --- ComfyUI's form --------------------------------------------------------------------------------------------
    @abstractmethod
    def comfyui(self, module_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """{key suffix: tensor} ComfyUI reads for one module of a folded state (``alpha`` included: scale 1)."""
        ...

    def join(self, native: str, parts: list[Part]) -> dict[str, torch.Tensor]:
        """One ComfyUI adapter for a fused native Linear whose row ranges are ``parts`` (folded states)."""
        present = [p for p in parts if p[2] is not None]
        if len(parts) == 1 and present:
            return self.comfyui(present[0][2])
        raise LoraFormatError(f"a {self.name} adapter on the parts of the fused Linear '{native}' cannot be written "
                              f"as one ComfyUI {self.name} adapter; use another adapter type for this family")


def no_dropout(name: str, settings) -> None:
    """LoRA's dropout (on the adapter's input) has no LoHa/LoKr counterpart (theirs drop ranks or whole modules)."""
    from ...errors import ConfigError

    if settings.dropout:
        raise ConfigError(f"dropout={settings.dropout} applies to lora and dora only; set it to 0 for {name}")


def scalar(value: float) -> torch.Tensor:
    """An ``alpha`` as ComfyUI and diffusers both read it: a float32 0-d tensor."""
    return torch.tensor(float(value), dtype=torch.float32)


def block_rows(parts: list[Part], key: str, rows_total: int) -> torch.Tensor:
    """Block-diagonal by rows: part p's ``key`` (rows x r_p) at its row range, in its own column range."""
    present = [(off, rows, s[key]) for off, rows, s in parts if s is not None]
    width = sum(t.shape[1] for _, _, t in present)
    out = torch.zeros(rows_total, width, dtype=present[0][2].dtype)
    col = 0
    for off, rows, t in present:
        out[off:off + rows, col:col + t.shape[1]] = t
        col += t.shape[1]
    return out


def stacked(parts: list[Part], key: str) -> torch.Tensor:
    """The parts' ``key`` (r_p x in) one under another, in the order of ``block_rows``' columns."""
    return torch.cat([s[key] for _, _, s in parts if s is not None], dim=0)
