"""LoHa: delta = (w1a @ w1b) * (w2a @ w2b) * alpha/r, a Hadamard product of two rank-r pairs (peft ``LoHaConfig``;
ComfyUI ``hada_w1_a``, ``hada_w1_b``, ``hada_w2_a``, ``hada_w2_b`` + ``alpha``, comfy/weight_adapter/loha.py)."""
from __future__ import annotations

from ._base import AdapterType, no_dropout, block_rows, scalar, stacked

_KEYS = ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b")


class LoHa(AdapterType):
    name = "loha"
    suffixes = _KEYS

    def peft_config(self, settings, targets):
        no_dropout(self.name, settings)
        from peft import LoHaConfig

        return LoHaConfig(r=settings.rank, alpha=settings.alpha, rank_dropout=0.0, module_dropout=0.0,
                          target_modules=targets, init_weights=True)

    def param_count(self, in_features, out_features, settings):
        return 2 * settings.rank * (in_features + out_features)

    def rank_of(self, module_state):
        return module_state["hada_w1_b"].shape[0]

    def fold(self, module_state, scale):
        # The product is linear in each factor: the whole scale goes into w1a.
        return {k: (v * scale if k == "hada_w1_a" else v) for k, v in module_state.items()}

    def comfyui(self, module_state):
        # ComfyUI's scale is alpha / w1b.shape[0]: alpha = that rank means 1.
        return {**{k: module_state[k] for k in _KEYS}, "alpha": scalar(module_state["hada_w1_b"].shape[0])}

    def join(self, native, parts):
        """Row blocks of a Hadamard product are the products of the row blocks: each factor's ``a`` is block-diagonal
        over the fused rows and its ``b`` the parts' ``b`` stacked (rank = the sum; a part without one is zero)."""
        rows = sum(r for _, r, _ in parts)
        out = {"hada_w1_a": block_rows(parts, "hada_w1_a", rows), "hada_w1_b": stacked(parts, "hada_w1_b"),
               "hada_w2_a": block_rows(parts, "hada_w2_a", rows), "hada_w2_b": stacked(parts, "hada_w2_b")}
        out["alpha"] = scalar(out["hada_w1_b"].shape[0])
        return out


ADAPTER = LoHa()
