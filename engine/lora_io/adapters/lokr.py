"""LoKr: delta = kron(w1, w2) * alpha/r (peft ``LoKrConfig``; ComfyUI ``lokr_w1`` / ``lokr_w1_a``+``lokr_w1_b``,
``lokr_w2`` / ``lokr_w2_a``+``lokr_w2_b``, comfy/weight_adapter/lokr.py). Which factors are split into a rank-r pair
is peft's choice from the layer's shape (W2 when rank < half its larger side; W1 only with ``lokr_decompose_both``).

A Kronecker product of stacked parts is not a Kronecker product, so a LoKr on the parts of a fused native Linear
(Lumina 2's q/k/v in one ``qkv``) has no ComfyUI form; ``join`` refuses it with the reason.
"""
from __future__ import annotations

from ._base import AdapterType, no_dropout, scalar


class LoKr(AdapterType):
    name = "lokr"
    joins_fused = False
    suffixes = ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b")

    def peft_config(self, settings, targets):
        no_dropout(self.name, settings)
        from peft import LoKrConfig

        return LoKrConfig(r=settings.rank, alpha=settings.alpha, rank_dropout=0.0, module_dropout=0.0,
                          target_modules=targets, init_weights=True, decompose_factor=settings.adapter.lokr_factor,
                          decompose_both=settings.adapter.lokr_decompose_both)

    def param_count(self, in_features, out_features, settings):
        from peft.tuners.lokr.layer import factorization

        a, c = factorization(out_features, settings.adapter.lokr_factor)
        b, d = factorization(in_features, settings.adapter.lokr_factor)
        r = settings.rank
        w1 = r * (a + b) if settings.adapter.lokr_decompose_both and r < max(a, b) / 2 else a * b
        w2 = r * (c + d) if r < max(c, d) / 2 else c * d
        return w1 + w2

    def rank_of(self, module_state):
        for key in ("lokr_w2_b", "lokr_w1_b"):
            if key in module_state:
                return module_state[key].shape[0]
        return 0  # both factors full: no rank

    def fold(self, module_state, scale):
        first = "lokr_w1" if "lokr_w1" in module_state else "lokr_w1_a"  # kron is linear in w1
        return {k: (v * scale if k == first else v) for k, v in module_state.items()}

    def comfyui(self, module_state):
        out = dict(module_state)
        # ComfyUI's scale is alpha / (the rank of a split factor), or 1 without one: alpha = that rank means 1.
        split = [k for k in ("lokr_w2_b", "lokr_w1_b") if k in module_state]
        if split:
            out["alpha"] = scalar(module_state[split[0]].shape[0])
        return out


ADAPTER = LoKr()
